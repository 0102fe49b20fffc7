"""Tiny profile only: a short supervised pass of CosyVoice's own `Qwen2LM` on synthetic-codebook targets.

Real GRPO starts from a pretrained CosyVoice2; a random tiny LLM would start from noise. This pass
(CosyVoice's own training forward and loss) makes it a mediocre speaker of the codebook language, so
GRPO has something to improve. Texts are sometimes concatenated, as zero-shot prompts are.
"""

from __future__ import annotations

import logging
import random
from pathlib import Path

import torch
from torch.nn.utils.rnn import pad_sequence
from tqdm import tqdm

log = logging.getLogger(__name__)


def make_example(texts, codebook, tokenizer, rng: random.Random, concat_prob: float, silence_prob: float):
    text, language = rng.choice(texts)
    if rng.random() < concat_prob:
        other, other_lang = rng.choice(texts)
        if other_lang == language:
            text = text + other
    speech = codebook.tokens_for_text(text, language, rng, silence_prob)
    return torch.tensor(tokenizer.encode(text)), torch.tensor(speech)


def collate(examples):
    text, speech = zip(*examples)
    return {"text_token": pad_sequence(text, batch_first=True), "text_token_len": torch.tensor([len(t) for t in text]),
            "speech_token": pad_sequence(speech, batch_first=True),
            "speech_token_len": torch.tensor([len(s) for s in speech])}


def warm_start(model_dir: str | Path, codebook, texts: list[tuple[str, str]], steps: int, batch_size: int,
               lr: float, seed: int, concat_prob: float = 0.3, silence_prob: float = 0.1) -> dict:
    """Train llm.pt in place; returns the last loss and token accuracy."""
    from grpo.tiny_models import load_cosyvoice_yaml

    model_dir = Path(model_dir)
    torch.manual_seed(seed)
    configs = load_cosyvoice_yaml(model_dir, skip=["flow", "hift"])
    llm = configs["llm"]
    llm.load_state_dict(torch.load(model_dir / "llm.pt", map_location="cpu", weights_only=True), strict=True)
    tokenizer = configs["get_tokenizer"]()
    llm.train()
    optim = torch.optim.AdamW(llm.parameters(), lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.OneCycleLR(optim, max_lr=lr, total_steps=steps, pct_start=0.1)
    rng = random.Random(seed)
    stats = {}
    for step in (bar := tqdm(range(steps), desc="warm start (tiny LLM)", mininterval=2)):
        batch = collate([make_example(texts, codebook, tokenizer, rng, concat_prob, silence_prob)
                         for _ in range(batch_size)])
        out = llm(batch, torch.device("cpu"))
        optim.zero_grad()
        out["loss"].backward()
        torch.nn.utils.clip_grad_norm_(llm.parameters(), 1.0)
        optim.step()
        sched.step()
        stats = {"loss": out["loss"].item(), "acc": float(out["acc"])}
        bar.set_postfix(loss=f"{stats['loss']:.3f}", acc=f"{stats['acc']:.3f}", refresh=False)
    torch.save(llm.state_dict(), model_dir / "llm.pt")
    log.info("warm start: %d steps, final loss %.3f, token accuracy %.3f", steps, stats["loss"], stats["acc"])
    return stats
