"""verl agent-loop extension: single-turn generation that stops on CosyVoice's end-of-speech ids.

The model's masked head (grpo.model.cosyvoice_lm) already gives every non-speech id probability 0, so no
`allowed_token_ids` are needed (vLLM's V2 runner caps them at 1024 anyway). What verl does not know is that
any of the end-of-speech ids ends a response: its agent loops pass `sampling_params` straight to
`vllm.SamplingParams`, so this loop adds them as `stop_token_ids`. It is registered through
`actor_rollout_ref.rollout.agent.agent_loop_config_path` = verl_agent_loop.yaml beside this file (shipped
in the package, so every node has it) and selected with
`actor_rollout_ref.rollout.agent.default_agent_loop=speech_token_agent`. It also tags each output with its
training step, which reaches the reward function (see `run`).

Each request gets its item's CosyVoice length bounds from its text (grpo.decoding), training items
`train.decoding` and validation items (split "val") the evaluation's decoding: all from the `grpo_decoding` node
the launcher adds to main_ppo's
config, so every node has them without a file.
"""

from __future__ import annotations

import math
from functools import lru_cache
from typing import Any

from verl.experimental.agent_loop.single_turn_agent_loop import SingleTurnAgentLoop

from grpo.decoding import RAS_KEY, RAS_PROCESSOR, capped, length_bounds, sampling_kwargs, text_token_count
from grpo.model.speech_vocab import SpeechVocab


@lru_cache(maxsize=8)
def _vocab(model_path: str) -> SpeechVocab:
    return SpeechVocab.load(model_path)


def speech_sampling_params(sampling_params: dict[str, Any], vocab: SpeechVocab) -> dict[str, Any]:
    """verl's sampling params plus the end-of-speech stop ids (a copy; the caller's dict is untouched)."""
    params = dict(sampling_params)
    params["stop_token_ids"] = sorted(set(params.get("stop_token_ids") or []) | set(vocab.stop_token_ids))
    return params


def bounded_sampling_params(sampling_params: dict[str, Any], decoding, text_tokens: int, validate: bool,
                            response_length: int, vocab: SpeechVocab) -> dict[str, Any]:
    """The item's CosyVoice length bounds (`min_tokens`/`max_tokens`, capped at verl's response_length); a
    validation item is decoded as the evaluation decodes (`decoding.validation`), not with verl's greedy
    val_kwargs. `decoding` is the launcher's `grpo_decoding` node of main_ppo's config."""
    spec = decoding.validation if validate else decoding.train
    min_len, max_len = length_bounds(text_tokens, spec.min_token_text_ratio, spec.max_token_text_ratio)
    capped_len = capped(min_len, max_len, response_length)
    params = dict(sampling_params)
    if validate or spec.get("preset", "plain") != "plain":
        params.update(sampling_kwargs(spec.preset, capped_len["min_tokens"], capped_len["max_tokens"],
                                      spec.temperature, spec.top_p, spec.top_k,
                                      min_len_masked_id=vocab.min_len_masked_id))
    else:   # plain training: verl's own temperature / top_p / top_k (rollout config), the item's bounds
        params.update(capped_len)
    return params


class SpeechTokenAgentLoop(SingleTurnAgentLoop):
    async def _stop_on_non_finite(self, logprobs: list[float], extra_info: dict) -> None:
        """Rollout log-probs with NaN/inf (vllm-omni#4168: CosyVoice3 in bf16) never reach the update: the line goes
        to the failure log the launcher watches (it stops main_ppo and says it), then the request raises."""
        from grpo.train.grpo_step import NonFiniteLogProbs, require_finite
        from grpo.train.reward_fn import record_failure

        try:
            require_finite("rollout", logprobs, None, self.config.actor_rollout_ref.rollout.dtype)
        except NonFiniteLogProbs as exc:
            failure_log = self.config.reward.custom_reward_function.get("reward_kwargs", {}).get("failure_log")
            if failure_log:
                await record_failure(failure_log, str(extra_info.get("sample_id", "?")), exc)
            raise ValueError(str(exc)) from None

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.vocab = _vocab(str(self.config.actor_rollout_ref.model.path))
        self.decoding = self.config.get("grpo_decoding")
        vllm_kwargs = (self.config.actor_rollout_ref.rollout.get("engine_kwargs") or {}).get("vllm") or {}
        self.ras_registered = RAS_PROCESSOR in list(vllm_kwargs.get("logits_processors") or [])

    async def run(self, sampling_params: dict[str, Any], **kwargs):
        params = speech_sampling_params(sampling_params, self.vocab)
        extra_info = kwargs.get("extra_info") or {}
        validate = extra_info.get("split") == "val"
        if self.decoding is not None and "text" in extra_info:   # our data stage's rows (grpo.data.to_records)
            params = bounded_sampling_params(
                params, self.decoding,
                text_token_count(self.tokenizer, extra_info.get("normalized_text") or extra_info["text"]), validate,
                response_length=int(self.config.actor_rollout_ref.rollout.response_length), vocab=self.vocab)
        if RAS_KEY in (params.get("extra_args") or {}) and not self.ras_registered:
            # vLLM would ignore the extra_args and sample plainly: a silently different distribution
            raise ValueError(f"a {'validation' if validate else 'training'} request decodes with cosyvoice_ras but "
                             "verl's vLLM servers were started without the RAS processor (grpo/train/verl_launcher.py)")
        output = await super().run(params, **kwargs)
        if output.response_logprobs is not None and not all(math.isfinite(x) for x in output.response_logprobs):
            await self._stop_on_non_finite(output.response_logprobs, extra_info)
        # what this request was sent with, for the reward function's component log (checkable per sample)
        output.extra_fields["sampling"] = {"validate": validate, "min_tokens": params.get("min_tokens"),
                                           "max_tokens": params.get("max_tokens"),
                                           "ras": "cosyvoice_ras" in (params.get("extra_args") or {})}
        # verl hands a sample's extra_fields to the reward function inside extra_info: the step lets
        # compute_score log each reward component per training step (reward.component_log)
        output.extra_fields.setdefault("global_steps", kwargs.get("global_steps"))
        return output
