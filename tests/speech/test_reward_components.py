"""Composable rewards: the duration band, the weighted combination, the speaker-similarity component of both
backends, all against hand-derived values."""

import random

import numpy as np
import pytest

from conftest import speaker_embedding_by_hand
from grpo.speech.components import RewardSpec, combine, duration_score
from grpo.speech.scoring import reward_from_error_rate, text_to_units
from reward_server.backends import ScoreItem, build_backend, score


@pytest.mark.parametrize("tokens, units, expected", [
    (20, 4, 1.0),      # 5 tokens a unit: inside [3, 10]
    (12, 4, 1.0),      # 3: the band's edge
    (10, 4, 0.6),      # 2.5: 3 / 2.5 - 1 = 0.2 short -> 1 - 0.2 / 0.5
    (48, 4, 0.6),      # 12: 12 / 10 - 1 = 0.2 over
    (8, 4, 0.0),       # 2: 0.5 short, at the tolerance
    (100, 4, 0.0),     # far over: clipped at 0
    (0, 4, 0.0),
])
def test_duration_score_by_hand(tokens, units, expected):
    assert duration_score(tokens, units, (3.0, 10.0), 0.5) == pytest.approx(expected)


def test_combine_is_the_weighted_mean_of_the_weighted_components():
    parts = {"cer": 0.8, "sim": 0.4, "duration": 0.6}
    assert combine(parts, {"cer": 1.0, "sim": 0.5, "duration": 0.5}) == pytest.approx((0.8 + 0.2 + 0.3) / 2)
    assert combine(parts, {"cer": 1.0, "sim": 0.0, "duration": 0.0}) == pytest.approx(0.8)
    # a zero weight means "not part of the reward": the backend need not compute that component at all
    assert combine({"cer": 0.8}, {"cer": 1.0, "sim": 0.0, "duration": 0.0}) == pytest.approx(0.8)
    assert combine({"cer": 0.8, "sim": None}, {"cer": 2.0, "sim": 0.0}) == pytest.approx(0.8)
    with pytest.raises(ValueError, match="sim"):
        combine({"cer": 0.8}, {"cer": 1.0, "sim": 0.5})
    with pytest.raises(ValueError, match="unknown component"):
        RewardSpec(weights={"cer": 1.0, "pitch": 1.0})
    with pytest.raises(ValueError, match="at least one positive"):
        RewardSpec(weights={"cer": 0.0})


def test_synthetic_backend_components_and_weights(tiny_cfg):
    """Every component per item; the reward is their weighted mean; the voice stand-in can be learned: for the
    same reading, the tokens closest to the speaker's voice score a higher similarity than random ones."""
    cfg = tiny_cfg("reward.weights.cer=1.0", "reward.weights.sim=0.5", "reward.weights.duration=0.5")
    backend = build_backend(cfg)
    spec = RewardSpec.from_config(cfg.reward)
    book, voices = backend.codebook, backend.voices
    text = "我们一起去公园散步吧"
    units = text_to_units(text, "zh")
    rng = random.Random(0)
    # speaker of the item by hand: sha1 of the id, first 8 bytes, modulo the speaker count
    import hashlib
    item_id = "group-7"
    speaker = int.from_bytes(hashlib.sha1(item_id.encode()).digest()[:8], "big") % 4
    target = voices.speaker_vectors[speaker]

    def cos(tokens):
        v = voices.token_vectors[tokens].mean(0)
        return float(v @ target / np.linalg.norm(v) / np.linalg.norm(target))

    random_tokens = book.tokens_for_units(units, rng)
    best_tokens = [max(book.tokens_by_unit[book.unit_index[u]], key=lambda t: voices.token_vectors[t] @ target)
                   for u in units]
    items = [ScoreItem(item_id, tuple(random_tokens), text), ScoreItem(item_id, tuple(best_tokens), text),
             ScoreItem(item_id, tuple(best_tokens[:5]), text)]
    results = score(items, backend.transcribe(items), spec=spec)
    for it, res in zip(items, results):
        c = res["error_rate"]
        expected = {"cer": reward_from_error_rate(c), "sim": max(0.0, cos(list(it.tokens))),
                    "duration": duration_score(len(it.tokens), len(units), (1.0, 1.5), 0.5)}
        assert res["components"] == pytest.approx(expected)
        weighted = expected["cer"] + 0.5 * expected["sim"] + 0.5 * expected["duration"]
        assert res["reward"] == pytest.approx(weighted / 2)
    assert results[0]["error_rate"] == results[1]["error_rate"] == 0
    assert results[1]["components"]["sim"] > results[0]["components"]["sim"] + 0.2
    assert results[2]["components"]["duration"] == pytest.approx(0.0)   # 5 tokens for 9 syllables: 0.56 per unit


def test_cosyvoice2_backend_similarity_to_the_prompt_speaker(tiny_cfg):
    """sim = cosine of the verifier's embedding of the generated 16 kHz wav with the prompt speaker's stored
    flow_embedding, recomputed with a second fbank implementation; computed only when its weight is set."""
    import torch

    plain = build_backend(tiny_cfg("reward.backend=cosyvoice2"))
    assert plain.verifier is None
    backend = build_backend(tiny_cfg("reward.backend=cosyvoice2", "reward.weights.sim=1.0"))
    items = [ScoreItem(f"utt-{i}", tuple(range(100 + 7 * i, 140 + 7 * i)), "今天天气很好") for i in range(3)]
    transcripts = backend.transcribe(items)
    by_hand = []
    for it, wav, tr in zip(items, backend.synthesize(items), transcripts):
        emb = torch.as_tensor(backend.speakers[backend.speaker_for(it.id)]["flow_embedding"]).reshape(-1).float()
        x = speaker_embedding_by_hand(wav)
        by_hand.append(float(torch.dot(x, emb) / (x.norm() * emb.norm())))
        assert tr.sim == pytest.approx(by_hand[-1], abs=2e-3)
    weights = tiny_cfg("reward.weights.sim=1.0").reward.weights
    assert {k: v for k, v in weights.items() if v} == {"cer": 1.0, "sim": 1.0}
    results = score(items, transcripts, spec=RewardSpec.from_config(tiny_cfg("reward.weights.sim=1.0").reward))
    for res, sim in zip(results, by_hand):     # negative similarity counts as 0; the reward is the mean of two
        assert res["components"]["sim"] == pytest.approx(max(0.0, sim), abs=2e-3)
        assert res["reward"] == pytest.approx((res["components"]["cer"] + max(0.0, sim)) / 2, abs=1e-3)


def test_verl_steps_take_the_components_of_the_samples_they_trained_on(tmp_path):
    """metrics_from_verl: a step gets the component means of the tag (step - 1 or step) whose mean score is its
    critic/score/mean; a step matching neither gets none."""
    import json

    from grpo.train.metrics_log import metrics_from_verl

    components = tmp_path / "components.jsonl"
    verl_rows = [{"step": s, "data": {"critic/score/mean": m}} for s, m in ((1, 0.25), (2, 0.5), (3, 0.9))]
    samples = [(0, 0.2, 0.1), (0, 0.3, 0.3), (1, 0.5, 0.6), (1, 0.5, 0.8), (2, 0.7, 0.0)]   # (tag, score, cer)
    components.write_text("".join(json.dumps({"step": t, "score": sc, "error_rate": 0.1, "reward_cer": c,
                                              "reward_sim": float("nan"), "reward_duration": 1.0}) + "\n"
                                  for t, sc, c in samples))
    rows = metrics_from_verl(verl_rows, components)
    assert rows[0]["reward_cer_mean"] == pytest.approx(0.2) and rows[1]["reward_cer_mean"] == pytest.approx(0.7)
    assert "reward_sim_mean" not in rows[0] and rows[0]["reward_duration_mean"] == 1.0   # NaN: not computed
    assert "reward_cer_mean" not in rows[2]            # tag 2 scored 0.7, step 3 trained on 0.9: no match
