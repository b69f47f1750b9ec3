"""Pure capture math: slice offsets, device-cache rows, overflow checks, windowed occupancy (no SGLang)."""

from __future__ import annotations

import itertools
import threading

import pytest
from hypothesis import given
from hypothesis import strategies as st

from engine_ext.sglang import capturer
from engine_ext.sglang.capturer import CaptureLimits, CaptureOverflowError, Occupancy, device_rows
from engine_ext.sglang.slicing import DecodeGraphExtent, LocalSlice, local_slice

# ---- slicing ---------------------------------------------------------------------------------------------


def test_verify_graph_offset_is_rank_times_graph_tokens() -> None:
    extent = DecodeGraphExtent(graph_bs=16, tokens_per_req=4)
    got = local_slice(rank=1, local_tokens=48, decode_graph=extent, padded_counts=None, counts=[40, 48])
    assert got == LocalSlice(64, 112, 128)  # upstream: 1 · 16 = 16


def test_ragged_verify_graph_uses_the_token_tier() -> None:
    extent = DecodeGraphExtent(graph_bs=16, tokens_per_req=4, ragged_tokens=40)
    got = local_slice(rank=3, local_tokens=7, decode_graph=extent, padded_counts=None, counts=[1, 2, 3, 7])
    assert (got.start, got.stop, got.gathered_rows) == (120, 127, 160)


def test_eager_and_prefill_graph_use_padded_prefix_sums() -> None:
    got = local_slice(rank=2, local_tokens=64, decode_graph=None, padded_counts=[64, 64, 64], counts=[10, 20, 30])
    assert got == LocalSlice(128, 192, 192)
    raw = local_slice(rank=2, local_tokens=30, decode_graph=None, padded_counts=None, counts=[10, 20, 30])
    assert raw == LocalSlice(30, 60, 60)


def test_missing_counts_are_a_value_error_naming_them() -> None:
    with pytest.raises(ValueError, match="global_num_tokens_padded_cpu and global_num_tokens_cpu are both None"):
        local_slice(rank=1, local_tokens=4, decode_graph=None, padded_counts=None, counts=None)
    with pytest.raises(ValueError, match="DP rank 2 has no entry"):
        local_slice(rank=2, local_tokens=4, decode_graph=None, padded_counts=[4, 4], counts=None)
    with pytest.raises(ValueError, match="holds 8 per rank"):
        local_slice(rank=0, local_tokens=9, decode_graph=DecodeGraphExtent(8, 1), padded_counts=None, counts=None)
    with pytest.raises(ValueError, match="bad decode graph extent"):
        DecodeGraphExtent(graph_bs=4, tokens_per_req=0)


@given(st.lists(st.integers(0, 5000), min_size=1, max_size=16))
def test_eager_slices_tile_the_gathered_batch(counts: list[int]) -> None:
    slices = [
        local_slice(rank=r, local_tokens=n, decode_graph=None, padded_counts=counts, counts=None)
        for r, n in enumerate(counts)
    ]
    assert [s.start for s in slices] == [sum(counts[:r]) for r in range(len(counts))]
    assert all(a.stop == b.start for a, b in itertools.pairwise(slices))
    assert slices[-1].stop == slices[-1].gathered_rows == sum(counts)


@given(st.integers(1, 8), st.integers(1, 512), st.integers(1, 8), st.data())
def test_decode_graph_slices_stay_inside_their_rank_block(ranks: int, graph_bs: int, w: int, data) -> None:
    extent = DecodeGraphExtent(graph_bs=graph_bs, tokens_per_req=w)
    for rank in range(ranks):
        tokens = data.draw(st.integers(0, graph_bs)) * w
        got = local_slice(rank=rank, local_tokens=tokens, decode_graph=extent, padded_counts=None, counts=[0] * ranks)
        assert rank * graph_bs * w <= got.start <= got.stop <= (rank + 1) * graph_bs * w
        assert got.gathered_rows == ranks * graph_bs * w


# ---- sizing ----------------------------------------------------------------------------------------------


def test_device_rows_is_n_times_max_of_prefill_and_verify() -> None:
    limits = CaptureLimits(max_running_requests=512, chunked_prefill_size=1024, context_len=32768, tokens_per_req=4)
    assert device_rows(limits, 8) == 8 * 2048  # upstream: 8 · max(1024, 512) = 8192 → verify overflows
    assert capturer.upstream_device_rows(1024, 512, 8) == 8192


def test_chunked_prefill_off_takes_a_whole_prompt() -> None:
    limits = CaptureLimits(8, chunked_prefill_size=-1, context_len=131072, max_prefill_tokens=16384)
    assert limits.prefill_tokens() == 131072
    assert device_rows(limits, 1) == 131072


def test_prefill_graph_bucket_and_decode_graph_batch_count() -> None:
    limits = CaptureLimits(
        max_running_requests=100,
        chunked_prefill_size=4096,
        context_len=8192,
        prefill_graph_max_tokens=8192,
        decode_graph_max_bs=160,
        tokens_per_req=2,
    )
    assert limits.rows_per_rank() == 8192
    assert device_rows(CaptureLimits(100, 64, 8192, decode_graph_max_bs=160, tokens_per_req=2), 2) == 640


def test_rows_align_to_attention_tp_like_dp_padding() -> None:
    assert CaptureLimits(63, 32, 512, attn_tp_size=2).rows_per_rank() == 64
    with pytest.raises(ValueError):
        device_rows(CaptureLimits(1, 1, 1), 0)


def test_cutedsl_tokens_count_every_prefill_graph_backend() -> None:
    got = capturer.cutedsl_moe_tokens(
        max_prefill_tokens=4096, prefill_graph_max_tokens=8192, decode_graph_max_bs=64, tokens_per_req=4
    )
    assert got == 8192


def test_corrected_buffers_use_the_budget_table_names() -> None:
    assert {"routed_experts.device_cache", "cutedsl_moe.wrapper"} <= capturer.CORRECTED_BUFFERS


# ---- checks ----------------------------------------------------------------------------------------------


def test_check_fits_names_what_and_remedy() -> None:
    capturer.check_fits(10, 10, what="x", remedy="y")
    with pytest.raises(CaptureOverflowError, match=r"^buf: this forward needs 11 rows but the buffer holds 10; lower"):
        capturer.check_fits(11, 10, what="buf", remedy="lower --max-running-requests")


def test_draft_kv_indices_bound_matches_flashinfers() -> None:
    # draft_kv_indices_used_len(seq_lens_sum, topk, bs=topk·num_seqs, steps) = seq_lens_sum·topk + bs·steps
    capturer.draft_kv_indices_fits(seq_lens_sum=100, topk=2, num_seqs=4, num_steps=3, width=224)
    with pytest.raises(CaptureOverflowError, match="EAGLE draft kv_indices"):
        capturer.draft_kv_indices_fits(seq_lens_sum=100, topk=2, num_seqs=4, num_steps=3, width=223)
    capturer.draft_kv_indices_fits(seq_lens_sum=None, topk=2, num_seqs=4, num_steps=3, width=1)


# ---- occupancy -------------------------------------------------------------------------------------------


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_occupancy_peak_is_the_max_over_the_window() -> None:
    clock = _Clock()
    occupancy = Occupancy("b", 100, window_s=10, clock=clock)
    assert occupancy.snapshot() == {"buffer": "b", "capacity": 100, "peak": 0, "window_s": 10}
    for t, rows in [(0, 30), (1, 80), (2, 20), (5, 50)]:
        clock.now = 1000.0 + t
        occupancy.record(rows)
    assert occupancy.peak() == 80
    clock.now = 1011.5  # 80 (t=1) has left the window; 50 (t=5) is the largest left
    assert occupancy.peak() == 50
    clock.now = 1100.0
    assert occupancy.peak() == 0
    with pytest.raises(ValueError):
        Occupancy("b", 1, window_s=0)


def test_occupancy_is_safe_across_threads() -> None:
    occupancy = Occupancy("b", 10_000, window_s=60)
    stop = threading.Event()
    seen: list[int] = []

    def reader() -> None:
        while not stop.is_set():
            seen.append(occupancy.snapshot()["peak"])

    thread = threading.Thread(target=reader)
    thread.start()
    for rows in range(5000):
        occupancy.record(rows % 997)
    stop.set()
    thread.join()
    assert occupancy.peak() == 996
    assert all(0 <= p <= 996 for p in seen)


def test_tracked_buffers_appear_in_the_snapshot() -> None:
    capturer.track("test.buffer", 64, window_s=5).record(12)
    assert {"buffer": "test.buffer", "capacity": 64, "peak": 12, "window_s": 5} in capturer.occupancy_snapshot()
    assert capturer.tracked("test.buffer").last == 12
