"""The experiment directory in one place: what every stage writes under exp/<profile>/ and the names inside.

The folders a user may move are config keys, all under `exp_dir` by default (conf/config.yaml and conf/*/default.yaml:
`model.*_dir`, `data.out_dir`, `train.out_dir`, `eval.out_dir`, `export.out_dir`); the names inside them are the
properties below, so renaming one is a one-line change.

    exp/<profile>/
      models/          model.cosyvoice_dir, model.hf_dir (hf_llm), the ASR dirs, prompt speakers, the codebook
      data/            data.out_dir: train.parquet, val.parquet; sources/ (data.sources.out_dir: text/, prompts/,
                       eval/<name>/, each stamped; grpo/data/sources.py)
      server.log       stage 1 when it runs in the background
      train/           train.out_dir: TrainDir
      eval/            eval.out_dir: EvalDir (each of eval.extra_sets in eval/<name>/, the same layout)
      export/          export.out_dir: <checkpoint>/llm.pt + the rest of the model dir
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

STEP_DIR = re.compile(r"^step_(\d+)$")


def step_of(name: str) -> int | None:
    """N of a checkpoint named step_N (the local engine's checkpoints, merged verl ones, their evaluation TSVs),
    else None."""
    m = STEP_DIR.match(name)
    return int(m.group(1)) if m else None


def server_log(exp_dir: str | Path) -> Path:
    return Path(exp_dir) / "server.log"


@dataclass(frozen=True)
class _Folder:
    root: Path

    def __post_init__(self):
        object.__setattr__(self, "root", Path(self.root))


class TrainDir(_Folder):
    """Stage 2's and 3's files under `train.out_dir`."""

    @property
    def local_checkpoints(self) -> Path:          # the local engine's HF checkpoints, step_N/
        return self.root / "checkpoints"

    @property
    def verl_checkpoints(self) -> Path:           # verl's FSDP shards, global_step_N/
        return self.root / "verl_checkpoints"

    @property
    def merged(self) -> Path:                     # stage 3: verl's shards as HF checkpoints, step_N/
        return self.root / "merged"

    @property
    def metrics(self) -> Path:                    # one row per step, both engines
        return self.root / "metrics.jsonl"

    @property
    def curves(self) -> Path:
        return self.root / "curves.png"

    @property
    def reward_components(self) -> Path:          # verl engine: one line per scored sample
        return self.root / "reward_components.jsonl"

    @property
    def reward_failures(self) -> Path:            # one line per sample whose reward failed after the retries
        return self.root / "reward_failures.jsonl"

    @property
    def tensorboard(self) -> Path:
        return self.root / "tensorboard"

    @property
    def hydra(self) -> Path:                      # verl engine: main_ppo's Hydra run dir
        return self.root / "hydra"

    @property
    def attempts(self) -> Path:                   # verl engine: one line per start (resumes)
        return self.root / "attempts.jsonl"

    def verl_metrics(self, attempt: int | str) -> Path:   # verl's own step log of one start ("*": the pattern)
        return self.root / f"verl_metrics.attempt{attempt}.jsonl"


class EvalDir(_Folder):
    """Stage 4's files under `eval.out_dir` (or an extra set's eval/<name>)."""

    @property
    def report_json(self) -> Path:
        return self.root / "report.json"

    @property
    def report_md(self) -> Path:
        return self.root / "report.md"

    @property
    def report_png(self) -> Path:
        return self.root / "report.png"

    @property
    def report_html(self) -> Path:
        return self.root / "report.html"

    @property
    def inputs(self) -> Path:                     # per item: normalised texts, LLM input ids, bounds, decoding
        return self.root / "inputs.jsonl"

    def tsv(self, checkpoint: str) -> Path:       # one row per (item, sample) of a checkpoint
        return self.root / f"{checkpoint}.tsv"

    def wavs(self, checkpoint: str) -> Path:
        return self.root / checkpoint

    def extra(self, name: str) -> EvalDir:
        return EvalDir(self.root / name)
