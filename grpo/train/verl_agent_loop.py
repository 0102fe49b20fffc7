"""verl agent-loop extension: single-turn generation that stops on CosyVoice's end-of-speech ids.

The model's masked head (grpo.model.cosyvoice_lm) already gives every non-speech id probability 0, so no
`allowed_token_ids` are needed (vLLM's V2 runner caps them at 1024 anyway). What verl does not know is that
any of the end-of-speech ids ends a response: its agent loops pass `sampling_params` straight to
`vllm.SamplingParams`, so this loop adds them as `stop_token_ids`. It is registered through
`actor_rollout_ref.rollout.agent.agent_loop_config_path` = verl_agent_loop.yaml beside this file (shipped
in the package, so every node has it) and selected with
`actor_rollout_ref.rollout.agent.default_agent_loop=speech_token_agent`. It also tags each output with its
training step, which reaches the reward function (see `run`).
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Any

from verl.experimental.agent_loop.single_turn_agent_loop import SingleTurnAgentLoop

from grpo.model.speech_vocab import SpeechVocab

AGENT_NAME = "speech_token_agent"
AGENT_LOOP_CONFIG = Path(__file__).with_suffix(".yaml")


@lru_cache(maxsize=8)
def _vocab(model_path: str) -> SpeechVocab:
    return SpeechVocab.load(model_path)


def speech_sampling_params(sampling_params: dict[str, Any], vocab: SpeechVocab) -> dict[str, Any]:
    """verl's sampling params plus the end-of-speech stop ids (a copy; the caller's dict is untouched)."""
    params = dict(sampling_params)
    params["stop_token_ids"] = sorted(set(params.get("stop_token_ids") or []) | set(vocab.stop_token_ids))
    return params


class SpeechTokenAgentLoop(SingleTurnAgentLoop):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.vocab = _vocab(str(self.config.actor_rollout_ref.model.path))

    async def run(self, sampling_params: dict[str, Any], **kwargs):
        output = await super().run(speech_sampling_params(sampling_params, self.vocab), **kwargs)
        # verl hands a sample's extra_fields to the reward function inside extra_info: the step lets
        # compute_score log each reward component per training step (reward.component_log)
        output.extra_fields.setdefault("global_steps", kwargs.get("global_steps"))
        return output
