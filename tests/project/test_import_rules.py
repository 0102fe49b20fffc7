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
    ("grpo.data.stage", ("reward_server",), "stages use grpo.speech, not the service's internals"),
    ("grpo.data.sources", ("reward_server", "grpo.train", "grpo.model", "grpo.evaluate"),
     "fetching data knows no stage and no service"),
    ("reward_server", ("grpo.train", "grpo.evaluate", "grpo.model"), "the service stands on grpo.speech alone"),
]
# the only ways into the service from the training side: its client and its launcher
SERVICE_DOORS = ("reward_server.client", "reward_server.launch")

# The floors of the house (docs/layout.md), lowest first: a module imports its own floor or lower, never higher.
# The ground floor is the few modules directly under grpo/ that every room shares.
GROUND = ("grpo.config", "grpo.layout", "grpo.decoding", "grpo.checkpoint_selection")
FLOORS = [GROUND, ("grpo.upstream",), ("grpo.node",), ("grpo.speech",), ("grpo.standins",), ("grpo.data",),
          ("grpo.model", "reward_server"), ("grpo.train",), ("grpo.evaluate",), ("grpo.__main__",)]


def floor(module: str) -> int | None:
    return next((k for k, rooms in enumerate(FLOORS) if any(under(module, r) for r in rooms)), None)


def arrows_up(graph: dict[str, set[str]]) -> list[str]:
    """Every import of a module on a higher floor than the importer's."""
    found = []
    for module, names in graph.items():
        here = floor(module)
        found += [f"{module} (floor {here}) imports {n} (floor {floor(n)})" for n in sorted(names)
                  if here is not None and floor(n) is not None and floor(n) > here]
    return found


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import cycles among the project's own modules (strongly connected components of more than one module,
    or a module importing itself), by Tarjan's algorithm."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in graph:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1 or v in graph.get(v, ()):
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


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


def project_graph(sources: dict[str, set[str]]) -> dict[str, set[str]]:
    """module -> the project's modules it imports (a `from package import name` counts when name is a module)."""
    return {m: {n for n in names if n in sources and n != m} for m, names in sources.items()}


def test_the_import_rules_hold(sources):
    assert {"grpo.speech.token2wav", "reward_server.backends", "grpo.evaluate.evaluator"} <= set(sources)
    assert violations(sources) == []


def test_no_cycle_and_no_arrow_up(sources):
    graph = project_graph(sources)
    assert cycles(graph) == []
    assert arrows_up(graph) == []
    unplaced = [m for m in graph if floor(m) is None and m not in ("grpo",)]
    assert unplaced == [], "every module lives on a floor (FLOORS)"


def test_the_ground_floor_is_a_few_shared_modules():
    """At most 8 modules directly under grpo/ (besides __init__ and __main__), and they are the ground floor."""
    direct = sorted(f"grpo.{p.stem}" for p in (ROOT / "grpo").glob("*.py") if p.stem not in ("__init__", "__main__"))
    assert len(direct) <= 8 and set(direct) == set(GROUND), direct


def test_a_cycle_or_an_arrow_up_is_found(sources):
    """The checkers themselves: one planted import of each kind is reported."""
    graph = project_graph(sources)
    planted = {**graph, "grpo.evaluate.evaluator": graph["grpo.evaluate.evaluator"] | {"grpo.evaluate.parallel"}}
    assert cycles(planted) == [["grpo.evaluate.evaluator", "grpo.evaluate.parallel"]]      # the circle there was
    assert cycles({"a": {"a"}}) == [["a"]]
    for importer, imported in [("grpo.model.vllm_plugin", "grpo.train.verl_cpu"),          # model -> train
                               ("grpo.node.cluster_check", "grpo.train.verl_agent_loop"),   # node -> train
                               ("grpo.decoding", "grpo.speech.scoring"),                    # ground -> a room
                               ("grpo.data.stage", "grpo.evaluate.report")]:                # stage 0 -> stage 4
        planted = {**graph, importer: graph[importer] | {imported}}
        assert arrows_up(planted) and all(importer in f for f in arrows_up(planted)), (importer, imported)


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


LOADS = """import sys, importlib
importlib.import_module(sys.argv[1])
print(",".join(sorted(m for m in sys.argv[2].split(",") if m in sys.modules)))"""


@pytest.mark.parametrize("module, forbidden", [
    ("grpo.evaluate.stage", "verl,reward_server,grpo.train.local_engine"),   # stage 4's driver
    ("grpo.speech.token2wav", "ray,verl"),
    ("grpo.speech.asr", "ray,verl"),
    ("grpo.speech.scoring", "ray,verl"),
    ("grpo.data.stage", "ray,verl,vllm,reward_server"),                    # stage 0
    # stage 2's driver waits beside main_ppo through the run's peak: verl and vLLM load in its workers, not here
    ("grpo.train.verl_launcher", "ray,verl,vllm,grpo.train.grpo_step,grpo.train.verl_agent_loop"),
])
def test_what_a_module_pulls_in_transitively(module, forbidden):
    """In a fresh interpreter: importing stage 4's driver loads neither verl, the reward client nor the trainer (it
    shares only the rollout engine and decoding); the speech primitives load neither Ray nor verl."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", LOADS, module, forbidden], capture_output=True, text=True,
                          timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "", f"importing {module} loads {proc.stdout.strip()}"
