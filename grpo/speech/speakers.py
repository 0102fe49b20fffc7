"""Prompt speakers of the cosyvoice2 backend: built once (stage -1, in the driver), loaded by every replica.

Clips come from `reward.prompt_speakers.clips`: a list of {text, wav[, id]}, a JSONL file of those, or a
Kaldi-style folder (`wav.scp` + `text`, utterance id first on each line). The speaker file holds CosyVoice's
spk2info entries and the hash of the clips it was built from: changed clips (text, path or audio) rebuild
it; it is written atomically (temporary file, then rename) and loaded with `weights_only=True`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Callable
from pathlib import Path

import torch

log = logging.getLogger(__name__)

REQUIRED = {"flow_prompt_speech_token", "prompt_speech_feat", "flow_embedding"}


def stable_hash(text: str) -> int:
    """Process-independent hash (Python's hash() is salted per process)."""
    return int.from_bytes(hashlib.sha1(text.encode("utf-8")).digest()[:8], "big")


def speaker_index(item_id: str, count: int) -> int:
    """The prompt speaker of a sample: fixed by its id, so a GRPO group shares one speaker."""
    return stable_hash(item_id) % count


def read_clips(source) -> list[dict]:
    """{id, text, wav} clips from a list of dicts, a JSONL file, or a Kaldi folder (wav.scp + text)."""
    if source is None or (not isinstance(source, (str, Path)) and len(source) == 0):
        return []
    if not isinstance(source, (str, Path)):
        clips = [dict(c) for c in source]
        base = Path.cwd()
    else:
        path = Path(source)
        if path.is_dir():
            wavs = dict(line.split(maxsplit=1) for line in (path / "wav.scp").read_text().splitlines() if line.strip())
            texts = dict(line.split(maxsplit=1) for line in (path / "text").read_text().splitlines() if line.strip())
            missing = sorted(set(wavs) ^ set(texts))
            if missing:
                raise ValueError(f"{path}: wav.scp and text disagree on utterances {missing[:5]}")
            clips, base = [{"id": k, "text": texts[k], "wav": wavs[k]} for k in sorted(wavs)], path
        elif path.is_file():
            clips = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
            base = path.parent
        else:
            raise FileNotFoundError(f"prompt clips {path} not found (a JSONL file or a folder with wav.scp + text)")
    for k, clip in enumerate(clips):
        if not clip.get("text") or not clip.get("wav"):
            raise ValueError(f"prompt clip {k} needs 'text' and 'wav': {clip}")
        clip.setdefault("id", f"speaker_{k}")
        wav = Path(clip["wav"])
        clip["wav"] = str(wav if wav.is_absolute() else base / wav)
        if not Path(clip["wav"]).exists():
            raise FileNotFoundError(f"prompt clip {clip['id']}: {clip['wav']} not found")
    return clips


def clips_hash(clips: list[dict]) -> str:
    h = hashlib.sha256()
    for clip in clips:
        h.update(json.dumps([clip["id"], clip["text"], clip["wav"]], ensure_ascii=False).encode())
        h.update(hashlib.sha256(Path(clip["wav"]).read_bytes()).digest())
    return h.hexdigest()[:16]


def save_atomically(obj, path: Path) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def check(speakers: dict, path) -> dict:
    if not speakers:
        raise ValueError(f"{path} holds no speakers")
    for name, spk in speakers.items():
        missing = REQUIRED - set(spk)
        if missing:
            raise ValueError(f"speaker {name!r} in {path} lacks {sorted(missing)}")
    return speakers


def load_speakers(path: str | Path) -> dict:
    """The speaker file stage -1 wrote (or a CosyVoice spk2info.pt), without unpickling code."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{path} not found: build the prompt speakers first (bash run.sh -1 -1), "
                                "or point reward.prompt_speakers.features at a CosyVoice spk2info.pt")
    data = torch.load(path, map_location="cpu", weights_only=True)
    speakers = data["speakers"] if isinstance(data, dict) and "clips_hash" in data else data
    return check(speakers, path)


def build_speakers(path: str | Path, clips: list[dict], featurize: Callable[[list[dict]], dict]) -> dict:
    """Speakers from `clips` via `featurize`; the saved file is reused while the clips are unchanged."""
    path, digest = Path(path), clips_hash(clips)
    if path.exists():
        data = torch.load(path, map_location="cpu", weights_only=True)
        if isinstance(data, dict) and data.get("clips_hash") == digest:
            log.info("prompt speakers up to date: %s", path)
            return check(data["speakers"], path)
        log.info("prompt clips changed: rebuilding %s", path)
    speakers = check(featurize(clips), path)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_atomically({"clips_hash": digest, "speakers": speakers}, path)
    log.info("%d prompt speakers written to %s", len(speakers), path)
    return speakers
