"""Audio datasets stored as Lhotse manifests rather than data files, read directly.

`yuekai/aishell` is such a repository by every public sign (a loading script that datasets 5.x refuses, Lhotse cuts
`*.jsonl.gz` beside the audio archives: docs/data.md). Its cuts are read with Lhotse's own reader
(`lhotse.load_manifest`: cuts, or recordings + supervisions), in manifest order (the order the loading script gives
its rows, so the recipe's seeded draw picks the same clips), as rows with the column contract of a `datasets`
split: `{audio: {"array", "sampling_rate"}, text: supervisions[0].text, speaker: supervisions[0].speaker}`.

A cut's audio is the file its recording names, found as given, relative to the manifest's or the folder's root, or
by its path's tail / file name among the folder's files and the contents of its tar archives (extracted once, on the
first file not found, into a scratch folder that the caller removes).
"""

from __future__ import annotations

import tarfile
from collections.abc import Sequence
from pathlib import Path

MANIFEST_SUFFIXES = (".jsonl.gz", ".jsonl", ".json.gz", ".json")
ARCHIVE_SUFFIXES = (".tar", ".tar.gz", ".tgz")
AUDIO_SUFFIXES = {".wav", ".flac", ".mp3", ".ogg", ".opus", ".m4a"}


def _named(folder: Path, suffixes: tuple[str, ...]) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.is_file() and p.name.endswith(suffixes)
                  and not any(part.startswith(".") for part in p.relative_to(folder).parts))


def manifests(folder: Path, split: str, pattern: str | None = None) -> dict[str, list[Path]]:
    """The split's Lhotse manifests in `folder` by kind (cuts, recordings, supervisions): file names holding the kind
    and the split (`aishell_cuts_test.jsonl.gz`), or matching `pattern` (a glob under `folder`)."""
    found = sorted(folder.glob(pattern)) if pattern else [p for p in _named(folder, MANIFEST_SUFFIXES)
                                                          if split in _words(p.relative_to(folder))]
    return {kind: [p for p in found if kind in p.name] for kind in ("cuts", "recordings", "supervisions")}


def _words(rel: Path) -> set[str]:
    """The words of a relative path (folders and the file's stem, split at `_`, `-` and `.`)."""
    text = "/".join([*rel.parts[:-1], rel.name.split(".")[0]])
    return set(text.replace("-", "_").replace("/", "_").split("_"))


def holds_manifests(folder: Path, split: str, pattern: str | None = None) -> bool:
    found = manifests(folder, split, pattern)
    return bool(found["cuts"] or (found["recordings"] and found["supervisions"]))


def has_loading_script(folder: Path) -> bool:
    """A dataset repository with a loading script: a top-level `<name>.py` (datasets 5.x refuses these)."""
    return any(p.suffix == ".py" for p in folder.iterdir() if p.is_file())


def load_cuts(found: dict[str, list[Path]]) -> list:
    """Every cut of `manifests(...)`, manifest by manifest in name order, each in its file's order."""
    from lhotse import CutSet, load_manifest

    if found["cuts"]:
        return [cut for path in found["cuts"] for cut in load_manifest(path)]
    return [cut for rec, sup in zip(found["recordings"], found["supervisions"], strict=True)
            for cut in CutSet.from_manifests(recordings=load_manifest(rec), supervisions=load_manifest(sup))]


class AudioFinder:
    """Where a recording's file lies: as given, under `roots`, else by path tail or name among the files of `roots`
    and of the folder's archives (extracted into `scratch` on the first miss)."""

    def __init__(self, folder: Path, roots: list[Path], scratch: Path):
        self.folder, self.roots, self.scratch = folder, roots, scratch
        self.by_name: dict[str, list[Path]] | None = None

    def _index(self) -> dict[str, list[Path]]:
        if self.by_name is None:
            extracted = self.scratch / "archives"
            for archive in _named(self.folder, ARCHIVE_SUFFIXES):
                with tarfile.open(archive) as tar:
                    tar.extractall(extracted / archive.name, filter="data")
            self.by_name = {}
            for root in [*self.roots, extracted]:
                for p in (root.rglob("*") if root.exists() else []):
                    if p.suffix.lower() in AUDIO_SUFFIXES:
                        self.by_name.setdefault(p.name, []).append(p)
        return self.by_name

    def find(self, source: str) -> Path | None:
        path = Path(source)
        if path.is_file():
            return path
        tails = [Path(*path.parts[k:]) for k in range(1 if path.is_absolute() else 0, len(path.parts))]
        for root in self.roots:
            for tail in tails:
                if (root / tail).is_file():
                    return root / tail
        candidates = self._index().get(path.name, [])
        for tail in tails:                      # the longest tail that names one candidate
            hits = [c for c in candidates if c.as_posix().endswith("/" + tail.as_posix())]
            if len(hits) == 1:
                return hits[0]
        return None


class CutRows(Sequence):
    """The cuts as rows of a `datasets` split: `len`, `[i]` (audio decoded by Lhotse when the row is read) and
    `column_names`."""

    def __init__(self, cuts: list, finder: AudioFinder, columns: dict[str, str]):
        self.cuts, self.finder, self.columns = cuts, finder, columns
        self.column_names = list(columns.values())

    def __len__(self) -> int:
        return len(self.cuts)

    def __getitem__(self, i: int) -> dict:
        from lhotse.utils import fastcopy

        cut = self.cuts[i]
        sources = []
        for src in cut.recording.sources:
            if src.type != "file":
                sources.append(src)
                continue
            found = self.finder.find(src.source)
            if found is None:
                raise FileNotFoundError(f"cut {cut.id}: audio {src.source} is neither a file nor in "
                                        f"{self.finder.folder} or its archives")
            sources.append(fastcopy(src, source=str(found)))
        cut = fastcopy(cut, recording=fastcopy(cut.recording, sources=sources))
        audio = cut.load_audio()
        sup = cut.supervisions[0] if cut.supervisions else None
        row = {self.columns["audio"]: {"array": audio.mean(axis=0), "sampling_rate": cut.sampling_rate},
               self.columns["text"]: sup.text if sup is not None and sup.text else ""}
        if "speaker_column" in self.columns:
            row[self.columns["speaker_column"]] = sup.speaker if sup is not None else None
        return row


def cut_rows(folder: Path, split: str, columns: dict[str, str], scratch: Path, pattern: str | None = None) -> CutRows:
    """The split of a Lhotse-layout folder as rows (`columns`: role -> the column name the caller reads)."""
    found = manifests(folder, split, pattern)
    roots = [folder, *sorted({p.parent for paths in found.values() for p in paths} - {folder})]
    return CutRows(load_cuts(found), AudioFinder(folder, roots, scratch), columns)
