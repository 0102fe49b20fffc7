"""CosyVoice `llm.pt` <-> Hugging Face Qwen2ForCausalLM (servable by vLLM, trainable by verl).

cosyvoice -> hf: the Qwen2 body as is; input embeddings = text rows + speech_embedding rows (+ the two
llm_embedding rows, sos and task_id, for CosyVoice2); lm_head rows of the speech tokens and control
ids = llm_decoder. Qwen2 has no lm_head bias, so a nonzero llm_decoder bias is handled knowingly in
`grpo.model.lm_head_bias` (measured, dropped or folded, reported). What HF cannot hold (the unused padding
rows of CosyVoice's text embedding, the original head) goes to `cosyvoice_extra.pt` so that
hf -> cosyvoice restores an untouched model bit for bit.

hf -> cosyvoice: the trained HF weights back into CosyVoice's state-dict layout; the head is the
original head plus what training changed (`delta`, default) or the HF head as is (`functional`).
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import torch

from grpo.model.speech_vocab import SpeechVocab, build_hf_tokenizer

log = logging.getLogger(__name__)

EXTRA_FILE = "cosyvoice_extra.pt"
BODY_PREFIX = "llm.model.model."       # Qwen2Encoder -> Qwen2ForCausalLM -> Qwen2Model
QWEN_HEAD_KEY = "llm.model.lm_head.weight"


def detect_family(state_dict: dict) -> str:
    """CosyVoice2's Qwen2LM has llm_embedding (sos, task_id); CosyVoice3's LM keeps them in speech rows."""
    return "cosyvoice2" if "llm_embedding.weight" in state_dict else "cosyvoice3"


def load_cosyvoice_llm(model_dir: str | Path) -> dict[str, torch.Tensor]:
    path = Path(model_dir) / "llm.pt"
    if not path.exists():
        raise FileNotFoundError(f"{path} not found (expected a CosyVoice model directory)")
    return torch.load(path, map_location="cpu", weights_only=True)


def _hf_config(blank_dir: Path, vocab: SpeechVocab, dtype: torch.dtype):
    from transformers import Qwen2Config

    config = Qwen2Config.from_pretrained(blank_dir)
    config.vocab_size = vocab.vocab_size
    config.tie_word_embeddings = False
    config.bos_token_id = vocab.sos_token_id
    config.eos_token_id = vocab.stop_token_ids[0]
    config.torch_dtype = dtype
    return config


def cosyvoice_state_to_hf(sd: dict, vocab: SpeechVocab) -> tuple[dict, dict]:
    """Map tensors; returns (hf_state_dict, extra) where extra holds what HF cannot represent."""
    T, rows = vocab.text_vocab_size, vocab.num_speech_rows
    embed_key = BODY_PREFIX + "embed_tokens.weight"
    text_embed = sd[embed_key]
    if text_embed.shape[0] < T:
        raise ValueError(f"text embedding has {text_embed.shape[0]} rows but the tokenizer has {T} tokens")
    hidden = text_embed.shape[1]
    decoder_w = sd["llm_decoder.weight"]
    if sd["speech_embedding.weight"].shape[0] != rows or decoder_w.shape[0] != rows:
        raise ValueError(
            f"{vocab.family}: expected {rows} speech rows, got speech_embedding "
            f"{tuple(sd['speech_embedding.weight'].shape)} and llm_decoder {tuple(decoder_w.shape)}")

    hf = {k[len("llm.model."):]: v.clone() for k, v in sd.items() if k.startswith(BODY_PREFIX) and k != embed_key}
    embed = torch.zeros(vocab.vocab_size, hidden, dtype=text_embed.dtype)
    embed[:T] = text_embed[:T]
    embed[T:T + rows] = sd["speech_embedding.weight"]
    if vocab.family == "cosyvoice2":
        embed[vocab.sos_token_id] = sd["llm_embedding.weight"][0]
        embed[vocab.task_id_token_id] = sd["llm_embedding.weight"][1]
    head = torch.zeros(vocab.vocab_size, hidden, dtype=decoder_w.dtype)
    head[T:T + rows] = decoder_w
    hf["model.embed_tokens.weight"] = embed
    hf["lm_head.weight"] = head

    qwen_head = sd.get(QWEN_HEAD_KEY)
    extra = {
        "family": vocab.family,
        "text_embed_padding": text_embed[T:].clone(),          # rows CosyVoice never indexes
        "qwen_head_tied": qwen_head is not None and torch.equal(qwen_head, text_embed),
        "qwen_head": None if qwen_head is None or torch.equal(qwen_head, text_embed) else qwen_head.clone(),
        "has_qwen_head": qwen_head is not None,
        "decoder_weight": decoder_w.clone(),                  # original head, restored by `delta` export
        "decoder_bias": sd.get("llm_decoder.bias"),
        "converted_head_rows": None,                          # filled after the bias decision
        "key_order": list(sd.keys()),
    }
    return hf, extra


def save_hf_model(hf_sd: dict, config, out_dir: Path) -> None:
    from transformers import Qwen2ForCausalLM

    with torch.device("meta"):
        model = Qwen2ForCausalLM(config)
    model.load_state_dict(hf_sd, strict=True, assign=True)
    model.save_pretrained(out_dir)


def write_generation_config(out_dir: Path, vocab: SpeechVocab, pad_token_id: int) -> None:
    from transformers import GenerationConfig

    GenerationConfig(
        eos_token_id=list(vocab.stop_token_ids), pad_token_id=pad_token_id, bos_token_id=vocab.sos_token_id,
        do_sample=True, temperature=1.0, top_p=0.8, top_k=25,
    ).save_pretrained(out_dir)


def cosyvoice_to_hf(cosyvoice_dir: str | Path, out_dir: str | Path, bias_mode: str = "auto",
                    calibration_texts: list[str] | None = None, calibration_samples: int = 64,
                    seed: int = 0) -> dict:
    """Convert a CosyVoice2/3 model directory's LLM to an HF directory; returns the conversion report."""
    from grpo.model import lm_head_bias

    cosyvoice_dir, out_dir = Path(cosyvoice_dir), Path(out_dir)
    blank_dir = cosyvoice_dir / "CosyVoice-BlankEN"
    sd = load_cosyvoice_llm(cosyvoice_dir)
    family = detect_family(sd)
    speech_token_size = sd["speech_embedding.weight"].shape[0] - (3 if family == "cosyvoice2" else 200)
    tokenizer, vocab = build_hf_tokenizer(blank_dir, family, speech_token_size)
    hf_sd, extra = cosyvoice_state_to_hf(sd, vocab)
    config = _hf_config(blank_dir, vocab, hf_sd["lm_head.weight"].dtype)

    tmp = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_hf_model(hf_sd, config, tmp)
    tokenizer.save_pretrained(tmp)
    vocab.save(tmp)
    write_generation_config(tmp, vocab, tokenizer.pad_token_id)

    report = lm_head_bias.apply(tmp, vocab, extra, tokenizer, bias_mode,
                                calibration_texts or [], calibration_samples, seed)
    report.update(family=family, source=str(cosyvoice_dir), text_vocab_size=vocab.text_vocab_size,
                  speech_token_size=vocab.speech_token_size, vocab_size=vocab.vocab_size)
    torch.save(extra, tmp / EXTRA_FILE)
    (tmp / "conversion_report.json").write_text(json.dumps(report, indent=2), encoding="utf-8")
    (tmp / "conversion_report.md").write_text(lm_head_bias.report_markdown(report), encoding="utf-8")
    shutil.rmtree(out_dir, ignore_errors=True)
    tmp.rename(out_dir)
    log.info("HF model written to %s (bias: %s)", out_dir, report["chosen"])
    return report


def hf_to_cosyvoice_state(hf_dir: str | Path, head: str = "delta") -> dict[str, torch.Tensor]:
    """Build CosyVoice's llm.pt state dict from an HF dir written by `cosyvoice_to_hf` (maybe trained)."""
    from safetensors.torch import load_file

    hf_dir = Path(hf_dir)
    vocab = SpeechVocab.load(hf_dir)
    extra_path = hf_dir / EXTRA_FILE
    if not extra_path.exists():
        raise FileNotFoundError(f"{extra_path} missing: it is written by the conversion and must travel with the model")
    extra = torch.load(extra_path, map_location="cpu", weights_only=False)
    hf = {}
    for shard in sorted(hf_dir.glob("*.safetensors")):
        hf.update(load_file(shard))
    T, rows = vocab.text_vocab_size, vocab.num_speech_rows
    embed, lm_head = hf["model.embed_tokens.weight"], hf["lm_head.weight"]
    dtype = extra["decoder_weight"].dtype

    sd = {}
    for k, v in hf.items():
        if k.startswith("model.") and k != "model.embed_tokens.weight":
            sd["llm.model." + k] = v.to(dtype)
    text_embed = torch.cat([embed[:T].to(dtype), extra["text_embed_padding"]], dim=0)
    sd[BODY_PREFIX + "embed_tokens.weight"] = text_embed
    if extra["has_qwen_head"]:
        sd[QWEN_HEAD_KEY] = text_embed.clone() if extra["qwen_head_tied"] else extra["qwen_head"]
    sd["speech_embedding.weight"] = embed[T:T + rows].to(dtype).clone()
    if vocab.family == "cosyvoice2":
        sd["llm_embedding.weight"] = torch.stack([embed[vocab.sos_token_id], embed[vocab.task_id_token_id]]).to(dtype)
    trained_rows = lm_head[T:T + rows]
    if head == "delta":
        # original head + what training changed: the converted rows rounded to the trained dtype (so untouched
        # rows add exactly 0, and an untrained model comes back bit for bit), the difference taken in fp32
        # (exact for two bf16 values; a bf16 subtraction would round the change itself)
        change = trained_rows.float() - extra["converted_head_rows"].to(trained_rows.dtype).float()
        sd["llm_decoder.weight"] = extra["decoder_weight"] + change.to(dtype)
        if extra["decoder_bias"] is not None:
            sd["llm_decoder.bias"] = extra["decoder_bias"].clone()
    elif head == "functional":
        # exactly the HF policy: bias zero, head rows as trained
        sd["llm_decoder.weight"] = trained_rows.to(dtype).clone()
        if extra["decoder_bias"] is not None:
            sd["llm_decoder.bias"] = torch.zeros_like(extra["decoder_bias"])
    else:
        raise ValueError(f"unknown head mode {head!r}; expected 'delta' or 'functional'")
    return {k: sd[k] for k in extra["key_order"]}


def hf_to_cosyvoice(hf_dir: str | Path, out_path: str | Path, head: str = "delta") -> Path:
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_path.with_name(out_path.name + ".tmp")
    torch.save(hf_to_cosyvoice_state(hf_dir, head), tmp)
    tmp.replace(out_path)
    log.info("CosyVoice llm.pt written to %s (head: %s)", out_path, head)
    return out_path
