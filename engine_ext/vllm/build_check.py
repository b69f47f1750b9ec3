"""A vLLM build no test proved checks its first records against vLLM's own inline rows before sidecar mode drops them.

Why: on vLLM the record is made from vLLM's own joined array (`hooks._around_completion_output`), but the plugin
converts it on the way to the spool: the routing layers kept (`ModelShape.layers`), the spool dtype, the shape.
A build between the matrix's rows, or a release string over other files (`fit`), may hand the plugin an array
that this conversion gets wrong where no test looked (dense layers placed otherwise, a wider id type, another
row layout). So on such a build each of the first `needed` records is decoded back as a trainer reads it from
the sidecar (`RoutedExperts.to_vllm_layout`: every layer's slot, dense ones zero) and compared, value for value,
with the array vLLM puts in that request's response. Until they agree the Spooler keeps vLLM's inline rows
beside the pointer (mirror); at the first difference `compare` raises `BuildMismatch` before anything of that
record is written, and the plugin steps aside in that process (`hooks._step_aside`).

Plain values only (numpy): it runs on the API server's event loop, for the first few records only.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from engine_ext.core.build_check import AGREED, PENDING, BuildMismatch, check_report, first_difference


def as_served(record: np.ndarray, layers: tuple[int, ...], num_hidden_layers: int) -> np.ndarray:
    """A record's rows `(rows, len(layers), topk)` as a trainer rebuilds vLLM's array from them: every model
    layer's slot, dense ones zero, in the record's dtype (the client's `to_vllm_layout`, without the client)."""
    out = np.zeros((record.shape[0], num_hidden_layers, record.shape[2]), dtype=record.dtype)
    out[:, list(layers), :] = record
    return out


@dataclass
class BuildCheck:
    """The comparison of one API server's first records; `state` goes from pending to agreed, or `compare` raises."""

    build: str  # the build and the row applied, for the message
    needed: int
    layers: tuple[int, ...]  # the model layers a record keeps (`ModelShape.layers`)
    num_hidden_layers: int  # the width of vLLM's array
    agreed: int = 0

    @property
    def state(self) -> str:
        return AGREED if self.agreed >= self.needed else PENDING

    def compare(self, rid: str, record: np.ndarray, inline: np.ndarray) -> None:
        """Count `rid`'s record (as the spool will store it) as agreeing with `inline` (vLLM's own array of it), or
        raise `BuildMismatch` naming the record, the first differing row and layer, and both values."""
        gap = first_difference(as_served(record, self.layers, self.num_hidden_layers), inline, engine="vLLM")
        if gap is not None:
            raise BuildMismatch(f"{self.build}: record {rid!r} as the spool stores it differs from vLLM's own: {gap}")
        self.agreed += 1

    def report(self) -> dict[str, object]:
        """The engine file's `build.check`."""
        return check_report(self.agreed, self.needed)
