"""Drive grpo.model.ras_logits.CosyVoiceRAS as vLLM's V1 runner does (BatchUpdate, then apply on the batch's
logits), without an engine: what the tests read is the row vLLM would sample from."""

from types import SimpleNamespace

import torch
from vllm.v1.sample.logits_processor import BatchUpdate, MoveDirectionality


def processor(head_rows=None):
    from grpo.model.ras_logits import CosyVoiceRAS

    config = SimpleNamespace(speculative_config=None, use_v2_model_runner=False,
                             model_config=SimpleNamespace(hf_config=SimpleNamespace(head_rows=head_rows)))
    return CosyVoiceRAS(config, torch.device("cpu"), False)


def update(proc, batch_size, added=(), removed=(), moved=()):
    """added: (index, SamplingParams, output_ids list) -- the list is kept by reference, as vLLM's is."""
    proc.update_state(BatchUpdate(batch_size=batch_size, removed=list(removed),
                                  added=[(i, params, None, out) for i, params, out in added],
                                  moved=[(a, b, MoveDirectionality.SWAP if swap else MoveDirectionality.UNIDIRECTIONAL)
                                         for a, b, swap in moved]))


def one_row(params, history, logits):
    """softmax of the row the processor returns for one request with `history` generated so far."""
    proc = processor()
    update(proc, 1, added=[(0, params, list(history))])
    return proc.apply(logits.clone()[None])[0].softmax(-1).double().numpy()
