"""CosyVoice's text frontend, in one place: normalise a text as `CosyVoiceFrontEnd.text_normalize` does, and build
the LLM's text ids as `frontend_zero_shot` + `Qwen2LM.inference` do (prompt text and target text tokenized
separately, then concatenated: BPE never merges across the join).

Shim (token2wav-cosyvoice 0.1.0, `cosyvoice/cli/frontend.py`, `CosyVoiceFrontEnd.__init__`): the lines that set
`self.use_ttsfrd` and the WeTextProcessing normalisers are commented out (`# self.use_ttsfrd = use_ttsfrd`), so
`text_normalize` raises AttributeError. `normalizer()` builds a frontend without its ONNX sessions (text
normalisation needs only the tokenizer) and sets those attributes as the commented lines would, with wetext
(WeTextProcessing's runtime) in place of `tn`: zh with remove_erhua=False, full_to_half=False; en defaults;
inflect for numbers. `check_shim()` fails loudly when the pinned file changes.
"""

from __future__ import annotations

import inspect
import logging
from functools import lru_cache
from pathlib import Path

log = logging.getLogger(__name__)

SHIMMED_VERSION = "0.1.0"
SHIMMED_LINE = "# self.use_ttsfrd = use_ttsfrd"


class FrontendShimOutdated(RuntimeError):
    """The pinned CosyVoice frontend changed: re-check grpo/text_frontend.py's shim."""


def check_shim() -> None:
    from importlib.metadata import version

    from cosyvoice.cli.frontend import CosyVoiceFrontEnd

    installed = version("token2wav-cosyvoice")
    if installed != SHIMMED_VERSION or SHIMMED_LINE not in inspect.getsource(CosyVoiceFrontEnd.__init__):
        raise FrontendShimOutdated(f"token2wav-cosyvoice {installed}: cosyvoice/cli/frontend.py no longer contains "
                                   f"{SHIMMED_LINE!r} (shimmed for {SHIMMED_VERSION}); see grpo/text_frontend.py")


@lru_cache(maxsize=4)
def normalizer(blank_dir: str):
    """A CosyVoiceFrontEnd that can run `text_normalize` (CosyVoice's tokenizer from `blank_dir`)."""
    import inflect
    from cosyvoice.cli.frontend import CosyVoiceFrontEnd
    from cosyvoice.tokenizer.tokenizer import get_qwen_tokenizer
    from wetext import Normalizer

    check_shim()
    if not (Path(blank_dir) / "vocab.json").exists():
        raise FileNotFoundError(f"data.frontend_tokenizer_dir={blank_dir}: no CosyVoice tokenizer there (run stage -1 "
                                f"first, or set data.text_frontend=false)")
    frontend = object.__new__(CosyVoiceFrontEnd)      # no campplus / speech-tokenizer sessions: text only
    frontend.tokenizer = get_qwen_tokenizer(blank_dir, skip_special_tokens=True)
    frontend.allowed_special = "all"
    frontend.use_ttsfrd = False
    frontend.zh_tn_model = Normalizer(lang="zh", operator="tn", remove_erhua=False, full_to_half=False)
    frontend.en_tn_model = Normalizer(lang="en", operator="tn")
    frontend.inflect_parser = inflect.engine()
    return frontend


def normalize(text: str, blank_dir: str) -> str:
    """CosyVoice's `text_normalize(text, split=False)`: one normalised string (its segments joined)."""
    return normalizer(str(blank_dir)).text_normalize(text, split=False)


def llm_text_ids(tokenizer, target: str, prompt: str = "") -> list[int]:
    """Text ids of the LLM input (without sos / task_id): the prompt's tokens, then the target's."""
    ids = tokenizer.encode(prompt, add_special_tokens=False) if prompt else []
    return ids + tokenizer.encode(target, add_special_tokens=False)
