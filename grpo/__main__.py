"""Stage entry point: `python -m grpo <stage> [key=value ...]`. run.sh maps stage numbers to these."""

from __future__ import annotations

import importlib
import logging
import sys

from hydra.errors import HydraException

from grpo.config import load_config, setup_logging
from grpo.upstream.pin import UpstreamError, check_imported

# stage name -> module with `run(cfg)`
STAGES = {
    "models": "grpo.model.prepare",             # -1: build tiny models or download real ones, convert to HF
    "data": "grpo.data.stage",                  # 0: JSONL -> verl parquet
    "serve": "reward_server.serve",             # 1: reward server (foreground)
    "train": "grpo.train.launch",               # 2: GRPO (local engine or verl)
    "merge": "grpo.train.merge",                # 3: checkpoints -> HF
    "evaluate": "grpo.evaluate.stage",          # 4: zero-shot CER report
    "export": "grpo.model.export",              # 5: HF -> CosyVoice llm.pt
}

# stages that never touch a device (stage 0's text, FSDP shards merged and llm.pt written on the CPU); every other
# stage checks `device` first (grpo/node/device.py)
DEVICE_FREE = ("data", "merge", "export")

USAGE = "usage: python -m grpo {" + ",".join(STAGES) + "} [key=value ...]"


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    stage, overrides = argv[0], argv[1:]
    if stage not in STAGES:
        print(f"unknown stage {stage!r}\n{USAGE}", file=sys.stderr)
        return 2
    try:
        check_imported()           # CosyVoice's code: upstream's at the pinned commit, unedited (grpo/upstream/pin.py)
    except UpstreamError as exc:
        print(f"[grpo] {exc}", file=sys.stderr)
        return 2
    setup_logging()
    try:
        cfg = load_config(overrides)
    except HydraException as exc:           # a mistyped key or value: Hydra's message in one line, no traceback
        print(f"[grpo] {' '.join(str(exc).split())}", file=sys.stderr)
        return 2
    dry_run = stage == "train" and cfg.train.verl.get("dry_run", False)     # composes verl's command only
    if stage not in DEVICE_FREE and not dry_run:
        from grpo.node.device import DeviceError, resolve
        from grpo.node.gpu_layout import LayoutError, apply

        try:
            apply(cfg, stage)                # reward.gpus: this stage's GPUs of the node, before CUDA is touched
            cfg.device = resolve(cfg)        # auto -> what this machine has; cuda that is not there -> stop here
        except (DeviceError, LayoutError) as exc:
            print(f"[grpo] {exc}", file=sys.stderr)
            return 2
    logging.getLogger("grpo").info("stage %s, profile %s, exp_dir %s, device %s", stage, cfg.profile.name,
                                   cfg.exp_dir, cfg.device)
    result = importlib.import_module(STAGES[stage]).run(cfg)
    return int(result or 0)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
