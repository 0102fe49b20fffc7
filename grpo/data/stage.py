"""Stage 0: JSONL -> verl parquet.

Input lines: {"text": str, "language": "zh"|"en" (optional), "id": str|int (optional)}.
Every bad line of every file is reported with file and line number; on any problem nothing is
written (each parquet goes to a temporary file and is renamed only when all files are good). data.sources are
fetched first (grpo/data/sources.py); training lines that are targets of an evaluation set follow data.eval_overlap.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path

from omegaconf import DictConfig
from tqdm import tqdm

from grpo.config import resolve_path
from grpo.speech.family import family
from grpo.speech.text_frontend import normalize

log = logging.getLogger(__name__)


@dataclass
class Problem:
    path: str
    line: int
    message: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.message}"


class DataError(ValueError):
    def __init__(self, problems: list[Problem]):
        self.problems = problems
        super().__init__(f"{len(problems)} bad line(s):\n" + "\n".join(f"  {p}" for p in problems))


def sample_id(text: str, language: str) -> str:
    """Stable id for a line without one: the same text and language always give the same id."""
    return hashlib.sha1(f"{language}\t{text}".encode()).hexdigest()[:16]


def read_jsonl(path: str | Path, cfg: DictConfig) -> tuple[list[dict], list[Problem]]:
    """Parse and validate; returns the good rows and every problem found."""
    path = Path(path)
    rows, problems = [], []
    languages = list(cfg.languages)
    size = path.stat().st_size
    with open(path, "rb") as f, tqdm(total=size, unit="B", unit_scale=True, desc=f"read {path.name}",
                                     disable=size < (1 << 20), leave=False) as bar:
        for lineno, raw in enumerate(f, start=1):
            bar.update(len(raw))
            if not raw.strip():
                continue
            problem = None
            try:
                row = json.loads(raw.decode("utf-8"))
            except UnicodeDecodeError:
                problem = "not valid UTF-8"
            except json.JSONDecodeError as exc:
                problem = f"malformed JSON ({exc.msg} at column {exc.colno})"
            else:
                problem = _validate(row, languages, cfg)
            if problem:
                problems.append(Problem(str(path), lineno, problem))
                continue
            language = row.get("language", cfg.default_language)
            text = row["text"].strip()
            rows.append({"text": text, "language": language, "line": lineno,
                         "id": str(row["id"]) if "id" in row else sample_id(text, language)})
    return rows, problems


def _validate(row, languages: list[str], cfg: DictConfig) -> str | None:
    if not isinstance(row, dict):
        return f"expected a JSON object, got {type(row).__name__}"
    if "text" not in row:
        return "missing field 'text'"
    text = row["text"]
    if not isinstance(text, str):
        return f"'text' must be a string, got {type(text).__name__}"
    if not text.strip():
        return "'text' is empty"
    if len(text.strip()) > cfg.max_text_chars:
        return f"'text' has {len(text.strip())} characters, more than data.max_text_chars={cfg.max_text_chars}"
    language = row.get("language", cfg.default_language)
    if language not in languages:
        return f"unknown language {language!r}; expected one of {languages}"
    if "id" in row and (isinstance(row["id"], bool) or not isinstance(row["id"], (str, int)) or str(row["id"]) == ""):
        return "'id' must be a non-empty string or an integer"
    return None


def check_duplicates(rows: list[dict], path: str, policy: str) -> tuple[list[dict], list[Problem], int]:
    """Duplicate (text, language) pairs: keep (default), drop all but the first, or error. Ids must be unique."""
    if policy not in ("keep", "drop", "error"):
        raise ValueError(f"data.duplicates must be keep, drop or error, got {policy!r}")
    problems, kept, seen_text, seen_id = [], [], {}, {}
    duplicates = 0
    for row in rows:
        key = (row["text"], row["language"])
        if row["id"] in seen_id and seen_id[row["id"]] != key:
            problems.append(Problem(path, row["line"], f"id {row['id']!r} already used for a different text"))
            continue
        seen_id[row["id"]] = key
        if key in seen_text:
            duplicates += 1
            if policy == "error":
                problems.append(Problem(path, row["line"], f"duplicate text (first at line {seen_text[key]})"))
            if policy != "keep":
                continue
        else:
            seen_text[key] = row["line"]
        kept.append(row)
    return kept, problems, duplicates


def to_records(rows: list[dict], cfg: DictConfig, split: str) -> list[dict]:
    """verl's RL dataset schema: chat-message prompt, ground truth for the reward, extra_info. The prompt holds
    the family's prompt prefix (CosyVoice3's "You are a helpful assistant.<|endofprompt|>", as upstream's examples
    begin the prompt text) and the text as CosyVoice's frontend normalises it (`data.text_frontend`); extra_info
    keeps the raw and the normalised text."""
    prefix = family(cfg.family).prompt_prefix
    records = []
    for i, row in tqdm(list(enumerate(rows)), desc=f"{split}: text frontend", mininterval=5,
                       disable=not cfg.text_frontend):
        fed = normalize(row["text"], cfg.frontend_tokenizer_dir, cfg.family) if cfg.text_frontend else row["text"]
        records.append({
            "data_source": cfg.data_source,
            "prompt": [{"role": "user", "content": prefix + fed}],
            "ability": cfg.ability,
            "reward_model": {"style": "rule", "ground_truth": row["text"]},
            "extra_info": {"index": i, "split": split, "text": row["text"], "normalized_text": fed,
                           "language": row["language"], "sample_id": row["id"]},
        })
    return records


def write_parquet(records: list[dict], out_path: Path) -> None:
    import datasets

    out_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_path.with_name(f".{out_path.name}.{os.getpid()}.tmp")
    try:
        datasets.Dataset.from_list(records).to_parquet(str(tmp))
        tmp.replace(out_path)
    finally:
        tmp.unlink(missing_ok=True)


def check_speech_budget(rows: list[dict], path: str, cfg: DictConfig, max_speech_tokens: int | None
                        ) -> tuple[list[dict], list[Problem]]:
    """Lines whose estimated speech (characters x data.speech_tokens_per_char) exceeds the response budget:
    data.long_text = warn (kept, logged), drop (left out, logged) or error (reported as problems)."""
    if not max_speech_tokens:
        return rows, []
    policy = cfg.long_text
    if policy not in ("warn", "drop", "error"):
        raise ValueError(f"data.long_text must be warn, drop or error, got {policy!r}")
    rate = cfg.speech_tokens_per_char
    long = [r for r in rows if len(r["text"]) * rate.get(r["language"], max(rate.values())) > max_speech_tokens]
    if not long:
        return rows, []
    what = (f"{len(long)} line(s) of {Path(path).name} likely need more than train.max_response_tokens="
            f"{max_speech_tokens} speech tokens (first at line {long[0]['line']})")
    if policy == "error":
        return rows, [Problem(path, r["line"], f"{len(r['text'])} characters: estimated speech longer than "
                                                f"train.max_response_tokens={max_speech_tokens}") for r in long]
    if policy == "drop":
        log.warning("%s: left out (data.long_text=drop)", what)
        ids = {id(r) for r in long}
        return [r for r in rows if id(r) not in ids], []
    log.warning("%s: rollouts will truncate them (data.long_text=warn; drop or error to change that)", what)
    return rows, []


def overlap_key(text: str) -> str:
    """Text as compared against evaluation targets: letters and digits only, lower case."""
    return "".join(ch for ch in text.lower() if ch.isalnum())


def eval_targets(eval_cfg: DictConfig) -> dict[str, set[str]]:
    """The target texts (overlap keys) of eval.data_path and every eval.extra_sets entry that exists yet."""
    from omegaconf import OmegaConf

    from grpo.data.test_sets import extra_sets, load_set

    sets = [("eval", eval_cfg)] + [(name, OmegaConf.merge(eval_cfg, keys)) for name, keys in extra_sets(eval_cfg)]
    out = {}
    for name, e in sets:
        if resolve_path(e.data_path).exists():
            out[name] = {overlap_key(it.text) for it in load_set(e.set, resolve_path(e.data_path), e.get("language"))}
        else:
            log.warning("evaluation set %s (%s) not there yet: training text not checked against it", name,
                        e.data_path)
    return out


def check_eval_overlap(rows: list[dict], path: str, targets: dict[str, set[str]], policy: str
                       ) -> tuple[list[dict], list[Problem]]:
    """Training lines that are also a target of an evaluation set: data.eval_overlap = keep (logged), drop, error."""
    if policy not in ("keep", "drop", "error"):
        raise ValueError(f"data.eval_overlap must be keep, drop or error, got {policy!r}")
    hits = {id(r): [n for n, keys in targets.items() if overlap_key(r["text"]) in keys] for r in rows}
    hits = {k: v for k, v in hits.items() if v}
    for name in targets:
        n = sum(name in v for v in hits.values())
        if n:
            log.warning("%s: %d line(s) are targets of the evaluation set %s (data.eval_overlap=%s)", Path(path).name,
                        n, name, policy)
    if policy == "error":
        return rows, [Problem(path, r["line"], f"a target of the evaluation set(s) {', '.join(hits[id(r)])}")
                      for r in rows if id(r) in hits]
    return ([r for r in rows if id(r) not in hits] if policy == "drop" else rows), []


def prepare(cfg: DictConfig, min_train_rows: int = 1, max_speech_tokens: int | None = None,
            eval_sets: dict[str, set[str]] | None = None) -> dict[str, Path]:
    """Validate every input file first, then write all parquet files (or none). The training split must hold
    at least `min_train_rows` prompts (one batch: train.batch_size), or no step could ever run; lines longer
    than the response budget are handled by `check_speech_budget`."""
    splits = {"train": cfg.train_file, "val": cfg.val_file}
    all_records, problems, outputs = {}, [], {}
    for split, file in splits.items():
        if not file:
            continue
        path = resolve_path(file)
        if not path.exists():
            problems.append(Problem(str(path), 0, "file not found"))
            continue
        rows, bad = read_jsonl(path, cfg)
        rows, dup_problems, n_dup = check_duplicates(rows, str(path), cfg.duplicates)
        rows, long_problems = check_speech_budget(rows, str(path), cfg, max_speech_tokens)
        overlap_problems = []
        if split == "train" and eval_sets:
            rows, overlap_problems = check_eval_overlap(rows, str(path), eval_sets, cfg.eval_overlap)
        problems += bad + dup_problems + long_problems + overlap_problems
        if n_dup:
            log.info("%s: %d duplicate text(s) (%s)", path.name, n_dup, cfg.duplicates)
        if not rows and not bad:
            problems.append(Problem(str(path), 0, "no data lines"))
        elif split == "train" and not bad and not dup_problems and len(rows) < min_train_rows:
            problems.append(Problem(str(path), 0, f"{len(rows)} usable prompt(s), fewer than one batch (train."
                                                  f"batch_size={min_train_rows}): lower the batch size or add data"))
        all_records[split] = to_records(rows, cfg, split)
    if problems:
        raise DataError(problems)
    out_dir = resolve_path(cfg.out_dir)
    for split, records in all_records.items():
        outputs[split] = out_dir / f"{split}.parquet"
        write_parquet(records, outputs[split])
        log.info("%s: %d rows -> %s", split, len(records), outputs[split])
    return outputs


def run(cfg: DictConfig) -> int:
    from grpo.data.sources import SourceError, fetch

    try:
        fetch(cfg)              # data.sources (stage -1 fetched them already: then this touches nothing)
        prepare(cfg.data, min_train_rows=cfg.train.batch_size, max_speech_tokens=cfg.train.max_response_tokens,
                eval_sets=eval_targets(cfg.eval))
    except (DataError, FileNotFoundError, SourceError) as exc:
        log.error("data stage failed, nothing written. %s", exc)
        return 1
    return 0
