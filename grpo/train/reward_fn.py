"""The reward function verl calls once per response (and the local engine calls the same way).

verl 0.9.1's reward loop awaits `compute_score(data_source, solution_str, ground_truth, extra_info,
**reward_kwargs)` with the response decoded by `tokenizer.decode(..., skip_special_tokens=True)`,
so speech tokens arrive as `<|s_N|>` strings. `reward_kwargs` (set by the launcher from `reward.*`): `client`, the
reward client's whole configuration (reward_server.client.ClientConfig, built once by `client_config`),
no_speech_reward, on_failure, failure_log, component_log (and verl's launcher adds the attempt). Concurrent calls
are sent to the server together (reward_server.client). Every failure (after the client's retries) is also appended to
`failure_log`: verl's agent loop catches a raising reward per sample and drops the group, so the verl
launcher watches that file and fails the run (on_failure=raise) instead of training on silently
shrunken batches. Inside verl's Ray cluster both logs are written on the head node, whichever node the
reward worker runs on (grpo.train.reward_ledger).
"""

from __future__ import annotations

import dataclasses
import logging
import time

from grpo.layout import TrainDir
from grpo.model.speech_vocab import speech_token_strings
from grpo.speech.components import COMPONENTS
from grpo.train import reward_ledger
from reward_server.client import ClientConfig, RewardClient, RewardServerError

log = logging.getLogger(__name__)

_CLIENTS: dict[tuple, RewardClient] = {}
ON_FAILURE = ("raise", "exclude")
COMPONENT_FIELDS = tuple(f"reward_{name}" for name in COMPONENTS)   # each component's key in compute_score's result


def client_for(client: dict) -> RewardClient:
    """One client (connection pools, pending batch) per configuration (ClientConfig's fields), shared by all calls."""
    client = dict(client)                   # (verl hands it over as a DictConfig)
    key = tuple(sorted(client.items()))
    if key not in _CLIENTS:
        _CLIENTS[key] = RewardClient(ClientConfig(**client))
    return _CLIENTS[key]


async def compute_score(data_source, solution_str, ground_truth, extra_info=None, *, client: dict,
                        no_speech_reward: float = 0.0, on_failure: str = "raise", failure_log: str | None = None,
                        component_log: str | None = None, attempt: int = 0) -> dict:
    """Score one response; returns {"score", "error_rate", "transcript", "no_speech", "reward_failed"} and
    each reward component as `reward_<name>` (cer, sim, duration; NaN when the server gave none). `client`: the
    ClientConfig fields (`client_config`)."""
    if on_failure not in ON_FAILURE:
        raise ValueError(f"reward.on_failure must be one of {ON_FAILURE}, got {on_failure!r}")
    extra_info = extra_info or {}
    tokens = speech_token_strings(solution_str)
    if not tokens:
        out = {"score": float(no_speech_reward), "error_rate": 1.0, "transcript": "", "no_speech": 1,
               "reward_failed": 0, **component_fields({"cer": no_speech_reward, "sim": 0.0, "duration": 0.0})}
        await log_components(component_log, extra_info, out, 0, attempt)
        return out
    item = {"id": str(extra_info.get("sample_id") or ground_truth), "tokens": tokens, "text": ground_truth,
            "language": extra_info.get("language", "zh")}
    try:
        result = await client_for(client).score_one(item)
    except RewardServerError as exc:
        if failure_log:   # the verl launcher watches this file: verl's agent loop would swallow the raise below
            await record_failure(failure_log, item["id"], exc, attempt)
        if on_failure == "raise":
            raise
        log.exception("reward failed for sample %s; it is excluded from the update", item["id"])
        # exclude: the caller (local engine) masks the sample out by `reward_failed`; the score is never used
        return {"score": 0.0, "error_rate": float("nan"), "transcript": "", "no_speech": 0, "reward_failed": 1,
                **component_fields({})}
    out = {"score": float(result["reward"]), "error_rate": float(result["error_rate"]),
           "transcript": result["transcript"], "no_speech": 0, "reward_failed": 0,
           **component_fields(result.get("components", {}))}
    await log_components(component_log, extra_info, out, len(tokens), attempt,
                         {"replica": result.get("replica"), "reward_node": result.get("node")})
    return out


async def log_components(path: str | None, extra_info: dict, out: dict, speech_tokens: int, attempt: int,
                         scored_by: dict | None = None) -> None:
    """verl engine: the sample's components under its training step (the agent loop puts `global_steps` in
    extra_info) and the launcher's attempt (grpo.train.verl_attempts); verl 0.9.1 logs no reward extras while
    training, so the launcher averages these per step. Each line also names the sample and its length, so its
    length bounds can be checked from the data, and the server replica (and its Ray node) that scored it."""
    if path and extra_info.get("global_steps") is not None:
        await reward_ledger.record(path, {
            "step": int(extra_info["global_steps"]), "attempt": attempt, **(scored_by or {}),
            "sample_id": extra_info.get("sample_id"),
            "speech_tokens": speech_tokens, **(extra_info.get("sampling") or {}), "score": out["score"],
            "error_rate": out["error_rate"], **{k: out[k] for k in COMPONENT_FIELDS}})


def component_fields(components: dict) -> dict:
    """Every component under a fixed key (verl's reward_extra_info wants the same keys for every sample)."""
    return {field: float(components.get(name, float("nan"))) for name, field in zip(COMPONENTS, COMPONENT_FIELDS)}


async def record_failure(path: str, sample_id: str, exc: Exception, attempt: int = 0) -> None:
    await reward_ledger.record(path, {"time": time.time(), "attempt": attempt, "id": sample_id,
                                      "error": f"{type(exc).__name__}: {exc}"[:500]})


def request_items(r) -> int:
    """Items per request: reward.client.max_items_per_request, or a quarter of the server's batch, so that a
    batch is filled by several requests and each request is routed to whichever replica frees up first."""
    return r.client.max_items_per_request or max(1, r.max_batch_size // 4)


def requests_in_flight(r) -> int:
    """Requests the client keeps open: reward.client.max_concurrency, or 4 per replica (about one server
    batch per replica in flight; more are sent as these complete, which is what balances the replicas)."""
    return r.client.max_concurrency or 4 * r.num_replicas


# what reward.client may set: ClientConfig's fields but the two that come from reward.* itself
CLIENT_KEYS = tuple(f.name for f in dataclasses.fields(ClientConfig) if f.name not in ("url", "auth_token"))


def client_config(cfg) -> dict:
    """The reward client's configuration, built once: reward.client over ClientConfig's defaults (null keeps the
    default), reward.url and reward.auth_token, and the two sizes computed from the server's (requests_in_flight,
    request_items). A key ClientConfig does not have is a one-line error naming it."""
    from omegaconf import OmegaConf

    r = cfg.reward
    given = OmegaConf.to_container(r.client, resolve=True) or {}
    unknown = sorted(set(given) - set(CLIENT_KEYS))
    if unknown:
        raise ValueError(f"reward.client.{unknown[0]}: unknown key (reward.client takes {', '.join(CLIENT_KEYS)})")
    given = {k: v for k, v in given.items() if v is not None}
    given.update(max_concurrency=requests_in_flight(r),
                 max_items_per_request=min(request_items(r), r.limits.max_items_per_request))
    return dataclasses.asdict(ClientConfig(url=r.url, auth_token=r.auth_token, **given))


def reward_kwargs(cfg) -> dict:
    """The keyword arguments compute_score takes, from the root config (reward.*)."""
    r = cfg.reward
    return {"client": client_config(cfg), "no_speech_reward": r.no_speech_reward, "on_failure": r.on_failure,
            "failure_log": str(TrainDir(cfg.train.out_dir).reward_failures),
            "component_log": str(TrainDir(cfg.train.out_dir).reward_components)}
