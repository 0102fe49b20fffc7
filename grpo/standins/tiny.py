"""Tiny CosyVoice2-shaped models with random weights, written in the real download's file layout.

Stage -1 of the `tiny` profile builds, under `model.cosyvoice_dir`, the released CosyVoice2 layout at tiny
sizes (grpo.standins.released_layout; the flow encoder width stays 512: CosyVoice's UpsampleConformerEncoder
hard-codes it) with a byte-level BPE trained on the shipped data as CosyVoice-BlankEN's tokenizer, and
SenseVoice / Paraformer directories (config.yaml, model.pt, tokens, am.mvn) at the sizes it is given (the
realsize profile builds those with the same functions at the released sizes).
Everything downstream loads these through the same code as the real models.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from omegaconf import DictConfig

from grpo.config import resolve_path
from grpo.speech.family import Family

log = logging.getLogger(__name__)

# Qwen2's chat specials; CosyVoice's QwenTokenizer adds its own on top at load time.
QWEN2_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

def _split_han(text: str) -> str:
    """Newlines between CJK characters: BPE merges then never cross a character (one token per character)."""
    return "".join(ch + "\n" if "\u3400" <= ch <= "\u9fff" else ch for ch in text)


def build_text_tokenizer(texts: list[str], vocab_size: int, out_dir: Path) -> int:
    """Train a byte-level BPE with Qwen2's pre-tokenizer and save it as a Qwen2 tokenizer folder.

    Merges are learnt within characters only, so Chinese text is one token per character (the real
    Qwen2 vocabulary also holds most characters whole); a tiny LLM then learns how characters sound
    instead of how byte fragments do."""
    from tokenizers import pre_tokenizers, trainers
    from transformers import Qwen2Tokenizer

    backend = Qwen2Tokenizer()._tokenizer  # Qwen2 normaliser, pre-tokenizer regex and byte-level decoder
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    backend.train_from_iterator([_split_han(t) for t in texts], trainer)
    model = json.loads(backend.to_str())["model"]
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in model["merges"]]
    tokenizer = Qwen2Tokenizer(vocab=model["vocab"], merges=merges)
    tokenizer.add_special_tokens({"additional_special_tokens": QWEN2_SPECIALS[1:]})
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(out_dir)
    # the real CosyVoice-BlankEN ships vocab.json + merges.txt; write them too
    (out_dir / "vocab.json").write_text(json.dumps(model["vocab"], ensure_ascii=False), encoding="utf-8")
    merges_txt = "#version: 0.2\n" + "\n".join(" ".join(m) for m in merges) + "\n"
    (out_dir / "merges.txt").write_text(merges_txt, encoding="utf-8")
    return len(tokenizer)


def build_cosyvoice_dir(model_dir: Path, tiny: DictConfig, texts: list[str], family: Family) -> None:
    """The family's released layout (grpo.standins.released_layout) at tiny sizes, with a BPE trained on `texts` and
    the family's prompt prefix (so that its English words are whole tokens, as in Qwen's real BPE: CosyVoice3's
    prefix is then 7 tokens, not 29 bytes, and the tiny LLM's warm start gets past its phase change); no speech
    tokenizer (the tiny profile's prompts are seeded stand-ins, not wavs)."""
    from grpo.standins.released_layout import build_cosyvoice_dir as build_released

    bpe_texts = [*texts, family.prompt_prefix] if family.prompt_prefix else texts
    build_released(model_dir, tiny, lambda blank: build_text_tokenizer(bpe_texts, tiny.text_vocab_size, blank),
                   family, speech_tokenizer=False)


def write_funasr_config(out_dir: Path, template: str, sizes: DictConfig, seed: int) -> DictConfig:
    """A funasr model directory's config.yaml (templates/<template> filled with `sizes`) and am.mvn (80-dim fbank,
    7 frames stacked); returns the config and seeds torch for the random weights."""
    from omegaconf import OmegaConf

    from grpo.standins import render

    yaml_text = render(template, **sizes)
    (out_dir / "config.yaml").write_text(yaml_text, encoding="utf-8")
    write_am_mvn(out_dir / "am.mvn", 80 * 7)
    torch.manual_seed(seed)
    return OmegaConf.create(yaml_text)


def write_am_mvn(path: Path, dim: int) -> None:
    """Kaldi nnet text format CMVN (shift and scale), as SenseVoice's am.mvn."""
    zeros = " ".join(["0"] * dim)
    ones = " ".join(["1"] * dim)
    path.write_text(
        "<Nnet>\n"
        f"<Splice> {dim} {dim}\n[ 0 ]\n"
        f"<AddShift> {dim} {dim}\n<LearnRateCoef> 0 [ {zeros} ]\n"
        f"<Rescale> {dim} {dim}\n<LearnRateCoef> 0 [ {ones} ]\n"
        "</Nnet>\n",
        encoding="utf-8",
    )


# The tag pieces of SenseVoiceSmall's own BPE (language, emotion, event, text normalisation): SenseVoice
# decodes its first output frames to these, so a transcript starts with e.g. <|zh|><|NEUTRAL|><|Speech|><|woitn|>.
SENSEVOICE_TAGS = ["<|zh|>", "<|en|>", "<|yue|>", "<|ja|>", "<|ko|>", "<|nospeech|>", "<|HAPPY|>", "<|SAD|>",
                   "<|ANGRY|>", "<|NEUTRAL|>", "<|EMO_UNKNOWN|>", "<|Speech|>", "<|BGM|>", "<|Laughter|>",
                   "<|Applause|>", "<|Event_UNK|>", "<|withitn|>", "<|woitn|>"]


def filler_symbols(count: int, taken: set[str]) -> list[str]:
    """`count` symbols outside `taken` that pad a token inventory to a released vocabulary size: CJK characters
    first (what a Chinese ASR vocabulary mostly holds), then numbered placeholders."""
    out = [ch for ch in map(chr, range(0x4E00, 0xA000)) if ch not in taken][:count]
    return out + [f"<|filler_{k}|>" for k in range(count - len(out))]


def _train_sentencepiece(texts: list[str], vocab_size: int, symbols: list[str]) -> bytes:
    import io

    import sentencepiece as spm

    model_bytes = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(texts), model_writer=model_bytes, vocab_size=vocab_size,
        model_type="unigram", character_coverage=1.0, hard_vocab_limit=False,
        unk_id=0, bos_id=1, eos_id=2, pad_id=-1, minloglevel=2, user_defined_symbols=symbols,
    )
    return model_bytes.getvalue()


def build_sensevoice_dir(out_dir: Path, sizes: DictConfig, texts: list[str], seed: int) -> None:
    """config.yaml, random model.pt, sentencepiece bpe.model of the model's vocab size, am.mvn.
    `sizes.exact_vocab`: pad the pieces learnt from `texts` with filler symbols to exactly `sizes.vocab_size`
    (the released size); otherwise the vocabulary is what the texts give, at most vocab_size."""
    import sentencepiece as spm
    from funasr.models.sense_voice.model import SenseVoiceSmall
    from omegaconf import OmegaConf

    out_dir.mkdir(parents=True, exist_ok=True)
    proto = _train_sentencepiece(texts, sizes.vocab_size, SENSEVOICE_TAGS)
    if sizes.get("exact_vocab", False):
        sp = spm.SentencePieceProcessor(model_proto=proto)
        taken = {sp.id_to_piece(i) for i in range(sp.get_piece_size())} | {ch for t in texts for ch in t}
        fill = filler_symbols(sizes.vocab_size - sp.get_piece_size(), taken)
        proto = _train_sentencepiece(texts, sizes.vocab_size, SENSEVOICE_TAGS + fill)
    (out_dir / "bpe.model").write_bytes(proto)
    vocab_size = spm.SentencePieceProcessor(model_proto=proto).get_piece_size()
    conf = write_funasr_config(out_dir, "sensevoice.yaml", sizes, seed)
    model = SenseVoiceSmall(
        encoder=conf.encoder, encoder_conf=OmegaConf.to_container(conf.encoder_conf),
        input_size=80 * 7, vocab_size=vocab_size, **OmegaConf.to_container(conf.model_conf),
    )
    torch.save(model.state_dict(), out_dir / "model.pt")
    log.info("SenseVoice dir written: %s (vocab %d)", out_dir, vocab_size)


# ---------------------------------------------------------------- the synthetic codebook's texts


def read_rows(paths) -> list[dict]:
    """The JSON lines of every existing file of `paths` (relative to the repository root)."""
    rows = []
    for p in paths:
        p = resolve_path(p)
        if p.exists():
            rows += [json.loads(line) for line in p.read_text(encoding="utf-8").splitlines() if line.strip()]
    return rows


def codebook_texts(cfg: DictConfig) -> list[tuple[str, str]]:
    """(text, language) of every text and prompt text in the codebook's source files."""
    return [(t, r.get("language", "zh")) for r in read_rows(cfg.reward.codebook.sources)
            for t in (r.get("text"), r.get("prompt_text")) if isinstance(t, str)]


def build_default_codebook(cfg: DictConfig):
    from grpo.speech.codebook import build_codebook

    return build_codebook(codebook_texts(cfg), cfg.model.tiny.speech_token_size, cfg.reward.codebook.silence_fraction,
                          cfg.reward.codebook.seed)
