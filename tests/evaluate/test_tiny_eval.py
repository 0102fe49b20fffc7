"""The tiny profile's evaluation extras: SIM as the synthetic reward computes it, and eval.extra_sets."""

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest

from grpo.evaluate import evaluator as evaluate
from grpo.layout import EvalDir

pytestmark = pytest.mark.vllm


def fixed_tokens(self, model_dir):
    """Stand-in for vLLM's decode: item i, sample j speaks tokens [10 i + j, ..., 10 i + j + 4]."""
    return [[list(range(10 * i + j, 10 * i + j + 5)) for j in range(self.e.num_samples)]
            for i in range(len(self.items))]


def synthetic_sim_by_hand(tokens, item_id, codebook_seed, num_speakers, size=6561):
    """The stand-in speaker verifier recomputed from its definition: seeded normal voice vectors (8 dims) for
    every token, then for every speaker; the speaker is the first 8 bytes of sha1(id), big-endian, mod num_speakers;
    cosine of the tokens' mean."""
    gen = np.random.default_rng(codebook_seed)
    token_vectors, speaker_vectors = gen.standard_normal((size, 8)), gen.standard_normal((num_speakers, 8))
    speaker = int.from_bytes(hashlib.sha1(item_id.encode()).digest()[:8], "big") % num_speakers
    a, b = token_vectors[tokens].mean(0), speaker_vectors[speaker]
    return float(a @ b / np.linalg.norm(a) / np.linalg.norm(b))


def test_synthetic_speaker_model_scores_the_rewards_sim(tiny_cfg, tmp_path, monkeypatch):
    monkeypatch.setattr(evaluate.Evaluator, "generate", fixed_tokens)
    out = tmp_path / "eval"
    cfg = tiny_cfg(f"eval.out_dir={out}", "eval.checkpoints=[base]", "eval.speaker_model=synthetic", "eval.max_items=3",
                   "eval.num_samples=2")
    assert evaluate.run(cfg) == 0
    items = [json.loads(line) for line in Path(cfg.eval.data_path).read_text().splitlines()[:3]]
    seed = json.loads(Path(cfg.reward.codebook.path).read_text())["seed"]
    sims = [synthetic_sim_by_hand(list(range(10 * i + j, 10 * i + j + 5)), it["id"], seed,
                                  cfg.reward.prompt_speakers.num_tiny) for i, it in enumerate(items) for j in range(2)]
    report = json.loads(EvalDir(out).report_json.read_text())["base"]
    assert report["sim_count"] == 3                     # items (each the mean of its 2 samples)
    assert report["sim"] == pytest.approx(np.mean(sims), abs=1e-5)   # (the TSV keeps 6 decimals)
    assert "synthetic reward's stand-in" in EvalDir(out).report_md.read_text()


def test_extra_sets_are_scored_into_their_own_folder(tiny_cfg, tmp_path, monkeypatch):
    monkeypatch.setattr(evaluate.Evaluator, "generate", fixed_tokens)
    out = tmp_path / "eval"
    extra = "[{name: seen, data_path: data/zero_shot_tiny_seen.jsonl, max_items: 2}]"
    cfg = tiny_cfg(f"eval.out_dir={out}", "eval.checkpoints=[base]", "eval.max_items=3", "eval.num_samples=1",
                   f"eval.extra_sets={extra}")
    assert evaluate.run(cfg) == 0
    held_out, seen = (json.loads(EvalDir(d).report_json.read_text())["base"] for d in (out, out / "seen"))
    assert (held_out["items"], seen["items"]) == (3, 2)       # each set with its own keys over eval.*
    seen_ids = [line.split("\t")[0] for line in (EvalDir(out).extra("seen").tsv("base")).read_text().splitlines()[1:]]
    shipped = Path("data/zero_shot_tiny_seen.jsonl").read_text().splitlines()
    assert seen_ids == [json.loads(line)["id"] for line in shipped[:2]]
    with pytest.raises(ValueError, match="eval.extra_sets"):
        evaluate.run(tiny_cfg(f"eval.out_dir={out}", "eval.extra_sets=[{name: x}]"))


def test_shards_cover_every_item_once_by_hand():
    from grpo.evaluate.parallel import shards

    assert shards(7, 3) == [[0, 3, 6], [1, 4], [2, 5]]
    assert shards(2, 4) == [[0], [1]]                      # no empty worker
    assert shards(5, 1) == [[0, 1, 2, 3, 4]]
    for n, k in [(100, 6), (13, 8), (1, 1)]:
        assert sorted(i for part in shards(n, k) for i in part) == list(range(n))


def test_data_parallel_workers_give_the_single_process_figures(tiny_cfg, tmp_path):
    """Stage 4 on two worker processes (vLLM decoding, token2wav, ASR in each) writes the per-item rows a single
    process writes: every item once, in the set's order, with its own seeds."""
    rows = {}
    for workers in (1, 2):
        out = tmp_path / f"eval{workers}"
        cfg = tiny_cfg(f"eval.out_dir={out}", "eval.checkpoints=[base]", "eval.max_items=5", "eval.num_samples=2",
                       f"eval.data_parallel={workers}")
        assert evaluate.run(cfg) == 0
        rows[workers] = EvalDir(out).tsv("base").read_text().splitlines()
        assert json.loads(EvalDir(out).inputs.read_text().splitlines()[4])["id"] == json.loads(
            Path(cfg.eval.data_path).read_text().splitlines()[4])["id"]
    assert len(rows[1]) == 1 + 5 * 2 and rows[2] == rows[1]
