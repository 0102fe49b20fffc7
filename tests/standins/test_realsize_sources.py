"""`bash run.sh -1 0 profile=realsize` with data.sources pointed at the public recipe's hub datasets built locally
(tests/data/hub_sets.py: the real schemas and repository layouts; the voxbox file through the hub cache, offline):
training and validation parquet from the recipe's split, prompt speakers computed by CosyVoice's frontend from the
audio dataset's clips (two real AISHELL-1 recordings), the zero-shot set in the project's layout; a second data
stage rewrites none of the fetched files. Marked slow + realsize (stage -1 of realsize: minutes when exp/realsize
holds no models yet)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import soundfile as sf
import torch

sys.path.insert(0, str(Path(__file__).parent.parent / "data"))
from hub_sets import aishell_repo, voxbox_in_hub_cache, zero_shot_repo  # noqa: E402

from grpo.config import REPO_ROOT  # noqa: E402
from grpo.standins.realsize import aishell_wavs  # noqa: E402

TEXTS = [f"这是第{i}句用来训练的中文句子" for i in range(7)]


@pytest.mark.slow
@pytest.mark.realsize
def test_realsize_data_stages_read_the_recipes_datasets(tmp_path):
    wavs = aishell_wavs()           # two real AISHELL-1 test utterances (16 kHz)
    clips = [(p.read_bytes(), " ".join(t)) for p, t in zip(wavs.values(), ["甚至出现交易几乎停滞的情况",
                                                                          "一二线城市虽然也处于调整中"])]
    voxbox_in_hub_cache(tmp_path / "hf_cache", TEXTS)
    aishell = aishell_repo(tmp_path / "aishell", clips)
    first = next(iter(wavs.values()))
    cv3 = zero_shot_repo(tmp_path / "cv3", {"zero_shot_zh": [
        {"id": f"zh_{k}", "prompt_text": "甚至出现交易几乎停滞的情况", "prompt_audio": first.read_bytes(),
         "target_text": t} for k, t in enumerate(["今天天气很好", "我们一起去公园散步吧"])]})
    src = tmp_path / "sources"
    keys = [f"data.sources.out_dir={src}", f"data.out_dir={tmp_path / 'data'}",
            "data.sources.text={hub: SparkAudio/voxbox, file: metadata/aishell-3.jsonl, train_lines: 5, val_lines: 2}",
            f"data.sources.prompts={{path: {aishell}, config: test, split: test, speakers: 2}}",
            f"data.sources.eval=[{{name: cv3_zero_shot_zh, path: {cv3}, split: zero_shot_zh}}]",
            f"data.train_file={src}/text/train.jsonl", f"data.val_file={src}/text/val.jsonl",
            f"reward.prompt_speakers.clips={src}/prompts/clips.jsonl",
            f"reward.prompt_speakers.features={tmp_path / 'prompt_speakers.pt'}",
            f"eval.data_path={src}/eval/cv3_zero_shot_zh/meta.lst"]
    env = {**os.environ, "HF_HUB_CACHE": str(tmp_path / "hf_cache"), "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(["bash", "run.sh", "-1", "0", "profile=realsize", *keys], cwd=REPO_ROOT, env=env,
                          capture_output=True, text=True, timeout=1800)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]

    import pandas as pd

    train = pd.read_parquet(tmp_path / "data" / "train.parquet")
    val = pd.read_parquet(tmp_path / "data" / "val.parquet")
    assert [r["ground_truth"] for r in train.reward_model] == TEXTS[:5]
    assert [r["ground_truth"] for r in val.reward_model] == TEXTS[5:]
    speakers = torch.load(tmp_path / "prompt_speakers.pt", weights_only=True)["speakers"]
    fetched = [json.loads(x) for x in (src / "prompts" / "clips.jsonl").read_text().splitlines()]
    assert sorted(c["text"] for c in fetched) == sorted(t.replace(" ", "") for _, t in clips)
    assert len(speakers) == 2
    meta = (src / "eval" / "cv3_zero_shot_zh" / "meta.lst").read_text().splitlines()
    assert [m.split("|")[3] for m in meta] == ["今天天气很好", "我们一起去公园散步吧"]
    assert sf.info(src / "eval" / "cv3_zero_shot_zh" / "wavs" / "zh_0.wav").samplerate == 16000

    mtimes = {p: p.stat().st_mtime_ns for p in src.rglob("*") if p.is_file()}
    again = subprocess.run(["bash", "run.sh", "0", "0", "profile=realsize", *keys], cwd=REPO_ROOT, env=env,
                           capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stderr[-3000:]
    assert {p: p.stat().st_mtime_ns for p in src.rglob("*") if p.is_file()} == mtimes
