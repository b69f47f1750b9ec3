"""Fallback launcher for the sidecar when the `r3-sidecar` console script is not installed: same app, same settings."""

from __future__ import annotations

import argparse

import uvicorn

from service.api import create_app
from service.settings import Settings


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, required=True)
    args = ap.parse_args()
    settings = Settings(host=args.host, port=args.port)
    uvicorn.run(create_app(settings), host=args.host, port=args.port, log_level="info")


if __name__ == "__main__":
    main()
