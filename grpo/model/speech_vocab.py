"""The Hugging Face vocabulary of a converted CosyVoice LLM: text tokens, then speech tokens.

Layout (T = CosyVoice's text tokenizer size, S = speech_token_size; the family's facts: grpo/speech/family.py):
  [0, T)            text tokens, ids identical to CosyVoice's own tokenizer (CosyVoice2Tokenizer / CosyVoice3Tokenizer)
  [T, T + S)        <|s_0|> ... <|s_{S-1}|>   ordinary added tokens: they survive
                    `decode(..., skip_special_tokens=True)`, which verl uses before the reward
  cosyvoice2:       T+S .. T+S+2  llm_decoder's rows S..S+2, the stop ids (S: end of speech),
                    then <|sos|>, <|task_id|> (the two llm_embedding rows)
  cosyvoice3:       T+S .. T+S+199 the control rows of speech_embedding/llm_decoder, all stop ids
                    (<|sos|> = S+0, <|eos|> = S+1, <|task_id|> = S+2, <|fill|> = S+3, reserved ...)
`speech_tokens.json` beside the model records this, and rollouts read it.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path

from grpo.speech.family import Family, family

SPEECH_TOKENS_FILE = "speech_tokens.json"
SPEECH_TOKEN_RE = re.compile(r"<\|s_(\d+)\|>")

CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if message['role'] == 'user' %}{{- '<|sos|>' + message['content'] + '<|task_id|>' }}"
    "{%- elif message['role'] == 'assistant' %}{{- message['content'] }}"
    "{%- endif %}{%- endfor %}"
)


@dataclass
class SpeechVocab:
    family: str
    text_vocab_size: int            # T
    speech_token_size: int          # S
    vocab_size: int                 # rows of the HF embedding / lm_head (padded)
    stop_token_ids: list[int]
    sos_token_id: int
    task_id_token_id: int
    control_tokens: dict[str, int] = field(default_factory=dict)

    @property
    def speech_token_offset(self) -> int:
        return self.text_vocab_size

    @property
    def model_family(self) -> Family:
        return family(self.family)

    @property
    def num_speech_rows(self) -> int:
        """Rows of CosyVoice's speech_embedding / llm_decoder (speech tokens + control rows)."""
        return self.speech_token_size + self.model_family.extra_speech_rows

    @property
    def eos_token_id(self) -> int:
        """The family's end of speech (row S for CosyVoice2, S+1 for CosyVoice3)."""
        return self.speech_token_offset + self.speech_token_size + self.model_family.eos_row

    @property
    def min_len_masked_id(self) -> int:
        """The id CosyVoice holds back before min_len: row `speech_token_size` of its decoder (`Qwen2LM.sampling_ids`
        at the pinned commit), i.e. CosyVoice2's first end-of-speech id and CosyVoice3's sos."""
        return self.speech_token_offset + self.speech_token_size

    def allowed_token_ids(self) -> list[int]:
        """What rollouts may sample: every speech token and the stop ids."""
        first = self.speech_token_offset
        return list(range(first, first + self.speech_token_size)) + list(self.stop_token_ids)

    def allowed_mask(self):
        """Boolean tensor over the vocabulary: True for the ids rollouts may sample."""
        import torch

        mask = torch.zeros(self.vocab_size, dtype=torch.bool)
        mask[torch.tensor(self.allowed_token_ids())] = True
        return mask

    def is_speech_id(self, token_id: int) -> bool:
        return 0 <= token_id - self.speech_token_offset < self.speech_token_size

    def to_speech_tokens(self, token_ids) -> list[int]:
        """HF ids -> CosyVoice speech tokens (0..S-1), stopping at the first stop id."""
        out = []
        stops = set(self.stop_token_ids)
        for t in token_ids:
            t = int(t)
            if t in stops:
                break
            if self.is_speech_id(t):
                out.append(t - self.speech_token_offset)
        return out

    def to_hf_ids(self, speech_tokens) -> list[int]:
        return [int(t) + self.speech_token_offset for t in speech_tokens]

    def save(self, model_dir: str | Path) -> None:
        data = asdict(self) | {"speech_token_offset": self.speech_token_offset,
                               "allowed_token_id_ranges": [[self.speech_token_offset,
                                                            self.speech_token_offset + self.speech_token_size]],
                               "chat_template": CHAT_TEMPLATE}
        Path(model_dir, SPEECH_TOKENS_FILE).write_text(json.dumps(data, indent=2), encoding="utf-8")

    @classmethod
    def load(cls, model_dir: str | Path) -> SpeechVocab:
        path = Path(model_dir, SPEECH_TOKENS_FILE)
        if not path.exists():
            raise FileNotFoundError(f"{path} not found: is {model_dir} a model converted by `grpo.model.convert`?")
        data = json.loads(path.read_text(encoding="utf-8"))
        names = cls.__dataclass_fields__
        return cls(**{k: v for k, v in data.items() if k in names})


def speech_token_strings(text: str) -> list[int]:
    """Parse `<|s_N|>` tokens out of a decoded response string (what verl hands the reward)."""
    return [int(m) for m in SPEECH_TOKEN_RE.findall(text)]


def format_speech_tokens(tokens) -> str:
    return "".join(f"<|s_{int(t)}|>" for t in tokens)


def build_hf_tokenizer(blank_dir: str | Path, family_name: str, speech_token_size: int, pad_to: int = 128):
    """CosyVoice's text tokenizer for the family + speech tokens + control tokens + chat template."""
    from tokenizers import AddedToken

    from grpo.speech.cosyvoice_dir import cosyvoice_text_tokenizer

    fam = family(family_name)
    tokenizer = cosyvoice_text_tokenizer(blank_dir, fam)
    T, S = len(tokenizer), speech_token_size
    speech = [AddedToken(f"<|s_{i}|>", special=False, normalized=False) for i in range(S)]
    control = list(fam.control_tokens)
    added = tokenizer.add_tokens(speech) + tokenizer.add_special_tokens(
        {"additional_special_tokens": control}, replace_extra_special_tokens=False)
    if len(tokenizer) != T + S + len(control) or added != S + len(control):
        raise RuntimeError("speech/control tokens collide with existing tokens in the text tokenizer")
    ids = {name: tokenizer.convert_tokens_to_ids(name) for name in control}
    if [ids[n] for n in control[:fam.extra_speech_rows]] != list(range(T + S, T + S + fam.extra_speech_rows)):
        raise RuntimeError("the control tokens did not land on the decoder rows past the speech tokens")
    tokenizer.chat_template = CHAT_TEMPLATE
    vocab = SpeechVocab(
        family=fam.name, text_vocab_size=T, speech_token_size=S,
        vocab_size=-(-len(tokenizer) // pad_to) * pad_to, stop_token_ids=[T + S + r for r in fam.stop_rows],
        sos_token_id=ids["<|sos|>"], task_id_token_id=ids["<|task_id|>"],
        control_tokens={name: ids[name] for name in control if not name.startswith("<|cv3_reserved_")},
    )
    return tokenizer, vocab
