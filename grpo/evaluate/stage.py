"""Stage 4, the driver: eval.set and each of eval.extra_sets, every selected checkpoint, in one process
(grpo/evaluate/evaluator.py) or over several devices (grpo/evaluate/parallel.py), into the reports
(grpo/evaluate/report.py)."""

from __future__ import annotations

import logging
from pathlib import Path

from omegaconf import DictConfig

from grpo.checkpoint_selection import select_checkpoints
from grpo.data.test_sets import extra_sets, load_set
from grpo.evaluate import report
from grpo.evaluate.evaluator import Evaluator, Scored, extra_judges
from grpo.evaluate.parallel import evaluate_parallel, worker_count
from grpo.layout import EvalDir

log = logging.getLogger(__name__)


def write_inputs(path: Path, inputs: list[dict]) -> None:
    """eval/inputs.jsonl: per item what the model was fed (texts after the frontend, ids, length bounds, decoding)."""
    import json

    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for x in inputs:
            f.write(json.dumps(x, ensure_ascii=False) + "\n")


def copy_prompts(out_dir: Path, items) -> None:
    """Each item's prompt audio beside the report (report.html plays it by a relative path)."""
    import shutil

    for it in items:
        if it.prompt_wav and Path(it.prompt_wav).exists():
            out_dir.mkdir(parents=True, exist_ok=True)
            if Path(it.prompt_wav).suffix == ".wav":
                shutil.copyfile(it.prompt_wav, out_dir / f"{it.id}.wav")


def run(cfg: DictConfig) -> int:
    """eval.set, then each of eval.extra_sets (its keys override eval.*) into eval.out_dir/<name>."""
    from omegaconf import OmegaConf

    extras = extra_sets(cfg.eval)
    evaluate_set(cfg)
    for name, overrides in extras:
        sub = OmegaConf.merge(cfg, {"eval": overrides})
        log.info("extra set %s (%s) -> %s", name, sub.eval.data_path, sub.eval.out_dir)
        evaluate_set(sub)
    return 0


def evaluate_set(cfg: DictConfig) -> None:
    e = cfg.eval
    items = load_set(e.set, e.data_path, e.get("language"))
    if e.max_items:
        items = items[: e.max_items]
    if not items:
        raise ValueError(f"no items in {e.data_path}")
    checkpoints = select_checkpoints(cfg, e.checkpoints)
    log.info("evaluating %d checkpoint(s) on %d items: %s", len(checkpoints), len(items), ", ".join(checkpoints))
    unit, extra = report.unit_of(e), extra_judges(e)

    def write(name: str, scored: list[Scored]) -> None:
        r = report.write_checkpoint(Path(e.out_dir), name, scored, unit, extra)
        log.info("%s: CER %.4f over %d samples (%d failures)", name, r["cer"], r["count"], r["failures"])

    copy_prompts(Path(e.out_dir) / "prompts", items)
    workers = worker_count(e, cfg.device)
    if workers > 1:
        inputs, scored = evaluate_parallel(cfg, items, checkpoints, workers)
        write_inputs(EvalDir(e.out_dir).inputs, inputs)
        for name in checkpoints:
            write(name, scored[name])
    else:             # one process: each checkpoint's report is written as soon as it is scored
        with Evaluator(cfg, items) as evaluator:
            write_inputs(EvalDir(e.out_dir).inputs, evaluator.inputs)
            for name, path in checkpoints.items():
                write(name, evaluator.evaluate(name, path))
    report.render(Path(e.out_dir), list(checkpoints), e)
