"""The HTTP API's request validation (pure functions, no server needed).

POST /score  {"items": [{"id": str, "tokens": [int, ...], "text": str, "language": "zh"|"en"}]}
Every problem of every item is reported, each naming the item index, its id and the field. A valid request
is answered 200 with one result per item, in order: {"id", "status": "ok", "reward", "error_rate",
"transcript", "components": {"cer", "duration"[, "sim"]}, "replica"} or, for an item the backend failed on,
{"id", "status": "error", "error", "detail"}.
"""

from __future__ import annotations

import json
import reprlib
from dataclasses import dataclass

from grpo.speech.scoring import LANGUAGES, text_to_units
from reward_server.backends import ScoreItem


@dataclass(frozen=True)
class Limits:
    max_items_per_request: int = 512
    max_tokens_per_item: int = 3000
    max_text_chars: int = 500
    max_request_bytes: int = 8_000_000
    speech_token_size: int = 6561
    max_tokens_per_request: int = 400_000     # all items together: bounds one request's backend work
    max_id_chars: int = 1024


class RequestError(Exception):
    """A client error: HTTP status and a JSON body that names what is wrong."""

    def __init__(self, status: int, error: str, problems: list[dict] | None = None):
        self.status, self.error, self.problems = status, error, problems or []
        super().__init__(error)

    def body(self) -> dict:
        return {"error": self.error, "problems": self.problems}


def parse_request(raw: bytes, limits: Limits) -> list[ScoreItem]:
    """Bytes of a POST /score body -> validated items, or RequestError (400/413/422)."""
    if len(raw) > limits.max_request_bytes:
        raise RequestError(413, f"request body of {len(raw)} bytes exceeds the limit of {limits.max_request_bytes}")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise RequestError(400, f"request body is not valid UTF-8 (byte {exc.start})") from None
    try:
        body = json.loads(text)
    except json.JSONDecodeError as exc:
        raise RequestError(400, f"malformed JSON: {exc.msg} at line {exc.lineno} column {exc.colno}") from None
    except RecursionError:
        raise RequestError(400, "JSON nested too deeply") from None
    except ValueError as exc:      # e.g. an integer longer than Python's int-conversion limit
        raise RequestError(400, f"JSON value refused: {str(exc)[:120]}") from None
    if not isinstance(body, dict) or "items" not in body:
        raise RequestError(422, 'expected a JSON object with an "items" list')
    items = body["items"]
    if not isinstance(items, list) or not items:
        raise RequestError(422, '"items" must be a non-empty list')
    if len(items) > limits.max_items_per_request:
        raise RequestError(413, f"{len(items)} items exceed the limit of {limits.max_items_per_request} per request")
    parsed, problems = [], []
    for index, item in enumerate(items):
        item_problems = _check_item(item, limits)
        if item_problems:
            problems += [{"item": index, "id": _echo_id(item, limits), "field": f, "problem": p}
                         for f, p in item_problems]
        else:
            parsed.append(ScoreItem(id=item["id"], tokens=tuple(item["tokens"]), text=item["text"],
                                    language=item.get("language", "zh")))
    if problems:
        raise RequestError(422, f"{len({p['item'] for p in problems})} invalid item(s)", problems)
    total = sum(len(it.tokens) for it in parsed)
    if total > limits.max_tokens_per_request:
        raise RequestError(413, f"{total} speech tokens in one request exceed the limit of "
                                f"{limits.max_tokens_per_request}")
    return parsed


_SHORT = reprlib.Repr()
_SHORT.maxstring = _SHORT.maxother = 60


def _short(value) -> str:
    """A bounded repr of a client's value (any depth, any length) for an error message."""
    return _SHORT.repr(value)


def _echo_id(item, limits: Limits):
    """The item's id as the error may echo it: only a string within the id limit."""
    item_id = item.get("id") if isinstance(item, dict) else None
    ok = isinstance(item_id, str) and len(item_id) <= limits.max_id_chars and not _unicode_problem(item_id)
    return item_id if ok else None


def _unicode_problem(value: str) -> str | None:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:      # a lone surrogate from a JSON \ud800 escape
        return f"not valid Unicode (code point {ord(value[exc.start]):#x} at {exc.start})"
    return None


def _check_item(item, limits: Limits) -> list[tuple[str, str]]:
    if not isinstance(item, dict):
        return [("item", f"expected an object, got {type(item).__name__}")]
    problems = []
    item_id = item.get("id")
    if not isinstance(item_id, str) or not item_id:
        problems.append(("id", "missing or not a non-empty string"))
    elif len(item_id) > limits.max_id_chars:
        problems.append(("id", f"{len(item_id)} characters exceed the limit of {limits.max_id_chars}"))
    elif _unicode_problem(item_id):
        problems.append(("id", _unicode_problem(item_id)))
    tokens = item.get("tokens")
    if not isinstance(tokens, list):
        problems.append(("tokens", "missing or not a list of integers"))
    elif not tokens:
        problems.append(("tokens", "empty: no speech tokens to score"))
    elif len(tokens) > limits.max_tokens_per_item:
        problems.append(("tokens", f"{len(tokens)} tokens exceed the limit of {limits.max_tokens_per_item}"))
    else:
        bad = [t for t in tokens if not isinstance(t, int) or isinstance(t, bool)]
        if bad:
            problems.append(("tokens", f"non-integer token {_short(bad[0])}"))
        else:
            out = [t for t in tokens if not 0 <= t < limits.speech_token_size]
            if out:
                problems.append(("tokens", f"token id {out[0]} outside the speech vocabulary "
                                           f"[0, {limits.speech_token_size})"))
    language = item.get("language", "zh")
    if language not in LANGUAGES:
        problems.append(("language", f"unknown language {_short(language)}; expected one of {list(LANGUAGES)}"))
    text = item.get("text")
    if not isinstance(text, str):
        problems.append(("text", "missing or not a string"))
    elif not text.strip():
        problems.append(("text", "empty reference text"))
    elif len(text) > limits.max_text_chars:
        problems.append(("text", f"{len(text)} characters exceed the limit of {limits.max_text_chars}"))
    elif _unicode_problem(text):
        problems.append(("text", _unicode_problem(text)))
    elif language in LANGUAGES and not text_to_units(text, language):
        problems.append(("text", "nothing speakable after normalisation (only punctuation?)"))
    return problems
