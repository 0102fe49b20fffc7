"""Random-weight builds, in the real file layouts, of the evaluation ASR models Seed-TTS-eval uses:
Paraformer-zh (SeACo-Paraformer, funasr: config.yaml, model.pt, tokens.json, am.mvn, seg_dict) and Whisper-large-v3
(transformers:
config.json, generation_config.json, model.safetensors, tokenizer and preprocessor files). The tiny profile
and the tests load them through the same code as the downloaded models."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from omegaconf import DictConfig

log = logging.getLogger(__name__)

def char_inventory(texts: list[str]) -> list[str]:
    """Paraformer-zh's token list shape: <blank>, <s>, </s>, the characters (English as words), <unk>."""
    chars = sorted({ch for t in texts for ch in t if not ch.isspace()})
    return ["<blank>", "<s>", "</s>", *chars, "<unk>"]


def build_paraformer_dir(out_dir: Path, sizes: DictConfig, texts: list[str], seed: int) -> None:
    """SeACo-Paraformer's released files: config.yaml (model: SeacoParaformer), model.pt, tokens.json, am.mvn and
    seg_dict (the hotword segmentation table, one "word token..." line per entry; here each character)."""
    from funasr.models.seaco_paraformer.model import SeacoParaformer
    from omegaconf import OmegaConf

    from grpo.standins.tiny import filler_symbols, write_funasr_config

    out_dir.mkdir(parents=True, exist_ok=True)
    tokens = char_inventory(texts)
    if sizes.get("vocab_size"):               # the released inventory size (8404): padded with filler symbols
        tokens = tokens[:-1] + filler_symbols(sizes.vocab_size - len(tokens), set(tokens)) + tokens[-1:]
    (out_dir / "tokens.json").write_text(json.dumps(tokens, ensure_ascii=False), encoding="utf-8")
    (out_dir / "seg_dict").write_text("".join(f"{t} {t}\n" for t in tokens[3:-1]), encoding="utf-8")
    # NO_BIAS: the id SeACo's hotword branch uses for "no hotword" (8377 in the released 8404-token list)
    no_bias = sizes.get("no_bias") or len(tokens) - 1
    conf = write_funasr_config(out_dir, "paraformer.yaml", {**sizes, "no_bias": no_bias}, seed)
    kwargs = OmegaConf.to_container(conf)
    model = SeacoParaformer(**kwargs, **kwargs["model_conf"], input_size=80 * 7, vocab_size=len(tokens))
    with torch.no_grad():     # random CIF weights rarely fire; a positive bias makes tokens come out
        model.predictor.cif_output.bias.fill_(2.0)
    torch.save(model.state_dict(), out_dir / "model.pt")
    log.info("SeACo-Paraformer dir written: %s (%d tokens)", out_dir, len(tokens))


def whisper_special_tokens() -> list[str]:
    """Whisper-large-v3's added tokens, in its order: end of text, start of transcript, the 100 languages,
    tasks, the other markers, and the timestamps 0.00 .. 30.00."""
    from transformers.models.whisper.tokenization_whisper import LANGUAGES

    return (["<|endoftext|>", "<|startoftranscript|>", *[f"<|{code}|>" for code in LANGUAGES],
             "<|translate|>", "<|transcribe|>", "<|startoflm|>", "<|startofprev|>", "<|nospeech|>",
             "<|notimestamps|>"] + [f"<|{k * 0.02:.2f}|>" for k in range(1501)])


def build_whisper_dir(out_dir: Path, sizes: DictConfig, texts: list[str], seed: int) -> None:
    """A byte-level BPE of the given texts plus Whisper's added tokens, a WhisperForConditionalGeneration with
    Whisper-large-v3's interface (128 mel bins, 30 s windows), its generation config and feature extractor."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import (
        GenerationConfig,
        WhisperConfig,
        WhisperFeatureExtractor,
        WhisperForConditionalGeneration,
        WhisperProcessor,
        WhisperTokenizer,
    )
    from transformers.models.whisper.tokenization_whisper import LANGUAGES

    out_dir.mkdir(parents=True, exist_ok=True)
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=sizes.text_vocab_size, show_progress=False,
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    state = json.loads(bpe.to_str())["model"]
    tokenizer = WhisperTokenizer(vocab=state["vocab"], merges=[tuple(m.split(" ")) if isinstance(m, str) else tuple(m)
                                                               for m in state["merges"]])
    specials = whisper_special_tokens()
    tokenizer.add_tokens(specials[1:], special_tokens=True)     # <|endoftext|> is already there
    ids = {tok: tokenizer.convert_tokens_to_ids(tok) for tok in specials}
    feature_extractor = WhisperFeatureExtractor(feature_size=128, sampling_rate=16000)
    WhisperProcessor(feature_extractor=feature_extractor, tokenizer=tokenizer).save_pretrained(out_dir)
    eot, sot = ids["<|endoftext|>"], ids["<|startoftranscript|>"]
    config = WhisperConfig(vocab_size=len(tokenizer), num_mel_bins=128, d_model=sizes.d_model,
                           encoder_layers=sizes.layers, decoder_layers=sizes.layers,
                           encoder_attention_heads=sizes.heads, decoder_attention_heads=sizes.heads,
                           encoder_ffn_dim=4 * sizes.d_model, decoder_ffn_dim=4 * sizes.d_model,
                           max_source_positions=1500, max_target_positions=448, pad_token_id=eot, bos_token_id=eot,
                           eos_token_id=eot, decoder_start_token_id=sot)
    torch.manual_seed(seed)
    model = WhisperForConditionalGeneration(config)
    model.generation_config = GenerationConfig(
        decoder_start_token_id=sot, eos_token_id=eot, pad_token_id=eot, bos_token_id=eot, max_length=448,
        is_multilingual=True, lang_to_id={f"<|{c}|>": ids[f"<|{c}|>"] for c in LANGUAGES},
        task_to_id={"transcribe": ids["<|transcribe|>"], "translate": ids["<|translate|>"]},
        no_timestamps_token_id=ids["<|notimestamps|>"], prev_sot_token_id=ids["<|startofprev|>"],
        begin_suppress_tokens=[eot], max_initial_timestamp_index=50,
        # the real config suppresses symbols; random weights would mostly emit markers, so suppress those
        suppress_tokens=[ids[tok] for tok in specials[2:specials.index("<|notimestamps|>") + 1]])
    model.save_pretrained(out_dir)
    log.info("tiny Whisper dir written: %s (vocab %d)", out_dir, len(tokenizer))
