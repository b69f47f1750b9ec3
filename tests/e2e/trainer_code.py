"""The RL trainers' own code (verl 0.9.1, AReaL 1.0.4), importable from `.venv-trainers` (`make trainers`).

They are installed with --no-deps beside the venv, not into it (both pin torch and sglang versions of their
own); the directory is appended to `sys.path`, so the venv's torch, numpy and sglang are the ones imported.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

TRAINERS = Path(__file__).resolve().parents[2] / ".venv-trainers"


def require() -> None:
    """Put the trainers' directory on `sys.path`; skip (locally) when `make trainers` has not run."""
    if not (TRAINERS / ".stamp").exists():
        pytest.skip(f"{TRAINERS} missing: run `make trainers` (`make test` does)")
    if str(TRAINERS) not in sys.path:
        sys.path.append(str(TRAINERS))
