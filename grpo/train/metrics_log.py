"""Per-step training metrics: metrics.jsonl (always), TensorBoard, optional W&B, and a PNG of the curves."""

from __future__ import annotations

import json
import logging
from pathlib import Path

log = logging.getLogger(__name__)

CURVES = (("reward_mean", "mean reward"), ("error_rate_mean", "mean error rate"))


class MetricsLogger:
    def __init__(self, out_dir: Path, loggers, project: str, experiment: str, config: dict, resume_step: int = 0):
        self.out_dir = out_dir
        self.path = out_dir / "metrics.jsonl"
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
    fig, axes = plt.subplots(1, len(CURVES), figsize=(10, 3.5))
    steps = [r["step"] for r in rows]
    for ax, (key, label) in zip(axes, CURVES):
        ax.plot(steps, [r.get(key, float("nan")) for r in rows], lw=1.2)
        ax.set_xlabel("step")
        ax.set_title(label)
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


def metrics_from_verl(verl_jsonl: Path) -> list[dict]:
    """Rows of verl's file logger ({"step", "data"}) in metrics.jsonl's format: the names above, plus every
    verl metric under its own name. A step logged twice (a resumed run) keeps its last line."""
    by_step: dict[int, dict] = {}
    for line in Path(verl_jsonl).read_text().splitlines():
        if not line.strip():
            continue
        row = json.loads(line)
        data = {k: v for k, v in row["data"].items() if isinstance(v, (int, float))}
        ours = {new: data[old] for old, new in VERL_METRICS.items() if old in data}
        errors = [v for k, v in data.items() if k.endswith("/error_rate/mean") and not k.startswith("val")]
        if errors:
            ours["error_rate_mean"] = errors[0]
        by_step[int(row["step"])] = {"step": int(row["step"]), **ours, **data}
    return [by_step[s] for s in sorted(by_step)]


def write_metrics(rows: list[dict], out_dir: Path) -> Path:
    path = Path(out_dir) / "metrics.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path
