"""The policy's logits are float32 whatever the compute dtype (grpo/model/cosyvoice_lm.py SpeechHead): under a bf16
autocast or FSDP2's bf16 mixed precision the body runs in bf16 and the head in float32. What is left of bf16 in the
log-probs verl's actor takes (its own `logprobs_from_logits`) is the body's rounding; bf16 logits would add
`log_softmax` in bf16 on top (~|log p| x 2^-8), several times more at the log-probs of a sharp head."""

from __future__ import annotations

import os
import socket

import pytest
import torch


@pytest.fixture(scope="module")
def tiny_model(tiny_cfg):
    from transformers import AutoModelForCausalLM

    import grpo.model  # noqa: F401  (registers the model class)
    from grpo.model.speech_vocab import SpeechVocab

    cfg = tiny_cfg()
    model = AutoModelForCausalLM.from_pretrained(cfg.model.hf_dir, dtype=torch.float32).eval()
    vocab = SpeechVocab.load(cfg.model.hf_dir)
    g = torch.Generator().manual_seed(0)
    first, end = model.config.head_rows
    prompt = torch.tensor([[vocab.sos_token_id, *range(5, 25), vocab.task_id_token_id]])
    ids = torch.cat([prompt, torch.randint(first, end - 3, (1, PROMPT_SPEECH), generator=g)], 1)
    with torch.no_grad():                     # speech logits of std ~3, as a trained head's: log-probs ~ -3 .. -25
        spread = model(ids).logits[0, :, first:end].std()
        model.lm_head.weight[first:end] *= 3.0 / spread
        ids[0, prompt.shape[1]:] = model(ids).logits[0, prompt.shape[1] - 1:-1].argmax(-1)   # likely tokens too
    return model, ids, prompt.shape[1]


PROMPT_SPEECH = 40


def verl_logprobs(logits, ids, start):
    """verl's log-probs of the response tokens (after the prompt), as its actor takes them."""
    from verl.utils.torch_functional import logprobs_from_logits

    return logprobs_from_logits(logits[0, start - 1:-1], ids[0, start:])


def test_bf16_autocast_gives_float32_logits_and_fp32_log_probs(tiny_model):
    model, ids, start = tiny_model
    with torch.no_grad():
        ref_logits = model(ids).logits
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(ids).logits
    assert ref_logits.dtype == torch.float32 and logits.dtype == torch.float32
    ref = verl_logprobs(ref_logits, ids, start)
    assert ref.min() < -8.0                                         # log-probs where bf16 rounding shows
    ours = (verl_logprobs(logits, ids, start) - ref).abs()
    # the same forward with bf16 logits (the head inside the autocast): verl's log_softmax runs in bf16
    bf16 = (verl_logprobs(logits.bfloat16(), ids, start).float() - ref).abs()
    print(f"autocast: fp32 head {ours.mean():.2e} mean / {ours.max():.2e} max, bf16 logits {bf16.mean():.2e} / "
          f"{bf16.max():.2e}")
    # FSDP2 casts every parameter to bf16 (the head's weight too, before its float32 matmul): less to win than
    # under autocast, and still half the error (measured 6.4e-3 vs 1.6e-2 mean)
    assert ours.mean() < bf16.mean() / 2
    assert (verl_logprobs(logits, ids, start).double() - verl_logprobs(logits.double(), ids, start)).abs().max() < 1e-5
    # at the head itself the float32 logits are exact: the same logits in float64 give the same log-probs
    exact = verl_logprobs(logits.double(), ids, start)
    assert (verl_logprobs(logits, ids, start).double() - exact).abs().max() < 1e-5


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_fsdp2_bf16_mixed_precision_gives_float32_logits(tiny_model):
    """verl's FSDP2 actor: `fully_shard` with MixedPrecisionPolicy(param_dtype=bf16) on gloo, world size 1."""
    import copy

    import torch.distributed as dist
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    model, ids, start = tiny_model
    with torch.no_grad():
        ref = verl_logprobs(model(ids).logits, ids, start)
    owned = not dist.is_initialized()              # an in-process vLLM test may have left a world of one
    if owned:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), RANK="0", WORLD_SIZE="1")
        dist.init_process_group("gloo")
    assert dist.get_world_size() == 1
    try:
        sharded = copy.deepcopy(model)
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for layer in sharded.model.layers:
            fully_shard(layer, mp_policy=policy)
        fully_shard(sharded, mp_policy=policy)
        with torch.no_grad():
            logits = sharded(ids).logits
    finally:
        if owned:
            dist.destroy_process_group()
    assert logits.dtype == torch.float32
    ours = (verl_logprobs(logits, ids, start) - ref).abs()
    bf16 = (verl_logprobs(logits.bfloat16(), ids, start).float() - ref).abs()
    print(f"FSDP2 bf16: fp32 head {ours.mean():.2e} mean / {ours.max():.2e} max, bf16 logits {bf16.mean():.2e} / "
          f"{bf16.max():.2e}")
    # FSDP2 casts every parameter to bf16 (the head's weight too, before its float32 matmul): less to win than
    # under autocast, and still well under half the error (measured 6.4e-3 vs 1.6e-2 mean)
    assert ours.mean() < bf16.mean() / 2
    exact = verl_logprobs(logits.double(), ids, start)
    assert (verl_logprobs(logits, ids, start).double() - exact).abs().max() < 1e-5
