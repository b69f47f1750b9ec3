"""The plugin's start-up line (the build found, the layout applied, proven or only fitting), where a user sees it.

Engines load plugins before they configure logging in some of their processes (SGLang 0.5.23's main process in
`Engine.__init__`, before it parses its arguments; its detokenizer, before `configure_logger`), and Python drops
an INFO record that meets no handler. A proven build's INFO line then said nothing, so the one line that names the
build would be missing exactly where the build is fine. With no handler anywhere yet, the line goes to stderr in
the engine log's shape; otherwise through logging as configured (a level above INFO silences it). An unproven
build's line is a WARNING, which Python always shows.
"""

from __future__ import annotations

import logging
import sys
import time


def announce(logger: logging.Logger, line: str, *, proven: bool) -> None:
    """Say `line` once in this process: INFO for a proven build, WARNING for one that only fits."""
    level = logging.INFO if proven else logging.WARNING
    if level >= logging.WARNING or logger.hasHandlers():  # a WARNING meets Python's last-resort handler at worst
        logger.log(level, "%s", line)
    else:
        stamp = time.strftime("%Y-%m-%d %H:%M:%S")
        print(f"[{stamp}] {line}", file=sys.stderr, flush=True)
