"""Tiny CosyVoice2-shaped models with random weights, written in the real download's file layout.

Stage -1 of the `tiny` profile builds, under `model.cosyvoice_dir`:
  CosyVoice-BlankEN/   Qwen2 text tokenizer (byte-level BPE trained on the shipped data) + tiny Qwen2
  cosyvoice2.yaml      the real yaml's structure (hyperpyyaml, CosyVoice's own classes) at tiny sizes
  llm.pt               state dict of CosyVoice's `Qwen2LM`
  flow.pt, hift.pt     state dicts of CosyVoice's flow-matching decoder and HiFT vocoder
                       (the flow encoder width stays 512: CosyVoice's UpsampleConformerEncoder hard-codes it)
and a tiny SenseVoice directory (config.yaml, model.pt, bpe.model, am.mvn) under `model.sensevoice_dir`.
Everything downstream loads these through the same code as the real models.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Iterable

import torch
from omegaconf import DictConfig

log = logging.getLogger(__name__)

# Qwen2's chat specials; CosyVoice's QwenTokenizer adds its own on top at load time.
QWEN2_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

COSYVOICE2_YAML = """\
# Tiny CosyVoice2 config written by cosyvoice-grpo (stage -1, profile tiny): the structure of the
# released cosyvoice2.yaml with small sizes and random weights. Loaded with hyperpyyaml, like the real one.
sample_rate: 24000
llm_input_size: {hidden}
llm_output_size: {hidden}
spk_embed_dim: 192
qwen_pretrain_path: ''
token_frame_rate: 25
token_mel_ratio: 2

llm: !new:cosyvoice.llm.llm.Qwen2LM
    llm_input_size: !ref <llm_input_size>
    llm_output_size: !ref <llm_output_size>
    speech_token_size: {speech_token_size}
    length_normalized_loss: True
    lsm_weight: 0
    mix_ratio: [5, 15]
    llm: !new:cosyvoice.llm.llm.Qwen2Encoder
        pretrain_path: !ref <qwen_pretrain_path>
    sampling: !name:cosyvoice.utils.common.ras_sampling
        top_p: 0.8
        top_k: 25
        win_size: 10
        tau_r: 0.1

flow: !new:cosyvoice.flow.flow.CausalMaskedDiffWithXvec
    input_size: {flow_hidden}
    output_size: 80
    spk_embed_dim: !ref <spk_embed_dim>
    output_type: 'mel'
    vocab_size: {speech_token_size}
    input_frame_rate: !ref <token_frame_rate>
    only_mask_loss: True
    token_mel_ratio: !ref <token_mel_ratio>
    pre_lookahead_len: 3
    encoder: !new:cosyvoice.transformer.upsample_encoder.UpsampleConformerEncoder
        output_size: {flow_hidden}
        attention_heads: {flow_heads}
        linear_units: {flow_linear}
        num_blocks: {flow_blocks}
        dropout_rate: 0.1
        positional_dropout_rate: 0.1
        attention_dropout_rate: 0.1
        normalize_before: True
        input_layer: 'linear'
        pos_enc_layer_type: 'rel_pos_espnet'
        selfattention_layer_type: 'rel_selfattn'
        input_size: {flow_hidden}
        use_cnn_module: False
        macaron_style: False
        static_chunk_size: !ref <token_frame_rate>
    decoder: !new:cosyvoice.flow.flow_matching.CausalConditionalCFM
        in_channels: 240
        n_spks: 1
        spk_emb_dim: 80
        cfm_params: !new:omegaconf.DictConfig
            content:
                sigma_min: 1e-06
                solver: 'euler'
                t_scheduler: 'cosine'
                training_cfg_rate: 0.2
                inference_cfg_rate: 0.7
                reg_loss_type: 'l1'
        estimator: !new:cosyvoice.flow.decoder.CausalConditionalDecoder
            in_channels: 320
            out_channels: 80
            channels: [{decoder_channels}]
            dropout: 0.0
            attention_head_dim: {decoder_head_dim}
            n_blocks: {decoder_blocks}
            num_mid_blocks: {mid_blocks}
            num_heads: {decoder_heads}
            act_fn: 'gelu'
            static_chunk_size: !ref <token_frame_rate> * <token_mel_ratio>
            num_decoding_left_chunks: 2

hift: !new:cosyvoice.hifigan.generator.HiFTGenerator
    in_channels: 80
    base_channels: {hift_channels}
    nb_harmonics: 8
    sampling_rate: !ref <sample_rate>
    nsf_alpha: 0.1
    nsf_sigma: 0.003
    nsf_voiced_threshold: 10
    upsample_rates: [8, 5, 3]
    upsample_kernel_sizes: [16, 11, 7]
    istft_params:
        n_fft: 16
        hop_len: 4
    resblock_kernel_sizes: [3, 7, 11]
    resblock_dilation_sizes: [[1, 3, 5], [1, 3, 5], [1, 3, 5]]
    source_resblock_kernel_sizes: [7, 7, 11]
    source_resblock_dilation_sizes: [[1, 3, 5], [1, 3, 5], [1, 3, 5]]
    lrelu_slope: 0.1
    audio_limit: 0.99
    f0_predictor: !new:cosyvoice.hifigan.f0_predictor.ConvRNNF0Predictor
        num_class: 1
        in_channels: 80
        cond_channels: {hift_channels}

get_tokenizer: !name:cosyvoice.tokenizer.tokenizer.get_qwen_tokenizer
    token_path: !ref <qwen_pretrain_path>
    skip_special_tokens: True
allowed_special: 'all'
feat_extractor: !name:matcha.utils.audio.mel_spectrogram
    n_fft: 1920
    num_mels: 80
    sampling_rate: !ref <sample_rate>
    hop_size: 480
    win_size: 1920
    fmin: 0
    fmax: 8000
    center: False
"""

# funasr's SANM encoder settings and 16 kHz fbank frontend, shared by SenseVoiceSmall and Paraformer-zh
SANM_ENCODER_COMMON = """\
    dropout_rate: 0.1
    positional_dropout_rate: 0.1
    attention_dropout_rate: 0.1
    input_layer: pe
    pos_enc_class: SinusoidalPositionEncoder
    normalize_before: true
    kernel_size: 11
    sanm_shfit: 0
    selfattention_layer_type: sanm
"""
WAV_FRONTEND = """\
frontend: WavFrontend
frontend_conf:
    fs: 16000
    window: hamming
    n_mels: 80
    frame_length: 25
    frame_shift: 10
    lfr_m: 7
    lfr_n: 6
    cmvn_file: null
"""

SENSEVOICE_YAML = """\
# Tiny SenseVoiceSmall config written by cosyvoice-grpo (random weights; real layout).
encoder: SenseVoiceEncoderSmall
encoder_conf:
    output_size: {output_size}
    attention_heads: {heads}
    linear_units: {linear_units}
    num_blocks: {num_blocks}
    tp_blocks: {tp_blocks}
""" + SANM_ENCODER_COMMON + """
model: SenseVoiceSmall
model_conf:
    length_normalized_loss: true
    sos: 1
    eos: 2
    ignore_id: -1

tokenizer: SentencepiecesTokenizer
tokenizer_conf:
  bpemodel: null
  unk_symbol: <unk>
  split_with_space: true

""" + WAV_FRONTEND + """"""


def _split_han(text: str) -> str:
    """Newlines between CJK characters: BPE merges then never cross a character (one token per character)."""
    return "".join(ch + "\n" if "\u3400" <= ch <= "\u9fff" else ch for ch in text)


def build_text_tokenizer(texts: list[str], vocab_size: int, out_dir: Path) -> int:
    """Train a byte-level BPE with Qwen2's pre-tokenizer and save it as a Qwen2 tokenizer folder.

    Merges are learnt within characters only, so Chinese text is one token per character (the real
    Qwen2 vocabulary also holds most characters whole); a tiny LLM then learns how characters sound
    instead of how byte fragments do."""
    from tokenizers import pre_tokenizers, trainers
    from transformers import Qwen2Tokenizer

    backend = Qwen2Tokenizer()._tokenizer  # Qwen2 normaliser, pre-tokenizer regex and byte-level decoder
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    backend.train_from_iterator([_split_han(t) for t in texts], trainer)
    model = json.loads(backend.to_str())["model"]
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in model["merges"]]
    tokenizer = Qwen2Tokenizer(vocab=model["vocab"], merges=merges)
    tokenizer.add_special_tokens({"additional_special_tokens": QWEN2_SPECIALS[1:]})
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(out_dir)
    # the real CosyVoice-BlankEN ships vocab.json + merges.txt; write them too
    (out_dir / "vocab.json").write_text(json.dumps(model["vocab"], ensure_ascii=False), encoding="utf-8")
    merges_txt = "#version: 0.2\n" + "\n".join(" ".join(m) for m in merges) + "\n"
    (out_dir / "merges.txt").write_text(merges_txt, encoding="utf-8")
    return len(tokenizer)


def build_blank_qwen(out_dir: Path, llm: DictConfig, vocab_size: int, seed: int) -> None:
    """A tiny random Qwen2ForCausalLM in CosyVoice-BlankEN (llm.pt overrides its weights later)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=llm.hidden_size,
        intermediate_size=llm.intermediate_size,
        num_hidden_layers=llm.num_layers,
        num_attention_heads=llm.num_heads,
        num_key_value_heads=llm.num_kv_heads,
        max_position_embeddings=llm.max_position_embeddings,
        tie_word_embeddings=True,
        rope_theta=10000.0,
        torch_dtype="float32",
    )
    torch.manual_seed(seed)
    Qwen2ForCausalLM(config).save_pretrained(out_dir)


def write_cosyvoice_yaml(model_dir: Path, tiny: DictConfig) -> Path:
    text = COSYVOICE2_YAML.format(
        hidden=tiny.llm.hidden_size,
        speech_token_size=tiny.speech_token_size,
        flow_hidden=tiny.flow.hidden,
        flow_heads=tiny.flow.heads,
        flow_linear=tiny.flow.linear_units,
        flow_blocks=tiny.flow.blocks,
        decoder_channels=tiny.flow.decoder_channels,
        decoder_blocks=tiny.flow.decoder_blocks,
        mid_blocks=tiny.flow.mid_blocks,
        decoder_heads=tiny.flow.get("decoder_heads", 2),
        decoder_head_dim=tiny.flow.get("decoder_head_dim", 32),
        hift_channels=tiny.hift.base_channels,
    )
    path = model_dir / "cosyvoice2.yaml"
    path.write_text(text, encoding="utf-8")
    return path


def load_cosyvoice_yaml(model_dir: str | Path, skip: Iterable[str] = ()) -> dict:
    """Load `cosyvoice2.yaml` the way CosyVoice2 does; `skip` replaces modules with None (not built)."""
    from hyperpyyaml import load_hyperpyyaml

    model_dir = Path(model_dir)
    overrides = {"qwen_pretrain_path": str(model_dir / "CosyVoice-BlankEN")}
    overrides.update({name: None for name in skip})
    with open(model_dir / "cosyvoice2.yaml", encoding="utf-8") as f:
        return load_hyperpyyaml(f, overrides=overrides)


def build_cosyvoice_dir(model_dir: Path, tiny: DictConfig, texts: list[str]) -> None:
    """Tokenizer, blank Qwen2, yaml, and random llm.pt/flow.pt/hift.pt (CosyVoice's own classes)."""
    blank = model_dir / "CosyVoice-BlankEN"
    n_text = build_text_tokenizer(texts, tiny.text_vocab_size, blank)
    # CosyVoice's QwenTokenizer adds ~19 specials on load; leave room and round up like Qwen2 does.
    vocab_size = ((n_text + 32 + 63) // 64) * 64
    build_blank_qwen(blank, tiny.llm, vocab_size, tiny.seed)
    write_cosyvoice_yaml(model_dir, tiny)
    torch.manual_seed(tiny.seed)
    configs = load_cosyvoice_yaml(model_dir)
    for name in ("llm", "flow", "hift"):
        torch.save(configs[name].state_dict(), model_dir / f"{name}.pt")
    build_speaker_verifier(model_dir / "campplus.onnx", tiny.seed)
    log.info("tiny CosyVoice2 dir written: %s (text vocab %d, embedding rows %d)", model_dir, n_text, vocab_size)


class TinySpeakerEncoder(torch.nn.Module):
    """CAM++'s interface (mean-normalised 80-dim fbank (1, T, 80) -> embedding (1, 192)) with one random
    projection and RMS pooling: the tiny profile's stand-in for CosyVoice2's campplus.onnx."""

    def __init__(self, seed: int):
        super().__init__()
        torch.manual_seed(seed)
        self.proj = torch.nn.Linear(80, 192)

    def forward(self, feats):
        return self.proj(feats).pow(2).mean(1).sqrt()


def build_speaker_verifier(path: Path, seed: int) -> Path:
    torch.onnx.export(TinySpeakerEncoder(seed), (torch.randn(1, 50, 80),), str(path), input_names=["feats"],
                      output_names=["emb"], dynamic_axes={"feats": {1: "T"}}, dynamo=False)
    return path


def write_funasr_config(out_dir: Path, template: str, sizes: DictConfig, seed: int) -> DictConfig:
    """A funasr model directory's config.yaml (the template filled with `sizes`) and am.mvn (80-dim fbank,
    7 frames stacked); returns the config and seeds torch for the random weights."""
    from omegaconf import OmegaConf

    yaml_text = template.format(**sizes)
    (out_dir / "config.yaml").write_text(yaml_text, encoding="utf-8")
    write_am_mvn(out_dir / "am.mvn", 80 * 7)
    torch.manual_seed(seed)
    return OmegaConf.create(yaml_text)


def write_am_mvn(path: Path, dim: int) -> None:
    """Kaldi nnet text format CMVN (shift and scale), as SenseVoice's am.mvn."""
    zeros = " ".join(["0"] * dim)
    ones = " ".join(["1"] * dim)
    path.write_text(
        "<Nnet>\n"
        f"<Splice> {dim} {dim}\n[ 0 ]\n"
        f"<AddShift> {dim} {dim}\n<LearnRateCoef> 0 [ {zeros} ]\n"
        f"<Rescale> {dim} {dim}\n<LearnRateCoef> 0 [ {ones} ]\n"
        "</Nnet>\n",
        encoding="utf-8",
    )


# The tag pieces of SenseVoiceSmall's own BPE (language, emotion, event, text normalisation): SenseVoice
# decodes its first output frames to these, so a transcript starts with e.g. <|zh|><|NEUTRAL|><|Speech|><|woitn|>.
SENSEVOICE_TAGS = ["<|zh|>", "<|en|>", "<|yue|>", "<|ja|>", "<|ko|>", "<|nospeech|>", "<|HAPPY|>", "<|SAD|>",
                   "<|ANGRY|>", "<|NEUTRAL|>", "<|EMO_UNKNOWN|>", "<|Speech|>", "<|BGM|>", "<|Laughter|>",
                   "<|Applause|>", "<|Event_UNK|>", "<|withitn|>", "<|woitn|>"]


def build_sensevoice_dir(out_dir: Path, sizes: DictConfig, texts: list[str], seed: int) -> None:
    """config.yaml, random model.pt, sentencepiece bpe.model of the model's vocab size, am.mvn."""
    import io

    import sentencepiece as spm
    from funasr.models.sense_voice.model import SenseVoiceSmall
    from omegaconf import OmegaConf

    out_dir.mkdir(parents=True, exist_ok=True)
    model_bytes = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(texts), model_writer=model_bytes, vocab_size=sizes.vocab_size,
        model_type="unigram", character_coverage=1.0, hard_vocab_limit=False,
        unk_id=0, bos_id=1, eos_id=2, pad_id=-1, minloglevel=2, user_defined_symbols=SENSEVOICE_TAGS,
    )
    (out_dir / "bpe.model").write_bytes(model_bytes.getvalue())
    vocab_size = spm.SentencePieceProcessor(model_proto=model_bytes.getvalue()).get_piece_size()
    conf = write_funasr_config(out_dir, SENSEVOICE_YAML, sizes, seed)
    model = SenseVoiceSmall(
        encoder=conf.encoder, encoder_conf=OmegaConf.to_container(conf.encoder_conf),
        input_size=80 * 7, vocab_size=vocab_size, **OmegaConf.to_container(conf.model_conf),
    )
    torch.save(model.state_dict(), out_dir / "model.pt")
    log.info("tiny SenseVoice dir written: %s (vocab %d)", out_dir, vocab_size)
