"""Stage -1 of the GPU profiles: the released models, downloaded once, or local copies checked file by file.

Each model has a directory key (`model.<name>_dir`) and a hub id (`model.modelscope.<name>` or
`model.huggingface.<name>`). A directory that holds every file this project reads (`required_files`: the released
layout; the realsize builders write the same) is used as it is -- that is the local-copy route for a cluster with no
hub. Otherwise the model is downloaded into it (resuming a partial copy). Whether each hub is reachable is asked
once; every failure is one line naming the keys, the id and the local-copy route.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from omegaconf import DictConfig

from grpo.config import resolve_path

log = logging.getLogger(__name__)

MODELS = ("cosyvoice", "sensevoice", "paraformer", "whisper")     # model.<name>_dir; CAM++ is the cosyvoice dir's
# transformers' Whisper: a | b = either file (the hub's release has both; transformers 5 saves the second)
WHISPER_FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer_config.json",
                 "preprocessor_config.json|processor_config.json", "tokenizer.json|vocab.json")
FUNASR_TOKENIZER = {"sensevoice": ("bpe.model",), "paraformer": ("tokens.json", "seg_dict")}


class ModelError(ValueError):
    """A model that is neither complete locally nor downloadable: the message names its keys."""


def _leaves(node) -> list[str]:
    if isinstance(node, dict):
        return [leaf for v in node.values() for leaf in _leaves(v)]
    if isinstance(node, list):
        return [leaf for v in node for leaf in _leaves(v)]
    return [node] if isinstance(node, str) else []


def required_files(name: str, model_dir: Path, family_name: str) -> tuple[str, ...]:
    """The files of `model_dir` that this project reads. funasr's models: what funasr itself resolves
    (funasr/download/download_model_from_hub.py: configuration.json's file_path_metas when present, else the fixed
    names tokens.json / seg_dict / bpe.model / am.mvn beside config.yaml and model.pt)."""
    if name == "cosyvoice":
        from grpo.speech.cosyvoice_dir import released_files
        from grpo.speech.family import family

        return released_files(family(family_name))
    if name == "whisper":
        return WHISPER_FILES
    meta = model_dir / "configuration.json"
    if meta.is_file():
        try:
            metas = json.loads(meta.read_text(encoding="utf-8")).get("file_path_metas", {})
        except json.JSONDecodeError:
            return ("configuration.json (valid JSON)",)
        return ("configuration.json", *dict.fromkeys(_leaves(metas)))
    return ("config.yaml", "model.pt", "am.mvn", *FUNASR_TOKENIZER[name])


def missing_files(name: str, model_dir: Path, family_name: str) -> list[str]:
    return [f for f in required_files(name, model_dir, family_name)
            if not any((model_dir / alt).is_file() for alt in f.split("|"))]


def hub_of(m: DictConfig, name: str) -> tuple[str, str]:
    """(hub, id): Hugging Face when model.huggingface names the model, else ModelScope (a funasr name resolved as
    funasr's AutoModel resolves it: `paraformer-zh` is Seed-TTS-eval's SeACo-Paraformer)."""
    if name in (m.get("huggingface") or {}):
        return "huggingface", m.huggingface[name]
    from funasr.download.name_maps_from_hub import name_maps_ms

    return "modelscope", name_maps_ms.get(m.modelscope[name], m.modelscope[name])


def unreachable(hub: str) -> str | None:
    """Why `hub` cannot be reached (None when it answers): one HEAD request, 10 s, to the endpoint the hub's own
    client uses (HF_ENDPOINT / HF_HUB_OFFLINE; MODELSCOPE_DOMAIN)."""
    import httpx

    if hub == "huggingface":
        import huggingface_hub.constants as hc

        if hc.HF_HUB_OFFLINE:
            return "HF_HUB_OFFLINE is set"
        url = hc.ENDPOINT
    else:
        from modelscope.hub.utils.utils import resolve_endpoint

        url = resolve_endpoint()
    try:
        httpx.head(url, timeout=10)
    except httpx.HTTPError as exc:
        return f"{url} unreachable ({type(exc).__name__})"
    return None


def _fetch(hub: str, repo: str, target: Path) -> None:
    if hub == "huggingface":
        from huggingface_hub import snapshot_download

        snapshot_download(repo, local_dir=str(target),
                          allow_patterns=["*.json", "*.txt", "model.safetensors"])      # not the .bin/flax copies
    else:
        from modelscope import snapshot_download

        snapshot_download(repo, local_dir=str(target))


def download(cfg: DictConfig) -> None:
    """Every model of MODELS complete in its directory: kept when complete, else downloaded; one line on failure."""
    m = cfg.model
    reach: dict[str, str | None] = {}
    for name in MODELS:
        key, target = f"model.{name}_dir", resolve_path(m[f"{name}_dir"])
        hub, repo = hub_of(m, name)
        id_key = f"model.{hub}.{name}={m[hub][name]}"
        missing = missing_files(name, target, m.family)
        if not missing:
            log.info("%s: complete in %s (%s)", name, target, key)
            continue
        local_route = (f"put a copy of {repo} in the released layout there (or set {key} to one; it is checked "
                       "file by file)")
        if hub not in reach:
            reach[hub] = unreachable(hub)
            if reach[hub]:
                log.warning("offline: %s", reach[hub])
        if reach[hub]:
            raise ModelError(f"{id_key}: {key}={target} lacks {', '.join(missing[:3])}"
                             f"{' ...' if len(missing) > 3 else ''} and {reach[hub]}: {local_route}")
        log.info("downloading %s from %s -> %s", repo, hub, target)
        try:
            _fetch(hub, repo, target)
        except Exception as exc:        # noqa: BLE001 - a wrong id, a lost connection: one line naming the keys
            text = str(exc).strip().splitlines()
            raise ModelError(f"{id_key}: download failed ({type(exc).__name__}: {text[0] if text else ''}); "
                             f"{local_route}") from None
        missing = missing_files(name, target, m.family)
        if missing:
            raise ModelError(f"{id_key}: downloaded into {key}={target}, which still lacks {', '.join(missing)}")
