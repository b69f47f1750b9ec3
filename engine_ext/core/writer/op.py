"""The writer thread's unit of work (`Op`): what the scheduler thread hands over, its bytes counted once."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from engine_ext.core.records import RecordSpec
from service.spool.record.meta import Weights


@dataclass(slots=True)
class Op:
    """One unit of work for the writer thread.

    `open` starts (or restarts) the record of `spec`; `rows` are appended; `status` finalizes it. The
    finish-time path sends all three in one op; live rows send an open, many appends, one final.
    """

    rid: str
    spec: RecordSpec | None = None
    rows: np.ndarray | None = None
    status: str | None = None
    weights: Weights | None = None  # with `status`: the versions known at the end (live records)
    nbytes: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        self.nbytes = 0 if self.rows is None else int(self.rows.nbytes)
