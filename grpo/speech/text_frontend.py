"""CosyVoice's text frontend, in one place: normalise a text with upstream's own `CosyVoiceFrontEnd.text_normalize`
(the pinned commit, grpo/upstream/pin.py), and build the LLM's text ids as `frontend_zero_shot` + `Qwen2LM.inference`
do (prompt text and target text tokenized separately, then concatenated: BPE never merges across the join).

`CosyVoice2.inference_zero_shot` normalises the two texts differently: the prompt text with `split=False`, the
target with `split=True`, whose segments end in punctuation (a Chinese text without it gains "。", an English
one "."). Upstream then synthesises each segment on its own; a target of several segments (Chinese past ~80
characters) is one LLM input here, its segments joined (`target_segments` tells how many there were).

The frontend is upstream's class built by its own `__init__` -- so it picks the normaliser upstream picks: ttsfrd
where installed, else wetext (`Normalizer(remove_erhua=False)` for Chinese, `Normalizer()` for English) -- with
the tokenizer the released yaml names (`get_qwen_tokenizer(token_path=CosyVoice-BlankEN, skip_special_tokens=True)`).
Text needs neither of its two ONNX sessions (speaker encoder, speech tokenizer), so they are given a one-node
stand-in model; a text holding `<|...|>` is left as is, as upstream leaves it.
"""

from __future__ import annotations

import logging
import tempfile
from functools import lru_cache, partial
from pathlib import Path

log = logging.getLogger(__name__)


@lru_cache(maxsize=1)
def _stand_in_onnx() -> str:
    """A one-node ONNX model (Identity) for the frontend's two sessions, which text normalisation never runs."""
    import onnx
    from onnx import TensorProto, helper

    graph = helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "unused",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])])
    path = Path(tempfile.mkdtemp(prefix="cosyvoice-grpo-")) / "unused.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=8), str(path))
    return str(path)


@lru_cache(maxsize=4)
def normalizer(blank_dir: str, family: str):
    """Upstream's CosyVoiceFrontEnd for text (`text_normalize`, `tokenizer`): the family's tokenizer from
    `blank_dir`, as its yaml's `get_tokenizer` entry builds it."""
    from cosyvoice.cli.frontend import CosyVoiceFrontEnd
    from cosyvoice.tokenizer.tokenizer import get_qwen_tokenizer

    from grpo.speech.family import family as family_named

    if not (Path(blank_dir) / "vocab.json").exists():
        raise FileNotFoundError(f"data.frontend_tokenizer_dir={blank_dir}: no CosyVoice tokenizer there (run stage -1 "
                                f"first, or set data.text_frontend=false)")
    unused = _stand_in_onnx()
    get_tokenizer = partial(get_qwen_tokenizer, token_path=str(blank_dir), skip_special_tokens=True,
                            version=family_named(family).tokenizer_version)
    return CosyVoiceFrontEnd(get_tokenizer, None, unused, unused, "", "all")


def target_segments(text: str, blank_dir: str, family: str) -> list[str]:
    """What `inference_zero_shot` synthesises for a target text: `text_normalize(text, split=True)`."""
    return normalizer(str(blank_dir), family).text_normalize(text, split=True)


def normalize(text: str, blank_dir: str, family: str) -> str:
    """A target text (training text, an evaluation item's text) as CosyVoice feeds it: its segments joined."""
    return "".join(target_segments(text, blank_dir, family))


def normalize_prompt(text: str, blank_dir: str, family: str) -> str:
    """A prompt text as `inference_zero_shot` feeds it: `text_normalize(text, split=False)` (a text holding
    `<|...|>`, such as CosyVoice3's prompt prefix, is left as it is)."""
    return normalizer(str(blank_dir), family).text_normalize(text, split=False)


def llm_text_ids(tokenizer, target: str, prompt: str = "") -> list[int]:
    """Text ids of the LLM input (without sos / task_id): the prompt's tokens, then the target's."""
    ids = tokenizer.encode(prompt, add_special_tokens=False) if prompt else []
    return ids + tokenizer.encode(target, add_special_tokens=False)
