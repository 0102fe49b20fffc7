"""Stage 3: training checkpoints -> Hugging Face model directories that later stages load.

- verl: `train/verl_checkpoints/global_step_N/actor` (FSDP shards) -> `train/merged/step_N` with
  `python -m verl.model_merger merge --backend fsdp`, plus the files verl does not know about
  (speech_tokens.json, cosyvoice_extra.pt, the tokenizer's chat template) copied from the base model.
- local engine: checkpoints are already HF; they are validated, not rewritten.
Every result is checked: config, tokenizer, speech-token layout and weight shapes agree.
"""

from __future__ import annotations

import json
import logging
import re
import shutil
import subprocess
import sys
from pathlib import Path

from omegaconf import DictConfig

from grpo.config import REPO_ROOT
from grpo.layout import TrainDir
from grpo.model.cosyvoice_lm import ARCHITECTURE
from grpo.model.speech_vocab import CHAT_TEMPLATE, SpeechVocab
from grpo.train.local_checkpoint import CARRIED_FILES

log = logging.getLogger(__name__)

VERL_STEP = re.compile(r"^global_step_(\d+)$")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json",
                   "vocab.json", "merges.txt", "added_tokens.json")


def validate(model_dir: Path) -> None:
    """Raise if the directory is not a complete, consistent converted model."""
    from safetensors import safe_open
    from transformers import AutoConfig, AutoTokenizer

    vocab = SpeechVocab.load(model_dir)
    config = AutoConfig.from_pretrained(model_dir)
    if list(config.architectures or []) != [ARCHITECTURE]:
        raise ValueError(f"{model_dir}: architectures {config.architectures}, expected [{ARCHITECTURE}] "
                         "(a model converted by an older version: run stage -1 again)")
    if config.vocab_size != vocab.vocab_size:
        raise ValueError(f"{model_dir}: config vocab_size {config.vocab_size} != speech_tokens.json {vocab.vocab_size}")
    shapes = {}
    for shard in model_dir.glob("*.safetensors"):
        with safe_open(shard, "pt") as f:
            shapes.update({k: tuple(f.get_slice(k).get_shape()) for k in f.keys()})
    if config.eos_token_id not in vocab.stop_token_ids:
        raise ValueError(f"{model_dir}: eos_token_id {config.eos_token_id} is not an end-of-speech id "
                         f"{vocab.stop_token_ids}")
    for key in ("model.embed_tokens.weight", "lm_head.weight", "lm_head.bias"):
        if shapes.get(key, (None,))[0] != vocab.vocab_size:
            raise ValueError(f"{model_dir}: {key} has shape {shapes.get(key)}, expected {vocab.vocab_size} rows")
    tok = AutoTokenizer.from_pretrained(model_dir)
    if tok.convert_tokens_to_ids("<|s_0|>") != vocab.speech_token_offset:
        raise ValueError(f"{model_dir}: tokenizer does not map <|s_0|> to {vocab.speech_token_offset}")
    if tok.chat_template != CHAT_TEMPLATE:
        raise ValueError(f"{model_dir}: chat template differs from the CosyVoice2 input template")


def carry_files(base: Path, target: Path) -> None:
    for name in CARRIED_FILES + TOKENIZER_FILES + ("generation_config.json",):
        if (base / name).exists():
            shutil.copy2(base / name, target / name)


def restore_special_ids(base: Path, target: Path) -> None:
    """verl saves the config with the text tokenizer's ids (eos = pad = <|endoftext|>, no bos): put back the
    converted model's end-of-speech eos, sos bos and pad, so that generation stops where CosyVoice stops."""
    config = json.loads((target / "config.json").read_text())
    original = json.loads((base / "config.json").read_text())
    for key in ("eos_token_id", "bos_token_id", "pad_token_id"):
        if key in original:
            config[key] = original[key]
        else:
            config.pop(key, None)
    (target / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def merge_verl_step(actor_dir: Path, target: Path, base: Path) -> Path:
    tmp = target.with_name(target.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    # `python -m verl.model_merger`, with CosyVoiceLMForCausalLM registered first (import grpo.model)
    cmd = [sys.executable, "-c", "import grpo.model; from verl.model_merger.__main__ import main; main()",
           "merge", "--backend", "fsdp", "--local_dir", str(actor_dir), "--target_dir", str(tmp)]
    log.info("merging %s", actor_dir)
    proc = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"verl.model_merger failed on {actor_dir}:\n{proc.stderr[-3000:]}")
    carry_files(base, tmp)
    restore_special_ids(base, tmp)
    validate(tmp)
    shutil.rmtree(target, ignore_errors=True)
    tmp.rename(target)
    return target


def verl_steps(cfg: DictConfig) -> dict[int, Path]:
    root = TrainDir(cfg.train.out_dir).verl_checkpoints
    if not root.is_dir():
        return {}
    return {int(m.group(1)): p / "actor" for p in root.iterdir()
            if (m := VERL_STEP.match(p.name)) and (p / "actor" / "fsdp_config.json").exists()}


def select_verl_steps(steps: dict[int, Path], wanted) -> dict[int, Path]:
    """`merge.steps`: all, last, or step names (one, or a list) matched exactly; an unknown name raises."""
    if wanted == "all":
        return steps
    if wanted == "last":
        return {max(steps): steps[max(steps)]} if steps else {}
    names = [wanted] if isinstance(wanted, str) else list(wanted)
    by_name = {f"step_{s}": s for s in steps}
    unknown = [n for n in names if n not in by_name]
    if unknown:
        raise ValueError(f"merge.steps: no verl checkpoint named {', '.join(map(str, unknown))}; "
                         f"available: {', '.join(sorted(by_name, key=lambda n: by_name[n])) or '-'}")
    return {by_name[n]: steps[by_name[n]] for n in names}


def run(cfg: DictConfig) -> int:
    from grpo.checkpoint_selection import trained_checkpoints

    base = Path(cfg.model.hf_dir)
    steps = select_verl_steps(verl_steps(cfg), cfg.merge.steps)
    merged_root = TrainDir(cfg.train.out_dir).merged
    for step, actor in sorted(steps.items()):
        target = merged_root / f"step_{step}"
        if target.exists() and not cfg.merge.overwrite:
            log.info("step_%d already merged: %s", step, target)
            continue
        merge_verl_step(actor, target, base)
    checkpoints = trained_checkpoints(cfg)
    if not checkpoints:
        log.error("no checkpoints under %s: run stage 2 first", cfg.train.out_dir)
        return 1
    for name, path in checkpoints.items():
        validate(path)
        log.info("%s ok: %s", name, path)
    return 0
