"""Uncertainty of the evaluation figures: bootstrap intervals over utterances and a paired bootstrap test.

The unit of resampling is the utterance (an item's k samples stay together: its value is their mean), because
the items are what a test set samples from the world; the samples only reduce each item's decoding noise.
- `bootstrap_ci`: percentile interval of the mean of per-utterance values (resampled with replacement).
- `paired_bootstrap`: for two checkpoints scored on the same items (and the same seeds), the mean of the
  per-item differences, its percentile interval, and a two-sided p-value for "no difference": twice the
  smaller share of resampled mean differences on either side of 0 (capped at 1).
"""

from __future__ import annotations

import numpy as np


def _resampled_means(values: np.ndarray, resamples: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, len(values), size=(resamples, len(values)))
    return values[idx].mean(axis=1)


def bootstrap_ci(values, resamples: int = 2000, seed: int = 0, level: float = 0.95) -> list[float]:
    """[low, high] percentile interval of the mean of `values` (NaN-free, one per utterance)."""
    values = np.asarray(values, dtype=np.float64)
    if len(values) == 0:
        return [float("nan"), float("nan")]
    means = _resampled_means(values, resamples, seed)
    alpha = (1 - level) / 2
    return [float(np.quantile(means, alpha)), float(np.quantile(means, 1 - alpha))]


def paired_bootstrap(base, other, resamples: int = 2000, seed: int = 0, level: float = 0.95) -> dict:
    """Mean of other - base over paired utterances, its interval, and the two-sided bootstrap p-value."""
    base, other = np.asarray(base, dtype=np.float64), np.asarray(other, dtype=np.float64)
    if base.shape != other.shape:
        raise ValueError(f"paired bootstrap needs the same items: {base.shape} vs {other.shape}")
    if len(base) == 0:
        return {"delta": float("nan"), "ci": [float("nan"), float("nan")], "p_value": float("nan")}
    diff = other - base
    means = _resampled_means(diff, resamples, seed)
    alpha = (1 - level) / 2
    p = min(1.0, 2 * min(float(np.mean(means <= 0)), float(np.mean(means >= 0))))
    return {"delta": float(diff.mean()), "ci": [float(np.quantile(means, alpha)), float(np.quantile(means, 1 - alpha))],
            "p_value": p}


def per_item_means(rows: list[dict], key: str) -> dict[str, float]:
    """Each item's mean of `key` over its scored samples (rows: id, key -> float or None)."""
    sums: dict[str, list[float]] = {}
    for r in rows:
        if r.get(key) is not None:
            sums.setdefault(r["id"], []).append(float(r[key]))
    return {i: float(np.mean(v)) for i, v in sums.items()}
