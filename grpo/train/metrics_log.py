"""Per-step training metrics: metrics.jsonl (always), TensorBoard, optional W&B, and a PNG of the curves."""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

from grpo.layout import TrainDir
from grpo.train.reward_fn import COMPONENT_FIELDS
from grpo.train.verl_attempts import latest_components

log = logging.getLogger(__name__)

CURVES = (("reward_mean", "mean reward"), ("error_rate_mean", "mean error rate"))


def component_means(samples: list[dict]) -> dict:
    """Per-step means of each reward component (`reward_<name>_mean`) and of the error rate over the samples
    that have them (NaN: the server did not compute that component)."""
    out = {}
    for key in (*COMPONENT_FIELDS, "error_rate"):
        values = [float(s[key]) for s in samples if key in s and s[key] is not None and not math.isnan(float(s[key]))]
        if values:
            out[f"{key}_mean"] = sum(values) / len(values)
    return out


class MetricsLogger:
    def __init__(self, out_dir: Path, loggers, project: str, experiment: str, config: dict, resume_step: int = 0):
        self.out_dir = out_dir
        self.path = TrainDir(out_dir).metrics
        out_dir.mkdir(parents=True, exist_ok=True)
        # a resumed run rewrites history from its checkpoint on: drop lines of steps that will be redone
        if self.path.exists():
            kept = [line for line in self.path.read_text().splitlines()
                    if line.strip() and json.loads(line)["step"] <= resume_step]
            self.path.write_text("".join(line + "\n" for line in kept))
        self.tb = self.wandb = None
        if "tensorboard" in loggers:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(str(out_dir / "tensorboard"), purge_step=resume_step + 1)
        if "wandb" in loggers:
            try:
                import wandb

                self.wandb = wandb.init(project=project, name=experiment, config=config, resume="allow")
            except Exception as exc:  # W&B is optional: say so once and go on
                log.warning("W&B logging disabled: %s", exc)

    def log(self, metrics: dict) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps(metrics) + "\n")
        step = metrics["step"]
        numeric = {k: v for k, v in metrics.items() if isinstance(v, (int, float)) and k != "step"}
        if self.tb:
            for k, v in numeric.items():
                self.tb.add_scalar(f"train/{k}", v, step)
        if self.wandb:
            self.wandb.log(numeric, step=step)

    def close(self) -> None:
        if self.tb:
            self.tb.close()
        if self.wandb:
            self.wandb.finish()


def read_metrics(path: Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def plot_curves(metrics_path: Path, out_png: Path) -> Path | None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(metrics_path)
    if not rows:
        return None
    components = [k for k in COMPONENT_FIELDS if any(f"{k}_mean" in r for r in rows)]
    panels = [[(key, None)] for key, _ in CURVES] + ([[(f"{k}_mean", k[len("reward_"):]) for k in components]]
                                                    if components else [])
    titles = [label for _, label in CURVES] + ["reward components"]
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 3.5))
    steps = [r["step"] for r in rows]
    for ax, panel, title in zip(axes, panels, titles):
        for key, label in panel:
            ax.plot(steps, [r.get(key, float("nan")) for r in rows], lw=1.2, label=label)
        if len(panel) > 1 or panel[0][1]:
            ax.legend(fontsize=8)
        ax.set_xlabel("step")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out_png, dpi=120)
    plt.close(fig)
    return out_png


# verl's metric names -> the local engine's (metrics.jsonl is one format for both engines)
VERL_METRICS = {
    "critic/score/mean": "reward_mean",
    "critic/score/max": "reward_max",
    "critic/score/min": "reward_min",
    "response_length/mean": "response_length_mean",
    "actor/entropy": "entropy",
    "actor/pg_loss": "pg_loss",
    "actor/ppo_kl": "ppo_kl",
    "actor/pg_clipfrac": "pg_clipfrac",
    "actor/kl_loss": "kl",
    "actor/grad_norm": "grad_norm",
    "rollout_corr/kl": "rollout_actor_kl",
    "timing_s/gen": "time_rollout_s",
    "timing_s/reward": "time_reward_s",
    "timing_s/update_actor": "time_update_s",
    "timing_s/update_weights": "time_sync_s",
    "perf/time_per_step": "time_step_s",
}


def metrics_from_verl(verl_rows: list[dict], component_log: Path | None = None) -> list[dict]:
    """Rows of verl's file logger ({"step", "data"}; grpo.train.verl_attempts.merged_verl_rows joins a resumed
    run's attempts) in metrics.jsonl's format: the names above, plus every verl metric under its own name.
    Rows of one step are merged, the later winning.

    verl 0.9.1 logs no reward extras while training: the per-step component and error-rate means come from
    `component_log` (one line per scored sample with its score, tagged with the `global_steps` verl gave its
    prompt batch; grpo.train.reward_fn.log_components; of a step scored by two attempts, the last one's). The
    v1 trainer keeps a prompt batch in flight, so the tag may read one less than the step that trains on it
    (measured: 0 for step 1). A step takes the samples of the tag (step - 1 or step) whose mean score is its
    own critic/score/mean; a step that matches neither gets no component means (and a warning), never another
    step's."""
    by_step: dict[int, dict] = {}
    for row in verl_rows:
        data = {k: v for k, v in row["data"].items() if isinstance(v, (int, float))}
        ours = {new: data[old] for old, new in VERL_METRICS.items() if old in data}
        step = int(row["step"])
        by_step.setdefault(step, {"step": step}).update({**ours, **data})
    tagged: dict[int, list[dict]] = {}
    if component_log is not None and Path(component_log).exists():
        records = [json.loads(line) for line in Path(component_log).read_text().splitlines() if line.strip()]
        for record in latest_components(records):
            if not record.get("validate"):      # validation samples are not a training step's
                tagged.setdefault(int(record["step"]), []).append(record)
    for step, row in by_step.items():
        if tagged:
            match_components(step, row, tagged)
    return [by_step[s] for s in sorted(by_step)]


def match_components(step: int, row: dict, tagged: dict[int, list[dict]]) -> None:
    """The component means of the tag (step - 1 or step) whose mean score is the step's reward_mean."""
    for tag in (step - 1, step):
        scores = [r["score"] for r in tagged.get(tag, [])]
        if scores and "reward_mean" in row and math.isclose(sum(scores) / len(scores), row["reward_mean"],
                                                             rel_tol=1e-6, abs_tol=1e-9):
            row.update(component_means(tagged[tag]))
            nodes = {r["node_id"] for r in tagged[tag] if r.get("node_id")}   # reward workers' nodes (Ray)
            if nodes:
                row["reward_nodes"] = len(nodes)
            return
    log.warning("step %d: no logged samples match its mean score; its reward components are left out", step)


def components_to_tensorboard(rows: list[dict], log_dir: Path) -> None:
    """The per-step reward-component means (which verl's own TensorBoard log lacks) as train/<name> scalars."""
    from torch.utils.tensorboard import SummaryWriter

    with SummaryWriter(str(log_dir)) as tb:
        for row in rows:
            for key in (*(f"{k}_mean" for k in COMPONENT_FIELDS), "error_rate_mean"):
                if key in row:
                    tb.add_scalar(f"train/{key}", row[key], row["step"])


def write_metrics(rows: list[dict], out_dir: Path) -> Path:
    path = TrainDir(out_dir).metrics
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path
