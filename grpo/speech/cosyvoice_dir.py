"""A CosyVoice2 model directory as CosyVoice itself loads it: `cosyvoice2.yaml` (hyperpyyaml, CosyVoice's own
classes) and the text tokenizer of `CosyVoice-BlankEN/`.

One loader for the released download and for the random-weight builds of the tiny and realsize profiles
(grpo/standins/released_layout.py): nothing here knows where the weights came from.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

# The files of the released CosyVoice2-0.5B directory that this project reads (stage -1's random builds write
# every one of them under the released name; tests/standins/test_realsize.py checks the realsize build against
# this list)
RELEASED_FILES = (
    "cosyvoice2.yaml", "llm.pt", "flow.pt", "hift.pt", "campplus.onnx", "speech_tokenizer_v2.onnx",
    "CosyVoice-BlankEN/config.json", "CosyVoice-BlankEN/generation_config.json",
    "CosyVoice-BlankEN/tokenizer_config.json", "CosyVoice-BlankEN/vocab.json", "CosyVoice-BlankEN/merges.txt",
    "CosyVoice-BlankEN/model.safetensors",
)
BLANK_DIR = "CosyVoice-BlankEN"

# Modules of the yaml that only CosyVoice's own training builds: the GAN wrapper of HiFT (its discriminators)
TRAINING_ONLY = ("hifigan",)


def load_cosyvoice_yaml(model_dir: str | Path, skip: Iterable[str] = ()) -> dict:
    """Load `cosyvoice2.yaml` the way CosyVoice2 does (qwen_pretrain_path -> CosyVoice-BlankEN).

    `skip` replaces top-level modules with None (not built); the GAN training wrapper is never built. Every
    `!name:` entry (the data pipeline's `cosyvoice.dataset.processor.*`, matcha's mel) is still imported, as
    hyperpyyaml does for the released file: what they import must be installed (grpo/envcheck.py)."""
    from hyperpyyaml import load_hyperpyyaml

    model_dir = Path(model_dir)
    path = model_dir / "cosyvoice2.yaml"
    if not path.exists():
        raise FileNotFoundError(f"{path} not found (expected a CosyVoice2 model directory)")
    overrides = {"qwen_pretrain_path": str(model_dir / BLANK_DIR)}
    overrides.update({name: None for name in (*TRAINING_ONLY, *skip)})
    with open(path, encoding="utf-8") as f:
        return load_hyperpyyaml(f, overrides=overrides)


def cosyvoice_text_tokenizer(model_dir: str | Path):
    """The text tokenizer exactly as CosyVoice builds it: its own CosyVoice2Tokenizer (Qwen's BPE of
    CosyVoice-BlankEN plus CosyVoice's special tokens). `model_dir` may be the model dir or BlankEN itself."""
    from cosyvoice.tokenizer.tokenizer import CosyVoice2Tokenizer

    blank = Path(model_dir)
    if (blank / BLANK_DIR).is_dir():
        blank = blank / BLANK_DIR
    return CosyVoice2Tokenizer(token_path=str(blank), skip_special_tokens=True).tokenizer
