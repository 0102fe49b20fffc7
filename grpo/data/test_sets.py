"""Zero-shot test sets: one item = id, prompt text, prompt speech (tokens or a wav), target text, language.

Layouts:
- `jsonl` (the shipped tiny set, or your own): {"id", "prompt_text", "text", "language"?,
  "prompt_speech_tokens"? , "prompt_wav"? (relative to the file)}
- `cv3_zero_shot`: a CV3-Eval directory (e.g. data/zero_shot/zh) with Kaldi-style `text`,
  `prompt_text` and `prompt_wav.scp` files
- `seedtts`: a Seed-TTS-eval `meta.lst` (utt|prompt_text|prompt_wav|target_text[|gt_wav])
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path


@dataclass
class ZeroShotItem:
    id: str
    prompt_text: str
    text: str
    language: str = "zh"
    prompt_speech_tokens: list[int] | None = None
    prompt_wav: str | None = None


def load_jsonl(path: str | Path) -> list[ZeroShotItem]:
    path = Path(path)
    items = []
    for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            wav = row.get("prompt_wav")
            items.append(ZeroShotItem(id=str(row["id"]), prompt_text=row["prompt_text"], text=row["text"],
                                      language=row.get("language", "zh"),
                                      prompt_speech_tokens=row.get("prompt_speech_tokens"),
                                      prompt_wav=str(path.parent / wav) if wav and not Path(wav).is_absolute()
                                      else wav))
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise ValueError(f"{path}:{lineno}: bad zero-shot item ({exc})") from None
    return items


def _kaldi_map(path: Path) -> dict[str, str]:
    out = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.strip():
            key, _, value = line.strip().partition(" ")
            out[key] = value.strip()
    return out


def _resolve_wav(wav: str, set_dir: Path) -> str:
    """CV3-Eval paths are relative to the repository root (data/zero_shot/...); accept either root."""
    p = Path(wav)
    if p.is_absolute():
        return str(p)
    for base in (set_dir, *set_dir.parents):
        if (base / p).exists():
            return str(base / p)
    return str(set_dir / p)


def load_cv3(set_dir: str | Path, language: str | None = None) -> list[ZeroShotItem]:
    set_dir = Path(set_dir)
    for name in ("text", "prompt_text", "prompt_wav.scp"):
        if not (set_dir / name).exists():
            raise FileNotFoundError(f"{set_dir / name} missing: not a CV3-Eval zero-shot directory")
    text, prompt_text, wavs = (_kaldi_map(set_dir / n) for n in ("text", "prompt_text", "prompt_wav.scp"))
    language = language or ("en" if set_dir.name.endswith("en") else "zh")
    return [ZeroShotItem(id=k, prompt_text=prompt_text[k], text=text[k], language=language,
                         prompt_wav=_resolve_wav(wavs[k], set_dir))
            for k in text if k in prompt_text and k in wavs]


def load_seedtts(meta: str | Path, language: str | None = None) -> list[ZeroShotItem]:
    meta = Path(meta)
    language = language or ("en" if "/en" in str(meta.parent) else "zh")
    items = []
    for lineno, line in enumerate(meta.read_text(encoding="utf-8").splitlines(), start=1):
        fields = line.strip().split("|")
        if not line.strip():
            continue
        if len(fields) not in (4, 5):
            raise ValueError(f"{meta}:{lineno}: expected utt|prompt_text|prompt_wav|text[|gt_wav]")
        utt, prompt_text, wav, text = fields[:4]
        items.append(ZeroShotItem(id=utt, prompt_text=prompt_text, text=text, language=language,
                                  prompt_wav=str(meta.parent / wav) if not Path(wav).is_absolute() else wav))
    return items


def load_set(kind: str, path: str | Path, language: str | None = None) -> list[ZeroShotItem]:
    if kind in ("tiny", "jsonl"):
        return load_jsonl(path)
    if kind == "cv3_zero_shot":
        return load_cv3(path, language)
    if kind == "seedtts":
        return load_seedtts(path, language)
    raise ValueError(f"unknown eval.set {kind!r}; expected tiny, jsonl, cv3_zero_shot or seedtts")


def extra_sets(eval_cfg) -> list[tuple[str, dict]]:
    """eval.extra_sets as (name, the eval.* keys it sets): its own keys over eval.*, its out_dir eval.out_dir/<name>.
    Each needs a name and a data_path."""
    out = []
    for extra in eval_cfg.get("extra_sets") or []:
        if not extra.get("name") or not extra.get("data_path"):
            raise ValueError(f"eval.extra_sets: each set needs a name and a data_path, got {dict(extra)}")
        overrides = {k: v for k, v in extra.items() if k != "name"}
        out.append((extra["name"], {**overrides, "out_dir": str(Path(eval_cfg.out_dir) / extra["name"]),
                                    "extra_sets": []}))
    return out
