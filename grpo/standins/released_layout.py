"""Random weights in the released model directory layouts (CosyVoice2-0.5B, Fun-CosyVoice3-0.5B-2512), at any size:
one builder for the tiny and the realsize profiles of both families (stage -1).

`build_cosyvoice_dir(model_dir, sizes, write_tokenizer, family)` writes every file of
grpo.speech.cosyvoice_dir.released_files(family): the family's yaml with every key the released file has (the LLM,
flow and HiFT modules, the GAN wrapper and CosyVoice's training-data pipeline) -- CosyVoice2's from the template
templates/cosyvoice2.yaml, CosyVoice3's as upstream ships it (examples/libritts/cosyvoice3/conf/cosyvoice3.yaml at
the pinned commit) with only its sizes changed --, `CosyVoice-BlankEN/` (a tokenizer written by the caller, a
Qwen2 config and random weights), `llm.pt` / `flow.pt` / `hift.pt` (state dicts of upstream's own classes built
from that yaml), `campplus.onnx` (CAM++'s interface: fbank (1, T, 80) -> (1, 192)) and the speech tokenizer's
ONNX file (S3Tokenizer's interface: 128-bin log-mel (1, 128, T) and its length -> tokens at 25 Hz). Everything
downstream loads the result through the same code as the download.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import torch
from omegaconf import DictConfig

from grpo.speech.cosyvoice_dir import BLANK_DIR, load_cosyvoice_yaml
from grpo.speech.family import FAMILIES, Family
from grpo.standins import render

log = logging.getLogger(__name__)

# The Qwen2 config of CosyVoice-BlankEN beyond the sizes (Qwen2.5-0.5B's public config.json)
QWEN2_CONFIG_FIXED = dict(hidden_act="silu", rms_norm_eps=1e-6, use_sliding_window=False, attention_dropout=0.0,
                          tie_word_embeddings=True, initializer_range=0.02, use_cache=True)


def cosyvoice2_yaml(sizes: DictConfig) -> str:
    f = sizes.flow
    return render("cosyvoice2.yaml",
        hidden=sizes.llm.hidden_size, speech_token_size=sizes.speech_token_size, flow_hidden=f.hidden,
        flow_heads=f.heads, flow_linear=f.linear_units, flow_blocks=f.blocks, decoder_channels=f.decoder_channels,
        decoder_blocks=f.decoder_blocks, mid_blocks=f.mid_blocks, decoder_heads=f.get("decoder_heads", 2),
        decoder_head_dim=f.get("decoder_head_dim", 32), hift_channels=sizes.hift.base_channels)


# CosyVoice3's sizes in upstream's cosyvoice3.yaml: where each lives, and which key of `sizes` sets it
COSYVOICE3_SIZES = {
    ("llm_input_size",): "llm.hidden_size", ("llm_output_size",): "llm.hidden_size",
    ("llm", "speech_token_size"): "speech_token_size", ("flow", "vocab_size"): "speech_token_size",
    ("flow", "pre_lookahead_layer", "channels"): "dit.lookahead_channels",
    ("flow", "decoder", "estimator", "dim"): "dit.dim", ("flow", "decoder", "estimator", "depth"): "dit.depth",
    ("flow", "decoder", "estimator", "heads"): "dit.heads",
    ("flow", "decoder", "estimator", "dim_head"): "dit.dim_head",
    ("flow", "decoder", "estimator", "ff_mult"): "dit.ff_mult",
    ("hift", "base_channels"): "hift.base_channels", ("hift", "f0_predictor", "cond_channels"): "hift.base_channels",
}


def cosyvoice3_yaml(sizes: DictConfig) -> str:
    """Upstream's cosyvoice3.yaml, byte for byte where `sizes` are its own (realsize), else with those changed."""
    import io

    from omegaconf import OmegaConf
    from ruamel.yaml import YAML

    from grpo.upstream.pin import config_file

    text = config_file("examples/libritts/cosyvoice3/conf/cosyvoice3.yaml").read_text(encoding="utf-8")
    yaml = YAML()
    yaml.indent(mapping=4, sequence=4, offset=4)
    data, changed = yaml.load(text), False
    for path, key in COSYVOICE3_SIZES.items():
        node = data
        for part in path[:-1]:
            node = node[part]
        value = OmegaConf.select(sizes, key)
        if node[path[-1]] != value:
            node[path[-1]], changed = value, True
    if not changed:
        return text
    out = io.StringIO()
    yaml.dump(data, out)
    return out.getvalue()


YAML_WRITERS = {"cosyvoice2": cosyvoice2_yaml, "cosyvoice3": cosyvoice3_yaml}


def write_cosyvoice_yaml(model_dir: Path, sizes: DictConfig, family: Family) -> Path:
    path = model_dir / family.yaml
    path.write_text(YAML_WRITERS[family.name](sizes), encoding="utf-8")
    return path


def write_blank_qwen(out_dir: Path, llm: DictConfig, vocab_size: int, seed: int, dtype: str) -> None:
    """CosyVoice-BlankEN's config.json, generation_config.json and random model.safetensors (Qwen2ForCausalLM;
    CosyVoice's Qwen2Encoder loads it, llm.pt then overrides the weights)."""
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=vocab_size, hidden_size=llm.hidden_size, intermediate_size=llm.intermediate_size,
        num_hidden_layers=llm.num_layers, num_attention_heads=llm.num_heads, num_key_value_heads=llm.num_kv_heads,
        max_position_embeddings=llm.max_position_embeddings, rope_theta=float(llm.get("rope_theta", 10000.0)),
        sliding_window=llm.max_position_embeddings, max_window_layers=llm.num_layers, bos_token_id=None,
        eos_token_id=None, torch_dtype=dtype, **QWEN2_CONFIG_FIXED)
    torch.manual_seed(seed)
    with torch.device("cpu"):
        model = Qwen2ForCausalLM(config).to(getattr(torch, dtype))
    model.save_pretrained(out_dir)
    GenerationConfig(do_sample=False, max_new_tokens=2048).save_pretrained(out_dir)


class RandomSpeakerEncoder(torch.nn.Module):
    """CAM++'s interface (mean-normalised 80-dim fbank (1, T, 80) -> embedding (1, 192)): one random projection
    and RMS pooling, a stand-in for CosyVoice2's campplus.onnx (its architecture is not in any package here)."""

    def __init__(self, seed: int):
        super().__init__()
        torch.manual_seed(seed)
        self.proj = torch.nn.Linear(80, 192)

    def forward(self, feats):
        return self.proj(feats).pow(2).mean(1).sqrt()


def build_speaker_verifier(path: Path, seed: int) -> Path:
    torch.onnx.export(RandomSpeakerEncoder(seed), (torch.randn(1, 50, 80),), str(path), input_names=["input"],
                      output_names=["output"], dynamic_axes={"input": {1: "T"}}, dynamo=False)
    return path


class _Block(torch.nn.Module):
    """Pre-norm self-attention + MLP written with reshapes ONNX export keeps dynamic (nn.MultiheadAttention's
    traced graph fixes the sequence length)."""

    def __init__(self, width: int, heads: int):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = torch.nn.LayerNorm(width), torch.nn.LayerNorm(width)
        self.qkv, self.out = torch.nn.Linear(width, 3 * width), torch.nn.Linear(width, width)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(width, 4 * width), torch.nn.GELU(),
                                       torch.nn.Linear(4 * width, width))

    def forward(self, x, bias):
        b, t, w = x.shape
        q, k, v = self.qkv(self.norm1(x)).reshape(b, -1, 3, self.heads, w // self.heads).permute(2, 0, 3, 1, 4)
        att = torch.softmax(q @ k.transpose(-1, -2) / (w // self.heads) ** 0.5 + bias, dim=-1) @ v
        x = x + self.out(att.transpose(1, 2).reshape(b, -1, w))
        return x + self.mlp(self.norm2(x))


class RandomSpeechTokenizer(torch.nn.Module):
    """S3Tokenizer v2's interface and size, random weights: 128-bin log-mel (1, 128, T) and its length (1,) int32
    -> speech token ids (1, ceil(T / 4)) int32 in [0, 3**8). Two strided convolutions (4x: 100 Hz mel -> 25 Hz),
    six 1280-wide attention blocks and an 8-dimensional ternary FSQ, as S3Tokenizer v2 has. Not its exact
    blocks: the `s3tokenizer` package's model holds complex rotary buffers that ONNX export cannot trace, and
    nothing here depends on which random network produces the tokens."""

    def __init__(self, seed: int, width: int = 1280, heads: int = 20, layers: int = 6, levels: int = 8):
        super().__init__()
        torch.manual_seed(seed)
        self.conv1 = torch.nn.Conv1d(128, width, 3, stride=2, padding=1)
        self.conv2 = torch.nn.Conv1d(width, width, 3, stride=2, padding=1)
        self.blocks = torch.nn.ModuleList(_Block(width, heads) for _ in range(layers))
        self.norm = torch.nn.LayerNorm(width)
        self.project = torch.nn.Linear(width, levels)
        self.register_buffer("powers", 3 ** torch.arange(levels), persistent=False)

    def forward(self, feats, feats_length):
        x = torch.nn.functional.gelu(self.conv2(torch.nn.functional.gelu(self.conv1(feats)))).transpose(1, 2)
        frames = (feats_length.long() + 3) // 4                          # valid output frames (two stride-2 convs)
        positions = torch.cumsum(torch.ones_like(x[0, :, 0]), 0) - 1
        bias = (positions[None, :] >= frames[:, None]).float()[:, None, None, :] * -1e4   # padded keys masked
        for block in self.blocks:
            x = block(x, bias)
        digits = torch.round(torch.tanh(4 * self.project(self.norm(x)))) + 1         # ternary FSQ: {0, 1, 2} per level
        return (digits.long() * self.powers).sum(-1).int()


def build_speech_tokenizer(path: Path, seed: int) -> Path:
    """The speech tokenizer's ONNX file with random weights at S3Tokenizer v2's size (about 120M parameters); it
    stands in for v3 too (CosyVoice3's frontend calls it the same way)."""
    feats = torch.randn(1, 128, 200)
    torch.onnx.export(RandomSpeechTokenizer(seed).eval(), (feats, torch.tensor([200], dtype=torch.int32)),
                      str(path), input_names=["feats", "feats_length"], output_names=["indices"],
                      dynamic_axes={"feats": {2: "T"}, "indices": {1: "T_out"}}, dynamo=False)
    return path


def build_cosyvoice_dir(model_dir: Path, sizes: DictConfig, write_tokenizer: Callable[[Path], int], family: Family,
                        blank_dtype: str = "float32", speech_tokenizer: bool = True) -> dict:
    """Every released file of the family at `sizes` with random weights; `write_tokenizer(blank_dir)` writes the
    BlankEN tokenizer files and returns the text vocabulary size (CosyVoice's specials not included)."""
    from grpo.speech.cosyvoice_dir import cosyvoice_text_tokenizer

    model_dir = Path(model_dir)
    blank = model_dir / BLANK_DIR
    blank.mkdir(parents=True, exist_ok=True)
    for stale in {f.yaml for f in FAMILIES.values()} - {family.yaml}:
        (model_dir / stale).unlink(missing_ok=True)
    n_text = write_tokenizer(blank)
    # room for the family's specials, rounded up as Qwen2 rounds its embedding (151,936 at real size)
    with_specials = len(cosyvoice_text_tokenizer(blank, family))
    vocab_size = sizes.llm.get("vocab_size") or -(-with_specials // 64) * 64
    write_blank_qwen(blank, sizes.llm, vocab_size, sizes.seed, blank_dtype)
    write_cosyvoice_yaml(model_dir, sizes, family)
    configs = load_cosyvoice_yaml(model_dir)      # CosyVoice's own classes (the yaml seeds torch itself)
    for name in ("llm", "flow", "hift"):
        module = configs[name].float()            # the released .pt files are float32
        torch.save(module.state_dict(), model_dir / f"{name}.pt")
    del configs
    build_speaker_verifier(model_dir / "campplus.onnx", sizes.seed)
    if speech_tokenizer:
        build_speech_tokenizer(model_dir / family.speech_tokenizer, sizes.seed)
    summary = {"text_vocab": n_text, "embedding_rows": vocab_size}
    log.info("%s dir with random weights written: %s (text vocab %d, embedding rows %d)", family.name, model_dir,
             n_text, vocab_size)
    return summary
