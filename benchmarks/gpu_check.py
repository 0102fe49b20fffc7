"""What only a GPU exercises, in one short script to run as is when a device is lent (or in the GPU image):

  cuda         torch's CUDA build, the device, the driver against the minimum for that CUDA (grpo/device.py)
  fsdp_bf16    one FSDP2 step (`fully_shard`, bf16 mixed precision) of a small LM whose output head has a bias,
               as the converted CosyVoice LLM's speech head does: loss finite, every parameter (the bias too) moved
  ipc_bias     that head's bias handed to a second process through CUDA IPC (torch.multiprocessing's reductions,
               the mechanism of verl's colocated weight sync): the receiver reads the same bits and sees an update
  vllm_graphs  the project's vLLM plugin on the tiny model with CUDA graphs vs eager: the same greedy tokens and
               log-probs within bf16 rounding (needs vLLM and the project's stack: the GPU image; skipped elsewhere)

    python benchmarks/gpu_check.py                  # on a GPU: every check
    python benchmarks/gpu_check.py --device cpu     # the CPU smoke CI runs (fsdp on gloo; the CUDA checks skip)

Needs torch only for the first three. Prints one line per check; the last line is JSON ({check: ok | skipped: why |
failed: why}); exits 1 when a check failed.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import socket
import sys
import tempfile
import traceback

import torch
import torch.multiprocessing as mp


class BiasedLM(torch.nn.Module):
    """Embedding, two MLP blocks, an output head with a bias (the converted llm_decoder's)."""

    def __init__(self, vocab: int = 512, hidden: int = 256):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, hidden)
        self.blocks = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.Linear(hidden, 4 * hidden), torch.nn.GELU(),
                                                              torch.nn.Linear(4 * hidden, hidden)) for _ in range(2))
        self.lm_head = torch.nn.Linear(hidden, vocab, bias=True)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        for block in self.blocks:
            h = h + block(h)
        return self.lm_head(h)


def check_cuda(device: str) -> str:
    if device != "cuda":
        return "skipped: --device cpu"
    if not torch.cuda.is_available():
        raise RuntimeError(f"torch {torch.__version__} (CUDA {torch.version.cuda}) sees no usable GPU")
    out = f"{torch.cuda.get_device_name()}, torch {torch.__version__}, CUDA {torch.version.cuda}"
    try:
        from grpo.device import MIN_DRIVER, driver_version
    except ImportError:        # the project's config stack is not installed here: report what torch sees
        return out + ", driver not checked (grpo.device needs omegaconf)"
    driver, need = driver_version(), MIN_DRIVER.get(int(torch.version.cuda.split(".")[0]))
    if driver and need and driver < need:
        raise RuntimeError(f"driver {'.'.join(map(str, driver))} is older than {need} for CUDA {torch.version.cuda}")
    return out + f", driver {'.'.join(map(str, driver or ()))}"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def check_fsdp_bf16(device: str) -> str:
    import torch.distributed as dist
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), RANK="0", WORLD_SIZE="1")
    dist.init_process_group("nccl" if device == "cuda" else "gloo")
    try:
        torch.manual_seed(0)
        model = BiasedLM().to(device)
        before = {n: p.detach().float().clone() for n, p in model.named_parameters()}
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for block in model.blocks:
            fully_shard(block, mp_policy=policy)
        fully_shard(model, mp_policy=policy)
        optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
        ids = torch.randint(0, 512, (4, 64), device=device)
        logits = model(ids[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, 512), ids[:, 1:].reshape(-1))
        loss.backward()
        optim.step()
        if not torch.isfinite(loss):
            raise RuntimeError(f"loss {loss.item()}")
        after = {n: p.full_tensor().float() for n, p in model.named_parameters()}
        still = [n for n in before if torch.equal(before[n].to(after[n].device), after[n])]
        if still:
            raise RuntimeError(f"parameters unchanged by the step: {still}")
        return f"loss {loss.item():.3f}, logits {logits.dtype}, {len(after)} parameters updated (lm_head.bias too)"
    finally:
        dist.destroy_process_group()


def _receive(queue, answer) -> None:
    bias = queue.get()                       # rebuilt from the CUDA IPC handle: the sender's memory
    answer.put(bias.clone().cpu())
    queue.get()                              # the sender updated it in place
    answer.put(bias.clone().cpu())


def check_ipc_bias(device: str) -> str:
    if device != "cuda":
        return "skipped: CUDA IPC needs a GPU"
    bias = BiasedLM().cuda().lm_head.bias.detach()
    ctx = mp.get_context("spawn")
    queue, answer = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=_receive, args=(queue, answer))
    proc.start()
    try:
        queue.put(bias)
        seen = answer.get(timeout=120)
        bias.add_(1.0)
        torch.cuda.synchronize()
        queue.put("updated")
        seen_after = answer.get(timeout=120)
    finally:
        proc.join(60)
    if not torch.equal(seen, bias.cpu() - 1.0) or not torch.equal(seen_after, bias.cpu()):
        raise RuntimeError("the receiving process read other values than the sender holds")
    return f"{bias.numel()} values shared and updated in place across processes"


def check_vllm_graphs(device: str) -> str:
    if device != "cuda":
        return "skipped: CUDA graphs need a GPU"
    try:
        import vllm  # noqa: F401
    except ImportError:
        return "skipped: vLLM is not installed here (the GPU image has it)"
    from grpo.config import load_config
    from grpo.model import prepare
    from grpo.model.speech_vocab import SpeechVocab
    from grpo.train.rollout import VLLMRollout

    with tempfile.TemporaryDirectory() as tmp:
        cfg = load_config(["profile=tiny", f"exp_dir={tmp}", "device=cuda"])
        prepare.run(cfg)
        vocab = SpeechVocab.load(cfg.model.hf_dir)
        prompts = [[vocab.sos_token_id, *range(10 + i, 30 + i), vocab.task_id_token_id] for i in range(4)]
        outputs = {}
        for eager in (True, False):
            engine = VLLMRollout(cfg.model.hf_dir, vocab, "bfloat16", 0.2, eager, 256, 0)
            params = [engine.speech_params(n=1, seed=0, temperature=0.0, max_tokens=32, logprobs=0) for _ in prompts]
            outputs[eager] = engine.run(prompts, params, with_logprobs=True)
            del engine                          # vLLM's engine core shuts down with it; its memory is freed
            gc.collect()
            torch.cuda.empty_cache()
    (eager_tokens, eager_lp), (graph_tokens, graph_lp) = outputs[True], outputs[False]
    if eager_tokens != graph_tokens:
        raise RuntimeError("greedy tokens differ between eager and CUDA graphs")
    worst = max(abs(a - b) for p, q in zip(eager_lp, graph_lp) for a, b in zip(p[0], q[0]))
    if worst > 0.05:                            # bf16 rounding of a 4-layer model: ~1e-2 at most
        raise RuntimeError(f"log-probs differ by {worst:.3f} between eager and CUDA graphs")
    return f"{len(prompts)} prompts: the same greedy tokens eager and with CUDA graphs, log-probs within {worst:.1e}"


CHECKS = {"cuda": check_cuda, "fsdp_bf16": check_fsdp_bf16, "ipc_bias": check_ipc_bias,
          "vllm_graphs": check_vllm_graphs}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cuda", "cpu"])
    parser.add_argument("--only", default=",".join(CHECKS), help="comma list of checks")
    args = parser.parse_args()
    results = {}
    for name in args.only.split(","):
        try:
            results[name] = CHECKS[name](args.device)
        except Exception as exc:
            traceback.print_exc()
            results[name] = f"failed: {type(exc).__name__}: {exc}"[:400]
        print(f"{name:12s} {results[name]}", flush=True)
    print(json.dumps({"device": args.device, **results}))
    return 1 if any(r.startswith("failed") for r in results.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
