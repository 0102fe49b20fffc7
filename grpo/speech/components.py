"""Reward components and how `reward.weights` combines them.

Each scored item gets every component the backend can give, each in [0, 1]:
- `cer`: the pinyin/word error rate c mapped to a reward (1 - tanh(3c) by default) -- the reference's reward;
- `duration`: 1 while the speech-token count per text unit (pinyin syllable or word) stays inside the
  language's band, falling linearly to 0 at `tolerance` relative distance outside it (a runaway or
  truncated utterance is penalised, natural pace is not);
- `sim`: cosine similarity of the generated speech to its prompt speaker (negative values count as 0),
  when the backend has a speaker verifier.
The reward is the weighted mean over the components with a non-zero weight (default: cer alone).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

COMPONENTS = ("cer", "sim", "duration")


@dataclass(frozen=True)
class RewardSpec:
    weights: dict[str, float] = field(default_factory=lambda: {"cer": 1.0})
    duration_band: dict[str, tuple[float, float]] = field(default_factory=lambda: {"zh": (3.0, 10.0),
                                                                                  "en": (4.0, 20.0)})
    duration_tolerance: float = 0.5

    def __post_init__(self):
        unknown = set(self.weights) - set(COMPONENTS)
        if unknown:
            raise ValueError(f"reward.weights: unknown component(s) {sorted(unknown)}; expected {list(COMPONENTS)}")
        if any(w < 0 for w in self.weights.values()) or not any(w > 0 for w in self.weights.values()):
            raise ValueError(f"reward.weights must be non-negative with at least one positive: {self.weights}")
        for language, (low, high) in self.duration_band.items():
            if not 0 < low <= high:
                raise ValueError(f"reward.duration.band.{language}: expected 0 < low <= high, got {[low, high]}")
        if self.duration_tolerance <= 0:
            raise ValueError("reward.duration.tolerance must be positive")

    @property
    def active(self) -> list[str]:
        return [name for name in COMPONENTS if self.weights.get(name, 0) > 0]

    @classmethod
    def from_config(cls, r) -> RewardSpec:
        """From the `reward` config node (weights, duration.band, duration.tolerance)."""
        return cls(weights={k: float(v) for k, v in r.weights.items()},
                   duration_band={k: (float(v[0]), float(v[1])) for k, v in r.duration.band.items()},
                   duration_tolerance=float(r.duration.tolerance))


def duration_score(num_tokens: int, num_units: int, band: tuple[float, float], tolerance: float) -> float:
    """1 inside [low, high] tokens per unit; below, the relative shortfall low/rate - 1, above, rate/high - 1,
    each taking the score linearly to 0 at `tolerance`."""
    if num_units <= 0:
        raise ValueError("duration needs at least one reference unit")
    rate = num_tokens / num_units
    low, high = band
    if rate <= 0:
        return 0.0
    distance = low / rate - 1 if rate < low else rate / high - 1 if rate > high else 0.0
    return max(0.0, 1.0 - distance / tolerance)


def combine(components: dict[str, float], weights: dict[str, float]) -> float:
    """Weighted mean of the components that have a positive weight; a weighted component must be present."""
    active = {name: w for name, w in weights.items() if w > 0}
    missing = [name for name in active if name not in components or components[name] is None
               or math.isnan(components[name])]
    if missing:
        raise ValueError(f"reward component(s) {missing} have weight but no value (backend cannot give them?)")
    return sum(w * components[name] for name, w in active.items()) / sum(active.values())


COMBINES = ("weighted_mean", "group_normalized")


def gdpo_components(reward_cfg) -> tuple[list[str], list[float]] | None:
    """For reward.combine=group_normalized: the compute_score keys of the weighted components and their weights
    (verl's algorithm.gdpo_reward_keys / gdpo_reward_weights); None for the weighted mean."""
    combine = reward_cfg.get("combine", "weighted_mean")
    if combine not in COMBINES:
        raise ValueError(f"reward.combine must be one of {', '.join(COMBINES)}, got {combine!r}")
    if combine == "weighted_mean":
        return None
    active = [(f"reward_{name}", float(w)) for name, w in reward_cfg.weights.items() if w > 0]
    return [k for k, _ in active], [w for _, w in active]
