"""Upstream CosyVoice at its pinned commit (pin.py, upstream.sha256) and the shims that guard the upstream lines the
project works around (shims.py: CosyVoice and torchaudio; vllm_cpu.py: vLLM on the CPU)."""
