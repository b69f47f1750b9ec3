"""`r3-sidecar`: serve the sidecar, run it with the demo engine, or fetch a record (an engine's budget: `r3-budget`).

Every `Settings` field is a flag (`--spool-dir`, `--auth-token`, …) as well as an `R3_*` variable; a flag
wins over the environment. The heavy imports (uvicorn, the app) happen inside the commands that need them.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from service.server.settings import Settings

DEFAULT_URL = "http://127.0.0.1:8000"
FORMATS = ("npy", "raw", "json", "sglang_b64")  # service.wire.formats.FORMATS, without importing numpy for --help


# ---- settings flags -----------------------------------------------------------------------------------


def _add_settings_flags(parser: argparse.ArgumentParser, shown: dict[str, object] | None = None) -> None:
    """One `--kebab-name` flag per `Settings` field; values are validated by `Settings` itself. `shown`: the
    defaults this command uses instead of the fields' own (the demo's temp spool and short TTL)."""
    group = parser.add_argument_group("settings (also R3_<NAME> in the environment; a flag wins)")
    for name, field in Settings.model_fields.items():
        default = (shown or {}).get(name, field.default)
        group.add_argument(
            f"--{name.replace('_', '-')}",
            dest=f"setting_{name}",
            metavar=name.upper(),
            default=None,
            help=f"{(field.description or '').rstrip('.')} (default: {default or 'none'}; R3_{name.upper()})",
        )


def _settings(args: argparse.Namespace, **overrides: Any) -> Settings:
    flags = {
        key.removeprefix("setting_"): value
        for key, value in vars(args).items()
        if key.startswith("setting_") and value is not None
    }
    return Settings(**{**overrides, **flags})


# ---- serve / demo -------------------------------------------------------------------------------------


# Open streams and waits end this long after SIGTERM (clients resume with `start=`), so a rollout does not wait
# for the pod's whole grace period.
GRACEFUL_SHUTDOWN_S = 5


def _serve(settings: Settings, banner: str | None = None, fd: int | None = None) -> None:
    import uvicorn

    from service.server.api import create_app
    from service.server.heap import keep_freed_chunks

    settings.spool_dir.mkdir(parents=True, exist_ok=True)
    keep_freed_chunks(settings.chunk_bytes)
    app = create_app(settings)
    listen = {"fd": fd} if fd is not None else {"host": settings.host, "port": settings.port}
    server = uvicorn.Server(
        uvicorn.Config(
            app,
            log_level="info",
            timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
            **listen,  # type: ignore[arg-type]
        )
    )
    if settings.idle_exit_s > 0 or settings.exit_with_pid > 0:
        from service.server.lifetime import watch

        watch(
            app.state.store,
            settings.idle_exit_s,
            settings.exit_with_pid,
            lambda _: setattr(server, "should_exit", True),
        )
    if banner:
        print(banner, flush=True)
    # uvicorn shuts down gracefully on SIGINT/SIGTERM, then re-raises the signal: turn that into a clean
    # exit (status 0) so `finally` blocks run and Ctrl-C or a pod stop is not reported as a failure.
    signal.signal(signal.SIGTERM, _exit_cleanly)
    with contextlib.suppress(KeyboardInterrupt):
        server.run()


def _exit_cleanly(_signum: int, _frame: object) -> None:
    raise SystemExit(0)


def cmd_serve(args: argparse.Namespace) -> int:
    _serve(_settings(args), fd=args.fd)
    return 0


def demo_banner(url: str, spool_dir: Path, token: str | None, ttl_s: float = 120.0) -> str:
    """The commands to try against a demo sidecar, ready to paste."""
    auth = f" -H 'Authorization: Bearer {token}'" if token else ""
    tok = f', token="{token}"' if token else ""
    fetch_tok = f" --token {token}" if token else ""
    rid = "demo-000000"
    python = _shown_path(sys.executable)
    script = Path(sys.executable).with_name("r3-sidecar")
    cli = _shown_path(str(script)) if script.exists() else f"{python} -m service.server.cli"
    return "\n".join(
        [
            f"r3-sidecar demo: {url}  (spool {spool_dir}; the demo engine writes {rid}, demo-000001, …)",
            "Try:",
            f"  curl -s{auth} '{url}/routed_experts/{rid}?wait=30&format=json&end=2'",
            f"  curl -s{auth} -o {rid}.npy '{url}/routed_experts/{rid}?wait=30'"
            f" && {python} -c 'import numpy; a = numpy.load(\"{rid}.npy\"); print(a.shape, a.dtype)'",
            f"  {python} -c 'from service.client import RoutedExpertsClient as C;"
            f' r = C("{url}"{tok}).get("{rid}", wait=30); print(r.array.shape, r.dtype, r.layers[:4])\'',
            f"  {cli} fetch {rid} --url {url}{fetch_tok} --out {rid}.npy",
            f"  curl -s{auth} '{url}/routed_experts/dsv3-000000?wait=30&format=sglang_b64' | head -c 80"
            "   # DeepSeek-V3 shape: 61 layer slots, dense 0-2 as zeros",
            f"  curl -s{auth} -o /dev/null -D - '{url}/routed_experts/dsv3-000000?wait=30&layers=0-15'"
            "   # a pipeline stage: MoE layers 3-15",
            f"  curl -s {url}/metrics | grep ^r3_",
            f"  curl -s{auth} {url}/v1/engines",
            f"Records keep coming and expire {ttl_s:g} s after they finish; {rid} … demo-000003 and dsv3-000000,"
            " dsv3-000001 come back whenever they are acknowledged or expire, so these commands work every time.",
            "Ctrl-C stops.",
        ]
    )


def _shown_path(path: str) -> str:
    """`path` relative to the working directory when it is inside it (`.venv/bin/python`), else as is."""
    try:
        return str(Path(path).relative_to(Path.cwd()))
    except ValueError:
        return path


DEMO_TTL_S = 120.0
"""The demo's record TTL (unless --ttl-s or R3_TTL_S says otherwise): at the demo's pace a few hundred records
live at once, well under `--max-live`, so records keep coming for as long as it runs."""


def cmd_demo(args: argparse.Namespace) -> int:
    from service.server.demo import DemoConfig, DemoEngine
    from service.spool import Spool

    temp_dir: str | None = None
    overrides: dict[str, Any] = {}
    if args.setting_spool_dir is None and "R3_SPOOL_DIR" not in os.environ:
        shm = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None
        temp_dir = tempfile.mkdtemp(prefix="r3-demo-", dir=shm)
        overrides["spool_dir"] = temp_dir
    if args.setting_ttl_s is None and "R3_TTL_S" not in os.environ:
        overrides["ttl_s"] = DEMO_TTL_S  # the oldest records expire, so the demo engine never stops producing
    settings = _settings(args, **overrides)
    pace = dict(max_live=args.max_live, max_records=args.max_records, step_s=args.step_ms / 1000)
    cfg = DemoConfig(**pace, seed=args.seed)
    engine = DemoEngine(Spool(settings.spool_dir), cfg).start()  # all-MoE (Qwen3-30B-A3B)
    dense = DemoEngine(Spool(settings.spool_dir), DemoConfig.deepseek_v3_like(**pace, seed=args.seed + 1)).start()
    host = "127.0.0.1" if settings.host in ("0.0.0.0", "::", "") else settings.host
    try:
        url = f"http://{host}:{settings.port}"
        _serve(settings, demo_banner(url, settings.spool_dir, settings.auth_token, settings.ttl_s))
    finally:
        engine.stop()
        dense.stop()
        if temp_dir:
            shutil.rmtree(temp_dir, ignore_errors=True)
    return 0


# ---- fetch --------------------------------------------------------------------------------------------


def cmd_fetch(args: argparse.Namespace) -> int:
    from service.client import RoutedExpertsClient

    token = args.token or os.environ.get("R3_AUTH_TOKEN") or None
    layers = args.layers or None  # the server's syntax: indices and inclusive ranges (0-15)
    query = {"start": args.start, "end": args.end, "layers": layers, "wait": args.wait, "clamp": args.clamp}
    with RoutedExpertsClient(args.url, token=token, timeout=args.timeout) as client:
        body = client.fetch_bytes(args.rid, args.format, **query)
    if args.out and args.out != "-":
        Path(args.out).write_bytes(body)
        print(f"{args.rid}: {len(body)} bytes of {args.format} → {args.out}", file=sys.stderr)
    elif args.out == "-" or args.format in ("json", "sglang_b64"):
        return _to_stdout(body if args.out == "-" else body + b"\n")
    else:
        from service.client.decoding import parse_npy

        summary = f"{len(body)} bytes"
        if args.format == "npy":
            array = parse_npy(body)
            summary = f"shape {array.shape} dtype {array.dtype}"
        print(f"{args.rid}: {summary} (use --out FILE to save it)")
    return 0


def one_line(command: str, exc: Exception) -> str:
    """A failure as the one line a person reads: which command, what kind, what the sidecar or the OS said."""
    status = getattr(exc, "status", None)
    kind = type(exc).__name__ + (f" (HTTP {status})" if status is not None else "")
    return f"r3-sidecar {command}: {kind}: {exc}"


def _to_stdout(data: bytes) -> int:
    """Write to stdout; a reader that stops early (`| head`) ends the command quietly, as for any Unix tool."""
    try:
        sys.stdout.buffer.write(data)
        sys.stdout.buffer.flush()
    except BrokenPipeError:
        # Python flushes stdout again at exit; point it at /dev/null so that flush cannot raise a second time
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141  # 128 + SIGPIPE, what a shell reports for a writer cut off by its reader
    return 0


# ---- entry --------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="r3-sidecar", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="serve the spool over HTTP (GET /routed_experts/<rid>, /metrics)")
    _add_settings_flags(serve)
    serve.add_argument(
        "--fd",
        type=int,
        default=None,
        help="serve on this already-listening socket (inherited) instead of host:port (default: none)",
    )
    serve.set_defaults(func=cmd_serve)

    demo = sub.add_parser(
        "demo",
        help="serve with the built-in demo engine writing records (temp spool; records expire after "
        f"{DEMO_TTL_S:g} s unless --ttl-s says otherwise)",
    )
    _add_settings_flags(demo, {"spool_dir": "a new temporary directory, removed at exit", "ttl_s": DEMO_TTL_S})
    demo.add_argument(
        "--max-live", type=int, default=1024, help="pause creating records while this many exist (default: %(default)s)"
    )
    demo.add_argument(
        "--max-records", type=int, default=None, help="create at most this many records (default: no limit)"
    )
    demo.add_argument(
        "--step-ms", type=float, default=30.0, help="decode step period, one row per request (default: %(default)s)"
    )
    demo.add_argument(
        "--seed", type=int, default=0, help="seed of the simulated router and traffic (default: %(default)s)"
    )
    demo.set_defaults(func=cmd_demo)

    fetch = sub.add_parser("fetch", help="fetch one record")
    fetch.add_argument("rid", help="the record's rid (the engine request's id)")
    fetch.add_argument(
        "--url",
        default=os.environ.get("R3_SIDECAR_URL", DEFAULT_URL),
        help="the sidecar (default: R3_SIDECAR_URL, else %(default)s)",
    )
    fetch.add_argument(
        "--format", default="npy", choices=FORMATS, help="body format: %(choices)s (default: %(default)s)"
    )
    fetch.add_argument("--out", default=None, help="write the body here, '-' for stdout (default: print a summary)")
    fetch.add_argument("--start", type=int, default=None, help="first token position (default: the record's start)")
    fetch.add_argument("--end", type=int, default=None, help="one past the last token position (default: its end)")
    fetch.add_argument(
        "--layers", default=None, help="model layer indices and inclusive ranges, e.g. 0,1 or 0-15 (default: all)"
    )
    fetch.add_argument(
        "--clamp", action="store_true", help="cut --start/--end to the rows that exist instead of a 416 (default: off)"
    )
    fetch.add_argument(
        "--wait", type=float, default=0.0, help="seconds to wait for the record to be final (default: %(default)s)"
    )
    fetch.add_argument("--token", default=None, help="bearer token (default: R3_AUTH_TOKEN, else none)")
    fetch.add_argument(
        "--timeout",
        type=float,
        default=30.0,
        help="seconds an answer may take, on top of --wait (default: %(default)s)",
    )
    fetch.set_defaults(func=cmd_fetch)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    from pydantic import ValidationError

    from service.client.errors import R3Error

    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except ValidationError as exc:
        print(f"r3-sidecar {args.command}: invalid setting\n{exc}", file=sys.stderr)
        return 2
    except (R3Error, OSError) as exc:  # the sidecar's answer, a connection, a file: one line, never a traceback
        print(one_line(args.command, exc), file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
