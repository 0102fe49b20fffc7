"""Prompt speakers: clips from a list, JSONL or Kaldi folder; built once, rebuilt when the clips change,
written atomically, loaded without unpickling code; the cosyvoice2 profile without clips fails at stage -1."""

import json
import subprocess
import sys

import numpy as np
import pytest
import soundfile as sf
import torch

from grpo.speech.speakers import build_speakers, load_speakers, read_clips


def wav(path, seed):
    sf.write(path, np.random.default_rng(seed).standard_normal(1600).astype(np.float32) * 0.1, 16000)
    return path


def featurize_counting(calls):
    def featurize(clips):
        calls.append([c["id"] for c in clips])
        return {c["id"]: {"flow_prompt_speech_token": torch.tensor([[len(c["text"])]]),
                          "prompt_speech_feat": torch.zeros(1, 2, 80), "flow_embedding": torch.ones(1, 192),
                          "prompt_text": c["text"]} for c in clips}
    return featurize


def test_clips_from_a_list_a_jsonl_file_and_a_kaldi_folder(tmp_path):
    wav(tmp_path / "a.wav", 0), wav(tmp_path / "b.wav", 1)
    (tmp_path / "clips.jsonl").write_text(json.dumps({"text": "你好", "wav": "a.wav"}, ensure_ascii=False) + "\n"
                                          + json.dumps({"id": "b", "text": "再见", "wav": "b.wav"}, ensure_ascii=False))
    from_jsonl = read_clips(tmp_path / "clips.jsonl")
    assert [(c["id"], c["text"], c["wav"]) for c in from_jsonl] == [
        ("speaker_0", "你好", str(tmp_path / "a.wav")), ("b", "再见", str(tmp_path / "b.wav"))]
    (tmp_path / "wav.scp").write_text(f"u2 {tmp_path / 'b.wav'}\nu1 a.wav\n")
    (tmp_path / "text").write_text("u1 你好 世界\nu2 再见\n")
    assert [(c["id"], c["text"], c["wav"]) for c in read_clips(tmp_path)] == [
        ("u1", "你好 世界", str(tmp_path / "a.wav")), ("u2", "再见", str(tmp_path / "b.wav"))]
    assert read_clips([{"text": "x", "wav": str(tmp_path / "a.wav")}])[0]["id"] == "speaker_0"
    assert read_clips([]) == []
    with pytest.raises(FileNotFoundError, match="missing.wav not found"):
        read_clips([{"text": "x", "wav": str(tmp_path / "missing.wav")}])
    (tmp_path / "text").write_text("u1 你好\n")
    with pytest.raises(ValueError, match="disagree on utterances"):
        read_clips(tmp_path)


def test_built_once_rebuilt_when_the_clips_change_and_written_atomically(tmp_path):
    clips = read_clips([{"id": "s1", "text": "你好", "wav": str(wav(tmp_path / "a.wav", 0))},
                        {"id": "s2", "text": "再见", "wav": str(wav(tmp_path / "b.wav", 1))}])
    out, calls = tmp_path / "speakers.pt", []
    first = build_speakers(out, clips, featurize_counting(calls))
    assert calls == [["s1", "s2"]] and set(first) == {"s1", "s2"}
    build_speakers(out, clips, featurize_counting(calls))
    assert len(calls) == 1                                            # unchanged clips: loaded, not rebuilt
    wav(tmp_path / "b.wav", 2)                                        # same path, other audio
    build_speakers(out, clips, featurize_counting(calls))
    assert len(calls) == 2
    clips[0]["text"] = "您好"
    rebuilt = build_speakers(out, clips, featurize_counting(calls))
    assert len(calls) == 3 and rebuilt["s1"]["prompt_text"] == "您好"
    assert load_speakers(out)["s1"]["prompt_text"] == "您好"          # weights_only=True load
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.wav", "b.wav", "speakers.pt"]   # no temp files

    def broken(_):
        raise RuntimeError("frontend failed")

    clips[1]["text"] = "拜拜"
    with pytest.raises(RuntimeError):
        build_speakers(out, clips, broken)
    assert load_speakers(out)["s1"]["prompt_text"] == "您好"          # the old file is untouched


def test_a_pickled_object_is_refused(tmp_path):
    import argparse

    torch.save({"s": {"flow_embedding": argparse.Namespace(x=1)}}, tmp_path / "evil.pt")   # any non-tensor class
    with pytest.raises(Exception, match="[Ww]eights only"):
        load_speakers(tmp_path / "evil.pt")


def test_cosyvoice2_profile_without_clips_fails_at_stage_minus_1_before_downloading(tmp_path, repo_root):
    own_data = ["device=cpu", "data.sources.text=null", "data.sources.prompts=null", "data.sources.eval=[]",
                "reward.prompt_speakers.clips=[]"]     # (no hub here; the clips left unset)
    proc = subprocess.run([sys.executable, "-m", "grpo", "models", "profile=cosyvoice2", f"exp_dir={tmp_path}",
                           *own_data], cwd=repo_root, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert "set reward.prompt_speakers.clips" in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "models").exists()                         # nothing downloaded
