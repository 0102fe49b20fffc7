"""The CosyVoice model families in one place: what differs between CosyVoice2 (CosyVoice2-0.5B) and CosyVoice3
(Fun-CosyVoice3-0.5B-2512), as upstream CosyVoice at the pinned commit (grpo/upstream/pin.py) defines it. Stages ask a
`Family` for a fact instead of testing the family's name; `model.family` picks one.

Read from upstream (file:class there):
- cosyvoice/cli/cosyvoice.py `CosyVoice2` / `CosyVoice3`: the model directory's yaml, its speech tokenizer file;
- cosyvoice/llm/llm.py `Qwen2LM` / `CosyVoice3LM`: the rows of `speech_embedding` / `llm_decoder` past the S speech
  tokens (3 / 200), where sos and task_id live (CosyVoice2: the two `llm_embedding` rows; CosyVoice3: speech rows
  S and S+2), the end of speech (S / S+1) and `stop_token_ids` (S..S+2 / S..S+199);
- cosyvoice/tokenizer/tokenizer.py `get_qwen_tokenizer(version=...)`: CosyVoice2Tokenizer / CosyVoice3Tokenizer;
- example.py, vllm_example.py: CosyVoice3's prompt text starts with "You are a helpful assistant.<|endofprompt|>"
  (`CosyVoice3LM.inference` asserts <|endofprompt|> is in its input);
- cosyvoice/cli/model.py `CosyVoice2Model` / `CosyVoice3Model`: token2wav, and CosyVoice3's silent tokens, of
  which `llm_job` keeps at most 5 in a row.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from functools import cached_property

MAX_SILENT_RUN = 5     # CosyVoice3Model.llm_job: max_silent_token_num


@dataclass(frozen=True)
class Family:
    name: str
    yaml: str                        # the model directory's config file
    tokenizer_version: str           # get_qwen_tokenizer(version=...), which builds upstream_tokenizer
    extra_speech_rows: int           # speech_embedding / llm_decoder rows past the S speech tokens
    eos_row: int                     # the end of speech, as an offset from S
    stop_rows: tuple[int, ...]       # the LM's stop_token_ids, offsets from S
    sos_row: int | None              # offsets from S of sos / task_id (None: they are llm_embedding rows)
    task_id_row: int | None
    control_tokens: tuple[str, ...]  # the HF names of the rows past S (then sos/task_id when they are not rows)
    speech_tokenizer: str            # the speech tokenizer's ONNX file in the model directory
    prompt_prefix: str               # what the LLM's text starts with (upstream's examples)
    upstream_tokenizer: str          # module:class of upstream's tokenizer, LM, model and entry class
    upstream_lm: str
    upstream_model: str
    upstream_entry: str              # (where a GPU profile downloads the directory from: model.modelscope.cosyvoice)

    @property
    def has_llm_embedding(self) -> bool:
        return self.sos_row is None

    @cached_property
    def silent_tokens(self) -> frozenset[int]:
        """The speech tokens upstream's model class trims runs of (none for CosyVoice2)."""
        return frozenset(upstream_class(self.upstream_model)(None, None, None).silent_tokens)

    def trim_silence(self, tokens: list[int]) -> list[int]:
        """What `CosyVoiceModel.llm_job` hands token2wav: runs of silent tokens cut after MAX_SILENT_RUN."""
        silent, out, run = self.silent_tokens, [], 0
        for t in tokens:
            if t in silent:
                run += 1
                if run > MAX_SILENT_RUN:
                    continue
            else:
                run = 0
            out.append(t)
        return out


def upstream_class(path: str):
    module, name = path.split(":")
    return getattr(importlib.import_module(module), name)


FAMILIES = {
    "cosyvoice2": Family(
        name="cosyvoice2", yaml="cosyvoice2.yaml", tokenizer_version="cosyvoice2", extra_speech_rows=3,
        eos_row=0, stop_rows=(0, 1, 2), sos_row=None, task_id_row=None,
        control_tokens=("<|speech_eos|>", "<|speech_eos_1|>", "<|speech_fill|>", "<|sos|>", "<|task_id|>"),
        speech_tokenizer="speech_tokenizer_v2.onnx", prompt_prefix="",
        upstream_tokenizer="cosyvoice.tokenizer.tokenizer:CosyVoice2Tokenizer", upstream_lm="cosyvoice.llm.llm:Qwen2LM",
        upstream_model="cosyvoice.cli.model:CosyVoice2Model",
        upstream_entry="cosyvoice.cli.cosyvoice:CosyVoice2"),
    "cosyvoice3": Family(
        name="cosyvoice3", yaml="cosyvoice3.yaml", tokenizer_version="cosyvoice3", extra_speech_rows=200,
        eos_row=1, stop_rows=tuple(range(200)), sos_row=0, task_id_row=2,
        control_tokens=("<|sos|>", "<|eos|>", "<|task_id|>", "<|fill|>",
                        *(f"<|cv3_reserved_{i}|>" for i in range(4, 200))),
        speech_tokenizer="speech_tokenizer_v3.onnx", prompt_prefix="You are a helpful assistant.<|endofprompt|>",
        upstream_tokenizer="cosyvoice.tokenizer.tokenizer:CosyVoice3Tokenizer",
        upstream_lm="cosyvoice.llm.llm:CosyVoice3LM", upstream_model="cosyvoice.cli.model:CosyVoice3Model",
        upstream_entry="cosyvoice.cli.cosyvoice:CosyVoice3"),
}


def family(name: str) -> Family:
    if name not in FAMILIES:
        raise ValueError(f"model.family must be one of {', '.join(FAMILIES)}, got {name!r}")
    return FAMILIES[name]


def family_of_llm(state_dict: dict) -> Family:
    """The family an llm.pt belongs to: CosyVoice2's LM has llm_embedding (sos, task_id), CosyVoice3's does not."""
    return FAMILIES["cosyvoice2" if "llm_embedding.weight" in state_dict else "cosyvoice3"]


def family_of_dir(model_dir) -> Family:
    """The family of a CosyVoice model directory, by its yaml."""
    from pathlib import Path

    found = [f for f in FAMILIES.values() if (Path(model_dir) / f.yaml).exists()]
    if len(found) != 1:
        names = " or ".join(f.yaml for f in FAMILIES.values())
        raise FileNotFoundError(f"{model_dir}: expected a CosyVoice model directory with {names}")
    return found[0]
