"""verl agent-loop extension: single-turn generation restricted to speech tokens and stop ids.

verl has no config key for vLLM's `allowed_token_ids`; its agent loops pass `sampling_params` straight
to `vllm.SamplingParams`, so this loop adds them. It is registered through
`actor_rollout_ref.rollout.agent.agent_loop_config_path` (a YAML the launcher writes) and selected with
`actor_rollout_ref.rollout.agent.default_agent_loop=speech_token_agent`.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

from verl.experimental.agent_loop.single_turn_agent_loop import SingleTurnAgentLoop

from grpo.model.speech_vocab import SpeechVocab

AGENT_NAME = "speech_token_agent"


@lru_cache(maxsize=8)
def _vocab(model_path: str) -> SpeechVocab:
    return SpeechVocab.load(model_path)


def speech_sampling_params(sampling_params: dict[str, Any], vocab: SpeechVocab) -> dict[str, Any]:
    """verl's sampling params plus the speech-token restriction (a copy; the caller's dict is untouched)."""
    params = dict(sampling_params)
    params["allowed_token_ids"] = vocab.allowed_token_ids()
    params["stop_token_ids"] = sorted(set(params.get("stop_token_ids") or []) | set(vocab.stop_token_ids))
    return params


class SpeechTokenAgentLoop(SingleTurnAgentLoop):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.vocab = _vocab(str(self.config.actor_rollout_ref.model.path))

    async def run(self, sampling_params: dict[str, Any], **kwargs):
        return await super().run(speech_sampling_params(sampling_params, self.vocab), **kwargs)


def agent_loop_yaml() -> str:
    """Content of the file verl reads from `agent_loop_config_path`."""
    return f"- name: {AGENT_NAME}\n  _target_: {SpeechTokenAgentLoop.__module__}.{SpeechTokenAgentLoop.__qualname__}\n"
