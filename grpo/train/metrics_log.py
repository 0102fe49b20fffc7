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
