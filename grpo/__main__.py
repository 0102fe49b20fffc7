"""Stage entry point: `python -m grpo <stage> [key=value ...]`. run.sh maps stage numbers to these."""

from __future__ import annotations

import importlib
import logging
import sys

from grpo.config import load_config, setup_logging
from grpo.upstream import UpstreamError, check_imported

# stage name -> module with `run(cfg)`
STAGES = {
    "models": "grpo.model.prepare",             # -1: build tiny models or download real ones, convert to HF
    "data": "grpo.data",                        # 0: JSONL -> verl parquet
    "serve": "reward_server.serve",             # 1: reward server (foreground)
    "train": "grpo.train.launch",               # 2: GRPO (local engine or verl)
    "merge": "grpo.train.merge",                # 3: checkpoints -> HF
    "evaluate": "grpo.evaluate.evaluator",      # 4: zero-shot CER report
    "export": "grpo.model.export",              # 5: HF -> CosyVoice llm.pt
}

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
        check_imported()           # CosyVoice's code is upstream's at the pinned commit, unedited (grpo/upstream.py)
    except UpstreamError as exc:
        print(f"[grpo] {exc}", file=sys.stderr)
        return 2
    setup_logging()
    cfg = load_config(overrides)
    logging.getLogger("grpo").info("stage %s, profile %s, exp_dir %s", stage, cfg.profile.name, cfg.exp_dir)
    result = importlib.import_module(STAGES[stage]).run(cfg)
    return int(result or 0)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
