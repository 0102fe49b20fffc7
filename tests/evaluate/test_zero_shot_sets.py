"""Loaders for the zero-shot test-set layouts (the real sets are not downloadable here: small stand-ins
in their exact file formats)."""

import json

import pytest

from grpo.data.test_sets import load_set


def test_cv3_eval_layout(tmp_path):
    root = tmp_path / "CV3-Eval"
    d = root / "data" / "zero_shot" / "zh"
    (d / "waveform").mkdir(parents=True)
    (d / "waveform" / "prompt_audio_1.wav").write_bytes(b"")
    (d / "text").write_text("uttid_1 今天天气很好\nuttid_2 没有提示的条目\n", encoding="utf-8")
    (d / "prompt_text").write_text("uttid_1 希望你以后能够做的比我还好呦\n", encoding="utf-8")
    (d / "prompt_wav.scp").write_text("uttid_1 data/zero_shot//zh/waveform/prompt_audio_1.wav\n")
    items = load_set("cv3_zero_shot", d)
    assert len(items) == 1
    it = items[0]
    assert (it.id, it.text, it.prompt_text, it.language) == \
        ("uttid_1", "今天天气很好", "希望你以后能够做的比我还好呦", "zh")
    assert it.prompt_wav == str(root / "data/zero_shot//zh/waveform/prompt_audio_1.wav")
    with pytest.raises(FileNotFoundError):
        load_set("cv3_zero_shot", tmp_path)


def test_seedtts_meta_lst(tmp_path):
    d = tmp_path / "seedtts_testset" / "en"
    d.mkdir(parents=True)
    (d / "meta.lst").write_text("u1|prompt words here|prompt-wavs/u1.wav|Target sentence one.\n"
                                "u2|other prompt|prompt-wavs/u2.wav|Target two.|wavs/u2.wav\n")
    items = load_set("seedtts", d / "meta.lst")
    assert [i.id for i in items] == ["u1", "u2"] and items[1].text == "Target two."
    assert items[0].language == "en" and items[0].prompt_wav == str(d / "prompt-wavs/u1.wav")
    (d / "bad.lst").write_text("only|three|fields\n")
    with pytest.raises(ValueError, match="bad.lst:1"):
        load_set("seedtts", d / "bad.lst")


def test_jsonl_and_the_shipped_tiny_set(tiny_cfg):
    from grpo.speech.codebook import Codebook
    from grpo.speech.scoring import text_to_units

    items = load_set("tiny", "data/zero_shot_tiny.jsonl")
    assert len(items) >= 20 and all(it.prompt_speech_tokens for it in items)
    codebook = Codebook.load(tiny_cfg().reward.codebook.path)
    for it in items:   # the shipped prompt tokens speak the prompt text in the default codebook
        assert codebook.transcribe(it.prompt_speech_tokens) == list(text_to_units(it.prompt_text))


def test_jsonl_errors_name_the_line(tmp_path):
    path = tmp_path / "set.jsonl"
    path.write_text(json.dumps({"id": "a", "prompt_text": "x", "text": "y"}) + "\n" + json.dumps({"id": "b"}) + "\n")
    with pytest.raises(ValueError, match="set.jsonl:2"):
        load_set("jsonl", path)


def test_the_tiny_held_out_set_is_new_to_the_warm_start_and_to_grpo(tiny_cfg):
    """data/zero_shot_tiny.jsonl holds sentences that neither GRPO (data.train_file) nor the warm start trains on;
    data/zero_shot_tiny_seen.jsonl holds GRPO training sentences. The warm start's texts are drawn as stage -1
    draws them (the tiny profile's warm_start options, its alphabet) and decoded back to text."""
    import random

    from grpo.config import load_config
    from grpo.speech.codebook import Codebook
    from grpo.speech.cosyvoice_dir import load_cosyvoice_yaml
    from grpo.standins.tiny import codebook_texts
    from grpo.standins.warm_start import DEFAULTS, chinese_characters, example_options, make_example

    cfg = load_config([])          # the tiny profile as `bash run.sh` runs it
    read = lambda path: [json.loads(x) for x in open(path, encoding="utf-8") if x.strip()]  # noqa: E731
    train = {r["text"] for r in read(cfg.data.train_file)}
    held_out, seen = read("data/zero_shot_tiny.jsonl"), read(cfg.eval.extra_sets[0].data_path)
    assert len(held_out) >= 20 and {x["split"] for x in held_out} == {"held_out"}
    assert not {x["text"] for x in held_out} & train
    assert len(seen) >= 20 and {x["split"] for x in seen} == {"seen"} and {x["text"] for x in seen} <= train

    built = tiny_cfg()
    tokenizer = load_cosyvoice_yaml(built.model.cosyvoice_dir, skip=["llm", "flow", "hift"])["get_tokenizer"]()
    codebook = Codebook.load(built.reward.codebook.path)
    ws = cfg.model.tiny.warm_start
    opts = {**DEFAULTS, **example_options(ws)}
    rows = [(r["text"], r.get("language", "zh")) for r in read(cfg.data.train_file)]
    chars = chinese_characters(codebook_texts(cfg))
    rng = random.Random(0)
    drawn = {tokenizer.decode(make_example(rows, chars, codebook, tokenizer, rng, opts)[0].tolist())
             for _ in range(3000)}
    sentences = train | {x["text"] for x in held_out} | {r["text"] for r in read(cfg.data.val_file)}
    assert len(drawn) > 2900 and not drawn & sentences             # random strings, never a sentence
    assert {ch for x in held_out for ch in x["text"] if "\u4e00" <= ch <= "\u9fff"} <= set(chars)   # taught to read
