"""Stage -1's model downloads (profile cosyvoice2): local copies in the released layout accepted and checked file by
file, and every failure -- offline, a copy missing a file, a download that breaks -- one line naming the keys, the id
and the local-copy route. The local copies are the tiny profile's builds (the released layouts at tiny sizes); the
expected file names are the released ones (upstream's cosyvoice2.yaml ... CAM++, funasr's own lookup of
tokens.json / seg_dict / bpe.model / am.mvn)."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest

from grpo.config import REPO_ROOT, load_config
from grpo.model import download
from grpo.model.download import ModelError


def gpu_profile(tiny_exp, cosyvoice_dir, *extra):
    return load_config(["profile=cosyvoice2", f"exp_dir={tiny_exp}", "device=cpu", *extra,
                        *([] if any(e.startswith("model.cosyvoice_dir=") for e in extra)
                          else [f"model.cosyvoice_dir={cosyvoice_dir}"])])


@pytest.fixture(scope="module")
def released_cosyvoice(tiny_exp, tmp_path_factory):
    """The tiny CosyVoice2 directory with the one released file the tiny profile never needs (the speech
    tokenizer's ONNX), written by the realsize profile's own builder."""
    from grpo.standins.released_layout import build_speech_tokenizer

    copy = tmp_path_factory.mktemp("released") / "CosyVoice2-0.5B"
    shutil.copytree(tiny_exp / "models" / "CosyVoice2-0.5B", copy)
    build_speech_tokenizer(copy / "speech_tokenizer_v2.onnx", 0)
    return copy


def test_complete_local_copies_are_used_without_asking_a_hub(tiny_exp, released_cosyvoice, monkeypatch):
    monkeypatch.setattr(download, "unreachable", lambda hub: pytest.fail(f"asked {hub} for complete copies"))
    monkeypatch.setattr(download, "_fetch", lambda *a: pytest.fail("downloaded a complete copy"))
    download.download(gpu_profile(tiny_exp, released_cosyvoice))


@pytest.mark.parametrize("name, removed, id_key", [
    ("sensevoice", "bpe.model", "model.modelscope.sensevoice=iic/SenseVoiceSmall"),
    ("cosyvoice", "campplus.onnx", "model.modelscope.cosyvoice=iic/CosyVoice2-0.5B"),
    ("whisper", "model.safetensors", "model.huggingface.whisper=openai/whisper-large-v3"),
])
def test_a_copy_missing_a_file_offline_is_one_line(tiny_exp, released_cosyvoice, tmp_path, monkeypatch, name,
                                                  removed, id_key):
    copy = tmp_path / name
    shutil.copytree(released_cosyvoice if name == "cosyvoice" else
                    tiny_exp / "models" / {"sensevoice": "SenseVoiceSmall", "whisper": "whisper-large-v3"}[name], copy)
    (copy / removed).unlink()
    asked = []
    monkeypatch.setattr(download, "unreachable", lambda hub: asked.append(hub) or "https://hub unreachable (x)")
    with pytest.raises(ModelError) as err:
        download.download(gpu_profile(tiny_exp, released_cosyvoice, f"model.{name}_dir={copy}"))
    message = str(err.value)
    assert message.startswith(f"{id_key}: model.{name}_dir={copy} lacks {removed} and https://hub unreachable")
    assert "released layout" in message and "\n" not in message and len(asked) == 1


def test_a_broken_download_is_one_line_and_an_incomplete_one_is_caught(tiny_exp, released_cosyvoice, tmp_path,
                                                                      monkeypatch):
    monkeypatch.setattr(download, "unreachable", lambda hub: None)

    def broken(hub, repo, target):
        raise ConnectionError("Max retries exceeded\n  a second line of the hub's error")

    monkeypatch.setattr(download, "_fetch", broken)
    cfg = gpu_profile(tiny_exp, released_cosyvoice, f"model.paraformer_dir={tmp_path / 'none'}")
    with pytest.raises(ModelError, match=r"^model.modelscope.paraformer=paraformer-zh: download failed "
                                         r"\(ConnectionError: Max retries exceeded\); put a copy of "
                                         r"iic/speech_seaco_paraformer\S+ in the released layout") as err:
        download.download(cfg)
    assert "\n" not in str(err.value)

    def partial(hub, repo, target):           # a download that "succeeds" without seg_dict
        shutil.copytree(tiny_exp / "models" / "paraformer-zh", target, ignore=shutil.ignore_patterns("seg_dict"))

    monkeypatch.setattr(download, "_fetch", partial)
    with pytest.raises(ModelError, match=r"model.paraformer_dir=\S+none, which still lacks seg_dict$"):
        download.download(cfg)


def test_stage_minus_1_offline_stops_in_one_line(tiny_exp, released_cosyvoice, tmp_path):
    """`bash run.sh -1 -1 profile=cosyvoice2` on a machine with no hub: exit status 1, one line, no traceback."""
    env = {"PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1", "MODELSCOPE_DOMAIN": "http://127.0.0.1:9"}
    args = [sys.executable, "-m", "grpo", "models", "profile=cosyvoice2", f"exp_dir={tiny_exp}", "device=cpu",
            "data.sources.text=null", "data.sources.prompts=null", "data.sources.eval=[]", "reward.backend=synthetic",
            f"model.cosyvoice_dir={released_cosyvoice}", f"model.sensevoice_dir={tmp_path / 'sv'}"]
    done = subprocess.run(args, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr[-2000:]
    errors = [line for line in done.stderr.splitlines() if " ERROR " in line]
    assert len(errors) == 1 and "model.modelscope.sensevoice=iic/SenseVoiceSmall: model.sensevoice_dir=" in errors[0]
    assert "http://127.0.0.1:9 unreachable" in errors[0]
    assert not (tmp_path / "sv").exists()
