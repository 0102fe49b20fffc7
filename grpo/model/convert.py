"""CosyVoice `llm.pt` <-> Hugging Face CosyVoiceLMForCausalLM (grpo.model.cosyvoice_lm), exact both ways.

cosyvoice -> hf: the Qwen2 body as is; input embeddings = text rows + speech_embedding rows (+ the two
llm_embedding rows, sos and task_id, for CosyVoice2); lm_head rows [T, T + rows) = llm_decoder's weight and
bias (a zero bias for a bias-free decoder, then frozen); every other lm_head row masked (zero weight, bias
MASKED_LOGIT). A softmax over the whole vocabulary is then CosyVoice's decoder distribution, for any bias.
What HF cannot hold (the padding rows of CosyVoice's text embedding, an unused Qwen lm_head, the key order)
goes to `cosyvoice_extra.pt`, so that hf -> cosyvoice restores an untouched model bit for bit.

hf -> cosyvoice: the (trained) HF weights back into CosyVoice's layout and llm.pt's dtype; llm_decoder is
the head's rows [T, T + rows), weight and bias.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import torch

from grpo.model.cosyvoice_lm import ARCHITECTURE, MASKED_LOGIT, CosyVoiceLMConfig, CosyVoiceLMForCausalLM
from grpo.model.speech_vocab import SpeechVocab, build_hf_tokenizer
from grpo.speech.family import family_of_llm

log = logging.getLogger(__name__)

EXTRA_FILE = "cosyvoice_extra.pt"
BODY_PREFIX = "llm.model.model."       # Qwen2Encoder -> Qwen2ForCausalLM -> Qwen2Model
QWEN_HEAD_KEY = "llm.model.lm_head.weight"


def load_cosyvoice_llm(model_dir: str | Path) -> dict[str, torch.Tensor]:
    path = Path(model_dir) / "llm.pt"
    if not path.exists():
        raise FileNotFoundError(f"{path} not found (expected a CosyVoice model directory)")
    return torch.load(path, map_location="cpu", weights_only=True)


def hf_config(blank_dir: Path, vocab: SpeechVocab, dtype: torch.dtype, has_bias: bool) -> CosyVoiceLMConfig:
    from transformers import Qwen2Config

    body = Qwen2Config.from_pretrained(blank_dir).to_dict()
    for key in ("model_type", "architectures", "auto_map", "transformers_version", "tie_word_embeddings"):
        body.pop(key, None)
    body.update(vocab_size=vocab.vocab_size, bos_token_id=vocab.sos_token_id, eos_token_id=vocab.eos_token_id,
                torch_dtype=dtype, architectures=[ARCHITECTURE])
    first = vocab.speech_token_offset
    return CosyVoiceLMConfig(head_rows=[first, first + vocab.num_speech_rows], train_head_bias=has_bias, **body)


def cosyvoice_state_to_hf(sd: dict, vocab: SpeechVocab) -> tuple[dict, dict]:
    """Map tensors; returns (hf_state_dict, extra) where extra holds what HF cannot represent."""
    T, rows = vocab.text_vocab_size, vocab.num_speech_rows
    embed_key = BODY_PREFIX + "embed_tokens.weight"
    text_embed = sd[embed_key]
    if text_embed.shape[0] < T:
        raise ValueError(f"text embedding has {text_embed.shape[0]} rows but the tokenizer has {T} tokens")
    hidden = text_embed.shape[1]
    decoder_w, decoder_b = sd["llm_decoder.weight"], sd.get("llm_decoder.bias")
    if sd["speech_embedding.weight"].shape[0] != rows or decoder_w.shape[0] != rows:
        raise ValueError(
            f"{vocab.family}: expected {rows} speech rows, got speech_embedding "
            f"{tuple(sd['speech_embedding.weight'].shape)} and llm_decoder {tuple(decoder_w.shape)}")

    hf = {k[len("llm.model."):]: v.clone() for k, v in sd.items() if k.startswith(BODY_PREFIX) and k != embed_key}
    embed = torch.zeros(vocab.vocab_size, hidden, dtype=text_embed.dtype)
    embed[:T] = text_embed[:T]
    embed[T:T + rows] = sd["speech_embedding.weight"]
    if vocab.model_family.has_llm_embedding:
        embed[vocab.sos_token_id] = sd["llm_embedding.weight"][0]
        embed[vocab.task_id_token_id] = sd["llm_embedding.weight"][1]
    head = torch.zeros(vocab.vocab_size, hidden, dtype=decoder_w.dtype)
    head[T:T + rows] = decoder_w
    bias = torch.full((vocab.vocab_size,), MASKED_LOGIT, dtype=decoder_w.dtype)
    bias[T:T + rows] = 0.0 if decoder_b is None else decoder_b
    hf.update({"model.embed_tokens.weight": embed, "lm_head.weight": head, "lm_head.bias": bias})

    qwen_head = sd.get(QWEN_HEAD_KEY)
    extra = {
        "family": vocab.family,
        "text_embed_padding": text_embed[T:].clone(),          # rows CosyVoice never indexes
        "qwen_head_tied": qwen_head is not None and torch.equal(qwen_head, text_embed),
        "qwen_head": None if qwen_head is None or torch.equal(qwen_head, text_embed) else qwen_head.clone(),
        "has_qwen_head": qwen_head is not None,
        "has_decoder_bias": decoder_b is not None,
        "dtype": str(decoder_w.dtype).removeprefix("torch."),
        "key_order": list(sd.keys()),
    }
    return hf, extra


def save_hf_model(hf_sd: dict, config: CosyVoiceLMConfig, out_dir: Path) -> None:
    with torch.device("meta"):
        model = CosyVoiceLMForCausalLM(config)
    model.load_state_dict(hf_sd, strict=True, assign=True)
    model.save_pretrained(out_dir)


def write_generation_config(out_dir: Path, vocab: SpeechVocab, pad_token_id: int) -> None:
    from transformers import GenerationConfig

    GenerationConfig(
        eos_token_id=list(vocab.stop_token_ids), pad_token_id=pad_token_id, bos_token_id=vocab.sos_token_id,
        do_sample=True, temperature=1.0, top_p=0.8, top_k=25,
    ).save_pretrained(out_dir)


def cosyvoice_to_hf(cosyvoice_dir: str | Path, out_dir: str | Path) -> dict:
    """Convert a CosyVoice2/3 model directory's LLM to an HF directory; returns what was converted."""
    cosyvoice_dir, out_dir = Path(cosyvoice_dir), Path(out_dir)
    blank_dir = cosyvoice_dir / "CosyVoice-BlankEN"
    sd = load_cosyvoice_llm(cosyvoice_dir)
    fam = family_of_llm(sd)
    family = fam.name
    speech_token_size = sd["speech_embedding.weight"].shape[0] - fam.extra_speech_rows
    tokenizer, vocab = build_hf_tokenizer(blank_dir, family, speech_token_size)
    hf_sd, extra = cosyvoice_state_to_hf(sd, vocab)
    config = hf_config(blank_dir, vocab, hf_sd["lm_head.weight"].dtype, extra["has_decoder_bias"])

    tmp = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_hf_model(hf_sd, config, tmp)
    tokenizer.save_pretrained(tmp)
    vocab.save(tmp)
    write_generation_config(tmp, vocab, tokenizer.pad_token_id)
    torch.save(extra, tmp / EXTRA_FILE)
    shutil.rmtree(out_dir, ignore_errors=True)
    tmp.rename(out_dir)
    summary = {"family": family, "source": str(cosyvoice_dir), "text_vocab_size": vocab.text_vocab_size,
               "speech_token_size": vocab.speech_token_size, "vocab_size": vocab.vocab_size,
               "decoder_bias": extra["has_decoder_bias"]}
    log.info("HF model written to %s (%s, exact speech head%s)", out_dir, family,
             " with llm_decoder's bias" if extra["has_decoder_bias"] else ", bias-free")
    return summary


def hf_to_cosyvoice_state(hf_dir: str | Path) -> dict[str, torch.Tensor]:
    """CosyVoice's llm.pt state dict from an HF dir written by `cosyvoice_to_hf` (maybe trained, maybe bf16)."""
    from safetensors.torch import load_file

    hf_dir = Path(hf_dir)
    vocab = SpeechVocab.load(hf_dir)
    extra_path = hf_dir / EXTRA_FILE
    if not extra_path.exists():
        raise FileNotFoundError(f"{extra_path} missing: it is written by the conversion and must travel with the model")
    extra = torch.load(extra_path, map_location="cpu", weights_only=True)
    hf = {}
    for shard in sorted(hf_dir.glob("*.safetensors")):
        hf.update(load_file(shard))
    if "lm_head.bias" not in hf:
        raise ValueError(f"{hf_dir}: no lm_head.bias; not a {ARCHITECTURE} checkpoint (convert again with stage -1)")
    T, rows = vocab.text_vocab_size, vocab.num_speech_rows
    dtype = getattr(torch, extra["dtype"])
    embed = hf["model.embed_tokens.weight"]

    sd = {"llm.model." + k: v.to(dtype) for k, v in hf.items()
          if k.startswith("model.") and k != "model.embed_tokens.weight"}
    text_embed = torch.cat([embed[:T].to(dtype), extra["text_embed_padding"]], dim=0)
    sd[BODY_PREFIX + "embed_tokens.weight"] = text_embed
    if extra["has_qwen_head"]:
        sd[QWEN_HEAD_KEY] = text_embed.clone() if extra["qwen_head_tied"] else extra["qwen_head"]
    sd["speech_embedding.weight"] = embed[T:T + rows].to(dtype).clone()
    if vocab.model_family.has_llm_embedding:
        sd["llm_embedding.weight"] = torch.stack([embed[vocab.sos_token_id], embed[vocab.task_id_token_id]]).to(dtype)
    sd["llm_decoder.weight"] = hf["lm_head.weight"][T:T + rows].to(dtype).clone()
    bias = hf["lm_head.bias"][T:T + rows]
    if extra["has_decoder_bias"]:
        sd["llm_decoder.bias"] = bias.to(dtype).clone()
    elif bias.abs().max() > 0:
        raise ValueError(f"{hf_dir}: the source llm_decoder has no bias, but the head's bias rows are nonzero "
                         "(was train_head_bias turned on?); llm.pt cannot hold them")
    return {k: sd[k] for k in extra["key_order"]}


def hf_to_cosyvoice(hf_dir: str | Path, out_path: str | Path) -> Path:
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_path.with_name(out_path.name + ".tmp")
    torch.save(hf_to_cosyvoice_state(hf_dir), tmp)
    tmp.replace(out_path)
    log.info("CosyVoice llm.pt written to %s", out_path)
    return out_path
