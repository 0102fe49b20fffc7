"""Random weights in the released CosyVoice2-0.5B directory layout, at any size: one builder for the tiny and the
realsize profiles (stage -1).

`build_cosyvoice_dir(model_dir, sizes, write_tokenizer)` writes every file of grpo.model.cosyvoice_dir.
RELEASED_FILES: `cosyvoice2.yaml` with every key the released file has (the LLM, flow and HiFT modules, the GAN
wrapper and CosyVoice's training-data pipeline), `CosyVoice-BlankEN/` (a tokenizer written by the caller, a
Qwen2 config and random weights), `llm.pt` / `flow.pt` / `hift.pt` (state dicts of CosyVoice's own classes
built from that yaml), `campplus.onnx` (CAM++'s interface: fbank (1, T, 80) -> (1, 192)) and
`speech_tokenizer_v2.onnx` (S3Tokenizer v2's interface and size: 128-bin log-mel (1, 128, T) and its length
-> tokens at 25 Hz). Everything downstream loads the result through the same code as the download.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Callable

import torch
from omegaconf import DictConfig

from grpo.model.cosyvoice_dir import BLANK_DIR, load_cosyvoice_yaml

log = logging.getLogger(__name__)

# The released cosyvoice2.yaml's structure and keys; {placeholders} are the sizes (the released values are in
# conf/profile/realsize.yaml). Loaded with hyperpyyaml by CosyVoice's code and by grpo.model.cosyvoice_dir.
COSYVOICE2_YAML = """\
# cosyvoice2.yaml written by cosyvoice-grpo (stage -1): every key of the released CosyVoice2-0.5B file, at the
# sizes of this build, with random weights in llm.pt / flow.pt / hift.pt.
__set_seed1: !apply:random.seed [1986]
__set_seed2: !apply:numpy.random.seed [1986]
__set_seed3: !apply:torch.manual_seed [1986]
__set_seed4: !apply:torch.cuda.manual_seed_all [1986]

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

# GAN training of HiFT (never built by this project: grpo.model.cosyvoice_dir.TRAINING_ONLY)
mel_spec_transform1: !name:matcha.utils.audio.mel_spectrogram
    n_fft: 1024
    num_mels: 80
    sampling_rate: !ref <sample_rate>
    hop_size: 256
    win_size: 1024
    fmin: 0
    fmax: null
    center: False
hifigan: !new:cosyvoice.hifigan.hifigan.HiFiGan
    generator: !ref <hift>
    discriminator: !new:cosyvoice.hifigan.discriminator.MultipleDiscriminator
        mpd: !new:matcha.hifigan.models.MultiPeriodDiscriminator
        mrd: !new:cosyvoice.hifigan.discriminator.MultiResolutionDiscriminator
    mel_spec_transform: [
        !ref <mel_spec_transform1>
    ]

# CosyVoice's training-data pipeline (imported at load time, as hyperpyyaml does for every !name:)
parquet_opener: !name:cosyvoice.dataset.processor.parquet_opener
get_tokenizer: !name:cosyvoice.tokenizer.tokenizer.get_qwen_tokenizer
    token_path: !ref <qwen_pretrain_path>
    skip_special_tokens: True
allowed_special: 'all'
tokenize: !name:cosyvoice.dataset.processor.tokenize
    get_tokenizer: !ref <get_tokenizer>
    allowed_special: !ref <allowed_special>
filter: !name:cosyvoice.dataset.processor.filter
    max_length: 40960
    min_length: 100
    token_max_length: 200
    token_min_length: 1
resample: !name:cosyvoice.dataset.processor.resample
    resample_rate: !ref <sample_rate>
truncate: !name:cosyvoice.dataset.processor.truncate
    truncate_length: 24480
feat_extractor: !name:matcha.utils.audio.mel_spectrogram
    n_fft: 1920
    num_mels: 80
    sampling_rate: !ref <sample_rate>
    hop_size: 480
    win_size: 1920
    fmin: 0
    fmax: 8000
    center: False
compute_fbank: !name:cosyvoice.dataset.processor.compute_fbank
    feat_extractor: !ref <feat_extractor>
compute_f0: !name:cosyvoice.dataset.processor.compute_f0
    sample_rate: !ref <sample_rate>
    hop_size: 480
parse_embedding: !name:cosyvoice.dataset.processor.parse_embedding
    normalize: True
shuffle: !name:cosyvoice.dataset.processor.shuffle
    shuffle_size: 1000
sort: !name:cosyvoice.dataset.processor.sort
    sort_size: 500
batch: !name:cosyvoice.dataset.processor.batch
    batch_type: 'dynamic'
    max_frames_in_batch: 2000
padding: !name:cosyvoice.dataset.processor.padding
    use_spk_embedding: False

data_pipeline: [
    !ref <parquet_opener>,
    !ref <tokenize>,
    !ref <filter>,
    !ref <resample>,
    !ref <compute_fbank>,
    !ref <parse_embedding>,
    !ref <shuffle>,
    !ref <sort>,
    !ref <batch>,
    !ref <padding>,
]
data_pipeline_gan: [
    !ref <parquet_opener>,
    !ref <tokenize>,
    !ref <filter>,
    !ref <resample>,
    !ref <truncate>,
    !ref <compute_fbank>,
    !ref <compute_f0>,
    !ref <parse_embedding>,
    !ref <shuffle>,
    !ref <sort>,
    !ref <batch>,
    !ref <padding>,
]

train_conf:
    optim: adam
    optim_conf:
        lr: 1e-5
    scheduler: constantlr
    scheduler_conf:
        warmup_steps: 2500
    max_epoch: 200
    grad_clip: 5
    accum_grad: 2
    log_interval: 100
    save_per_step: -1

train_conf_gan:
    optim: adam
    optim_conf:
        lr: 0.0002
    scheduler: constantlr
    optim_d: adam
    optim_conf_d:
        lr: 0.0002
    scheduler_d: constantlr
    max_epoch: 200
    grad_clip: 5
    accum_grad: 1
    log_interval: 100
    save_per_step: -1
"""

# The Qwen2 config of CosyVoice-BlankEN beyond the sizes (Qwen2.5-0.5B's public config.json)
QWEN2_CONFIG_FIXED = dict(hidden_act="silu", rms_norm_eps=1e-6, use_sliding_window=False, attention_dropout=0.0,
                          tie_word_embeddings=True, initializer_range=0.02, use_cache=True)


def write_cosyvoice_yaml(model_dir: Path, sizes: DictConfig) -> Path:
    f = sizes.flow
    text = COSYVOICE2_YAML.format(
        hidden=sizes.llm.hidden_size, speech_token_size=sizes.speech_token_size, flow_hidden=f.hidden,
        flow_heads=f.heads, flow_linear=f.linear_units, flow_blocks=f.blocks, decoder_channels=f.decoder_channels,
        decoder_blocks=f.decoder_blocks, mid_blocks=f.mid_blocks, decoder_heads=f.get("decoder_heads", 2),
        decoder_head_dim=f.get("decoder_head_dim", 32), hift_channels=sizes.hift.base_channels)
    path = model_dir / "cosyvoice2.yaml"
    path.write_text(text, encoding="utf-8")
    return path


def write_blank_qwen(out_dir: Path, llm: DictConfig, vocab_size: int, seed: int, dtype: str) -> None:
    """CosyVoice-BlankEN's config.json, generation_config.json and random model.safetensors (Qwen2ForCausalLM;
    CosyVoice's Qwen2Encoder loads it, llm.pt then overrides the weights)."""
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=vocab_size, hidden_size=llm.hidden_size, intermediate_size=llm.intermediate_size,
        num_hidden_layers=llm.num_layers, num_attention_heads=llm.num_heads, num_key_value_heads=llm.num_kv_heads,
        max_position_embeddings=llm.max_position_embeddings, rope_theta=float(llm.get("rope_theta", 10000.0)),
        sliding_window=llm.max_position_embeddings, max_window_layers=llm.num_layers, bos_token_id=None,
        eos_token_id=None, torch_dtype=dtype, **QWEN2_CONFIG_FIXED)
    torch.manual_seed(seed)
    with torch.device("cpu"):
        model = Qwen2ForCausalLM(config).to(getattr(torch, dtype))
    model.save_pretrained(out_dir)
    GenerationConfig(do_sample=False, max_new_tokens=2048).save_pretrained(out_dir)


class RandomSpeakerEncoder(torch.nn.Module):
    """CAM++'s interface (mean-normalised 80-dim fbank (1, T, 80) -> embedding (1, 192)): one random projection
    and RMS pooling, a stand-in for CosyVoice2's campplus.onnx (its architecture is not in any package here)."""

    def __init__(self, seed: int):
        super().__init__()
        torch.manual_seed(seed)
        self.proj = torch.nn.Linear(80, 192)

    def forward(self, feats):
        return self.proj(feats).pow(2).mean(1).sqrt()


def build_speaker_verifier(path: Path, seed: int) -> Path:
    torch.onnx.export(RandomSpeakerEncoder(seed), (torch.randn(1, 50, 80),), str(path), input_names=["input"],
                      output_names=["output"], dynamic_axes={"input": {1: "T"}}, dynamo=False)
    return path


class _Block(torch.nn.Module):
    """Pre-norm self-attention + MLP written with reshapes ONNX export keeps dynamic (nn.MultiheadAttention's
    traced graph fixes the sequence length)."""

    def __init__(self, width: int, heads: int):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = torch.nn.LayerNorm(width), torch.nn.LayerNorm(width)
        self.qkv, self.out = torch.nn.Linear(width, 3 * width), torch.nn.Linear(width, width)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(width, 4 * width), torch.nn.GELU(),
                                       torch.nn.Linear(4 * width, width))

    def forward(self, x, bias):
        b, t, w = x.shape
        q, k, v = self.qkv(self.norm1(x)).reshape(b, -1, 3, self.heads, w // self.heads).permute(2, 0, 3, 1, 4)
        att = torch.softmax(q @ k.transpose(-1, -2) / (w // self.heads) ** 0.5 + bias, dim=-1) @ v
        x = x + self.out(att.transpose(1, 2).reshape(b, -1, w))
        return x + self.mlp(self.norm2(x))


class RandomSpeechTokenizer(torch.nn.Module):
    """S3Tokenizer v2's interface and size, random weights: 128-bin log-mel (1, 128, T) and its length (1,) int32
    -> speech token ids (1, ceil(T / 4)) int32 in [0, 3**8). Two strided convolutions (4x: 100 Hz mel -> 25 Hz),
    six 1280-wide attention blocks and an 8-dimensional ternary FSQ, as S3Tokenizer v2 has. Not its exact
    blocks: the `s3tokenizer` package's model holds complex rotary buffers that ONNX export cannot trace, and
    nothing here depends on which random network produces the tokens."""

    def __init__(self, seed: int, width: int = 1280, heads: int = 20, layers: int = 6, levels: int = 8):
        super().__init__()
        torch.manual_seed(seed)
        self.conv1 = torch.nn.Conv1d(128, width, 3, stride=2, padding=1)
        self.conv2 = torch.nn.Conv1d(width, width, 3, stride=2, padding=1)
        self.blocks = torch.nn.ModuleList(_Block(width, heads) for _ in range(layers))
        self.norm = torch.nn.LayerNorm(width)
        self.project = torch.nn.Linear(width, levels)
        self.register_buffer("powers", 3 ** torch.arange(levels), persistent=False)

    def forward(self, feats, feats_length):
        x = torch.nn.functional.gelu(self.conv2(torch.nn.functional.gelu(self.conv1(feats)))).transpose(1, 2)
        frames = (feats_length.long() + 3) // 4                          # valid output frames (two stride-2 convs)
        positions = torch.cumsum(torch.ones_like(x[0, :, 0]), 0) - 1
        bias = (positions[None, :] >= frames[:, None]).float()[:, None, None, :] * -1e4   # padded keys masked
        for block in self.blocks:
            x = block(x, bias)
        digits = torch.round(torch.tanh(4 * self.project(self.norm(x)))) + 1         # ternary FSQ: {0, 1, 2} per level
        return (digits.long() * self.powers).sum(-1).int()


def build_speech_tokenizer(path: Path, seed: int) -> Path:
    """speech_tokenizer_v2.onnx with random weights at S3Tokenizer v2's size (about 120M parameters)."""
    feats = torch.randn(1, 128, 200)
    torch.onnx.export(RandomSpeechTokenizer(seed).eval(), (feats, torch.tensor([200], dtype=torch.int32)),
                      str(path), input_names=["feats", "feats_length"], output_names=["indices"],
                      dynamic_axes={"feats": {2: "T"}, "indices": {1: "T_out"}}, dynamo=False)
    return path


def build_cosyvoice_dir(model_dir: Path, sizes: DictConfig, write_tokenizer: Callable[[Path], int],
                        blank_dtype: str = "float32", speech_tokenizer: bool = True) -> dict:
    """Every released file at `sizes` with random weights; `write_tokenizer(blank_dir)` writes the BlankEN
    tokenizer files and returns the text vocabulary size (CosyVoice's specials not included). Returns a summary."""
    model_dir = Path(model_dir)
    blank = model_dir / BLANK_DIR
    blank.mkdir(parents=True, exist_ok=True)
    n_text = write_tokenizer(blank)
    # room for CosyVoice's ~19 specials, rounded up as Qwen2 rounds its embedding (151,936 at real size)
    vocab_size = sizes.llm.get("vocab_size") or ((n_text + 32 + 63) // 64) * 64
    write_blank_qwen(blank, sizes.llm, vocab_size, sizes.seed, blank_dtype)
    write_cosyvoice_yaml(model_dir, sizes)
    configs = load_cosyvoice_yaml(model_dir)      # CosyVoice's own classes (the yaml seeds torch itself)
    for name in ("llm", "flow", "hift"):
        module = configs[name].float()            # the released .pt files are float32
        torch.save(module.state_dict(), model_dir / f"{name}.pt")
    del configs
    build_speaker_verifier(model_dir / "campplus.onnx", sizes.seed)
    if speech_tokenizer:
        build_speech_tokenizer(model_dir / "speech_tokenizer_v2.onnx", sizes.seed)
    summary = {"text_vocab": n_text, "embedding_rows": vocab_size}
    log.info("CosyVoice2 dir with random weights written: %s (text vocab %d, embedding rows %d)", model_dir,
             n_text, vocab_size)
    return summary
