"""Where a source's rows come from: the Hugging Face hub (asked once whether it is reachable) or a local copy, read
through `datasets`, or as Lhotse manifests (grpo/data/lhotse_cuts.py) when the repository holds a loading script.
Every failure is a `SourceError` in one line naming the config key."""

from __future__ import annotations

import io
import logging
from pathlib import Path

import numpy as np

from grpo.config import resolve_path
from grpo.data import lhotse_cuts

log = logging.getLogger(__name__)


class SourceError(ValueError):
    """A source that cannot be fetched or read: the message names its config key."""



class Hub:
    """The Hugging Face hub as this fetch sees it: reachable or not, asked once (an unreachable hub otherwise costs
    every call its own retries)."""

    def __init__(self):
        self._offline: str | None = None
        self._asked = False

    @property
    def offline(self) -> str | None:
        """Why the hub is out of reach (None when reachable)."""
        if not self._asked:
            self._asked = True
            import huggingface_hub.constants as hc

            if hc.HF_HUB_OFFLINE:
                self._offline = "HF_HUB_OFFLINE is set"
            else:
                import httpx

                try:
                    httpx.head(hc.ENDPOINT, timeout=10, follow_redirects=False)
                except httpx.HTTPError as exc:
                    self._offline = f"{hc.ENDPOINT} unreachable ({first_line(exc)})"
            if self._offline:
                log.warning("offline: %s; the sources are read from the hub cache only", self._offline)
        return self._offline

    def miss(self, where: str, exc: BaseException) -> SourceError:
        """The one line for a hub read that failed: offline and not cached, or the hub's own error."""
        if self.offline:
            import huggingface_hub.constants as hc

            return SourceError(f"{where}: offline ({self.offline}) and not in the hub cache ({hc.HF_HUB_CACHE}): "
                               "fetch once where the hub is reachable, or set `path` to a local copy (docs/data.md)")
        return SourceError(f"{where}: {first_line(exc)}")


def where_of(spec: dict, key: str) -> str:
    if spec.get("path"):
        return f"{key}.path={spec['path']}"
    if not spec.get("hub"):
        raise SourceError(f"{key}: set `hub` (a dataset id on the Hugging Face hub) or `path` (a local copy)")
    return f"{key}.hub={spec['hub']}"


def text_file(spec: dict, key: str, hub: Hub) -> Path:
    """The text source's JSONL: the local `path`, or `file` of the hub dataset `hub` (cached, resumable)."""
    where = where_of(spec, key)
    if spec.get("path"):
        path = resolve_path(spec["path"])
        if not path.is_file():
            raise SourceError(f"{where}: file not found")
        return path
    from huggingface_hub import hf_hub_download

    if not spec.get("file"):
        raise SourceError(f"{key}.file: which file of {spec['hub']} to read (e.g. metadata/aishell-3.jsonl)")
    try:
        return Path(hf_hub_download(spec["hub"], spec["file"], repo_type="dataset", revision=spec.get("revision"),
                                    local_files_only=bool(hub.offline)))
    except Exception as exc:        # noqa: BLE001 - no network, wrong id or file: one line naming the key
        raise hub.miss(f"{where} file={spec['file']}", exc) from None


SCRIPT_REFUSED = "Dataset scripts are no longer supported"     # datasets 5.x on a repository with a loading script


def hub_files(spec: dict, key: str, hub: Hub) -> Path:
    """The hub dataset's files as a local folder (the hub cache's snapshot): `files` patterns, by default the
    files naming the config or split (`hf download --include "*test*"`), the card and any loading script."""
    from huggingface_hub import snapshot_download

    patterns = spec.get("files") or [f"*{spec.get('config') or spec['split']}*", "*.py", "README.md"]
    try:
        return Path(snapshot_download(spec["hub"], repo_type="dataset", revision=spec.get("revision"),
                                      allow_patterns=patterns, local_files_only=bool(hub.offline)))
    except Exception as exc:        # noqa: BLE001 - one line naming the key
        raise hub.miss(f"{where_of(spec, key)} files={patterns}", exc) from None


def audio_dataset(spec: dict, key: str, columns: dict[str, str], scratch: Path, hub: Hub):
    """The split of an audio dataset as rows (`columns`: the spec's column keys -> column names; `audio` or
    `prompt_audio` is the audio), from the hub id or a local copy: a folder in the repository's layout, one written
    by `Dataset.save_to_disk`, or Lhotse manifests with their audio (grpo/data/lhotse_cuts.py). A hub repository
    that `datasets` cannot load (a loading script), or any repository while offline, is read as files from the hub
    cache's snapshot."""
    import datasets

    where = where_of(spec, key)
    if spec.get("path"):
        folder = resolve_path(spec["path"])
        if not folder.exists():
            raise SourceError(f"{where} config={spec.get('config')} split={spec.get('split')}: "
                              "FileNotFoundError: folder not found")
    elif hub.offline:
        folder = hub_files(spec, key, hub)
    else:
        try:
            ds = datasets.load_dataset(spec["hub"], spec.get("config"), split=spec["split"],
                                       revision=spec.get("revision"))
            return _checked(ds, spec, key, columns, where)
        except Exception as exc:    # noqa: BLE001 - no network, wrong id / config / split: one line naming the key
            if SCRIPT_REFUSED not in str(exc):
                raise SourceError(f"{where} config={spec.get('config')} split={spec.get('split')}: "
                                  f"{first_line(exc)}") from None
            log.info("%s: a loading script (datasets 5.x runs none): reading its files", where)
            folder = hub_files(spec, key, hub)
    return _local_split(folder, spec, key, columns, scratch, where)


def _local_split(folder: Path, spec: dict, key: str, columns: dict[str, str], scratch: Path, where: str):
    """A local folder's split: Lhotse manifests read directly, else `datasets` (a fresh cache in `scratch`: datasets
    keys its cache of a local folder by the folder's name, so an edited copy would be read from a stale cache)."""
    import datasets

    if lhotse_cuts.holds_manifests(folder, spec["split"], spec.get("cuts")):
        if "audio" not in columns:
            raise SourceError(f"{where}: Lhotse manifests hold clips and transcripts, not the prompt/target pairs "
                              "of an evaluation set")
        try:
            return lhotse_cuts.cut_rows(folder, spec["split"], columns, scratch, spec.get("cuts"))
        except Exception as exc:    # noqa: BLE001 - an unreadable manifest: one line naming the key
            raise SourceError(f"{where}: Lhotse manifests of split {spec['split']}: {first_line(exc)}") from None
    try:
        if (folder / "state.json").exists():
            ds = datasets.load_from_disk(str(folder))
            ds = ds[spec["split"]] if isinstance(ds, datasets.DatasetDict) else ds
        else:
            ds = datasets.load_dataset(str(folder), spec.get("config"), split=spec["split"],
                                       revision=spec.get("revision") if spec.get("path") else None,
                                       cache_dir=str(scratch))
    except Exception as exc:        # noqa: BLE001 - wrong config / split, a script without cuts: one line
        hint = (" (a loading script and no Lhotse manifests naming the split: set `cuts` to their glob)"
                if SCRIPT_REFUSED in str(exc) else "")
        raise SourceError(f"{where} config={spec.get('config')} split={spec.get('split')}: "
                          f"{first_line(exc)}{hint}") from None
    return _checked(ds, spec, key, columns, where)


def _checked(ds, spec: dict, key: str, columns: dict[str, str], where: str):
    """The split with its audio column undecoded, after checking that every configured column is there."""
    import datasets

    missing = [f"{key}.{k}={name}" for k, name in columns.items() if name not in ds.column_names]
    if missing:
        raise SourceError(f"{where}: no column {', '.join(missing)} (columns: {', '.join(ds.column_names)})")
    audio = columns.get("audio", columns.get("prompt_audio"))
    return ds.cast_column(audio, datasets.Audio(decode=False))


def decode(audio: dict, what: str) -> tuple[np.ndarray, int]:
    """(mono float32 samples, sample rate) of an undecoded Audio value ({bytes, path}) or decoded samples
    ({array, sampling_rate}: a Lhotse cut's)."""
    import soundfile as sf

    if "array" in audio:
        return np.asarray(audio["array"], dtype=np.float32), int(audio["sampling_rate"])
    try:
        data, sr = sf.read(io.BytesIO(audio["bytes"]) if audio.get("bytes") else audio["path"], dtype="float32",
                           always_2d=True)
    except Exception as exc:        # noqa: BLE001
        raise SourceError(f"{what}: unreadable audio ({first_line(exc)})") from None
    return data.mean(axis=1), sr



def first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"


