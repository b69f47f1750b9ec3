"""`r3-budget <sglang server args…>`: the buffer budget table of a launch, before launching it.

Parses the arguments with SGLang's own parser (`ServerArgs.add_cli_args` / `from_cli_args`), resolves them on
this machine (`--device` defaults to cpu, so no accelerator is needed) and prints the same rows the
pre-launch check logs. `--model-path dummy` works when the sizes are explicit (SGLang's resolution stops
before model-dependent defaults). Exit code: 0 fits, 1 a buffer falls short that the plugin does not
correct, 2 SGLang itself rejects the arguments.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import asdict

from engine_ext.sglang.budget.table import BudgetRow, blocking_rows

NEEDS = (
    "r3-budget runs where the engine runs: it parses the launch with SGLang's own ServerArgs, so it needs SGLang "
    "(0.5.12 to 0.5.23) importable, i.e. the engine's environment with r3-sidecar installed beside it. No GPU needed."
)


def _base_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="r3-budget",
        description="Check an SGLang launch's buffer budget offline: give it the arguments of `sglang serve` "
        "(e.g. r3-budget --model-path dummy --tp 8 --chunked-prefill-size 8192). Exit 0: fits; 1: a buffer falls "
        "short that the plugin does not correct; 2: SGLang rejects the arguments.",
        epilog=NEEDS,
        allow_abbrev=False,
    )
    parser.add_argument("--json", action="store_true", dest="r3_json", help="Print JSON (default: a table).")
    return parser


def _without_sglang(argv: list[str]) -> int:
    """SGLang is not importable: `--help` still explains the command and what it needs; anything else says so."""
    if {"-h", "--help"} & set(argv):
        _base_parser().print_help()
        print("\n(SGLang is not importable here, so its launch arguments are not listed.)")
        return 0
    print(f"r3-budget: SGLang is not importable here. {NEEDS}", file=sys.stderr)
    return 2


def _parser():
    from sglang.srt.server_args import ServerArgs

    parser = _base_parser()
    ServerArgs.add_cli_args(parser)
    return parser, ServerArgs


def _status(row: BudgetRow) -> str:
    return "ok" if row.ok else ("corrected" if row.corrected else "FAIL")


def render(rows: Sequence[BudgetRow], file=None) -> None:
    """The table with rich: one line per buffer, then each buffer's formula."""
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    console = Console(file=file or sys.stdout, width=200, soft_wrap=True)
    table = Table(title="r3-sidecar buffer budget (SGLang 0.5.23)")
    for name, justify in (("buffer", "left"), ("unit", "left"), ("capacity", "right"), ("demand", "right")):
        table.add_column(name, justify=justify, no_wrap=True)
    table.add_column("status", no_wrap=True)
    table.add_column("fix")
    styles = {"ok": "green", "corrected": "yellow", "FAIL": "bold red"}
    for row in rows:
        status = _status(row)
        table.add_row(
            row.buffer,
            row.unit,
            str(row.capacity),
            str(row.demand),
            f"[{styles[status]}]{status}[/]",
            escape(row.fix or ""),
        )
    console.print(table)
    for row in rows:
        console.print(f"[dim]{row.buffer}: {escape(row.formula)}[/]", highlight=False)
    blocking = blocking_rows(rows)
    if blocking:
        console.print(f"[bold red]{len(blocking)} buffer(s) fall short and the plugin does not correct them.[/]")


def main(argv: Sequence[str] | None = None) -> int:
    """Parse SGLang server args, resolve them offline, print the budget; 1 when a row blocks the launch."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        parser, server_args_cls = _parser()
    except ImportError:
        return _without_sglang(argv)
    args = parser.parse_args(argv)
    if getattr(args, "device", None) is None:
        args.device = "cpu"
    as_json = args.r3_json
    try:
        server_args = server_args_cls.from_cli_args(args)
        server_args.resolve_once()
    except Exception as exc:  # SGLang's own validation: report it, do not crash with a traceback
        print(f"r3-budget: SGLang rejects these arguments: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2

    from engine_ext.sglang.hooks.budget import budget_table

    rows = budget_table(server_args)
    blocking = blocking_rows(rows)
    if as_json:
        payload = {
            "ok": not blocking,
            "rows": [{**asdict(r), "blocking": r.blocking} for r in rows],
        }
        print(json.dumps(payload, indent=2))
    else:
        render(rows)
    return 1 if blocking else 0


if __name__ == "__main__":
    sys.exit(main())
