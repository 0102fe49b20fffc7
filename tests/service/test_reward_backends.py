"""The cosyvoice2 backend (CosyVoice token2wav + SenseVoice) on tiny random-weight assets through the
production loading code, the server with a bearer token, and a real-audio check of ASR + scoring."""

import os
import shutil
import subprocess

import httpx
import numpy as np
import pytest
import soundfile as sf

from conftest import FAST_TINY, ServerProcess
from grpo.speech.scoring import error_rate, reward_from_error_rate
from grpo.speech.speakers import stable_hash
from grpo.speech.token2wav import resample
from reward_server.backends import ScoreItem, build_backend


def test_cosyvoice2_backend_speaker_is_fixed_by_id(tiny_cfg):
    """Same id -> same prompt speaker -> the same audio; ids spread over the speakers, and the speaker
    really conditions the audio (same tokens, another speaker -> other audio)."""
    backend = build_backend(tiny_cfg("reward.backend=cosyvoice2"))
    assert len(backend.speaker_names) == 4
    ids = [f"utt-{i}" for i in range(40)]
    by_speaker = {}
    for i in ids:
        by_speaker.setdefault(backend.speaker_for(i), []).append(i)
    assert len(by_speaker) > 1                                     # ids spread over the speakers
    first = backend.speaker_names[0]
    id1 = next(i for i in ids if backend.speaker_for(i) != first)      # a speaker other than the first
    tokens = tuple(range(100, 140))
    a, short = ScoreItem(id1, tokens, "今天天气很好"), ScoreItem(id1, tuple(range(100, 130)), "今天天气很好")
    wav_a, wav_short = backend.synthesize([a, short])
    assert wav_a.shape == (16000 * 40 // 25,) and wav_short.shape == (16000 * 30 // 25,)   # 16 kHz, 25 tokens/s
    # deterministic, and independent of what else is in the batch
    np.testing.assert_allclose(backend.synthesize([a])[0], wav_a, atol=1e-3)
    # the audio is the id's own speaker and seed rendered by token2wav; with another speaker (same seed) it differs
    seed = stable_hash(id1) % 2**31

    def render(speaker):
        wav = backend.token2wav.batch([list(tokens)], [backend.speakers[speaker]], [seed])[0]
        return resample(wav, backend.token2wav.sample_rate, 16000)

    own, other = np.abs(render(backend.speaker_for(id1)) - wav_a).max(), np.abs(render(first) - wav_a).max()
    assert own < 1e-3
    assert other > 10 * own, "the prompt speaker does not change the audio"


def test_a_backend_of_the_other_family_stops_before_loading_a_model(tiny_cfg):
    """reward.backend names the family of model.cosyvoice_dir (here cosyvoice3 against the tiny CosyVoice2 dir)."""
    cfg = tiny_cfg("reward.backend=cosyvoice3", "reward.prompt_speakers.features=/nonexistent/speakers.pt")
    with pytest.raises(ValueError, match="reward.backend=cosyvoice3, but .* holds a cosyvoice2 model"):
        build_backend(cfg)


def test_batched_flow_equals_cosyvoices_own_inference(tiny_cfg):
    """Token2Wav.flow_batch runs CosyVoice's flow modules on a padded batch; each utterance must equal
    CosyVoice's own one-utterance `flow.inference`."""
    import torch

    from grpo.speech.token2wav import Token2Wav
    from grpo.standins.tiny_speakers import tiny_speakers

    t2w = Token2Wav(tiny_cfg().model.cosyvoice_dir)
    speakers = list(tiny_speakers(3, 1).values())
    g = torch.Generator().manual_seed(0)
    tokens = [torch.randint(0, 6561, (n,), generator=g).tolist() for n in (40, 17, 63)]
    batched = t2w.flow_batch(tokens, speakers)
    for tok, spk, mel in zip(tokens, speakers, batched):
        p_tok, p_feat = spk["flow_prompt_speech_token"], spk["prompt_speech_feat"]
        with torch.inference_mode():
            ref, _ = t2w.flow.inference(
                token=torch.tensor([tok], dtype=torch.int32), token_len=torch.tensor([len(tok)], dtype=torch.int32),
                prompt_token=p_tok, prompt_token_len=torch.tensor([p_tok.shape[1]], dtype=torch.int32),
                prompt_feat=p_feat, prompt_feat_len=torch.tensor([p_feat.shape[1]], dtype=torch.int32),
                embedding=spk["flow_embedding"], streaming=False, finalize=True)
        assert mel.shape == ref[0].shape
        torch.testing.assert_close(mel, ref[0], rtol=1e-4, atol=1e-4)


def test_batched_token2wav_equals_upstreams_per_utterance_token2wav(tiny_cfg):
    """Token2Wav.batch (flow in one padded pass, HiFT per utterance, seeded) against upstream's own
    `CosyVoice2Model.token2wav` (cosyvoice/cli/model.py, non-streaming, finalize) on the same modules and seeds."""
    import torch
    from cosyvoice.cli.model import CosyVoice2Model

    from grpo.speech.token2wav import Token2Wav
    from grpo.standins.tiny_speakers import tiny_speakers

    t2w = Token2Wav(tiny_cfg().model.cosyvoice_dir)
    reference = CosyVoice2Model(None, t2w.flow, t2w.hift, fp16=False)
    speakers = list(tiny_speakers(2, 3).values())
    g = torch.Generator().manual_seed(2)
    tokens = [torch.randint(0, 6561, (n,), generator=g).tolist() for n in (33, 8, 51)]
    spk = [speakers[i % 2] for i in range(3)]
    ours = t2w.batch(tokens, spk, seeds=[11, 12, 13])
    for i, (tok, s) in enumerate(zip(tokens, spk)):
        reference.hift_cache_dict[f"u{i}"] = None
        torch.manual_seed(11 + i)
        with torch.inference_mode():
            wav = reference.token2wav(torch.tensor([tok]), s["flow_prompt_speech_token"], s["prompt_speech_feat"],
                                      s["flow_embedding"], token_offset=0, uuid=f"u{i}", stream=False, finalize=True)
        assert ours[i].shape == (wav.shape[1],)
        np.testing.assert_allclose(ours[i], wav[0].numpy(), rtol=0, atol=1e-4)


def test_length_buckets_by_hand():
    from grpo.speech.token2wav import length_buckets

    # the frame cap alone (padding unbounded). sorted: 10 (i3), 20 (i1), 30 (i0), 100 (i2), 400 (i4); cap 60:
    # [10, 20] pads to 2 x 20, adding 30 would pad to 3 x 30 = 90; [30] alone (30 + 100 -> 200); [100]; 400 is over
    # the cap and goes alone
    inf = float("inf")
    assert length_buckets([30, 20, 100, 10, 400], 60, max_padding=inf) == [[3, 1], [0], [2], [4]]
    assert length_buckets([5] * 7, 15, max_padding=inf) == [[0, 1, 2], [3, 4, 5], [6]]
    # the padding bound alone (cap unbounded), 10%: 100, 105 -> 210 padded for 205 held (<= 225.5); + 110 -> 330 for
    # 315 (<= 346.5); + 150 -> 600 for 465 (> 511.5): a new batch; 150, 160 -> 320 for 310 (<= 341)
    assert length_buckets([150, 100, 160, 105, 110], 10**9, max_padding=0.1) == [[1, 3, 4], [0, 2]]
    # with 50% padding allowed, 150 joins the first (600 <= 697.5) and so does 160 (800 <= 937.5)
    assert length_buckets([150, 100, 160, 105, 110], 10**9, max_padding=0.5) == [[1, 3, 4, 0, 2]]
    # both bounds: equal lengths never pad, so only the cap cuts
    assert length_buckets([5] * 7, 15, max_padding=0.0) == [[0, 1, 2], [3, 4, 5], [6]]


def test_bucketed_and_autocast_flow_match_one_batch(tiny_cfg, monkeypatch):
    """Token2Wav.mels: length buckets under a frame cap give the same mels, in input order, as one padded
    batch; every flow pass respects the cap; bf16 autocast (CPU here, the GPU default) stays close."""
    import torch

    from grpo.speech.token2wav import Token2Wav
    from grpo.standins.tiny_speakers import tiny_speakers

    model_dir = tiny_cfg().model.cosyvoice_dir
    speakers = list(tiny_speakers(3, 2, prompt_tokens=10).values())
    g = torch.Generator().manual_seed(1)
    tokens = [torch.randint(0, 6561, (n,), generator=g).tolist() for n in (60, 12, 35, 14, 70, 20)]
    spk = [speakers[i % 3] for i in range(len(tokens))]
    reference = Token2Wav(model_dir, max_frames_per_batch=10**9).flow_batch(tokens, spk)
    t2w = Token2Wav(model_dir, max_frames_per_batch=200)
    passes = []
    original = t2w.flow_batch
    monkeypatch.setattr(t2w, "flow_batch", lambda t, s: passes.append([2 * (len(x) + 10) for x in t]) or original(t, s))
    for mel, ref in zip(t2w.mels(tokens, spk), reference):
        torch.testing.assert_close(mel, ref, rtol=1e-4, atol=1e-4)
    assert len(passes) > 2 and all(len(p) * max(p) <= 200 or len(p) == 1 for p in passes)
    assert sorted(len(p) for p in passes) != [1] * len(passes)          # some passes batch several items
    bf16 = Token2Wav(model_dir, dtype="bfloat16")
    assert bf16.dtype == torch.bfloat16
    for mel, ref in zip(bf16.mels(tokens, spk), reference):
        assert mel.dtype == torch.float32 and mel.shape == ref.shape
        assert 0 < (mel - ref).abs().mean() < 0.05 * ref.abs().mean()      # bf16 really ran; ~1% off here


@pytest.mark.server
def test_cosyvoice2_server_with_bearer_token(tiny_exp, tmp_path):
    import asyncio
    import math

    from reward_server.client import ClientConfig, RewardClient, RewardRequestError

    overrides = [f"exp_dir={tiny_exp}", *FAST_TINY, "reward.backend=cosyvoice2", "reward.auth_token=s3cret"]
    server = ServerProcess(overrides, log_path=tmp_path / "cv2.log").wait(auth_token="s3cret")
    items = [{"id": f"u{i}", "tokens": list(range(200, 240 + 5 * i)), "text": "今天天气很好", "language": "zh"}
             for i in range(4)]

    async def with_client(token):
        client = RewardClient(ClientConfig(server.url, retries=0, auth_token=token))
        try:
            return await asyncio.gather(*(client.score_one(it) for it in items))
        finally:
            await client.aclose()

    try:
        body = {"items": items}
        assert httpx.post(f"{server.url}/score", json=body).status_code == 401
        wrong = {"Authorization": "Bearer wrong"}
        assert httpx.post(f"{server.url}/score", json=body, headers=wrong).status_code == 401
        ok = {"Authorization": "Bearer s3cret"}
        r1 = httpx.post(f"{server.url}/score", json=body, headers=ok, timeout=60)
        assert r1.status_code == 200
        for res in r1.json()["results"]:
            c = error_rate("今天天气很好", res["transcript"], "zh")
            assert res["error_rate"] == pytest.approx(c)
            assert res["reward"] == pytest.approx(min(1.0, max(0.0, 1 - math.tanh(3 * c))))   # the default mapping
        # the training client sends the token (reward.auth_token); random-weight ASR may flip a piece between
        # two passes, so the second answer is checked for its ids and its own consistency
        answers = asyncio.run(with_client("s3cret"))
        assert [a["id"] for a in answers] == [it["id"] for it in items]
        for a in answers:
            assert a["reward"] == pytest.approx(min(1.0, max(0.0, 1 - math.tanh(3 * a["error_rate"]))))
        with pytest.raises(RewardRequestError) as err:
            asyncio.run(with_client(None))
        assert err.value.status == 401
        assert httpx.get(f"{server.url}/health", headers=ok).json()["backend"] == "cosyvoice2"
        # the metrics are behind the token too
        assert httpx.get(f"{server.url}/metrics").status_code == 401
        assert httpx.get(f"{server.url}/metrics", headers={"Authorization": "Bearer s3cre"}).status_code == 401
        assert "reward_items_total" in httpx.get(f"{server.url}/metrics", headers=ok).text
    finally:
        server.stop()


def espeak(text: str, path) -> np.ndarray:
    subprocess.run(["espeak-ng", "-v", "en-us", "-s", "150", "-w", str(path), text], check=True, capture_output=True)
    wav, sr = sf.read(path, dtype="float32")
    return resample(wav, sr, 16000)


@pytest.mark.skipif(not shutil.which("espeak-ng") and not os.environ.get("REQUIRE_ESPEAK"),
                    reason="espeak-ng not installed (CI installs it and sets REQUIRE_ESPEAK=1)")
def test_real_english_audio_scores_the_matching_text_higher(tmp_path):
    """espeak-ng speaks, PocketSphinx (real en-us model) transcribes through the ASR interface.
    No Chinese ASR with real weights installs here, so the real-audio check is English."""
    from grpo.speech.asr import build_asr

    asr = build_asr("pocketsphinx")
    sentences = ["the weather is nice today", "please close the window", "my phone battery is empty",
                 "i want to go home now", "one two three four five", "good morning everyone",
                 "the children are playing football in the park", "thank you very much"]
    transcripts = asr.transcribe([espeak(s, tmp_path / f"{i}.wav") for i, s in enumerate(sentences)])
    # errors[i][j]: transcript of sentence i scored against sentence j
    errors = np.array([[error_rate(ref, hyp, "en") for ref in sentences] for hyp in transcripts])
    rewards = np.vectorize(reward_from_error_rate)(errors)
    off = ~np.eye(len(sentences), dtype=bool)
    # PocketSphinx on synthetic speech is a weak ASR, so the check is statistical
    assert errors.diagonal().mean() < errors[off].mean() - 0.25
    assert rewards.diagonal().mean() > 2 * rewards[off].mean()
    assert (errors.argmin(axis=1) == np.arange(len(sentences))).mean() >= 0.6


def test_app_builder_for_serve_run_on_an_existing_cluster(tiny_exp):
    """`serve run reward_server.app:app_builder overrides=...` builds the same application, with the
    overrides applied to the deployment (replicas, batching)."""
    from ray.serve import Application

    from reward_server.app import app_builder

    app = app_builder({"overrides": f"exp_dir={tiny_exp} reward.backend=synthetic reward.num_replicas=3 "
                                    "reward.max_batch_size=17"})
    assert isinstance(app, Application)
    deployment = app._bound_deployment
    assert deployment.num_replicas == 3
    assert deployment.init_args[0]["reward"]["max_batch_size"] == 17
