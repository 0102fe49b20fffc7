"""CosyVoice's own code: the public FunAudioLLM/CosyVoice repository at one pinned commit, imported, never copied.

No PyPI package ships today's CosyVoice (nor CosyVoice3), and upstream itself runs from a checkout
(`PYTHONPATH=CosyVoice:CosyVoice/third_party/Matcha-TTS`). This module finds that checkout, checks it, and makes
the venv import it (a `.pth` file in site-packages, so every process of the venv -- Ray workers, vLLM servers --
sees the same code):

1. `COSYVOICE_DIR`: an existing checkout (its `third_party/Matcha-TTS` submodule, or `MATCHA_TTS_DIR`);
2. else `$COSYVOICE_CACHE` (default ~/.cache/cosyvoice-grpo)/CosyVoice-<commit>: cloned from `COSYVOICE_REPO_URL`
   (default GitHub) at PINNED_COMMIT with its Matcha-TTS submodule, the first time.

"Checked" means every file of upstream's `cosyvoice/` and `matcha/` packages hashes as at the pinned commit
(`upstream.sha256` beside this file, written from an unmodified copy of that commit): a checkout at another commit,
or an edited one, stops in one line naming the setting. Every exactness claim of this project refers to this commit.

    python -m grpo.upstream install [--site DIR]   resolve, fetch if needed, check, write the .pth (run.sh setup)
    python -m grpo.upstream check                  the imported `cosyvoice` / `matcha` are the pinned files
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

PINNED_COMMIT = "ace7c47f41bbd303aa6bf1ea80e6f9fbd595cd40"      # 2026-03-16
MATCHA_COMMIT = "dd9105b34bf2be2230f4aa1e4769fb586a3c824e"      # CosyVoice's third_party/Matcha-TTS submodule there
REPO_URL = "https://github.com/FunAudioLLM/CosyVoice.git"
MATCHA_SUBMODULE = "third_party/Matcha-TTS"
MANIFEST = Path(__file__).with_name("upstream.sha256")
PTH_NAME = "cosyvoice_upstream.pth"
PACKAGES = {"cosyvoice": "COSYVOICE_DIR", "matcha": "MATCHA_TTS_DIR"}   # package -> the setting that points at it
# files outside the packages that the project reads from the checkout: the model configs upstream ships
CONFIG_FILES = ("examples/libritts/cosyvoice2/conf/cosyvoice2.yaml",
                "examples/libritts/cosyvoice3/conf/cosyvoice3.yaml")


class UpstreamError(RuntimeError):
    """The CosyVoice checkout is missing, unreachable or not the pinned files (one line, naming the setting)."""


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def read_manifest(path: Path = MANIFEST) -> dict[str, str]:
    """{"cosyvoice/llm/llm.py": sha256, ...}: every file of the two packages at the pinned commits."""
    out = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.strip() and not line.startswith("#"):
            digest, name = line.split(maxsplit=1)
            out[name] = digest
    return out


def write_manifest(cosyvoice_dir: Path, matcha_dir: Path, path: Path = MANIFEST) -> int:
    """Hash every file of `cosyvoice/` and `matcha/` (an unmodified copy of the pinned commits) into the manifest."""
    lines = [f"# sha256 of upstream's files: FunAudioLLM/CosyVoice {PINNED_COMMIT} (cosyvoice/), "
             f"shivammehta25/Matcha-TTS {MATCHA_COMMIT} (matcha/); written by `python -m grpo.upstream manifest`"]
    for root, package in ((cosyvoice_dir, "cosyvoice"), (matcha_dir, "matcha")):
        for f in sorted((root / package).rglob("*")):
            if f.is_file() and "__pycache__" not in f.parts:
                lines.append(f"{_sha256(f)}  {f.relative_to(root).as_posix()}")
    lines += [f"{_sha256(cosyvoice_dir / name)}  {name}" for name in CONFIG_FILES]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return len(lines) - 1


def mismatches(roots: dict[str, Path], manifest: dict[str, str] | None = None) -> list[str]:
    """Manifest files that are missing or differ under their package's root (`roots`: package -> parent dir)."""
    manifest = manifest or read_manifest()
    bad = []
    for name, digest in manifest.items():
        f = roots["matcha" if name.startswith("matcha/") else "cosyvoice"] / name
        if not f.is_file() or _sha256(f) != digest:
            bad.append(name)
    return bad


def _git(*args: str, cwd: Path | None = None) -> str:
    done = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True)
    if done.returncode != 0:
        lines = done.stderr.strip().splitlines() or ["(no message)"]
        fatal = [line for line in lines if line.startswith("fatal:")]
        raise UpstreamError(f"git {args[0]}: {(fatal or lines)[0]}")
    return done.stdout.strip()


def _head(path: Path) -> str:
    try:
        return _git("rev-parse", "HEAD", cwd=path)
    except (UpstreamError, OSError):
        return ""


def check_roots(cosyvoice_dir: Path, matcha_dir: Path, setting: str) -> None:
    """Stop in one line when the two folders are not the pinned files."""
    for package, root in (("cosyvoice", cosyvoice_dir), ("matcha", matcha_dir)):
        if not (root / package / "__init__.py").is_file():
            key = setting if package == "cosyvoice" else PACKAGES["matcha"]
            raise UpstreamError(f"{key}: no `{package}` package in {root} (expected a checkout of "
                                f"FunAudioLLM/CosyVoice at {PINNED_COMMIT[:7]} with its {MATCHA_SUBMODULE} submodule)")
    bad = mismatches({"cosyvoice": cosyvoice_dir, "matcha": matcha_dir})
    if bad:
        head = _head(cosyvoice_dir)
        at = f" (HEAD {head[:7]})" if head else ""
        raise UpstreamError(
            f"{setting}={cosyvoice_dir}{at} is not CosyVoice at the pinned commit {PINNED_COMMIT[:7]}: {len(bad)} "
            f"file(s) differ, e.g. {bad[0]}. Check out {PINNED_COMMIT} (git checkout {PINNED_COMMIT[:7]} && git "
            f"submodule update --init) or unset {setting} to let setup fetch it")


def matcha_dir_for(cosyvoice_dir: Path) -> Path:
    env = os.environ.get("MATCHA_TTS_DIR")
    return Path(env).expanduser().resolve() if env else cosyvoice_dir / MATCHA_SUBMODULE


def cache_dir() -> Path:
    return Path(os.environ.get("COSYVOICE_CACHE", "~/.cache/cosyvoice-grpo")).expanduser() / \
        f"CosyVoice-{PINNED_COMMIT[:12]}"


def clone(url: str, commit: str, dest: Path) -> None:
    """`commit` of `url` with its Matcha-TTS submodule into `dest`, atomically: a failed fetch leaves nothing."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".clone-", dir=dest.parent))
    try:
        _git("init", "-q", str(tmp))
        _git("remote", "add", "origin", url, cwd=tmp)
        _git("fetch", "-q", "--depth", "1", "origin", commit, cwd=tmp)
        _git("checkout", "-q", "FETCH_HEAD", cwd=tmp)
        _git("submodule", "update", "-q", "--init", MATCHA_SUBMODULE, cwd=tmp)
        tmp.rename(dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def resolve(fetch: bool = True, commit: str = PINNED_COMMIT) -> tuple[Path, Path]:
    """(cosyvoice checkout, Matcha-TTS folder), checked; cloned into the cache first when neither exists."""
    env = os.environ.get("COSYVOICE_DIR")
    if env:
        root = Path(env).expanduser().resolve()
        if not root.is_dir():
            raise UpstreamError(f"COSYVOICE_DIR={env}: no such directory (a checkout of FunAudioLLM/CosyVoice at "
                                f"{PINNED_COMMIT[:7]}, or unset it to let setup fetch one)")
        matcha = matcha_dir_for(root)
        check_roots(root, matcha, "COSYVOICE_DIR")
        return root, matcha
    root = cache_dir()
    if not root.is_dir():
        if not fetch:
            raise UpstreamError(f"no CosyVoice checkout: set COSYVOICE_DIR (a checkout at {PINNED_COMMIT[:7]}) or run "
                                f"`bash run.sh setup` to fetch one into {root}")
        url = os.environ.get("COSYVOICE_REPO_URL", REPO_URL)
        print(f"[upstream] fetching CosyVoice {commit[:7]} from {url} into {root}", file=sys.stderr)
        try:
            clone(url, commit, root)
        except (UpstreamError, OSError) as exc:
            raise UpstreamError(f"could not fetch CosyVoice {commit[:7]} from {url} ({exc}): set COSYVOICE_DIR to a "
                                f"checkout of FunAudioLLM/CosyVoice at {PINNED_COMMIT} (with its {MATCHA_SUBMODULE} "
                                f"submodule)") from None
    check_roots(root, matcha_dir_for(root), f"COSYVOICE_CACHE (the checkout in {root})")
    return root, matcha_dir_for(root)


def site_packages() -> Path:
    return Path(sysconfig.get_paths()["purelib"])


def install(site: Path | None = None, commit: str = PINNED_COMMIT) -> Path:
    """Resolve (fetching if needed), check, and write the .pth that puts both folders on every process's path."""
    root, matcha = resolve(fetch=True, commit=commit)
    pth = (site or site_packages()) / PTH_NAME
    pth.write_text(f"{root}\n{matcha}\n", encoding="utf-8")
    return pth


_checked: set[str] = set()


def config_file(name: str) -> Path:
    """One of CONFIG_FILES from the imported checkout (checked like the packages)."""
    import cosyvoice

    if name not in CONFIG_FILES:
        raise KeyError(f"{name} is not among the checked upstream files {CONFIG_FILES}")
    check_imported()
    return Path(cosyvoice.__file__).parent.parent / name


def check_imported() -> None:
    """The `cosyvoice` and `matcha` this process imports are the pinned files (hashed once per process)."""
    import importlib.util

    roots = {}
    for package, setting in PACKAGES.items():
        spec = importlib.util.find_spec(package)
        if spec is None or not spec.origin:
            raise UpstreamError(f"`{package}` is not importable: run `bash run.sh setup` ({setting} names a checkout "
                                f"of CosyVoice at {PINNED_COMMIT[:7]})")
        roots[package] = Path(spec.origin).parent.parent
    key = f"{roots['cosyvoice']}|{roots['matcha']}"
    if key not in _checked:
        check_roots(roots["cosyvoice"], roots["matcha"], "COSYVOICE_DIR")
        _checked.add(key)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m grpo.upstream", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    inst = sub.add_parser("install", help="resolve / fetch / check the checkout and write the venv's .pth")
    inst.add_argument("--site", type=Path, help="site-packages folder for the .pth (default: this interpreter's)")
    sub.add_parser("check", help="the imported cosyvoice/matcha are the pinned files")
    man = sub.add_parser("manifest", help="rewrite upstream.sha256 from an unmodified copy of the pinned commits")
    man.add_argument("cosyvoice_dir", type=Path)
    man.add_argument("matcha_dir", type=Path)
    args = parser.parse_args(argv)
    try:
        if args.cmd == "install":
            pth = install(args.site)
            print(f"[upstream] CosyVoice {PINNED_COMMIT[:7]}: {pth.read_text().splitlines()[0]} (via {pth})")
        elif args.cmd == "check":
            check_imported()
            print(f"[upstream] ok: CosyVoice {PINNED_COMMIT[:7]}")
        else:
            print(f"[upstream] {write_manifest(args.cosyvoice_dir, args.matcha_dir)} files hashed into {MANIFEST}")
    except UpstreamError as exc:
        print(f"[upstream] {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
