"""The public recipe's data in one command: training text, prompt speakers and zero-shot sets (`data.sources`).

Each source is a dataset on the Hugging Face hub (`hub`, with `config`/`split`/`file`) or a local copy (`path`),
fetched once and converted into the project's own layouts under `data.sources.out_dir`:

    text/train.jsonl, text/val.jsonl        {"text", "language", "id"} lines for stage 0 (data.train_file/val_file)
    prompts/clips.jsonl, prompts/wavs/      {"id", "text", "wav"} prompt clips (reward.prompt_speakers.clips)
    eval/<name>/meta.lst, eval/<name>/wavs/ Seed-TTS-eval layout (eval.set=seedtts)

Each output folder carries a stamp of the spec that made it: a rerun with the same spec touches nothing (no
network). Everything is built in temporary folders and renamed into place only when every source succeeded, so a
failure (no network, wrong id, split or column, unreadable audio) ends in one line naming the key and writes nothing.

Where the rows come from (the hub asked once whether it is reachable, `datasets`, Lhotse manifests for a repository
with a loading script) is grpo/data/readers.py; this module checks the specs, builds the layouts and stamps them.
"""

from __future__ import annotations

import json
import logging
import shutil
from functools import partial
from pathlib import Path

import numpy as np
from omegaconf import DictConfig, OmegaConf
from tqdm import tqdm

from grpo.config import resolve_path
from grpo.data.readers import Hub, SourceError, audio_dataset, decode, first_line, text_file, where_of

log = logging.getLogger(__name__)

FORMAT_VERSION = 1          # bump when an output layout changes
STAMP = ".source.json"


# ---------------------------------------------------------------- specs and checks


# what a source spec holds besides hub/path/config/split/revision (a profile or the command line sets the rest)
DEFAULTS = {
    "text": {"file": None, "text_key": "text", "id_key": "index", "language_key": "language", "train_lines": 80000,
             "val_lines": 100},
    "prompts": {"split": "test", "audio": "audio", "text": "text", "speakers": 20, "seed": 0, "strip_spaces": True,
                "speaker_column": None},
    "eval": {"split": "test", "id": "id", "prompt_text": "prompt_text", "prompt_audio": "prompt_audio",
             "target_text": "target_text"},
}


# keys every source takes: where it is (hub or path, revision; config, split and the `files` patterns of a
# repository downloaded as files) and, for a Lhotse-layout repository, `cuts` (a glob of its manifests)
COMMON_KEYS = ("hub", "path", "revision", "config", "split", "files", "cuts")


def _spec(node, kind: str, key: str) -> dict:
    """The source spec over its kind's defaults; a key that no source of the kind reads is a one-line error."""
    spec = OmegaConf.to_container(node, resolve=True) if isinstance(node, DictConfig) else dict(node)
    allowed = tuple(dict.fromkeys((*COMMON_KEYS, *DEFAULTS[kind], *(("name",) if kind == "eval" else ()))))
    unknown = [k for k in spec if k not in allowed]
    if unknown:
        raise SourceError(f"{key}.{unknown[0]}: unknown key (a {kind} source takes {', '.join(allowed)})")
    return {**DEFAULTS[kind], **spec}


def audio_problem(samples: np.ndarray, sr: int, checks: dict) -> str | None:
    """Why a clip is unfit as a prompt (None if fit): sample rate, duration bounds, silence."""
    duration = len(samples) / sr if sr else 0.0
    if sr < checks["min_sample_rate"]:
        return f"sample rate {sr} Hz < {checks['min_sample_rate']}"
    if not checks["min_seconds"] <= duration <= checks["max_seconds"]:
        return f"{duration:.2f} s outside [{checks['min_seconds']}, {checks['max_seconds']}] s"
    rms = float(np.sqrt(np.mean(np.square(samples, dtype=np.float64)))) if len(samples) else 0.0
    if 20 * np.log10(max(rms, 1e-10)) < checks["silence_dbfs"]:
        return f"silent (RMS {20 * np.log10(max(rms, 1e-10)):.1f} dBFS < {checks['silence_dbfs']})"
    return None


def _row(ds, i: int, what: str) -> dict:
    """Row `i` of a split; a Lhotse cut whose audio cannot be found or read is a one-line error."""
    try:
        return ds[i]
    except Exception as exc:        # noqa: BLE001
        raise SourceError(f"{what}: {first_line(exc)}") from None


def _clean(text: str, what: str) -> str:
    text = " ".join(str(text).split())
    if not text or "|" in text:
        raise SourceError(f"{what}: {'empty text' if not text else 'text holds |, which meta.lst cannot hold'}")
    return text


def _write_wav(path: Path, samples: np.ndarray, sr: int) -> None:
    import soundfile as sf

    path.parent.mkdir(parents=True, exist_ok=True)
    sf.write(str(path), samples, sr, subtype="PCM_16")


def _scratch(folder: Path) -> Path:
    """Where a source being built into `folder` keeps its datasets cache (removed when it is built)."""
    return folder.with_name(f".{folder.name}.cache")


def _safe_name(s: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in str(s))


# ---------------------------------------------------------------- the three kinds


def build_text(spec: dict, key: str, out: Path, hub: Hub) -> str:
    """train.jsonl = the first `train_lines` lines, val.jsonl = the last `val_lines` (the recipe's head/tail)."""
    path = text_file(spec, key, hub)
    lines = [ln for ln in path.read_text(encoding="utf-8").splitlines() if ln.strip()]
    n_train, n_val = spec["train_lines"], spec["val_lines"]
    if n_train + n_val > len(lines):
        raise SourceError(f"{key}: {path.name} has {len(lines)} lines, fewer than train_lines + val_lines = "
                          f"{n_train + n_val}: training and validation text would overlap")
    for name, chunk, offset in (("train", lines[:n_train], 0), ("val", lines[len(lines) - n_val:], len(lines) - n_val)):
        rows = []
        for i, line in enumerate(chunk, start=offset + 1):
            try:
                row = json.loads(line)
                text = row[spec["text_key"]]
            except (json.JSONDecodeError, KeyError, TypeError) as exc:
                raise SourceError(f"{key}: {path.name}:{i}: no {spec['text_key']!r} ({first_line(exc)})") from None
            out_row = {"text": text, "id": str(row.get(spec["id_key"], f"{name}_{i}"))}
            if spec.get("language_key") and row.get(spec["language_key"]):
                out_row["language"] = row[spec["language_key"]]
            rows.append(json.dumps(out_row, ensure_ascii=False))
        (out / f"{name}.jsonl").write_text("\n".join(rows) + "\n", encoding="utf-8")
    return f"{n_train} training and {n_val} validation lines of {len(lines)}"


def build_prompts(spec: dict, key: str, out: Path, checks: dict, hub: Hub) -> str:
    """`speakers` clips chosen by a seeded permutation of the split, skipping clips that fail the audio checks
    (and, with `speaker_column`, more than one clip per speaker)."""
    columns = {"audio": spec["audio"], "text": spec["text"]}
    if spec.get("speaker_column"):
        columns["speaker_column"] = spec["speaker_column"]
    ds = audio_dataset(spec, key, columns, _scratch(out), hub)
    order = np.random.default_rng(spec["seed"]).permutation(len(ds))
    clips, seen, skipped = [], set(), {}
    with tqdm(total=spec["speakers"], desc=f"{key}: prompt clips") as bar:
        for i in order:
            if len(clips) == spec["speakers"]:
                break
            row = _row(ds, int(i), f"{key} row {i}")
            speaker = row[spec["speaker_column"]] if spec["speaker_column"] else None
            if speaker is not None and speaker in seen:
                continue
            samples, sr = decode(row[spec["audio"]], f"{key} row {i}")
            problem = audio_problem(samples, sr, checks)
            text = str(row[spec["text"]]).replace(" ", "") if spec["strip_spaces"] else str(row[spec["text"]])
            if problem or not text.strip():
                skipped[int(i)] = problem or "empty text"
                continue
            seen.add(speaker)
            clip_id = f"prompt_{len(clips):03d}_{_safe_name(speaker if speaker is not None else i)}"
            _write_wav(out / "wavs" / f"{clip_id}.wav", samples, sr)
            clips.append({"id": clip_id, "text": text.strip(), "wav": f"wavs/{clip_id}.wav", "row": int(i)})
            bar.update()
    if len(clips) < spec["speakers"]:
        raise SourceError(f"{key}.speakers={spec['speakers']}: only {len(clips)} usable clips in the split "
                          f"({len(skipped)} failed the audio checks, e.g. row {next(iter(skipped), '-')}: "
                          f"{next(iter(skipped.values()), '-')})")
    if skipped:
        log.info("%s: %d clip(s) skipped by the audio checks (data.sources.audio_checks)", key, len(skipped))
    (out / "clips.jsonl").write_text("".join(json.dumps(c, ensure_ascii=False) + "\n" for c in clips), "utf-8")
    return f"{len(clips)} prompt clips from {len(ds)} rows"


def build_eval(spec: dict, key: str, out: Path, checks: dict, hub: Hub) -> str:
    """Every item of the split as meta.lst (utt|prompt_text|prompt_wav|target_text) + wavs; items whose prompt
    fails the audio checks are kept (the set is a benchmark) and counted in the log."""
    columns = {k: spec[k] for k in ("prompt_audio", "prompt_text", "target_text", "id")}
    ds = audio_dataset(spec, key, columns, _scratch(out), hub)
    lines, flagged, ids = [], 0, set()
    for i in tqdm(range(len(ds)), desc=f"{key}: items", mininterval=5):
        row = ds[i]
        utt = _safe_name(row[spec["id"]])
        if utt in ids:
            raise SourceError(f"{key}: id {utt!r} twice (column {spec['id']})")
        ids.add(utt)
        samples, sr = decode(row[spec["prompt_audio"]], f"{key} item {utt}")
        flagged += audio_problem(samples, sr, checks) is not None
        _write_wav(out / "wavs" / f"{utt}.wav", samples, sr)
        lines.append("|".join([utt, _clean(row[spec["prompt_text"]], f"{key} item {utt} prompt_text"),
                               f"wavs/{utt}.wav", _clean(row[spec["target_text"]], f"{key} item {utt} target_text")]))
    if not lines:
        raise SourceError(f"{key}: the split has no items")
    if flagged:
        log.warning("%s: %d of %d prompts fail the audio checks (kept: the set is a benchmark)", key, flagged,
                    len(lines))
    (out / "meta.lst").write_text("\n".join(lines) + "\n", encoding="utf-8")
    return f"{len(lines)} items"


# ---------------------------------------------------------------- stamps and the stage entry


def planned(cfg: DictConfig) -> list[tuple[str, str, dict, Path]]:
    """(kind, config key, spec, output folder) of every configured source."""
    src = cfg.data.sources
    root = resolve_path(src.out_dir)
    jobs = []
    if src.get("text"):
        jobs.append(("text", "data.sources.text", _spec(src.text, "text", "data.sources.text"), root / "text"))
    if src.get("prompts"):
        jobs.append(("prompts", "data.sources.prompts", _spec(src.prompts, "prompts", "data.sources.prompts"),
                     root / "prompts"))
    for k, item in enumerate(src.get("eval") or []):
        spec = _spec(item, "eval", f"data.sources.eval[{k}]")
        if not spec.get("name"):
            raise SourceError(f"data.sources.eval[{k}]: needs a name (its folder under {root / 'eval'})")
        jobs.append(("eval", f"data.sources.eval[{k}]", spec, root / "eval" / _safe_name(spec["name"])))
    return jobs


def _local_identity(spec: dict) -> list | None:
    """A local copy's size and newest modification time: an edited copy is converted again."""
    if not spec.get("path"):
        return None
    root = resolve_path(spec["path"])
    files = [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.is_file()) if root.exists() else []
    return [sum(p.stat().st_size for p in files), max((p.stat().st_mtime_ns for p in files), default=0)]


def _stamp(kind: str, spec: dict, checks: dict) -> dict:
    return {"format": FORMAT_VERSION, "kind": kind, "spec": spec, "local": _local_identity(spec),
            "audio_checks": checks if kind != "text" else None}


def up_to_date(out: Path, stamp: dict) -> bool:
    try:
        return json.loads((out / STAMP).read_text()) == stamp
    except (OSError, json.JSONDecodeError):
        return False


def fetch(cfg: DictConfig) -> list[Path]:
    """Fetch and convert every source whose output is missing or was made from another spec; all or nothing (a
    failure also removes the folders this call created)."""
    checks = OmegaConf.to_container(cfg.data.sources.audio_checks, resolve=True)
    todo = [(kind, key, spec, out) for kind, key, spec, out in planned(cfg)
            if not up_to_date(out, _stamp(kind, spec, checks))]
    hub = Hub()
    builders = {"text": partial(build_text, hub=hub), "prompts": partial(build_prompts, checks=checks, hub=hub),
                "eval": partial(build_eval, checks=checks, hub=hub)}
    staged, created = [], []
    try:
        for kind, key, spec, out in todo:
            tmp = out.with_name(f".{out.name}.partial")
            shutil.rmtree(tmp, ignore_errors=True)
            created += [d for d in reversed(tmp.parents) if not d.exists()]
            tmp.mkdir(parents=True)
            try:
                summary = builders[kind](spec, key, tmp)
            finally:
                shutil.rmtree(_scratch(tmp), ignore_errors=True)
            (tmp / STAMP).write_text(json.dumps(_stamp(kind, spec, checks), ensure_ascii=False, indent=1))
            staged.append((tmp, out))
            log.info("%s: %s (%s)", key, summary, where_of(spec, key))
    except BaseException:
        for _, _, _, out in todo:           # every partial folder, built or half-built
            shutil.rmtree(out.with_name(f".{out.name}.partial"), ignore_errors=True)
        for folder in reversed(created):    # then the folders made for them, deepest first, if left empty
            if folder.is_dir() and not any(folder.iterdir()):
                folder.rmdir()
        raise
    for tmp, out in staged:
        shutil.rmtree(out, ignore_errors=True)
        tmp.rename(out)
    return [out for _, out in staged]
