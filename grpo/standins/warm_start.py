"""Tiny profile only: a short supervised pass of CosyVoice's own `Qwen2LM` on synthetic-codebook targets.

Real GRPO starts from a pretrained CosyVoice2; a random tiny LLM would start from noise. This pass
(CosyVoice's own training forward and loss) makes it a mediocre reader of the codebook language, so GRPO
has something to improve. With `random_text_prob=1` (the tiny profile) every example is a random string
of the codebook's characters (and some punctuation), never a sentence: the model must learn to read,
which it does after a phase change (~1000 steps of 32 strings for a 2-layer, 4-head LLM: docs/tiny-profile.md), and
sentences of the held-out set are new to it. Otherwise texts are sometimes concatenated, as zero-shot
prompts are.
"""

from __future__ import annotations

import logging
import random
from pathlib import Path

import torch
from torch.nn.utils.rnn import pad_sequence
from tqdm import tqdm

log = logging.getLogger(__name__)


def make_example(texts, chars, codebook, tokenizer, rng: random.Random, cfg: dict):
    """One (text tokens, speech tokens) pair. Half are shuffled character strings: without them a tiny
    model memorises whole sentences instead of learning how characters sound."""
    while True:
        text, language = rng.choice(texts)
        if language == "zh" and rng.random() < cfg["random_text_prob"]:
            text = "".join(rng.choice(PUNCTUATION) if rng.random() < cfg["punctuation_prob"] else rng.choice(chars)
                           for _ in range(rng.randint(cfg["min_len"], cfg["max_len"])))
        elif rng.random() < cfg["concat_prob"]:
            other, other_lang = rng.choice(texts)
            if other_lang == language:
                text = text + other
        try:
            speech = codebook.tokens_for_text(text, language, rng, cfg["silence_prob"], cfg["canonical_prob"])
        except KeyError:   # a reading out of context that the codebook does not know: draw again
            continue
        if speech:         # (a string of punctuation alone says nothing)
            return torch.tensor(tokenizer.encode(text)), torch.tensor(speech)


def chinese_characters(texts: list[tuple[str, str]]) -> list[str]:
    """The characters random strings are drawn from: every Chinese character of the (zh) texts."""
    return sorted({ch for text, lang in texts if lang == "zh" for ch in text if "\u4e00" <= ch <= "\u9fff"})


def collate(examples, prefix: list[int] = ()):
    """The training batch of upstream's LM forward; `prefix`: the family's prompt prefix as the instruction that
    CosyVoice3LM's forward puts between sos and the text (Qwen2LM reads none; the prefix is empty there)."""
    text, speech = zip(*examples)
    return {"text_token": pad_sequence(text, batch_first=True), "text_token_len": torch.tensor([len(t) for t in text]),
            "speech_token": pad_sequence(speech, batch_first=True),
            "speech_token_len": torch.tensor([len(s) for s in speech]),
            "instruct_token": torch.tensor([list(prefix)] * len(text), dtype=torch.long).reshape(len(text), -1),
            "instruct_token_len": torch.full((len(text),), len(prefix))}


DEFAULTS = {"random_text_prob": 0.0, "min_len": 4, "max_len": 16, "punctuation_prob": 0.0, "concat_prob": 0.0,
            "silence_prob": 0.05, "canonical_prob": 0.9, "init_speech_from_text": True}
PUNCTUATION = "，。"


def example_options(warm_start_cfg: dict) -> dict:
    """model.tiny.warm_start without the optimiser's keys (steps, batch_size, lr): how examples are drawn."""
    return {k: v for k, v in warm_start_cfg.items() if k not in ("steps", "batch_size", "lr")}


@torch.no_grad()
def init_speech_embeddings(llm, tokenizer, codebook, texts) -> int:
    """Start each unit's speech-token embeddings at the mean text embedding of the characters read
    as that unit: a pretrained TTS LLM relates the two, and without it a tiny model memorises
    sentences long before it learns to follow the text."""
    from grpo.speech.scoring import text_to_units

    emb = llm.llm.model.model.embed_tokens.weight
    by_unit: dict[int, list[int]] = {}
    for text, lang in texts:
        for ch in text:
            ids, units = tokenizer.encode(ch), text_to_units(ch, lang) if ch.strip() else ()
            if len(ids) == 1 and len(units) == 1 and units[0] in codebook.unit_index:
                by_unit.setdefault(codebook.unit_index[units[0]], []).append(ids[0])
    for u, ids in by_unit.items():
        llm.speech_embedding.weight[codebook.tokens_by_unit[u]] = emb[sorted(set(ids))].mean(0)
    return len(by_unit)


def warm_start(model_dir: str | Path, codebook, texts: list[tuple[str, str]], steps: int, batch_size: int,
               lr: float, seed: int, alphabet: list[tuple[str, str]] | None = None, **options) -> dict:
    """Train llm.pt in place; returns the last loss and token accuracy. Random strings are drawn from the
    Chinese characters of `alphabet` (texts whose characters the codebook speaks; default `texts`)."""
    from grpo.speech.cosyvoice_dir import load_cosyvoice_yaml
    from grpo.speech.family import family_of_dir
    from grpo.upstream.shims import qwen2lm_any_width

    model_dir = Path(model_dir)
    torch.manual_seed(seed)
    configs = load_cosyvoice_yaml(model_dir, skip=["flow", "hift"])
    llm = configs["llm"]
    qwen2lm_any_width(llm)                      # upstream's training forward assumes the released width
    llm.load_state_dict(torch.load(model_dir / "llm.pt", map_location="cpu", weights_only=True), strict=True)
    tokenizer = configs["get_tokenizer"]()
    prefix = family_of_dir(model_dir).prompt_prefix
    prefix_ids = tokenizer.encode(prefix) if prefix else []   # the text the LLM reads after sos, before the target
    opts = {**DEFAULTS, **options}
    alphabet = alphabet or texts
    if opts["init_speech_from_text"]:
        init_speech_embeddings(llm, tokenizer, codebook, alphabet)
    llm.train()
    optim = torch.optim.AdamW(llm.parameters(), lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.OneCycleLR(optim, max_lr=lr, total_steps=steps, pct_start=0.1)
    rng = random.Random(seed)
    chars = chinese_characters(alphabet)
    stats = {}
    for step in (bar := tqdm(range(steps), desc="warm start (tiny LLM)", mininterval=2)):
        batch = collate([make_example(texts, chars, codebook, tokenizer, rng, opts) for _ in range(batch_size)],
                        prefix_ids)
        out = llm(batch, torch.device("cpu"))
        optim.zero_grad()
        out["loss"].backward()
        torch.nn.utils.clip_grad_norm_(llm.parameters(), 1.0)
        optim.step()
        sched.step()
        stats = {"loss": out["loss"].item(), "acc": float(out["acc"])}
        if step % 100 == 0:
            log.info("warm start step %d: loss %.3f acc %.3f", step, stats["loss"], stats["acc"])
        bar.set_postfix(loss=f"{stats['loss']:.3f}", acc=f"{stats['acc']:.3f}", refresh=False)
    torch.save(llm.state_dict(), model_dir / "llm.pt")
    log.info("warm start: %d steps, final loss %.3f, token accuracy %.3f", steps, stats["loss"], stats["acc"])
    return stats
