"""Servers under test, each in its own process on 127.0.0.1, started with the same uvicorn options.

`python -m benchmarks.servers inline|sidecar --port P --dir D` is the child; `serve(...)` is the parent's
context manager that starts it, waits until it answers, and stops it.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import uvicorn

UVICORN_OPTIONS = {"log_level": "warning", "access_log": False, "loop": "uvloop", "http": "httptools"}


@dataclass(frozen=True, slots=True)
class Server:
    url: str
    pid: int


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serve(kind: str, directory: Path, *, timeout_s: float = 120.0) -> Iterator[Server]:
    """Run one server process until the block exits; raises if it does not answer within `timeout_s`."""
    ready_path = "/readyz" if kind == "sidecar" else "/healthz"
    port = free_port()
    env = {**os.environ, "R3_SPOOL_DIR": str(directory)}
    cmd = [sys.executable, "-m", "benchmarks.servers", kind, "--port", str(port), "--dir", str(directory)]
    proc = subprocess.Popen(cmd, env=env, cwd=Path(__file__).resolve().parent.parent)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_ready(proc, kind, url + ready_path, timeout_s)
        yield Server(url, proc.pid)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _wait_ready(proc: subprocess.Popen, kind: str, url: str, timeout_s: float) -> None:
    """Poll `url` until it answers 200. One client for the whole wait: each `httpx.get` builds its own, whose TLS
    context (certifi's bundle) costs ~40 ms of CPU, which a benchmark's machine should not spend."""
    deadline = time.monotonic() + timeout_s
    with httpx.Client(timeout=2) as client:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"{kind} server exited with {proc.returncode} before answering")
            with contextlib.suppress(httpx.HTTPError):
                if client.get(url).status_code == 200:
                    return
            if time.monotonic() > deadline:
                raise RuntimeError(f"{kind} server did not answer {url} within {timeout_s} s")
            time.sleep(0.1)


def _app(kind: str, directory: Path):
    if kind == "inline":
        from benchmarks.inline_path import create_inline_app

        return create_inline_app(directory)
    from service.server.api import create_app
    from service.server.heap import keep_freed_chunks
    from service.server.settings import Settings

    settings = Settings(spool_dir=directory, host="127.0.0.1")
    keep_freed_chunks(settings.chunk_bytes)  # as `r3-sidecar serve` does
    return create_app(settings)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("kind", choices=("inline", "sidecar"))
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--dir", type=Path, required=True)
    args = ap.parse_args()
    uvicorn.run(_app(args.kind, args.dir), host="127.0.0.1", port=args.port, **UVICORN_OPTIONS)


if __name__ == "__main__":
    main()
