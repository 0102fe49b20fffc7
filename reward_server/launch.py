"""Helpers run.sh uses around a background server: where its log goes, and waiting until it is healthy."""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import httpx

from grpo.config import load_config
from grpo.layout import server_log


def wait_healthy(url: str, timeout_s: float, pid: int | None = None, auth_token: str | None = None) -> None:
    """Poll GET /health until 200; fail early if the server process died."""
    deadline = time.monotonic() + timeout_s
    headers = {"Authorization": f"Bearer {auth_token}"} if auth_token else {}
    last = "no answer"
    while time.monotonic() < deadline:
        if pid is not None:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                raise RuntimeError(f"reward server process {pid} exited before it became healthy") from None
        try:
            resp = httpx.get(f"{url}/health", timeout=2.0, headers=headers)
            if resp.status_code == 200:
                return
            last = f"HTTP {resp.status_code}"
        except httpx.HTTPError as exc:
            last = type(exc).__name__
        time.sleep(0.5)
    raise TimeoutError(f"reward server at {url} not healthy after {timeout_s:.0f} s (last: {last})")


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """`python -m grpo serve` in a subprocess on a free port (as run.sh starts it), stopped with SIGINT."""

    def __init__(self, overrides: list[str], log_path: Path, port: int | None = None):
        import subprocess

        from grpo.config import REPO_ROOT

        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = Path(log_path)
        self.proc = subprocess.Popen([sys.executable, "-m", "grpo", "serve", *overrides, f"reward.port={self.port}"],
                                     cwd=REPO_ROOT, stdout=open(self.log_path, "w"), stderr=subprocess.STDOUT,
                                     start_new_session=True)

    def wait(self, auth_token: str | None = None, timeout_s: float = 240) -> ServerProcess:
        try:
            wait_healthy(self.url, timeout_s, self.proc.pid, auth_token)
        except Exception:
            self.stop()
            raise RuntimeError("reward server did not start:\n" + self.log_path.read_text()[-4000:]) from None
        return self

    def stop(self) -> None:
        import signal
        import subprocess

        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m reward_server.launch")
    parser.add_argument("action", choices=["logfile", "wait"])
    parser.add_argument("--pid", type=int)
    parser.add_argument("--timeout", type=float, default=300)
    args, overrides = parser.parse_known_args(argv)
    cfg = load_config(overrides)
    if args.action == "logfile":
        path = server_log(cfg.exp_dir)
        path.parent.mkdir(parents=True, exist_ok=True)
        print(path)
        return 0
    try:
        wait_healthy(cfg.reward.url, args.timeout, args.pid, cfg.reward.auth_token)
    except (RuntimeError, TimeoutError) as exc:
        print(f"[launch] {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
