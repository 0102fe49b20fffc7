"""The tiny profile's evaluation extras: SIM as the synthetic reward computes it, and eval.extra_sets."""

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest

from grpo.evaluate import evaluator as evaluate
from grpo.evaluate import stage as eval_stage
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
    assert eval_stage.run(cfg) == 0
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
    closed, close = [], evaluate.Evaluator.close
    monkeypatch.setattr(evaluate.Evaluator, "close", lambda self: (closed.append(self.engine), close(self)))
    out = tmp_path / "eval"
    extra = "[{name: seen, data_path: data/zero_shot_tiny_seen.jsonl, max_items: 2}]"
    cfg = tiny_cfg(f"eval.out_dir={out}", "eval.checkpoints=[base]", "eval.max_items=3", "eval.num_samples=1",
                   f"eval.extra_sets={extra}")
    assert eval_stage.run(cfg) == 0
    held_out, seen = (json.loads(EvalDir(d).report_json.read_text())["base"] for d in (out, out / "seen"))
    assert (held_out["items"], seen["items"]) == (3, 2)       # each set with its own keys over eval.*
    seen_ids = [line.split("\t")[0] for line in (EvalDir(out).extra("seen").tsv("base")).read_text().splitlines()[1:]]
    shipped = Path("data/zero_shot_tiny_seen.jsonl").read_text().splitlines()
    assert seen_ids == [json.loads(line)["id"] for line in shipped[:2]]
    assert len(closed) == 2 and all(e.llm is None for e in closed)   # each set's vLLM engine shut down after it
    with pytest.raises(ValueError, match="eval.extra_sets"):
        eval_stage.run(tiny_cfg(f"eval.out_dir={out}", "eval.extra_sets=[{name: x}]"))


def test_shards_cover_every_item_once_by_hand():
    from grpo.evaluate.parallel import shards

    assert shards(7, 3) == [[0, 3, 6], [1, 4], [2, 5]]
    assert shards(2, 4) == [[0], [1]]                      # no empty worker
    assert shards(5, 1) == [[0, 1, 2, 3, 4]]
    for n, k in [(100, 6), (13, 8), (1, 1)]:
        assert sorted(i for part in shards(n, k) for i in part) == list(range(n))


def evaluate_base(tiny_cfg, out, *overrides, items=4, samples=2):
    """Stage 4 on the base model alone, eval.max_items items x eval.num_samples samples, into `out`."""
    cfg = tiny_cfg(f"eval.out_dir={out}", "eval.checkpoints=[base]", f"eval.max_items={items}",
                   f"eval.num_samples={samples}", *overrides)
    assert eval_stage.run(cfg) == 0
    return cfg


def test_data_parallel_workers_give_the_single_process_figures(tiny_cfg, tmp_path):
    """Stage 4 on two worker processes (vLLM decoding, token2wav, ASR in each) writes the per-item rows a single
    process writes: every item once, in the set's order, with its own seeds."""
    rows = {}
    for workers in (1, 2):
        out = tmp_path / f"eval{workers}"
        cfg = evaluate_base(tiny_cfg, out, f"eval.data_parallel={workers}", items=5)
        rows[workers] = EvalDir(out).tsv("base").read_text().splitlines()
        assert json.loads(EvalDir(out).inputs.read_text().splitlines()[4])["id"] == json.loads(
            Path(cfg.eval.data_path).read_text().splitlines()[4])["id"]
    assert len(rows[1]) == 1 + 5 * 2 and rows[2] == rows[1]


def varied_tokens(self, model_dir):
    """Item i, sample j speaks 5 + 3 i tokens from 10 i + j: lengths differ, so the batched flow pads."""
    return [[list(range(10 * i + j, 10 * i + j + 5 + 3 * i)) for j in range(self.e.num_samples)]
            for i in range(len(self.items))]


def test_batched_token2wav_writes_the_audio_of_upstreams_per_utterance_path(tiny_cfg, tmp_path, monkeypatch):
    """eval.token2wav_batch_frames renders stage 4's audio in batched flow passes: every wav equals the one upstream's
    flow.inference renders one utterance at a time, up to float rounding (16-bit files: 1e-3); a batch that fails is
    rendered again one by one, and only the utterance that fails alone counts as failed."""
    import soundfile as sf

    from grpo.speech.token2wav import Token2Wav

    monkeypatch.setattr(evaluate.Evaluator, "generate", varied_tokens)
    batch_calls = []
    real_batch = Token2Wav.batch

    def counted_batch(self, tokens, speakers, seeds):
        batch_calls.append(len(tokens))
        return real_batch(self, tokens, speakers, seeds)

    monkeypatch.setattr(Token2Wav, "batch", counted_batch)
    wavs = {}
    for frames in (0, 20000):
        out = tmp_path / f"eval{frames}"
        evaluate_base(tiny_cfg, out, f"eval.token2wav_batch_frames={frames}")
        wavs[frames] = {p.name: sf.read(p, dtype="float32")[0] for p in EvalDir(out).wavs("base").glob("*.wav")}
    assert batch_calls == [8]                  # 0: never batched; 20000: the 8 utterances in one call
    assert sorted(wavs[0]) == sorted(wavs[20000]) and len(wavs[0]) == 8
    for name, wav in wavs[0].items():
        assert wav.shape == wavs[20000][name].shape, name
        np.testing.assert_allclose(wavs[20000][name], wav, rtol=0, atol=1e-3, err_msg=name)

    def failing_batch(self, tokens, speakers, seeds):
        raise RuntimeError("out of memory")

    real_call = Token2Wav.__call__
    first_item = {}

    def one_fails(self, tokens, speaker, seed=0):
        if first_item.setdefault("tokens", tokens) == tokens:
            raise RuntimeError("this utterance fails alone")
        return real_call(self, tokens, speaker, seed)

    monkeypatch.setattr(Token2Wav, "batch", failing_batch)
    monkeypatch.setattr(Token2Wav, "__call__", one_fails)
    out = tmp_path / "eval_fail"
    evaluate_base(tiny_cfg, out, "eval.token2wav_batch_frames=20000")
    assert len(list(EvalDir(out).wavs("base").glob("*.wav"))) == 7
    with pytest.raises(ValueError, match="eval.token2wav_batch_frames"):
        evaluate_base(tiny_cfg, out, "eval.token2wav_batch_frames=-1", items=1)
