"""Stage -1 (tiny): the model directory is laid out like CosyVoice2-0.5B and loads through CosyVoice's code."""

import json

import numpy as np
import torch

from grpo.model.tiny import load_cosyvoice_yaml


def test_layout(tiny_cfg):
    cfg = tiny_cfg()
    cv = __import__("pathlib").Path(cfg.model.cosyvoice_dir)
    for name in ("cosyvoice2.yaml", "llm.pt", "flow.pt", "hift.pt", "CosyVoice-BlankEN/config.json",
                 "CosyVoice-BlankEN/vocab.json", "CosyVoice-BlankEN/merges.txt", "CosyVoice-BlankEN/tokenizer_config.json"):
        assert (cv / name).is_file(), name
    sv = __import__("pathlib").Path(cfg.model.sensevoice_dir)
    for name in ("config.yaml", "model.pt", "bpe.model", "am.mvn"):
        assert (sv / name).is_file(), name


def test_llm_pt_loads_strictly_into_qwen2lm_from_yaml(tiny_cfg):
    from cosyvoice.llm.llm import Qwen2LM

    cfg = tiny_cfg()
    configs = load_cosyvoice_yaml(cfg.model.cosyvoice_dir, skip=["flow", "hift"])
    llm = configs["llm"]
    assert isinstance(llm, Qwen2LM)
    state = torch.load(f"{cfg.model.cosyvoice_dir}/llm.pt", weights_only=True)
    llm.load_state_dict(state, strict=True)
    tiny = cfg.model.tiny
    # shapes follow the yaml / tiny sizes
    assert configs["llm_input_size"] == tiny.llm.hidden_size
    assert llm.speech_embedding.weight.shape == (tiny.speech_token_size + 3, tiny.llm.hidden_size)
    assert llm.llm_decoder.weight.shape == (tiny.speech_token_size + 3, tiny.llm.hidden_size)
    assert llm.llm_embedding.weight.shape == (2, tiny.llm.hidden_size)
    qwen = llm.llm.model.config
    assert (qwen.num_hidden_layers, qwen.num_attention_heads, qwen.num_key_value_heads) == (
        tiny.llm.num_layers, tiny.llm.num_heads, tiny.llm.num_kv_heads)
    blank = json.loads(open(f"{cfg.model.cosyvoice_dir}/CosyVoice-BlankEN/config.json").read())
    assert state["llm.model.model.embed_tokens.weight"].shape[0] == blank["vocab_size"]


def test_flow_and_hift_load_and_make_audio(tiny_cfg):
    from reward_server.token2wav import Token2Wav, tiny_speakers

    t2w = Token2Wav(tiny_cfg().model.cosyvoice_dir)
    speaker = next(iter(tiny_speakers(1, 0).values()))
    wav = t2w(list(range(100, 150)), speaker, seed=1)
    # 50 tokens at 25 Hz -> 2 s at 24 kHz
    assert wav.shape == (48000,) and np.isfinite(wav).all()
    assert np.array_equal(wav, t2w(list(range(100, 150)), speaker, seed=1)), "seeded synthesis must be deterministic"


def test_tiny_sensevoice_loads_with_funasr_automodel(tiny_cfg):
    from reward_server.asr import FunASR

    asr = FunASR(tiny_cfg().model.sensevoice_dir)
    rng = np.random.default_rng(0)
    out = asr.transcribe([rng.standard_normal(16000).astype(np.float32) * 0.1 for _ in range(3)])
    assert len(out) == 3 and all(isinstance(t, str) for t in out)
    assert not any("<|" in t for t in out), "SenseVoice tags must be stripped"


def test_rebuild_is_skipped_when_up_to_date(tiny_cfg, caplog):
    from grpo.model.prepare import build_tiny

    before = open(f"{tiny_cfg().model.cosyvoice_dir}/llm.pt", "rb").read()
    with caplog.at_level("INFO"):
        build_tiny(tiny_cfg())
    assert "up to date" in caplog.text
    assert open(f"{tiny_cfg().model.cosyvoice_dir}/llm.pt", "rb").read() == before
