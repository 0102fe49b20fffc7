"""README.md and docs/ stay true to the tree: every relative link resolves, and every file path they name in
backticks (repository-relative, starting with one of the repository's top-level entries) exists."""

from __future__ import annotations

import re
import subprocess

import pytest

from grpo.config import REPO_ROOT

PAGES = [REPO_ROOT / "README.md", *sorted((REPO_ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")
CODE = re.compile(r"`([^`\n]+)`")


def top_level() -> set[str]:
    tracked = subprocess.run(["git", "ls-files"], cwd=REPO_ROOT, capture_output=True, text=True).stdout.split()
    return {p.split("/", 1)[0] for p in tracked}


def named_paths(text: str, tops: set[str]) -> list[str]:
    """Backticked words that are repository paths: `grpo/x.py`, `tests/a/test_b.py::test_c`, `conf/*/d.yaml`."""
    out = []
    for code in CODE.findall(text):
        for word in code.split():
            word = word.split("::")[0].rstrip(".,;:)")
            if "<" in word or "{" in word or "$" in word or "=" in word:
                continue              # a template (exp/<profile>/), a variable, a key=value override
            if word.split("/", 1)[0] in tops and (word in tops or "/" in word):
                out.append(word)
    return out


def resolves(path: str) -> bool:
    return any(REPO_ROOT.glob(path)) if "*" in path else (REPO_ROOT / path).exists()


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_links_and_named_paths_resolve(page):
    text = page.read_text(encoding="utf-8")
    broken = []
    for target in LINK.findall(text):
        if re.match(r"(https?:|mailto:|#)", target):
            continue
        if not (page.parent / target.split("#")[0]).exists():
            broken.append(f"link {target}")
    broken += [f"path {p}" for p in named_paths(text, top_level()) if not resolves(p)]
    assert broken == [], f"{page.relative_to(REPO_ROOT)}: {broken}"


def test_the_checker_finds_a_wrong_path_and_a_dead_link(tmp_path):
    tops = top_level()
    assert named_paths("see `grpo/speech/token2wav.py` and `tests/speech/test_scoring.py::test_x`", tops) == \
        ["grpo/speech/token2wav.py", "tests/speech/test_scoring.py"]
    assert not resolves("grpo/speech/no_such_module.py") and resolves("conf/*/default.yaml")
    assert named_paths("`exp/<profile>/train` and `model.hf_dir` and `x/y`", tops) == []


def test_the_readme_is_a_landing_page():
    readme = (REPO_ROOT / "README.md").read_text(encoding="utf-8")
    assert len(readme.splitlines()) <= 200
    first = readme.split("```")[1]
    assert "bash run.sh " in first and "bash run.sh test" in first
    assert "## On a GPU node" in readme
    linked = set(LINK.findall(readme))
    missing = [p.name for p in PAGES[1:] if f"docs/{p.name}" not in linked]
    assert missing == [], f"docs pages the README does not link: {missing}"
