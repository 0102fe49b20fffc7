"""Stage -1: the models every later stage needs, then the LLM converted to Hugging Face.

- profile tiny (`model.source=tiny`): build CosyVoice2-shaped models with random weights (grpo.standins.tiny),
  the synthetic codebook, seeded prompt speakers, and warm-start the LLM on codebook targets.
- profile cosyvoice2 (`model.source=modelscope`): download CosyVoice2-0.5B, SenseVoiceSmall and the evaluation ASRs,
  or use local copies checked file by file (grpo.model.download).
- profile realsize (`model.source=realsize`): the same directories built with random weights at the released
  sizes (grpo.standins.realsize); the prompt speakers of both come from real clips through CosyVoice's frontend.
Then `cosyvoice_dir/llm.pt` -> `model.hf_dir` (grpo.model.convert: exact, CosyVoice's biased head included).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

from grpo.config import resolve_path
from grpo.speech.family import family, family_of_dir
from grpo.standins.tiny import build_default_codebook, codebook_texts, read_rows

log = logging.getLogger(__name__)

BUILD_STAMP = ".tiny_build.json"
TINY_BUILD_VERSION = 6      # bump when grpo.standins.tiny builds differently (2: SenseVoice BPE with its tag pieces,
                            # 3: a campplus.onnx stand-in, 4: warm start on random strings of every character,
                            # 5: the model family, upstream CosyVoice at the pinned commit,
                            # 6: the BPE learns the family's prompt prefix)


def _stamp(cfg: DictConfig) -> str:
    """What the tiny build depends on: its sizes, the codebook settings and the data the tokenizers learn from."""
    h = hashlib.sha256(f"v{TINY_BUILD_VERSION}{cfg.model.family}".encode())
    h.update(json.dumps(OmegaConf.to_container(cfg.model.tiny, resolve=True), sort_keys=True).encode())
    book = {k: v for k, v in OmegaConf.to_container(cfg.reward.codebook, resolve=True).items() if k != "path"}
    h.update(json.dumps(book, sort_keys=True).encode())      # (not where it lies: another exp dir shares the stamp)
    for p in [*cfg.reward.codebook.sources, cfg.data.train_file]:      # (the warm start reads the train file)
        p = resolve_path(p)
        h.update(p.read_bytes() if p.exists() else b"")
    return h.hexdigest()[:16]


def warm_start_cached(cfg: DictConfig, cv_dir: Path, codebook, stamp: str) -> dict:
    """The warm start of llm.pt, or its copy from model.tiny.cache_dir (keyed by the build stamp, which covers
    every input of the build: a second exp dir, a rerun after `rm -rf exp`, or the next test session reuses it)."""
    from grpo.standins.warm_start import example_options, warm_start

    tiny, ws = cfg.model.tiny, cfg.model.tiny.warm_start
    cached = Path(os.path.expanduser(tiny.cache_dir)) / f"tiny-llm-{stamp}.pt" if tiny.get("cache_dir") else None
    if cached and cached.exists() and cached.with_suffix(".json").exists():
        shutil.copyfile(cached, cv_dir / "llm.pt")
        log.info("warm start: the warm-started LLM of this build from %s (model.tiny.cache_dir)", cached)
        return json.loads(cached.with_suffix(".json").read_text())
    options = example_options(OmegaConf.to_container(ws, resolve=True))
    train_rows = read_rows([cfg.data.train_file])
    stats = warm_start(cv_dir, codebook, [(r["text"], r.get("language", "zh")) for r in train_rows],
                       ws.steps, ws.batch_size, ws.lr, tiny.seed, alphabet=codebook_texts(cfg), **options)
    if cached:
        cached.parent.mkdir(parents=True, exist_ok=True)
        tmp = cached.with_suffix(".tmp")
        shutil.copyfile(cv_dir / "llm.pt", tmp)
        cached.with_suffix(".json").write_text(json.dumps(stats))
        os.replace(tmp, cached)                     # whole or absent: a killed copy leaves no half file
    return stats


def build_tiny(cfg: DictConfig) -> None:
    from grpo.standins import tiny as tiny_models
    from grpo.standins.tiny_eval_asr import build_paraformer_dir, build_whisper_dir
    from grpo.standins.tiny_speakers import tiny_speakers

    cv_dir, sv_dir = resolve_path(cfg.model.cosyvoice_dir), resolve_path(cfg.model.sensevoice_dir)
    stamp = _stamp(cfg)
    stamp_file = cv_dir / BUILD_STAMP
    if stamp_file.exists() and json.loads(stamp_file.read_text()).get("stamp") == stamp:
        log.info("tiny models in %s are up to date (delete the directory to rebuild)", cv_dir)
        return
    tiny = cfg.model.tiny
    texts = [t for t, _ in codebook_texts(cfg)]
    tiny_models.build_cosyvoice_dir(cv_dir, tiny, texts, family(cfg.model.family))
    tiny_models.build_sensevoice_dir(sv_dir, tiny.sensevoice, texts, tiny.seed)
    build_paraformer_dir(resolve_path(cfg.model.paraformer_dir), tiny.paraformer, texts, tiny.seed)
    build_whisper_dir(resolve_path(cfg.model.whisper_dir), tiny.whisper, texts, tiny.seed)
    codebook = build_default_codebook(cfg)
    codebook.save(resolve_path(cfg.reward.codebook.path))
    torch.save(tiny_speakers(cfg.reward.prompt_speakers.num_tiny, tiny.seed, speech_token_size=tiny.speech_token_size),
               resolve_path(cfg.reward.prompt_speakers.features))

    stats = warm_start_cached(cfg, cv_dir, codebook, stamp) if tiny.warm_start.steps > 0 else {}
    stamp_file.write_text(json.dumps({"stamp": stamp, "warm_start": stats}, indent=2))


def convert(cfg: DictConfig) -> dict:
    from grpo.model.convert import cosyvoice_to_hf

    return cosyvoice_to_hf(resolve_path(cfg.model.cosyvoice_dir), resolve_path(cfg.model.hf_dir))


def convert_checked(cfg: DictConfig) -> dict:
    """The conversion, refused when the model directory is not of `model.family` (one line naming the key)."""
    found = family_of_dir(resolve_path(cfg.model.cosyvoice_dir)).name
    if found != cfg.model.family:
        raise SystemExit(f"model.family={cfg.model.family}, but {cfg.model.cosyvoice_dir} holds a {found} model: set "
                         f"model.family={found} (or point model.cosyvoice_dir elsewhere)")
    return convert(cfg)


def speaker_clips(cfg: DictConfig) -> list[dict]:
    """reward.prompt_speakers.clips read and checked (files exist); empty only if a speaker file is given.
    Checked before any download, so that a missing setting fails in seconds with the key to set."""
    from grpo.speech.speakers import read_clips

    p = cfg.reward.prompt_speakers
    clips = read_clips(resolve_path(p.clips) if isinstance(p.clips, str) else list(p.clips or []))
    if not clips and not resolve_path(p.features).exists():
        raise SystemExit(f"no prompt speakers for the {cfg.reward.backend} backend: set reward.prompt_speakers.clips "
                         "to {text, wav} clips (a list, a JSONL file, or a folder with wav.scp + text), or "
                         f"reward.prompt_speakers.features to a CosyVoice spk2info.pt (now {p.features})")
    return clips


def prompt_speakers(cfg: DictConfig, clips: list[dict]) -> None:
    """The audio backends' prompt speakers (real models; the tiny build writes seeded stand-ins), built here
    once so that replicas only load them."""
    from grpo.speech.speakers import build_speakers, load_speakers
    from grpo.speech.token2wav import speakers_from_clips

    features = resolve_path(cfg.reward.prompt_speakers.features)
    if clips:
        build_speakers(features, clips, lambda c: speakers_from_clips(resolve_path(cfg.model.cosyvoice_dir), c))
    else:
        load_speakers(features)


def run(cfg: DictConfig) -> int:
    from grpo.data.sources import SourceError, fetch

    try:
        fetch(cfg)              # data.sources first: a wrong id or no network stops before any model work
    except SourceError as exc:
        log.error("models stage stopped, nothing written: %s", exc)
        return 1
    if cfg.model.source == "tiny":
        build_tiny(cfg)
    elif cfg.model.source in ("modelscope", "realsize"):
        if cfg.model.source == "realsize":      # random weights in the released layouts, real prompt wavs
            from grpo.standins.realsize import build_realsize

            build_realsize(cfg)
        audio = cfg.reward.backend != "synthetic"         # real token2wav needs prompt speakers
        clips = speaker_clips(cfg) if audio else []
        if cfg.model.source == "modelscope":
            from grpo.model.download import ModelError, download

            try:
                download(cfg)
            except ModelError as exc:
                log.error("models stage stopped: %s", exc)
                return 1
        if audio:
            prompt_speakers(cfg, clips)
    else:
        raise ValueError(f"model.source must be tiny, realsize or modelscope, got {cfg.model.source!r}")
    convert_checked(cfg)
    return 0
