"""Speech tokens -> 24 kHz audio with CosyVoice's own flow-matching decoder and HiFT vocoder, and the
prompt speakers that condition it.

Prompt speakers use CosyVoice's spk2info schema (`flow_prompt_speech_token`, `prompt_speech_feat`,
`flow_embedding`, ...), so a `spk2info.pt` saved by CosyVoice itself works as a speakers file.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import torch

log = logging.getLogger(__name__)

SAMPLE_RATE = 24000


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def autocast_dtype(dtype: str, device: str | torch.device) -> torch.dtype:
    """`auto`: bfloat16 on CUDA, float32 (no autocast) elsewhere; or a dtype by name."""
    if dtype == "auto":
        return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    if dtype not in DTYPES:
        raise ValueError(f"unknown token2wav dtype {dtype!r}; expected auto or one of {list(DTYPES)}")
    return DTYPES[dtype]


def length_buckets(lengths: list[int], max_frames: int, max_padding: float = 0.1) -> list[list[int]]:
    """Indices grouped into batches of similar length: sorted by length, an item joins the current batch while
    the batch's padded size (count x longest) stays at most `max_frames` (a longer item goes alone) and at most
    `1 + max_padding` times the frames it really holds. The first bound keeps one batch's activations within a
    memory budget, the second keeps compute from going to padding (on a CPU, where a larger batch is not
    faster per frame, padding is pure loss)."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    buckets: list[list[int]] = []
    held = 0                                  # frames the last bucket really holds
    for i in order:
        padded = (len(buckets[-1]) + 1) * lengths[i] if buckets else 0
        if buckets and padded <= max_frames and padded <= (1 + max_padding) * (held + lengths[i]):
            buckets[-1].append(i)
            held += lengths[i]
        else:
            buckets.append([i])
            held = lengths[i]
    return buckets


class Token2Wav:
    """flow.pt + hift.pt + the family's yaml from a CosyVoice model directory: speech tokens -> 24 kHz audio as
    upstream's `CosyVoice2Model.token2wav` / `CosyVoice3Model.token2wav` (non-streaming, finalize) compute it.

    CosyVoice2: the conformer encoder, CausalConditionalCFM with its U-Net estimator, HiFTGenerator. CosyVoice3:
    the pre-look-ahead layer repeated to mel frames, the same CFM with the DiT estimator, CausalHiFTGenerator
    (finalize), and the LLM's tokens first trimmed of long silences as `CosyVoice3Model.llm_job` does
    (`Family.trim_silence`). `dtype`: the flow under autocast (bf16/fp16 on a GPU; HiFT's STFT stays float32).
    `max_frames_per_batch`: the padded mel frames (items x longest, prompt included) one flow pass may take;
    `max_padding`: the fraction of a pass's frames that may be padding (`length_buckets`)."""

    def __init__(self, model_dir: str | Path, device: str = "cpu", dtype: str = "auto",
                 max_frames_per_batch: int = 20000, max_padding: float = 0.1):
        from cosyvoice.flow.flow import CausalMaskedDiffWithDiT
        from cosyvoice.hifigan.generator import CausalHiFTGenerator

        from grpo.speech.cosyvoice_dir import load_cosyvoice_yaml
        from grpo.speech.family import family_of_dir

        model_dir = Path(model_dir)
        self.family = family_of_dir(model_dir)
        configs = load_cosyvoice_yaml(model_dir, skip=["llm"])
        self.device = torch.device(device)
        self.flow, self.hift = configs["flow"], configs["hift"]
        self.flow.load_state_dict(torch.load(model_dir / "flow.pt", map_location="cpu", weights_only=True), strict=True)
        hift_sd = torch.load(model_dir / "hift.pt", map_location="cpu", weights_only=True)
        self.hift.load_state_dict({k.replace("generator.", ""): v for k, v in hift_sd.items()}, strict=True)
        self.flow.to(self.device).eval()
        self.hift.to(self.device).eval()
        self.dit = isinstance(self.flow, CausalMaskedDiffWithDiT)          # CosyVoice3's flow
        self.causal_hift = isinstance(self.hift, CausalHiFTGenerator)      # CosyVoice3's vocoder
        self.sample_rate = configs.get("sample_rate", SAMPLE_RATE)
        self.feat_extractor = configs.get("feat_extractor")
        self.dtype = autocast_dtype(dtype, self.device)
        self.max_frames_per_batch, self.max_padding = max_frames_per_batch, max_padding
        self.token_mel_ratio = getattr(self.flow, "token_mel_ratio", 2)     # mel frames per speech token

    def flow_tokens(self, tokens: list[int]) -> list[int]:
        """The LLM's tokens as upstream hands them to token2wav (CosyVoice3: long silences trimmed)."""
        return self.family.trim_silence(list(tokens))

    def _vocode(self, mel: torch.Tensor) -> torch.Tensor:
        if self.causal_hift:
            wav, _ = self.hift.inference(speech_feat=mel, finalize=True)
        else:
            wav, _ = self.hift.inference(speech_feat=mel, cache_source=torch.zeros(1, 1, 0, device=self.device))
        return wav

    @torch.inference_mode()
    def __call__(self, tokens: list[int], speaker: dict, seed: int = 0) -> np.ndarray:
        """One utterance with upstream's own `flow.inference` (batch size 1); seeded so the same input gives the
        same audio."""
        dev = self.device
        token = torch.tensor([self.flow_tokens(tokens)], dtype=torch.int32, device=dev)
        prompt_token = speaker["flow_prompt_speech_token"].to(dev)
        prompt_feat = speaker["prompt_speech_feat"].to(dev)
        with torch.random.fork_rng(devices=[dev] if dev.type == "cuda" else []):
            torch.manual_seed(seed)
            mel, _ = self.flow.inference(
                token=token, token_len=torch.tensor([token.shape[1]], dtype=torch.int32, device=dev),
                prompt_token=prompt_token,
                prompt_token_len=torch.tensor([prompt_token.shape[1]], dtype=torch.int32, device=dev),
                prompt_feat=prompt_feat,
                prompt_feat_len=torch.tensor([prompt_feat.shape[1]], dtype=torch.int32, device=dev),
                embedding=speaker["flow_embedding"].to(dev), streaming=False, finalize=True)
            wav = self._vocode(mel)
        return wav.squeeze(0).float().cpu().numpy()

    def _mu(self, full: torch.Tensor) -> torch.Tensor:
        """The flow's conditioning mu (T_mel, 80) for prompt + target tokens, one utterance."""
        flow, dev = self.flow, self.device
        emb = flow.input_embedding(torch.clamp(full, min=0)[None].to(dev))
        if self.dit:       # CausalMaskedDiffWithDiT.inference: look-ahead layer, repeated to mel frames
            return flow.pre_lookahead_layer(emb).repeat_interleave(flow.token_mel_ratio, dim=1)[0]
        h, _ = flow.encoder(emb, torch.tensor([len(full)], device=dev), streaming=False)
        return flow.encoder_proj(h)[0]

    @torch.inference_mode()
    def flow_batch(self, tokens: list[list[int]], speakers: list[dict]) -> list[torch.Tensor]:
        """Mel spectrograms of several utterances with CosyVoice's flow modules, the costly part batched.

        Upstream's `flow.inference` and its Euler solver take one utterance (two rows for classifier-free
        guidance). Here the text side (CosyVoice2's encoder, CosyVoice3's look-ahead convolution) runs per
        utterance: its convolutions would read padding in a batch. The ten guided passes of the estimator, which
        dominate the cost, run on the right-padded batch: its attention masks the padding out, and CosyVoice3's
        DiT mixes positions otherwise only through a causal convolution, which never reads to the right. The
        fixed noise of CausalConditionalCFM and the Euler steps of its `solve_euler`. Equal to per-utterance
        inference up to float rounding (tests/service/test_reward_backends.py). `tokens` are flow tokens."""
        from cosyvoice.utils.mask import make_pad_mask

        flow, cfm, dev = self.flow, self.flow.decoder, self.device
        emb = flow.spk_embed_affine_layer(torch.nn.functional.normalize(
            torch.cat([spk["flow_embedding"] for spk in speakers]).to(dev), dim=1)).float()
        mus = [self._mu(torch.cat([spk["flow_prompt_speech_token"].flatten().long(), torch.tensor(t).long()]))
               for t, spk in zip(tokens, speakers)]                     # (T_i, 80) each
        mel_len = torch.tensor([len(m) for m in mus], device=dev)
        # the Euler solver's state stays float32 under autocast; only the networks run in the lower precision
        mu = torch.nn.utils.rnn.pad_sequence(mus, batch_first=True).transpose(1, 2).float()   # (B, 80, T)
        prompt_len = [spk["prompt_speech_feat"].shape[1] for spk in speakers]
        cond = torch.zeros_like(mu)
        for i, spk in enumerate(speakers):
            cond[i, :, :prompt_len[i]] = spk["prompt_speech_feat"][0].to(dev).T
        mask = (~make_pad_mask(mel_len)).unsqueeze(1).to(mu)           # (B, 1, T)
        B, T = mu.shape[0], mu.shape[2]
        x = cfm.rand_noise[:, :, :T].to(dev, mu.dtype).expand(B, -1, -1).clone()
        t_span = torch.linspace(0, 1, 10 + 1, device=dev, dtype=mu.dtype)
        if cfm.t_scheduler == "cosine":
            t_span = 1 - torch.cos(t_span * 0.5 * torch.pi)
        zeros_mu, zeros_spk = torch.zeros_like(mu), torch.zeros_like(emb)
        for step in range(1, len(t_span)):
            t, dt = t_span[step - 1], t_span[step] - t_span[step - 1]
            out = cfm.estimator(torch.cat([x, x]), torch.cat([mask, mask]), torch.cat([mu, zeros_mu]),
                                t.expand(2 * B), torch.cat([emb, zeros_spk]), torch.cat([cond, zeros_mu]),
                                streaming=False).float()
            cond_out, uncond_out = out[:B], out[B:]
            x = x + dt * ((1.0 + cfm.inference_cfg_rate) * cond_out - cfm.inference_cfg_rate * uncond_out)
        return [x[i, :, prompt_len[i]:mel_len[i]].float() for i in range(B)]

    def mel_frames(self, tokens: list[int], speaker: dict) -> int:
        return self.token_mel_ratio * (len(tokens) + speaker["flow_prompt_speech_token"].shape[-1])

    @torch.inference_mode()
    def mels(self, tokens: list[list[int]], speakers: list[dict]) -> list[torch.Tensor]:
        """flow_batch over length buckets (autocast to `dtype` where it is not float32), in input order;
        `tokens` are flow tokens (`flow_tokens`)."""
        lengths = [self.mel_frames(t, spk) for t, spk in zip(tokens, speakers)]
        out: list[torch.Tensor | None] = [None] * len(tokens)
        autocast = torch.autocast(self.device.type, dtype=self.dtype, enabled=self.dtype != torch.float32)
        for bucket in length_buckets(lengths, self.max_frames_per_batch, self.max_padding):
            with autocast:
                mels = self.flow_batch([tokens[i] for i in bucket], [speakers[i] for i in bucket])
            for i, mel in zip(bucket, mels):       # float32 already: flow_batch's solver state
                out[i] = mel
        return out

    @torch.inference_mode()
    def batch(self, tokens: list[list[int]], speakers: list[dict], seeds: list[int]) -> list[np.ndarray]:
        """Several utterances of the LLM's tokens: the flow in length-bucketed batched passes, HiFT per utterance
        (seeded)."""
        dev = self.device
        wavs = []
        for mel, seed in zip(self.mels([self.flow_tokens(t) for t in tokens], speakers), seeds):
            with torch.random.fork_rng(devices=[dev] if dev.type == "cuda" else []):
                torch.manual_seed(seed)
                wav = self._vocode(mel[None])
            wavs.append(wav.squeeze(0).float().cpu().numpy())
        return wavs


def resample(wav: np.ndarray, orig_sr: int, target_sr: int) -> np.ndarray:
    if orig_sr == target_sr:
        return wav
    import torchaudio.functional as AF

    return AF.resample(torch.from_numpy(np.ascontiguousarray(wav)), orig_sr, target_sr).numpy()


def load_wav_16k(path: str | Path) -> torch.Tensor:
    """Mono float waveform at 16 kHz, shape (1, T), as CosyVoice's frontend expects."""
    import soundfile as sf

    data, sr = sf.read(str(path), dtype="float32", always_2d=True)
    return torch.from_numpy(resample(data.mean(axis=1), sr, 16000)).unsqueeze(0)


def cosyvoice_frontend(model_dir: str | Path):
    """CosyVoice's own frontend (speech tokenizer, speaker encoder, mel) for real prompt clips, as `CosyVoice2` /
    `CosyVoice3` build it (cosyvoice/cli/cosyvoice.py); it reads the clips itself
    (grpo.upstream.shims.torchaudio_load)."""
    from cosyvoice.cli.frontend import CosyVoiceFrontEnd

    from grpo.speech.cosyvoice_dir import load_cosyvoice_yaml
    from grpo.speech.family import family_of_dir
    from grpo.upstream.shims import torchaudio_load

    torchaudio_load()
    model_dir = Path(model_dir)
    fam = family_of_dir(model_dir)
    configs = load_cosyvoice_yaml(model_dir, skip=["llm", "flow", "hift"])
    for name in ("campplus.onnx", fam.speech_tokenizer):
        if not (model_dir / name).exists():
            raise FileNotFoundError(f"{model_dir / name} missing: real prompt clips need the model's full download")
    return CosyVoiceFrontEnd(configs["get_tokenizer"], configs["feat_extractor"], str(model_dir / "campplus.onnx"),
                             str(model_dir / fam.speech_tokenizer), "", configs["allowed_special"])


def speakers_from_clips(model_dir: str | Path, clips: list[dict]) -> dict:
    """spk2info entries for {text, wav} prompt clips, computed once with CosyVoice's frontend (as its
    `add_zero_shot_spk` does)."""
    frontend = cosyvoice_frontend(model_dir)
    speakers = {}
    for k, clip in enumerate(clips):
        features = frontend.frontend_zero_shot("", clip["text"], str(clip["wav"]), SAMPLE_RATE, "")
        features.pop("text", None)
        features.pop("text_len", None)
        speakers[clip.get("id", f"speaker_{k}")] = {name: v.cpu() if torch.is_tensor(v) else v
                                                    for name, v in features.items()}
    return speakers
