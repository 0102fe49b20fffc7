"""A CosyVoice model directory as upstream CosyVoice loads it: the family's yaml (`cosyvoice2.yaml` or
`cosyvoice3.yaml`, hyperpyyaml, upstream's own classes) and the text tokenizer of `CosyVoice-BlankEN/`.

One loader for the released downloads and for the random-weight builds of the tiny and realsize profiles
(grpo/standins/released_layout.py): nothing here knows where the weights came from.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from grpo.speech.family import Family, family_of_dir

BLANK_DIR = "CosyVoice-BlankEN"
BLANK_FILES = ("config.json", "generation_config.json", "tokenizer_config.json", "vocab.json", "merges.txt",
               "model.safetensors")

# Modules of the yaml that only CosyVoice's own training builds: the GAN wrapper of HiFT (its discriminators)
TRAINING_ONLY = ("hifigan",)


def released_files(family: Family) -> tuple[str, ...]:
    """The files of the released model directory this project reads (stage -1's random builds write every one
    of them under the released name; tests/standins/test_realsize.py checks the realsize builds against it)."""
    return (family.yaml, "llm.pt", "flow.pt", "hift.pt", "campplus.onnx", family.speech_tokenizer,
            *(f"{BLANK_DIR}/{f}" for f in BLANK_FILES))


def load_cosyvoice_yaml(model_dir: str | Path, skip: Iterable[str] = ()) -> dict:
    """Load the directory's yaml the way `CosyVoice2` / `CosyVoice3` do (qwen_pretrain_path -> CosyVoice-BlankEN).

    `skip` replaces top-level modules with None (not built); the GAN training wrapper is never built. Every
    `!name:` entry (the data pipeline's `cosyvoice.dataset.processor.*`, matcha's mel) is still imported, as
    hyperpyyaml does for the released file: what they import must be installed (grpo/node/envcheck.py)."""
    from hyperpyyaml import load_hyperpyyaml

    model_dir = Path(model_dir)
    path = model_dir / family_of_dir(model_dir).yaml
    overrides = {"qwen_pretrain_path": str(model_dir / BLANK_DIR)}
    overrides.update({name: None for name in (*TRAINING_ONLY, *skip)})
    with open(path, encoding="utf-8") as f:
        return load_hyperpyyaml(f, overrides=overrides)


def blank_dir(model_dir: str | Path) -> Path:
    """`model_dir` may be the model directory or its CosyVoice-BlankEN itself."""
    blank = Path(model_dir)
    return blank / BLANK_DIR if (blank / BLANK_DIR).is_dir() else blank


def cosyvoice_text_tokenizer(model_dir: str | Path, family: Family):
    """The text tokenizer exactly as CosyVoice builds it: a fresh instance of the class `get_qwen_tokenizer` picks
    for the family (Qwen's BPE of CosyVoice-BlankEN plus the family's special tokens), its Hugging Face tokenizer.
    (Fresh: get_qwen_tokenizer caches its instances, and the caller may add tokens to this one.)"""
    from grpo.speech.family import upstream_class

    return upstream_class(family.upstream_tokenizer)(token_path=str(blank_dir(model_dir)),
                                                     skip_special_tokens=True).tokenizer
