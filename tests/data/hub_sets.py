"""The public recipe's hub datasets built locally with `datasets`, in the schemas and repository layouts the recipe
reads (examples/grpo/cosyvoice2 at the pinned commit: run.sh stage 0, token2wav_asr_server.py, infer_dataset.py):

- SparkAudio/voxbox: `metadata/aishell-3.jsonl` (one JSON object per line: index, split, language, ..., text), placed
  in the Hugging Face hub cache as a downloaded file is (hf_hub_download finds it offline: the hub code path)
- yuekai/aishell: config `test`, split `test`, columns audio (Audio) and text (AISHELL's transcript, characters
  separated by spaces; the recipe removes them)
- yuekai/CV3-Eval and yuekai/seed_tts_cosy2: one parquet per split (`data/<split>-00000-of-00001.parquet`), columns
  id, prompt_text, prompt_audio (Audio), target_text
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import soundfile as sf

VOXBOX_COMMIT = "0" * 40


def tone(seconds: float, sr: int = 16000, amplitude: float = 0.3, freq: float = 220.0) -> np.ndarray:
    t = np.arange(int(seconds * sr)) / sr
    return (amplitude * np.sin(2 * np.pi * freq * t)).astype(np.float32)


def wav_bytes(samples: np.ndarray, sr: int) -> bytes:
    buf = io.BytesIO()
    sf.write(buf, samples, sr, format="WAV", subtype="PCM_16")
    return buf.getvalue()


def _audio_dataset(rows: dict, audio_column: str):
    """A Dataset whose `audio_column` is an Audio feature holding the given {bytes, path} values (built as a struct and
    cast: encoding through Audio needs torchcodec, which the project does not install)."""
    from datasets import Audio, Dataset, Features, Value

    features = Features({k: ({"bytes": Value("binary"), "path": Value("string")} if k == audio_column
                             else Value("string")) for k in rows})
    return Dataset.from_dict(rows, features=features).cast_column(audio_column, Audio())


def voxbox_in_hub_cache(cache: Path, texts: list[str]) -> Path:
    """metadata/aishell-3.jsonl of SparkAudio/voxbox as the hub cache holds a downloaded file."""
    repo = cache / "datasets--SparkAudio--voxbox"
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / "main").write_text(VOXBOX_COMMIT)
    path = repo / "snapshots" / VOXBOX_COMMIT / "metadata" / "aishell-3.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    rows = [{"index": f"AISHELL-3_{i:010d}", "split": "train", "language": "zh", "age": "Youth-Adult",
             "gender": "female", "emotion": "UNKNOWN", "duration": 3.0, "text": t} for i, t in enumerate(texts)]
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    return path


def aishell_repo(root: Path, clips: list[tuple[bytes, str]]) -> Path:
    """yuekai/aishell's layout: a README declaring the `test` config, its parquet under test/."""
    (root / "test").mkdir(parents=True, exist_ok=True)
    (root / "README.md").write_text("---\nconfigs:\n- config_name: test\n  data_files:\n  - split: test\n"
                                    "    path: test/*.parquet\n---\n")
    ds = _audio_dataset({"audio": [{"bytes": b, "path": f"{k}.wav"} for k, (b, _) in enumerate(clips)],
                         "text": [t for _, t in clips]}, "audio")
    ds.to_parquet(str(root / "test" / "test-00000-of-00001.parquet"))
    return root


def zero_shot_repo(root: Path, splits: dict[str, list[dict]]) -> Path:
    """CV3-Eval / seed_tts_cosy2's layout: data/<split>-00000-of-00001.parquet; items {id, prompt_text,
    prompt_audio: (bytes), target_text}."""
    (root / "data").mkdir(parents=True, exist_ok=True)
    for split, items in splits.items():
        rows = {"id": [it["id"] for it in items], "prompt_text": [it["prompt_text"] for it in items],
                "prompt_audio": [{"bytes": it["prompt_audio"], "path": f"{it['id']}.wav"} for it in items],
                "target_text": [it["target_text"] for it in items]}
        _audio_dataset(rows, "prompt_audio").to_parquet(str(root / "data" / f"{split}-00000-of-00001.parquet"))
    return root


AISHELL_AUTHOR_ROOT = "/mnt/samsung-t7/yuekai/aishell"     # where the manifests' paths point (not on this machine)


def aishell_lhotse_repo(root: Path, clips: list[tuple[bytes, str]], archive: bool = True) -> Path:
    """yuekai/aishell as its public signs describe it: a loading script, the test split as Lhotse cuts
    (`test/aishell_cuts_test.jsonl.gz`, written by Lhotse's own writer) whose recordings name files on the author's
    machine, and the audio in `test/test.tar.gz` (AISHELL-1's `data_aishell/wav/test/<speaker>/<utt>.wav`); the
    speakers are S0764, S0765, ... one clip each, the transcripts words separated by spaces."""
    import tarfile

    from lhotse import CutSet, Recording, RecordingSet, SupervisionSegment, SupervisionSet
    from lhotse.utils import fastcopy

    staging = root / ".staging"
    recordings, supervisions = [], []
    for k, (data, text) in enumerate(clips):
        speaker, utt = f"S{764 + k:04d}", f"BAC009S{764 + k:04d}W0121"
        rel = f"data_aishell/wav/test/{speaker}/{utt}.wav"
        (staging / rel).parent.mkdir(parents=True, exist_ok=True)
        (staging / rel).write_bytes(data)
        rec = Recording.from_file(staging / rel, recording_id=utt)
        rec = fastcopy(rec, sources=[fastcopy(s, source=f"{AISHELL_AUTHOR_ROOT}/{rel}") for s in rec.sources])
        recordings.append(rec)
        supervisions.append(SupervisionSegment(id=utt, recording_id=utt, start=0.0, duration=rec.duration,
                                               channel=0, text=text, speaker=speaker, language="Chinese"))
    (root / "test").mkdir(parents=True, exist_ok=True)
    cuts = CutSet.from_manifests(recordings=RecordingSet.from_recordings(recordings),
                                 supervisions=SupervisionSet.from_segments(supervisions))
    cuts.to_file(root / "test" / "aishell_cuts_test.jsonl.gz")
    if archive:
        with tarfile.open(root / "test" / "test.tar.gz", "w:gz") as tar:
            tar.add(staging / "data_aishell", arcname="data_aishell")
    import shutil

    shutil.rmtree(staging)
    (root / "aishell.py").write_text('"""yuekai/aishell loading script (datasets < 4 ran these)."""\n')
    (root / "README.md").write_text("---\nlicense: apache-2.0\n---\n")
    return root


def in_hub_cache(cache: Path, repo_id: str, folder: Path, commit: str = "1" * 40) -> Path:
    """A dataset repository's files as the hub cache holds a downloaded snapshot (snapshot_download finds it
    offline)."""
    import shutil

    repo = cache / f"datasets--{repo_id.replace('/', '--')}"
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / "main").write_text(commit)
    shutil.copytree(folder, repo / "snapshots" / commit)
    return repo / "snapshots" / commit
