"""Routed-experts capture: worst-case sizing, host-side overflow checks, and per-forward buffer occupancy.

Plain functions of plain integers; `hooks.capture` feeds them from SGLang 0.5.23 and builds the real capturer.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from engine_ext.core.degraded import EngineFailure

# Buffer names as the budget table (`engine_ext.sglang.budget`) and the engine file's `occupancy` list spell them.
DEVICE_CACHE = "routed_experts.device_cache"
GATHER_BUFFER = "routed_experts.gather_buffer"  # DeepEP: device rows × attn_tp, so it follows DEVICE_CACHE
CUTEDSL_MOE_WRAPPER = "cutedsl_moe.wrapper"  # N × cutedsl_moe_max_num_tokens(), which the plugin replaces

# Buffers whose 0.5.23 sizing this plugin replaces with the worst case; the budget check reports them as
# corrected instead of asking the operator to change a setting.
CORRECTED_BUFFERS = frozenset({DEVICE_CACHE, GATHER_BUFFER, CUTEDSL_MOE_WRAPPER})

DEFAULT_WINDOW_S = 60.0


class CaptureOverflowError(EngineFailure):
    """A forward would write more rows than a capture buffer holds; says which setting to change."""


@dataclass(frozen=True, slots=True)
class CaptureLimits:
    """The settings that bound how many rows one forward routes on one DP rank (all per rank)."""

    max_running_requests: int
    chunked_prefill_size: int | None  # None or <= 0: chunked prefill off
    context_len: int
    max_prefill_tokens: int = 0
    prefill_graph_max_tokens: int = 0  # largest prefill CUDA-graph token bucket (0: no prefill graph)
    decode_graph_max_bs: int = 0  # largest decode/verify CUDA-graph batch (0: no decode graph)
    tokens_per_req: int = 1  # w: speculative_num_draft_tokens when verify forwards run, else 1
    attn_tp_size: int = 1  # DP padding aligns each rank's count to this

    def prefill_tokens(self) -> int:
        """P: the most tokens one prefill forward carries on one rank."""
        if self.chunked_prefill_size is None or self.chunked_prefill_size <= 0:
            chunk = max(self.context_len, self.max_prefill_tokens)  # a whole prompt in one forward
        else:
            chunk = self.chunked_prefill_size
        return max(chunk, self.prefill_graph_max_tokens)

    def decode_tokens(self) -> int:
        """Most tokens one decode/verify forward carries on one rank: the largest batch (eager or graph) × w."""
        return max(self.max_running_requests, self.decode_graph_max_bs) * self.tokens_per_req

    def rows_per_rank(self) -> int:
        """max(P, graph_max_bs · w), aligned up to attn_tp_size as DP padding does."""
        rows = max(self.prefill_tokens(), self.decode_tokens())
        align = max(1, self.attn_tp_size)
        return -(-rows // align) * align

    def formula(self, num_dp_ranks: int) -> str:
        return (
            f"{num_dp_ranks} DP ranks × max(P={self.prefill_tokens()}, "
            f"max(max_running_requests={self.max_running_requests}, cuda_graph_max_bs={self.decode_graph_max_bs})"
            f" × w={self.tokens_per_req})"
        )


def device_rows(limits: CaptureLimits, num_dp_ranks: int) -> int:
    """Rows of the routed-experts device cache: `N · max(P, graph_max_bs · w)` (docs/design.md, "Capture
    buffer sizing").

    `num_dp_ranks` is N when the MoE sees the DP-gathered batch, 1 when each rank's tokens stay local.
    """
    if num_dp_ranks < 1:
        raise ValueError(f"num_dp_ranks must be >= 1, got {num_dp_ranks}")
    return num_dp_ranks * limits.rows_per_rank()


def upstream_device_rows(chunked_prefill_size: int, max_running_requests: int, num_dp_ranks: int) -> int:
    """0.5.23's sizing (`RoutedExpertsCapturer.__init__`): no verify width, no prefill graph, no -1 case."""
    return max(chunked_prefill_size * num_dp_ranks, max_running_requests * num_dp_ranks)


def cutedsl_moe_tokens(
    *, max_prefill_tokens: int, prefill_graph_max_tokens: int, decode_graph_max_bs: int, tokens_per_req: int
) -> int:
    """Largest per-rank token count of one CuteDSL MoE forward, counting every prefill-graph backend.

    0.5.23 counts the prefill graph only under the legacy TC_PIECEWISE name, which no longer parses, so the
    default BREAKABLE and the FULL prefill graphs are missed (`runtime_context.cutedsl_moe_max_num_tokens`).
    """
    return max(max_prefill_tokens, prefill_graph_max_tokens, decode_graph_max_bs * tokens_per_req)


def check_fits(used: int, capacity: int, *, what: str, remedy: str, unit: str = "rows") -> None:
    """Raise `CaptureOverflowError` unless `used <= capacity`; both are host-side integers."""
    if used > capacity:
        raise CaptureOverflowError(
            f"{what}: this forward needs {used} {unit} but the buffer holds {capacity}; {remedy}"
        )


def draft_kv_indices_fits(*, seq_lens_sum: int | None, topk: int, num_seqs: int, num_steps: int, width: int) -> None:
    """EAGLE draft-decode kv_indices row: `seq_lens_sum · topk + num_seqs · topk · num_steps` entries must fit.

    The same bound FlashInfer asserts (`draft_kv_indices_used_len`); Triton and AITER size the row the same way
    but check nothing, and their kernels bound writes per row only. Unknown `seq_lens_sum` (sync-free batches)
    is not checked: the kernel's own clamp then applies.
    """
    if seq_lens_sum is None:
        return
    bs = topk * num_seqs
    check_fits(
        seq_lens_sum * topk + bs * num_steps,
        width,
        what=f"EAGLE draft kv_indices row (num_seqs={num_seqs}, topk={topk}, seq_lens_sum={seq_lens_sum})",
        remedy="sequences within --speculative-num-steps of the context length overflow it: lower "
        "--speculative-num-steps or --speculative-eagle-topk, or cap max_new_tokens below the context length",
        unit="entries",
    )


class Occupancy:
    """Rows used per forward against a buffer's capacity, with the peak over a sliding window.

    `record` runs on the scheduler thread once per forward (amortised O(1), monotonic deque); `snapshot` runs on
    the telemetry thread. One lock, held for a few list operations.
    """

    def __init__(
        self,
        buffer: str,
        capacity: int,
        *,
        window_s: float = DEFAULT_WINDOW_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if window_s <= 0:
            raise ValueError(f"window_s must be > 0, got {window_s}")
        self.buffer = buffer
        self.capacity = capacity
        self.window_s = window_s
        self._clock = clock
        self._lock = threading.Lock()
        self._peaks: deque[tuple[float, int]] = deque()  # (time, rows), rows strictly decreasing
        self.last = 0

    def record(self, rows: int) -> None:
        now = self._clock()
        with self._lock:
            self.last = rows
            peaks = self._peaks
            while peaks and peaks[-1][1] <= rows:
                peaks.pop()
            peaks.append((now, rows))
            self._expire(now)

    def _expire(self, now: float) -> None:
        horizon = now - self.window_s
        peaks = self._peaks
        while peaks and peaks[0][0] < horizon:
            peaks.popleft()

    def peak(self) -> int:
        with self._lock:
            self._expire(self._clock())
            return self._peaks[0][1] if self._peaks else 0

    def snapshot(self) -> dict:
        """`{"buffer", "capacity", "peak", "window_s"}`: one entry of the engine file's `occupancy` (Contract 1)."""
        return {"buffer": self.buffer, "capacity": self.capacity, "peak": self.peak(), "window_s": self.window_s}


_tracked: dict[str, Occupancy] = {}
_tracked_lock = threading.Lock()


def track(buffer: str, capacity: int, *, window_s: float = DEFAULT_WINDOW_S) -> Occupancy:
    """Start (or restart, on a new capacity) occupancy tracking of `buffer` in this process."""
    occupancy = Occupancy(buffer, capacity, window_s=window_s)
    with _tracked_lock:
        _tracked[buffer] = occupancy
    return occupancy


def tracked(buffer: str) -> Occupancy | None:
    with _tracked_lock:
        return _tracked.get(buffer)


def occupancy_snapshot() -> list[dict]:
    """Every tracked buffer's capacity and windowed peak, for the telemetry thread."""
    with _tracked_lock:
        current = list(_tracked.values())
    return [occupancy.snapshot() for occupancy in current]


class RoutedLayers:
    """The model layers SGLang's forward routes in, as seen at the first forward that captured any.

    Why not the HF config: which layers are MoE is the model class's decision, and config fields do not always
    say it (SGLang 0.5.23's Qwen3-MoE routes every layer whatever `mlp_only_layers` says). The first forward
    (SGLang's warmup) precedes every request, so records always know; the config is the fallback.
    """

    def __init__(self) -> None:
        self.seen: set[int] = set()
        self.known: tuple[int, ...] | None = None

    def note(self, layer_id: int) -> None:
        self.seen.add(int(layer_id))

    def close(self) -> None:
        if self.seen:
            self.known = tuple(sorted(self.seen))


ROUTED_LAYERS = RoutedLayers()  # this process's model, filled by `hooks.capture._checked_device_capture`
