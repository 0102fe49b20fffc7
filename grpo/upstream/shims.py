"""Workarounds for upstream code at its pinned version, one function each. Every shim names the upstream file and
line it works around and fails loudly (grpo.upstream.guards.ShimOutdated) when that line or the pinned version
changes.

- `torchaudio_load`: CosyVoice ace7c47, `cosyvoice/utils/file_utils.py`, `load_wav`:
  `speech, sample_rate = torchaudio.load(wav, backend='soundfile')`. Since torchaudio 2.9 (2.11 is pinned in both
  locks), `torchaudio.load` decodes only through TorchCodec, which needs FFmpeg's shared libraries and a build per
  torch version. One decoder on every machine: `torchaudio.load` reads with soundfile (libsndfile), as
  torchaudio's own soundfile backend did before 2.9 (float32 in [-1, 1], channels first), whether TorchCodec is
  installed or not (setup and the GPU image both remove it); upstream's resampling that follows is untouched.
- `qwen2lm_any_width`: CosyVoice ace7c47, `cosyvoice/llm/llm.py`, `Qwen2LM.prepare_lm_input_target`:
  `instruct_token_emb = [torch.empty(0, 896).to(text_token_emb[0])] * len(text_token)` -- the empty instruction
  of a CosyVoice2 training example is 896 wide (the released LLM's width), so upstream's training forward fails
  for any other width (the tiny profile's warm start). For one model, the missing instruction is handed in as
  an empty one of the model's own width, which takes upstream's other branch to the same input and target.
"""

from __future__ import annotations

import inspect

from grpo.upstream.guards import ShimOutdated

TORCHAUDIO_LOAD_LINE = "torchaudio.load(wav, backend='soundfile')"
TORCHAUDIO_PINNED = "2.11"
INSTRUCT_WIDTH_LINE = "instruct_token_emb = [torch.empty(0, 896).to(text_token_emb[0])] * len(text_token)"


def _soundfile_load(uri, frame_offset: int = 0, num_frames: int = -1, normalize: bool = True,
                    channels_first: bool = True, format=None, buffer_size: int = 4096, backend=None):
    import soundfile as sf
    import torch

    data, sample_rate = sf.read(uri, start=frame_offset, frames=num_frames, dtype="float32", always_2d=True)
    wav = torch.from_numpy(data)
    return (wav.T.contiguous() if channels_first else wav), sample_rate


def torchaudio_load() -> None:
    """Make upstream's `load_wav` decode with soundfile, the one audio decoder of the CPU venv and the GPU image."""
    import torchaudio
    from cosyvoice.utils import file_utils

    if TORCHAUDIO_LOAD_LINE not in inspect.getsource(file_utils.load_wav) or \
            not torchaudio.__version__.startswith(TORCHAUDIO_PINNED + "."):
        raise ShimOutdated(
            f"grpo/upstream/shims.py torchaudio_load: shimmed for torchaudio {TORCHAUDIO_PINNED} and "
            f"cosyvoice/utils/file_utils.py's {TORCHAUDIO_LOAD_LINE!r}; found torchaudio {torchaudio.__version__} and "
            f"a load_wav {'with' if TORCHAUDIO_LOAD_LINE in inspect.getsource(file_utils.load_wav) else 'without'} it")
    torchaudio.load = _soundfile_load


def qwen2lm_any_width(llm) -> None:
    """Let upstream's `Qwen2LM.forward` (training) run on `llm` whatever its width (a no-op at 896)."""
    from cosyvoice.llm.llm import Qwen2LM

    if INSTRUCT_WIDTH_LINE not in inspect.getsource(Qwen2LM.prepare_lm_input_target):
        raise ShimOutdated(f"grpo/upstream/shims.py qwen2lm_any_width: cosyvoice/llm/llm.py's "
                                   f"Qwen2LM.prepare_lm_input_target no longer contains {INSTRUCT_WIDTH_LINE!r}")
    if llm.llm_input_size == 896:
        return
    upstream_prepare = llm.prepare_lm_input_target

    def prepare(sos_emb, text_token, text_token_emb, text_token_len, task_id_emb, speech_token, speech_token_emb,
                speech_token_len, *instruct):
        if not instruct:           # (instruct_token, instruct_token_emb, instruct_token_len), all empty
            b = text_token.shape[0]
            instruct = (text_token.new_zeros(b, 0), text_token_emb.new_zeros(b, 0, text_token_emb.shape[-1]),
                        text_token_len.new_zeros(b))
        return upstream_prepare(sos_emb, text_token, text_token_emb, text_token_len, task_id_emb, speech_token,
                                speech_token_emb, speech_token_len, *instruct)

    llm.prepare_lm_input_target = prepare
