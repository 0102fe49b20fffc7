"""Speaker similarity (SIM) between generated speech and its prompt: cosine of speaker embeddings.

The embedding model is an ONNX speaker-verification network taking 80-dim Kaldi fbank features
(16 kHz, mean-normalised), e.g. the CAM++ `campplus.onnx` shipped in CosyVoice2-0.5B, which is what
CosyVoice's own frontend extracts speaker embeddings with. Seed-TTS-eval reports SIM with a WavLM-TDNN
verifier instead, so figures from the two are not interchangeable.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch


class SpeakerSimilarity:
    def __init__(self, model_path: str | Path):
        import onnxruntime

        if not Path(model_path).exists():
            raise FileNotFoundError(f"speaker model {model_path} not found")
        options = onnxruntime.SessionOptions()
        options.intra_op_num_threads = 1
        self.session = onnxruntime.InferenceSession(str(model_path), sess_options=options,
                                                    providers=["CPUExecutionProvider"])
        self.input_name = self.session.get_inputs()[0].name

    def embed(self, wav16k: np.ndarray) -> np.ndarray:
        import torchaudio.compliance.kaldi as kaldi

        feats = kaldi.fbank(torch.from_numpy(np.asarray(wav16k, dtype=np.float32))[None], num_mel_bins=80, dither=0,
                            sample_frequency=16000)
        feats = feats - feats.mean(dim=0, keepdim=True)
        return self.session.run(None, {self.input_name: feats[None].numpy()})[0].reshape(-1)

    def similarity(self, a16k: np.ndarray, b16k: np.ndarray) -> float:
        return cosine(self.embed(a16k), self.embed(b16k))

    def similarity_to_embedding(self, wav16k: np.ndarray, embedding) -> float:
        """Against a stored embedding, e.g. a CosyVoice speaker's `flow_embedding` (CAM++ of its prompt clip)."""
        return cosine(self.embed(wav16k), np.asarray(embedding, dtype=np.float32).reshape(-1))


def cosine(x: np.ndarray, y: np.ndarray) -> float:
    return float(np.dot(x, y) / (np.linalg.norm(x) * np.linalg.norm(y) + 1e-12))
