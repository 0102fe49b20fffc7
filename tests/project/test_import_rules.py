"""One room per concern, checked on the source: every import (module level and inside functions) of every module
under grpo/ and reward_server/, read with `ast`, against the rules of the code's layout (docs/layout.md)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from grpo.config import REPO_ROOT

ROOT = REPO_ROOT

# (the importing package, what it must not import, why)
RULES = [
    ("grpo.speech", ("reward_server", "grpo.train", "grpo.evaluate", "grpo.model", "ray", "httpx", "fastapi",
                     "starlette", "verl", "vllm"),
     "speech primitives know no service, no training, no Ray or HTTP"),
    ("grpo.model", ("reward_server",), "stages use grpo.speech, not the service's internals"),
    ("grpo.evaluate", ("reward_server",), "stages use grpo.speech, not the service's internals"),
    ("grpo.data", ("reward_server",), "stages use grpo.speech, not the service's internals"),
    ("grpo.sources", ("reward_server", "grpo.train", "grpo.model", "grpo.evaluate"),
     "fetching data knows no stage and no service"),
    ("reward_server", ("grpo.train", "grpo.evaluate", "grpo.model"), "the service stands on grpo.speech alone"),
]
# the only ways into the service from the training side: its client and its launcher
SERVICE_DOORS = ("reward_server.client", "reward_server.launch")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path) -> set[str]:
    """Absolute names a module imports (`from x import y` gives x and x.y: y may be a module)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{a.name}" for a in node.names)
    return names


def under(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def violations(sources: dict[str, set[str]]) -> list[str]:
    found = []
    for module, names in sources.items():
        for package, forbidden, why in RULES:
            if under(module, package):
                found += [f"{module} imports {n} ({why})" for n in sorted(names)
                          if any(under(n, f) for f in forbidden)]
        if under(module, "grpo"):
            found += [f"{module} imports {n} (the training side reaches the service through "
                      f"{' / '.join(SERVICE_DOORS)} only)" for n in sorted(names)
                      if under(n, "reward_server") and n != "reward_server"
                      and not any(under(n, d) for d in SERVICE_DOORS)]
    return found


@pytest.fixture(scope="module")
def sources() -> dict[str, set[str]]:
    files = [p for d in ("grpo", "reward_server") for p in (ROOT / d).rglob("*.py")]
    return {module_name(p): imports(p) for p in files}


def test_the_import_rules_hold(sources):
    assert {"grpo.speech.token2wav", "reward_server.backends", "grpo.evaluate.evaluator"} <= set(sources)
    assert violations(sources) == []


def test_a_forbidden_import_is_found(sources):
    """The checker itself: one added line of each kind is reported."""
    planted = {**sources,
               "grpo.speech.scoring": sources["grpo.speech.scoring"] | {"reward_server.protocol"},
               "reward_server.backends": sources["reward_server.backends"] | {"grpo.model.prepare"},
               "grpo.train.local_engine": sources["grpo.train.local_engine"] | {"reward_server.backends"}}
    found = violations(planted)
    assert len(found) == 4, found        # the speech module's import breaks two rules
    assert any("grpo.speech.scoring imports reward_server.protocol" in f for f in found)
    assert any("grpo.train.local_engine imports reward_server.backends" in f for f in found)
    # a function-level import counts as much as a module-level one
    assert "grpo.speech.cosyvoice_dir" in imports(ROOT / "grpo/speech/token2wav.py")
