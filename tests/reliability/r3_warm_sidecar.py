"""`r3-sidecar` with its modules imported ahead: it imports, then waits for a `go` line before running.

Why: the spool model restarts its sidecar once a run, and Python importing the sidecar's modules is most of a
start (about 1 s of 1.4 s on a loaded 2-core machine). A spare started ahead runs the same `main` with the
same arguments and environment once told to, so a restart costs only the sidecar's own start (its index, its
socket, ready). Nothing at import time reads the spool, the environment's settings or the clock.
"""

from __future__ import annotations

import sys

import uvicorn  # noqa: F401  # what `serve` imports when it starts

import service.server.api  # noqa: F401
from service.server.cli import main

if __name__ == "__main__":
    if sys.stdin.readline().strip() != "go":
        raise SystemExit(0)  # a spare never used: its test ended
    raise SystemExit(main(sys.argv[1:]))
