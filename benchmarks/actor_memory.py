"""Peak memory of the actor's log-prob pass and update pass at real size, per micro-batch (measured on the CPU).

    python benchmarks/actor_memory.py [--hf-dir exp/realsize/models/hf_llm] [--shapes 1x128 1x256 2x256 4x256]

Each shape runs in a fresh process (the peak RSS is a process high-water mark): load the converted model
(CosyVoiceLMForCausalLM, float32, the realsize build's 158,336-column vocabulary), then
- logprob: no-grad forward over B x L tokens, full-vocabulary log-softmax and the chosen tokens' log-probs
  (what verl's actor and reference compute for every rollout),
- update: the same with gradients, a policy-gradient style loss and backward (what each PPO micro-batch does).
Prints JSON: per shape the peak above the loaded model, in GiB, and a least-squares fit peak = a + b x tokens,
which docs/memory-plan.md scales to bfloat16 (arithmetic shown there).
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
from pathlib import Path

GIB = 2**30


def peak_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GIB


def child(hf_dir: str, batch: int, length: int, mode: str) -> dict:
    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from grpo.model.cosyvoice_lm import CosyVoiceLMForCausalLM
    from grpo.model.speech_vocab import SpeechVocab

    torch.manual_seed(0)
    vocab = SpeechVocab.load(hf_dir)
    model = CosyVoiceLMForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    ids = torch.randint(vocab.speech_token_offset, vocab.speech_token_offset + vocab.speech_token_size,
                        (batch, length))
    with torch.no_grad():     # page the (memory-mapped) weights in, so that the baseline holds them
        sum(float(p.sum()) for p in model.parameters())
    loaded = peak_gib()
    if mode == "logprob":
        with torch.no_grad():
            logp = torch.log_softmax(model(input_ids=ids).logits.float(), dim=-1)
            logp[:, :-1].gather(-1, ids[:, 1:, None])
    else:
        model.train()
        logits = model(input_ids=ids).logits.float()
        chosen = torch.log_softmax(logits, dim=-1)[:, :-1].gather(-1, ids[:, 1:, None])
        (-chosen.mean()).backward()
    return {"batch": batch, "length": length, "mode": mode, "vocab": vocab.vocab_size,
            "params_gib": sum(p.numel() for p in model.parameters()) * 4 / GIB, "model_gib": loaded,
            "peak_above_model_gib": peak_gib() - loaded}


def fit(rows: list[dict]) -> dict:
    """peak = a + b * tokens by least squares (numpy), per mode."""
    import numpy as np

    out = {}
    for mode in ("logprob", "update"):
        pts = [(r["batch"] * r["length"], r["peak_above_model_gib"]) for r in rows if r["mode"] == mode]
        if len(pts) >= 2:
            x, y = np.array(pts, dtype=float).T
            b, a = np.polyfit(x, y, 1)
            out[mode] = {"fixed_gib": float(a), "gib_per_1k_tokens": float(b * 1000)}
    return out


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python benchmarks/actor_memory.py")
    parser.add_argument("--hf-dir", default="exp/realsize/models/hf_llm")
    parser.add_argument("--shapes", nargs="+", default=["1x128", "1x256", "2x256", "4x256"])
    parser.add_argument("--child", nargs=3, metavar=("B", "L", "MODE"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.hf_dir, int(args.child[0]), int(args.child[1]), args.child[2])))
        return 0
    rows = []
    for shape in args.shapes:
        b, length = shape.split("x")
        for mode in ("logprob", "update"):
            proc = subprocess.run([sys.executable, __file__, "--hf-dir", args.hf_dir, "--child", b, length, mode],
                                  capture_output=True, text=True)
            if proc.returncode:
                print(proc.stderr[-2000:], file=sys.stderr)
                return proc.returncode
            rows.append(json.loads(proc.stdout.strip().splitlines()[-1]))
            print(json.dumps(rows[-1]), file=sys.stderr)
    print(json.dumps({"rows": rows, "fit": fit(rows)}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
