"""A build no test proved checks itself before the plugin takes delivery over from SGLang's own inline rows.

Why: a build that fits a layout (`fit`) but whose real server no test ran (a post release, a fork's dev build, a
patched image) may still differ where no name shows it: a slice computed otherwise, a host cache laid out anew.
So on such a build the first records are gathered the plugin's way (`gather.StepGather`, as sidecar mode
delivers them) *and* taken from SGLang's own inline payload (as mirror mode does), and compared byte for byte.
Until `needed` records agree, the collector runs in mirror mode: responses carry SGLang's rows and the pointer,
and the spool gets SGLang's own rows. Once they agree, the configured mode applies. At the first difference the
check raises `BuildMismatch` from the plugin's own code, so the guard hands every hook back to SGLang (one
ERROR line, the engine file's `degraded` naming the record, row and layer, `R3EngineDegraded`).

The comparison runs where the gathered rows land (the collector's drain), for the first few records only; its
states, failure and row comparison are every engine's (`engine_ext/core/build_check.py`).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import numpy as np
import torch

from engine_ext.core.build_check import AGREED, PENDING, BuildMismatch, check_report, first_difference
from engine_ext.sglang.gather import to_spool_rows


@dataclass
class BuildCheck:
    """The comparison of one process's first records; `state` goes from pending to agreed, or raises."""

    build: str  # the build and its layout, for the message
    needed: int
    agreed: int = 0
    _ours: dict[str, np.ndarray] = field(default_factory=dict)
    _theirs: dict[str, np.ndarray] = field(default_factory=dict)
    _without: set[str] = field(default_factory=set)  # rids SGLang built no rows for: nothing to compare
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def state(self) -> str:
        return AGREED if self.agreed >= self.needed else PENDING

    def wants(self) -> bool:
        """Whether to compare one more record (enough are already on their way otherwise)."""
        with self._lock:
            return self.agreed + len(self._theirs) + len(self._ours) < 2 * self.needed and self.state == PENDING

    def ticket(self, rid: str, layer_slots: tuple[int, ...] | None, dtype: str) -> CheckTicket:
        """What the step's batched read hands the plugin's rows of `rid` to."""
        return CheckTicket(self, rid, layer_slots, dtype)

    def theirs(self, rid: str, rows: np.ndarray | None) -> None:
        """SGLang's own rows of `rid`, as the spool stores them (None: it built none; nothing to compare)."""
        self._arrive(rid, rows, mine=False)

    def ours(self, rid: str, rows: np.ndarray) -> None:
        self._arrive(rid, rows, mine=True)

    def _arrive(self, rid: str, rows: np.ndarray | None, *, mine: bool) -> None:
        with self._lock:
            if rows is None:  # SGLang built no rows for it: drop what of it arrived, and what will
                self._ours.pop(rid, None)
                self._without.add(rid)
                return
            if mine and rid in self._without:
                self._without.discard(rid)
                return
            (self._ours if mine else self._theirs)[rid] = rows
            if rid not in self._ours or rid not in self._theirs:
                return
            ours, theirs = self._ours.pop(rid), self._theirs.pop(rid)
            gap = first_difference(ours, theirs, engine="SGLang")
            if gap is None:
                self.agreed += 1
                return
        raise BuildMismatch(f"{self.build}: record {rid!r} gathered the plugin's way differs from SGLang's own: {gap}")

    def report(self) -> dict[str, object]:
        """The engine file's `build.check`."""
        return check_report(self.agreed, self.needed)


@dataclass(frozen=True, slots=True)
class CheckTicket:
    """One record's rows from the step's batched read, for the comparison only (nothing is written)."""

    check: BuildCheck
    rid: str
    layer_slots: tuple[int, ...] | None
    dtype: str

    def deliver(self, rows: torch.Tensor) -> None:
        self.check.ours(self.rid, to_spool_rows(rows, self.layer_slots, self.dtype))
