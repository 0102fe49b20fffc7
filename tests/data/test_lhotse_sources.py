"""Prompt speakers from `yuekai/aishell` stored as its public signs describe it (a loading script, Lhotse cuts, the
audio in archives), the spec's key checks, offline detection and a failed fetch that leaves nothing behind.

The Lhotse layout is written with Lhotse's own writers (hub_sets.py); the parquet layout of the same clips is the
independent reference: both must give the same 20 clips, sample for sample."""

from __future__ import annotations

import io
import json
import subprocess
import sys
import time

import huggingface_hub.constants
import numpy as np
import pytest
import soundfile as sf
from hub_sets import aishell_lhotse_repo, aishell_repo, in_hub_cache, tone, voxbox_in_hub_cache, wav_bytes

from grpo.config import REPO_ROOT, load_config
from grpo.data import readers
from grpo.data.sources import SourceError, fetch

SPEAKERS = 20


def clip_set() -> list[tuple[bytes, str]]:
    """22 clips, AISHELL-style transcripts (words separated by spaces); one silent and one too short."""
    clips = [(wav_bytes(tone(1.2 + k / 40, 16000, freq=180 + 15 * k), 16000), f"第 {k} 个 提示 语音")
             for k in range(SPEAKERS + 2)]
    clips[3] = (wav_bytes(tone(1.5, 16000, amplitude=1e-5), 16000), "静 音")
    clips[8] = (wav_bytes(tone(0.4, 16000), 16000), "太 短")
    return clips


@pytest.fixture(scope="module")
def layouts(tmp_path_factory):
    root = tmp_path_factory.mktemp("aishell")
    clips = clip_set()
    return {"clips": clips, "parquet": aishell_repo(root / "parquet", clips),
            "lhotse": aishell_lhotse_repo(root / "lhotse", clips),
            "no_audio": aishell_lhotse_repo(root / "no_audio", clips[:SPEAKERS], archive=False)}


def config(tmp_path, prompts: str, **extra):
    return load_config(["profile=cosyvoice2", f"exp_dir={tmp_path / 'exp'}", "data.sources.text=null",
                        "data.sources.eval=[]", f"data.sources.prompts={prompts}",
                        *[f"{k}={v}" for k, v in extra.items()]])


def fetched_clips(tmp_path) -> list[tuple[dict, np.ndarray]]:
    out = tmp_path / "exp" / "data" / "sources" / "prompts"
    rows = [json.loads(x) for x in (out / "clips.jsonl").read_text().splitlines()]
    return [(r, sf.read(out / r["wav"], dtype="float32")[0]) for r in rows]


def expected_rows(clips) -> list[int]:
    """The recipe's seeded draw by hand: rows in numpy's permutation of the split, skipping the unfit two."""
    order = np.random.default_rng(0).permutation(len(clips))
    return [int(i) for i in order if i not in (3, 8)][:SPEAKERS]


def test_a_lhotse_folder_gives_the_clips_of_the_parquet_layout(tmp_path, layouts, monkeypatch):
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    fetch(config(tmp_path / "a", f"{{path: {layouts['lhotse']}, config: test, split: test}}"))
    fetch(config(tmp_path / "b", f"{{path: {layouts['parquet']}, config: test, split: test}}"))
    lhotse, parquet = fetched_clips(tmp_path / "a"), fetched_clips(tmp_path / "b")
    assert [r["row"] for r, _ in lhotse] == expected_rows(layouts["clips"]) == [r["row"] for r, _ in parquet]
    for (a, wav_a), (b, wav_b) in zip(lhotse, parquet, strict=True):
        data, text = layouts["clips"][a["row"]]
        assert a["text"] == b["text"] == text.replace(" ", "")
        want, sr = sf.read(io.BytesIO(data), dtype="float32")
        assert np.array_equal(wav_a, want) and np.array_equal(wav_b, want)


def test_stage_0_reads_the_default_yuekai_aishell_from_the_hub_cache(tmp_path, layouts):
    """`bash run.sh 0 0 profile=cosyvoice2` offline with yuekai/aishell's snapshot in the hub cache: the profile's
    own prompts spec (hub, config test, split test) gives 20 clips."""
    cache = tmp_path / "hf_cache"
    in_hub_cache(cache, "yuekai/aishell", layouts["lhotse"])
    voxbox_in_hub_cache(cache, [f"第{i}句训练文本" for i in range(6)])
    env = {"HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"}
    args = [sys.executable, "-m", "grpo", "data", "profile=cosyvoice2", f"exp_dir={tmp_path / 'exp'}",
            "data.sources.text={hub: SparkAudio/voxbox, file: metadata/aishell-3.jsonl, train_lines: 6, val_lines: 0}",
            "data.sources.eval=[]", "data.val_file=null", "data.text_frontend=false", "train.batch_size=2",
            "eval.extra_sets=[]", f"eval.data_path={tmp_path / 'none.lst'}", "data.eval_overlap=keep"]
    done = subprocess.run(args, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert [r["row"] for r, _ in fetched_clips(tmp_path)] == expected_rows(layouts["clips"])
    typo = subprocess.run([*args, "data.sources.prompts.audio_colum=audio"], cwd=REPO_ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert typo.returncode == 2 and typo.stderr.strip().splitlines() == [
        "[grpo] Could not override 'data.sources.prompts.audio_colum'. To append to your config use "
        "+data.sources.prompts.audio_colum=audio"]


def test_the_hub_route_when_datasets_refuses_the_loading_script(tmp_path, layouts, monkeypatch):
    """Online: `datasets.load_dataset` refuses the script (its datasets 5.x message), the repository is read as
    files instead."""
    import datasets

    def refuse(path, *a, **k):
        if path == "yuekai/aishell":
            raise RuntimeError("Dataset scripts are no longer supported, but found aishell.py")
        return load(path, *a, **k)

    load = datasets.load_dataset
    monkeypatch.setattr(datasets, "load_dataset", refuse)
    monkeypatch.setattr(readers.Hub, "offline", None)
    asked = []
    monkeypatch.setattr(readers, "hub_files", lambda spec, key, hub: asked.append(spec["hub"]) or layouts["lhotse"])
    fetch(config(tmp_path, "{hub: yuekai/aishell, config: test, split: test}"))
    assert asked == ["yuekai/aishell"]
    assert [r["row"] for r, _ in fetched_clips(tmp_path)] == expected_rows(layouts["clips"])


def nothing_left(tmp_path) -> bool:
    return not (tmp_path / "exp").exists() or list((tmp_path / "exp").rglob("*")) == []


@pytest.mark.parametrize("prompts, extra, message", [
    ("{path: <no_audio>, config: test, split: test}", {}, "data.sources.prompts row "),
    ("{path: <lhotse>, config: test, split: test}", {"+data.sources.prompts.audio_column": "audio"},
     "data.sources.prompts.audio_column: unknown key (a prompts source takes hub, path"),
    ("{path: <lhotse>, config: test, split: dev}", {}, "data.sources.prompts.path="),
])
def test_a_bad_lhotse_source_stops_in_one_line_and_leaves_nothing(tmp_path, layouts, prompts, extra, message):
    prompts = prompts.replace("<no_audio>", str(layouts["no_audio"])).replace("<lhotse>", str(layouts["lhotse"]))
    with pytest.raises(SourceError) as err:
        fetch(config(tmp_path, prompts, **extra))
    assert message in str(err.value) and "\n" not in str(err.value)
    assert nothing_left(tmp_path)


def test_unknown_and_missing_evaluation_keys_name_the_key_that_sets_them(tmp_path, layouts):
    with pytest.raises(SourceError, match=r"^data.sources.eval\[0\].audio: unknown key \(an? eval source takes "
                                          r".*prompt_audio"):
        fetch(config(tmp_path, "null", **{"data.sources.eval": f"[{{name: x, path: {layouts['parquet']}, "
                                                               "split: test, audio: audio}]"}))
    with pytest.raises(SourceError, match=r"data.sources.eval\[0\].prompt_audio=prompt_audio"):
        fetch(config(tmp_path, "null", **{"data.sources.eval": f"[{{name: x, path: {layouts['parquet']}, "
                                                               "config: test, split: test, id: text, "
                                                               "prompt_text: text, target_text: text}]"}))
    assert nothing_left(tmp_path)


def test_offline_is_detected_once_and_said_in_one_line(tmp_path, layouts, monkeypatch):
    """The hub unreachable (a closed local port): one probe for the whole fetch, the cached file still read, the
    uncached repository one line naming its key -- in seconds, not a retry storm per file."""
    import httpx

    cache = tmp_path / "hf_cache"
    voxbox_in_hub_cache(cache, [f"第{i}句" for i in range(4)])
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", "http://127.0.0.1:9")
    probes, head = [], httpx.head
    monkeypatch.setattr(httpx, "head", lambda url, **k: probes.append(url) or head(url, **k))
    text = "{hub: SparkAudio/voxbox, file: metadata/aishell-3.jsonl, train_lines: 3, val_lines: 1}"
    started = time.monotonic()
    with pytest.raises(SourceError) as err:
        fetch(config(tmp_path, "{hub: yuekai/aishell, config: test, split: test}", **{"data.sources.text": text}))
    assert probes == ["http://127.0.0.1:9"] and time.monotonic() - started < 20
    assert str(err.value).startswith("data.sources.prompts.hub=yuekai/aishell files=") and "\n" not in str(err.value)
    assert "offline (http://127.0.0.1:9 unreachable" in str(err.value) and "not in the hub cache" in str(err.value)
    assert nothing_left(tmp_path)
    # the same fetch with the repository in the cache: read from it, no second probe per source
    in_hub_cache(cache, "yuekai/aishell", layouts["lhotse"])
    probes.clear()
    fetch(config(tmp_path, "{hub: yuekai/aishell, config: test, split: test}", **{"data.sources.text": text}))
    assert probes == ["http://127.0.0.1:9"] and len(fetched_clips(tmp_path)) == SPEAKERS
