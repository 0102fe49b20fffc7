"""Stage 0: JSONL -> verl parquet, with every bad line reported and nothing written on error."""

import json
import subprocess
import sys

import datasets
import pytest

from grpo.config import load_config
from grpo.data.stage import DataError, prepare, sample_id


def write_lines(path, lines):
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def data_cfg(tmp_path, train, val=None, *extra):
    return load_config([f"exp_dir={tmp_path}/exp", f"data.train_file={train}",
                        f"data.val_file={val if val else 'null'}", *extra]).data


def test_good_file_round_trips_with_stable_ids(tmp_path):
    train = write_lines(tmp_path / "train.jsonl", [
        json.dumps({"text": "今天天气很好。", "id": "a1"}, ensure_ascii=False),
        json.dumps({"text": "Hello world.", "language": "en"}),
        json.dumps({"text": "  他在2019年毕业。 ", "language": "zh", "id": 7}, ensure_ascii=False),
    ])
    out = prepare(data_cfg(tmp_path, train))
    ds = datasets.load_dataset("parquet", data_files=str(out["train"]), split="train")
    assert len(ds) == 3
    assert [r["reward_model"]["ground_truth"] for r in ds] == ["今天天气很好。", "Hello world.", "他在2019年毕业。"]
    assert ds[0]["prompt"] == [{"role": "user", "content": "今天天气很好。"}]
    assert [r["extra_info"]["sample_id"] for r in ds] == ["a1", sample_id("Hello world.", "en"), "7"]
    assert [r["extra_info"]["language"] for r in ds] == ["zh", "en", "zh"]
    assert [r["extra_info"]["index"] for r in ds] == [0, 1, 2]
    assert set(ds[0]) >= {"data_source", "prompt", "ability", "reward_model", "extra_info"}
    # a second run gives the same ids
    out2 = prepare(data_cfg(tmp_path, train))
    ds2 = datasets.load_dataset("parquet", data_files=str(out2["train"]), split="train")
    assert [r["extra_info"]["sample_id"] for r in ds2] == [r["extra_info"]["sample_id"] for r in ds]


def test_every_bad_line_is_reported_and_nothing_written(tmp_path):
    good = json.dumps({"text": "好"}, ensure_ascii=False)
    train = write_lines(tmp_path / "bad.jsonl", [
        good,                                           # 1 ok
        "{not json",                                    # 2 malformed
        json.dumps({"txt": "x"}),                       # 3 missing text
        json.dumps({"text": ""}),                       # 4 empty
        json.dumps({"text": 42}),                       # 5 non-string
        json.dumps({"text": "长" * 300}, ensure_ascii=False),  # 6 too long
        json.dumps({"text": "好", "language": "fr"}, ensure_ascii=False),  # 7 unknown language
        "[1, 2]",                                       # 8 not an object
        good,                                           # 9 ok
    ])
    (tmp_path / "bad2.jsonl").write_bytes(b'{"text": "\xff\xfe"}\n')
    cfg = data_cfg(tmp_path, train, tmp_path / "bad2.jsonl")
    with pytest.raises(DataError) as err:
        prepare(cfg)
    lines = {(p.path.rsplit("/", 1)[-1], p.line) for p in err.value.problems}
    assert lines == {("bad.jsonl", n) for n in (2, 3, 4, 5, 6, 7, 8)} | {("bad2.jsonl", 1)}
    messages = " ".join(p.message for p in err.value.problems)
    for expected in ("malformed JSON", "missing field 'text'", "empty", "must be a string", "more than",
                     "unknown language", "expected a JSON object", "UTF-8"):
        assert expected in messages
    assert not (tmp_path / "exp").exists() or not any((tmp_path / "exp").rglob("*.parquet"))


def test_cli_exits_nonzero_and_names_lines(tmp_path, repo_root):
    train = write_lines(tmp_path / "t.jsonl", ['{"text": "好"}', "oops", '{"text": 1}'])
    proc = subprocess.run([sys.executable, "-m", "grpo", "data", f"exp_dir={tmp_path}/exp",
                           f"data.train_file={train}", "data.val_file=null"],
                          cwd=repo_root, capture_output=True, text=True)
    assert proc.returncode == 1
    assert "t.jsonl:2" in proc.stderr and "t.jsonl:3" in proc.stderr
    assert not list((tmp_path).rglob("*.parquet"))


@pytest.mark.parametrize("policy,expect_rows", [("keep", 3), ("drop", 2)])
def test_duplicates_keep_or_drop(tmp_path, policy, expect_rows, caplog):
    train = write_lines(tmp_path / "d.jsonl", ['{"text": "好"}', '{"text": "坏"}', '{"text": "好"}'])
    with caplog.at_level("INFO"):
        out = prepare(data_cfg(tmp_path, train, None, f"data.duplicates={policy}"))
    assert len(datasets.load_dataset("parquet", data_files=str(out["train"]), split="train")) == expect_rows
    assert "1 duplicate" in caplog.text


def test_duplicates_error_and_conflicting_ids(tmp_path):
    train = write_lines(tmp_path / "d.jsonl", ['{"text": "好", "id": "x"}', '{"text": "坏", "id": "x"}',
                                               '{"text": "好"}'])
    with pytest.raises(DataError) as err:
        prepare(data_cfg(tmp_path, train, None, "data.duplicates=error"))
    assert {p.line for p in err.value.problems} == {2, 3}


def test_shipped_data_is_valid(tmp_path):
    out = prepare(load_config([f"exp_dir={tmp_path}"]).data)
    n_train = len(datasets.load_dataset("parquet", data_files=str(out["train"]), split="train"))
    n_val = len(datasets.load_dataset("parquet", data_files=str(out["val"]), split="train"))
    assert n_train >= 150 and n_val >= 20


def test_missing_file_empty_file_and_bad_ids_are_reported_together(tmp_path):
    empty = write_lines(tmp_path / "empty.jsonl", ["", "   "])
    missing = tmp_path / "nowhere.jsonl"
    with pytest.raises(DataError) as err:
        prepare(data_cfg(tmp_path, empty, missing))
    assert {(p.path.rsplit("/", 1)[-1], p.line, p.message) for p in err.value.problems} == {
        ("empty.jsonl", 0, "no data lines"), ("nowhere.jsonl", 0, "file not found")}
    ids = write_lines(tmp_path / "ids.jsonl", [
        '{"text": "好", "id": true}', '{"text": "好", "id": 1.5}', '{"text": "好", "id": ""}',
        '{"text": "好", "id": ["a"]}', '{"text": "好", "id": 0}', '{"text": "坏", "id": "0"}'])
    with pytest.raises(DataError) as err:
        prepare(data_cfg(tmp_path, ids))
    # 1-4: not a non-empty string or integer; 6: id "0" is the integer 0 of line 5 as a string, for another text
    assert {(p.line, "'id' must be" in p.message or "already used" in p.message) for p in err.value.problems} == {
        (1, True), (2, True), (3, True), (4, True), (6, True)}
    assert not list(tmp_path.rglob("*.parquet"))


def test_fewer_prompts_than_one_batch_is_an_error_naming_the_batch_size(tmp_path, repo_root):
    train = write_lines(tmp_path / "small.jsonl", ['{"text": "好"}', '{"text": "坏"}', '{"text": "好"}'])
    with pytest.raises(DataError, match="fewer than one batch"):
        prepare(data_cfg(tmp_path, train), min_train_rows=4)
    assert prepare(data_cfg(tmp_path, train), min_train_rows=3)["train"].exists()
    proc = subprocess.run([sys.executable, "-m", "grpo", "data", f"exp_dir={tmp_path}/cli", f"data.train_file={train}",
                           "data.val_file=null", "train.batch_size=8"], cwd=repo_root, capture_output=True, text=True)
    assert proc.returncode == 1 and "3 usable prompt(s)" in proc.stderr and "train.batch_size=8" in proc.stderr
    assert not list((tmp_path / "cli").rglob("*.parquet"))


@pytest.mark.parametrize("policy", ["warn", "drop", "error"])
def test_lines_longer_than_the_response_budget(tmp_path, policy, caplog):
    # at 6 speech tokens per Chinese character, 20 characters need ~120 tokens: over a budget of 96
    train = write_lines(tmp_path / "t.jsonl", ['{"text": "好好"}', json.dumps({"text": "长" * 20}, ensure_ascii=False),
                                               '{"text": "坏"}'])
    cfg = data_cfg(tmp_path, train, None, f"data.long_text={policy}", "data.speech_tokens_per_char={zh: 6.0, en: 2.0}")
    if policy == "error":
        with pytest.raises(DataError) as err:
            prepare(cfg, max_speech_tokens=96)
        assert [(p.line, "train.max_response_tokens=96" in p.message) for p in err.value.problems] == [(2, True)]
        return
    with caplog.at_level("WARNING"):
        out = prepare(cfg, max_speech_tokens=96)
    texts = [r["reward_model"]["ground_truth"] for r in datasets.load_dataset("parquet", data_files=str(out["train"]),
                                                                               split="train")]
    assert texts == (["好好", "长" * 20, "坏"] if policy == "warn" else ["好好", "坏"])
    assert "1 line(s) of t.jsonl likely need more than train.max_response_tokens=96" in caplog.text
    assert prepare(cfg, max_speech_tokens=120)["train"].exists()   # 20 x 6 = 120 fits exactly
