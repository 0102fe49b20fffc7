"""run.sh as a user meets it: stage validation, exit codes, the background reward server and its trap.

run.sh only sequences `$VENV/bin/python -m ...` calls, so it runs here against a stand-in venv whose python
records each call and acts the part: a stage that fails with a given code, a server that runs until it is
signalled (as reward_server/serve.py does) or one that never becomes healthy.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from grpo.config import REPO_ROOT

FAKE_PYTHON = f"""#!{sys.executable}
import os, signal, sys, threading
state = os.environ["FAKE_STATE"]
def note(line):
    with open(os.path.join(state, "calls"), "a") as f:
        f.write(line + "\\n")
argv = sys.argv[1:]
note(" ".join(argv))
if argv[:3] == ["-m", "reward_server.launch", "logfile"]:
    print(os.path.join(state, "server.log"))
elif argv[:3] == ["-m", "reward_server.launch", "wait"]:
    pid = int(argv[argv.index("--pid") + 1])
    ready = os.path.join(state, f"server.{{pid}}.ready")
    while not os.path.exists(ready):   # the stand-in server writes it once its signal handlers are set
        os.kill(pid, 0)
        threading.Event().wait(0.05)
    sys.exit(1 if os.environ.get("FAKE_SERVER_FAILS") else 0)   # up, but never healthy
elif argv[:3] == ["-m", "grpo", "serve"]:
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    open(os.path.join(state, f"server.{{os.getpid()}}.ready"), "w").close()
    stop.wait(90)
    note("server stopped" if stop.is_set() else "server never stopped")
elif argv[:2] == ["-m", "grpo"] and argv[2] == os.environ.get("FAKE_FAIL_STAGE"):
    sys.exit(int(os.environ.get("FAKE_FAIL_CODE", "7")))
"""


@pytest.fixture
def run_sh(tmp_path):
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / ".setup-stamp").write_text("test")
    python = venv / "bin" / "python"
    python.write_text(FAKE_PYTHON)
    python.chmod(0o755)

    def run(*args, **env):
        proc = subprocess.run(["bash", str(REPO_ROOT / "run.sh"), *args], capture_output=True, text=True, timeout=120,
                              env={**{k: v for k, v in os.environ.items() if k != "GRPO_TEST_WORKERS"},
                                   "VENV": str(venv), "FAKE_STATE": str(tmp_path), **env})
        calls = tmp_path / "calls"
        proc.calls = calls.read_text().splitlines() if calls.exists() else []
        return proc
    return run


def stages_called(calls):
    return [c.split()[2] for c in calls if c.startswith("-m grpo ") and c.split()[2] != "serve"]


@pytest.mark.parametrize("args", [("7", "7"), ("-2", "0"), ("a", "1"), ("1", "x"), ("0.5", "2")])
def test_bad_stage_numbers_are_refused_before_anything_runs(run_sh, args):
    proc = run_sh(*args)
    assert proc.returncode == 2 and "stage must be an integer in -1..5" in proc.stderr
    assert proc.calls == []


def test_stages_run_in_order_with_the_overrides(run_sh):
    proc = run_sh("2", "4", "train.total_steps=3", "profile=tiny")
    assert proc.returncode == 0, proc.stderr
    assert stages_called(proc.calls) == ["train", "merge", "evaluate"]
    assert proc.calls[0] == "-m grpo train train.total_steps=3 profile=tiny"
    assert proc.calls[-1] == "-m grpo.evaluate.report summary train.total_steps=3 profile=tiny"   # after stage 4


def test_a_failing_stage_stops_the_run_with_its_exit_code(run_sh):
    proc = run_sh("2", "5", FAKE_FAIL_STAGE="merge", FAKE_FAIL_CODE="7")
    assert proc.returncode == 7
    assert stages_called(proc.calls) == ["train", "merge"]
    assert "stage 3 (merge): FAILED with exit code 7" in proc.stdout


def test_the_background_server_is_stopped_when_the_run_ends(run_sh):
    proc = run_sh("1", "3")
    assert proc.returncode == 0, proc.stderr
    assert stages_called(proc.calls) == ["train", "merge"]
    assert proc.calls[-1] == "server stopped"              # SIGINT from run.sh's stop_server, before it exits


def test_the_background_server_is_stopped_when_a_later_stage_fails(run_sh):
    proc = run_sh("1", "4", FAKE_FAIL_STAGE="train", FAKE_FAIL_CODE="3")
    assert proc.returncode == 3
    assert stages_called(proc.calls) == ["train"]
    assert proc.calls[-1] == "server stopped"              # through the EXIT trap


def test_a_server_that_never_becomes_healthy_fails_the_run(run_sh):
    proc = run_sh("1", "3", FAKE_SERVER_FAILS="1")
    assert proc.returncode == 1 and "stage 1 (serve): FAILED" in proc.stdout
    assert stages_called(proc.calls) == []
    assert proc.calls[-1] == "server stopped"


def test_test_command_runs_the_fast_suite_by_default_and_takes_a_marker(run_sh):
    two = "-n 2 --dist loadfile"       # the default and fast tiers: two xdist workers, one file per worker
    assert run_sh("test", "-q").calls == [f"-m pytest -m not slow {two} -q"]
    # a marker of the caller's (the slow and real-size tiers) runs in one process, as does a -n or no:xdist of theirs
    assert run_sh("test", "-m", "slow", "tests/x.py").calls[-1] == "-m pytest -m slow tests/x.py"
    assert run_sh("test", "-mserver").calls[-1] == "-m pytest -mserver"
    assert run_sh("test", "-n", "0", "-x").calls[-1] == "-m pytest -m not slow -n 0 -x"
    assert run_sh("test", "-p", "no:xdist").calls[-1] == "-m pytest -m not slow -p no:xdist"
    assert run_sh("test", "-q", GRPO_TEST_WORKERS="3").calls[-1] == "-m pytest -m not slow -n 3 --dist loadfile -q"
    fast = "-m pytest -m not slow and not server and not vllm and not verl and not realsize and not fullsize"
    assert run_sh("test", "fast").calls[-1] == f"{fast} {two}"
    assert run_sh("test", "fast", "tests/speech", "-x").calls[-1] == f"{fast} {two} tests/speech -x"


def test_xdist_workers_share_the_cores_instead_of_each_taking_them_all():
    """Under `bash run.sh test`'s workers, torch's threads in one worker times the workers fit the cores."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
    if workers < 2:
        pytest.skip("not run by two or more xdist workers")
    import torch
    cores = os.cpu_count() or 1
    assert torch.get_num_threads() * workers <= max(cores, workers), (torch.get_num_threads(), workers, cores)


def slow_tests(root) -> list[str]:
    """Test functions that `-m slow` selects: marked @pytest.mark.slow themselves or by their module's pytestmark
    (read from the source: collecting the suite in a subprocess imports every test module, ~12 s here)."""
    import ast

    def marks_slow(node) -> bool:
        return any(isinstance(n, ast.Attribute) and n.attr == "slow" and ast.unparse(n) == "pytest.mark.slow"
                   for n in ast.walk(node))

    found = []
    for path in sorted(Path(root).rglob("test_*.py")):
        tree = ast.parse(path.read_text())
        module_slow = any(isinstance(n, ast.Assign) and any(getattr(t, "id", "") == "pytestmark" for t in n.targets)
                          and marks_slow(n.value) for n in tree.body)
        found += [f"{path.name}::{n.name}" for n in tree.body if isinstance(n, ast.FunctionDef)
                  and n.name.startswith("test_") and (module_slow or any(marks_slow(d) for d in n.decorator_list))]
    return found


def test_slow_tests_exist_for_the_slow_marker(tmp_path):
    """`bash run.sh test -m slow` must collect something (pytest exits 5 on an empty selection)."""
    assert any(t.startswith("test_verl_two_nodes.py::") for t in slow_tests(REPO_ROOT / "tests"))   # CI's step
    # the reader itself: a module-level mark and a decorator count, other marks do not
    (tmp_path / "test_a.py").write_text("import pytest\npytestmark = [pytest.mark.slow]\ndef test_one(): pass\n")
    (tmp_path / "test_b.py").write_text("import pytest\n@pytest.mark.slow\ndef test_two(): pass\n"
                                        "@pytest.mark.server\ndef test_three(): pass\n")
    assert slow_tests(tmp_path) == ["test_a.py::test_one", "test_b.py::test_two"]


