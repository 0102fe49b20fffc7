"""Seeded stand-in prompt speakers for the tiny profile: no speaker encoder or speech tokenizer exists there, so
the flow's conditioning (prompt tokens, mel, speaker embedding) is drawn from a seed, in CosyVoice's spk2info
schema (grpo/speech/token2wav.py)."""

from __future__ import annotations

import torch

from grpo.speech.speakers import stable_hash


def tiny_speakers(count: int, seed: int, prompt_tokens: int = 50, speech_token_size: int = 6561) -> dict:
    """Seeded stand-in speakers for the tiny profile (no speaker encoder or speech tokenizer exists there)."""
    gen = torch.Generator().manual_seed(seed)
    speakers = {}
    for k in range(count):
        tokens = torch.randint(0, speech_token_size, (1, prompt_tokens), generator=gen, dtype=torch.int32)
        speakers[f"tiny_speaker_{k}"] = {
            "prompt_text": f"tiny speaker {k}",
            "llm_prompt_speech_token": tokens, "flow_prompt_speech_token": tokens,
            "prompt_speech_feat": 0.5 * torch.randn(1, 2 * prompt_tokens, 80, generator=gen),
            "flow_embedding": torch.randn(1, 192, generator=gen), "llm_embedding": torch.zeros(1, 0),
        }
    return speakers


def tiny_prompt_features(item_id: str, prompt_tokens: list[int]) -> dict:
    """Stand-in flow conditioning for a tiny zero-shot item: its own prompt tokens, seeded mel and embedding."""
    gen = torch.Generator().manual_seed(stable_hash(item_id) % (2**31))
    tokens = torch.tensor([prompt_tokens], dtype=torch.int32)
    return {"flow_prompt_speech_token": tokens, "llm_prompt_speech_token": tokens,
            "prompt_speech_feat": 0.5 * torch.randn(1, 2 * len(prompt_tokens), 80, generator=gen),
            "flow_embedding": torch.randn(1, 192, generator=gen)}
