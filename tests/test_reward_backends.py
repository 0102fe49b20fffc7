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
from reward_server.backends import ScoreItem, build_backend, score
from reward_server.scoring import error_rate, reward_from_error_rate


def test_cosyvoice2_backend_speaker_is_fixed_by_id(tiny_cfg):
    backend = build_backend(tiny_cfg("reward.backend=cosyvoice2"))
    assert len(backend.speaker_names) == 4
    a = ScoreItem("utt-1", tuple(range(100, 140)), "今天天气很好")
    b = ScoreItem("utt-2", tuple(range(100, 130)), "今天天气很好")
    assert backend.speaker_for("utt-1") == backend.speaker_for("utt-1")
    assert len({backend.speaker_for(f"utt-{i}") for i in range(40)}) > 1   # ids spread over the speakers
    wav_a, wav_b = backend.synthesize([a, b])
    assert wav_a.shape == (16000 * 40 // 25,) and wav_b.shape == (16000 * 30 // 25,)   # 16 kHz
    # deterministic, and independent of what else is in the batch
    np.testing.assert_allclose(backend.synthesize([a])[0], wav_a, atol=1e-3)
    results = score([a, a, b], backend.transcribe([a, a, b]))
    assert results[0] == results[1] and 0.0 <= results[0]["reward"] <= 1.0


def test_batched_flow_equals_cosyvoices_own_inference(tiny_cfg):
    """Token2Wav.flow_batch runs CosyVoice's flow modules on a padded batch; each utterance must equal
    CosyVoice's own one-utterance `flow.inference`."""
    import torch

    from reward_server.token2wav import Token2Wav, tiny_speakers

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


@pytest.mark.server
def test_cosyvoice2_server_with_bearer_token(tiny_exp, tmp_path):
    overrides = [f"exp_dir={tiny_exp}", *FAST_TINY, "reward.backend=cosyvoice2", "reward.auth_token=s3cret"]
    server = ServerProcess(overrides, log_path=tmp_path / "cv2.log").wait(auth_token="s3cret")
    try:
        body = {"items": [{"id": f"u{i}", "tokens": list(range(200, 240)), "text": "今天天气很好"} for i in range(4)]}
        assert httpx.post(f"{server.url}/score", json=body).status_code == 401
        assert httpx.post(f"{server.url}/score", json=body, headers={"Authorization": "Bearer wrong"}).status_code == 401
        ok = {"Authorization": "Bearer s3cret"}
        r1 = httpx.post(f"{server.url}/score", json=body, headers=ok, timeout=60)
        r2 = httpx.post(f"{server.url}/score", json=body, headers=ok, timeout=60)
        assert r1.status_code == 200 and r1.json() == r2.json()
        for res in r1.json()["results"]:
            assert isinstance(res["transcript"], str) and 0 <= res["reward"] <= 1
        assert httpx.get(f"{server.url}/health", headers=ok).json()["backend"] == "cosyvoice2"
    finally:
        server.stop()


def espeak(text: str, path) -> np.ndarray:
    subprocess.run(["espeak-ng", "-v", "en-us", "-s", "150", "-w", str(path), text], check=True, capture_output=True)
    wav, sr = sf.read(path, dtype="float32")
    from reward_server.token2wav import resample

    return resample(wav, sr, 16000)


@pytest.mark.skipif(not shutil.which("espeak-ng") and not os.environ.get("REQUIRE_ESPEAK"),
                    reason="espeak-ng not installed (CI installs it and sets REQUIRE_ESPEAK=1)")
def test_real_english_audio_scores_the_matching_text_higher(tmp_path):
    """espeak-ng speaks, PocketSphinx (real en-us model) transcribes through the ASR interface.
    No Chinese ASR with real weights installs here, so the real-audio check is English."""
    from reward_server.asr import build_asr

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
    """`serve run reward_server.app:app_builder overrides=...` builds the same application."""
    from ray.serve import Application

    from reward_server.app import app_builder

    app = app_builder({"overrides": f"exp_dir={tiny_exp} reward.backend=synthetic reward.num_replicas=3"})
    assert isinstance(app, Application)
