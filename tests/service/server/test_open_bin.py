"""`record_answer.open_bin` when the record it was asked for is no longer the one on disk.

A reader holds a record's metadata; before it opens the `.bin`, the rid is reused by a writer whose record is
shorter. The open then fails the size check, and that is a race with the rid's next writer, not a damaged spool:
409 (ask again, as the clients do on `record_replaced`), with nothing counted in `r3_spool_skipped_total`. A CI-like
run of 2026-11-30 saw the old answer, a 410 "corrupt", reach a trainer reading a rid reused as fast as a writer
could go (`tests/service/client/test_local_reads.py::test_rid_reuse_while_readers_read`).
"""

from __future__ import annotations

import pytest
from helpers import random_rows, write_record

from service.server.errors import ApiError
from service.server.record_answer import open_bin
from service.server.settings import Settings
from service.server.store import Store
from service.spool import Spool


def _store(spool: Spool) -> Store:
    return Store(spool, Settings.model_validate({"spool_dir": spool.root}))


def test_a_rid_reused_by_a_shorter_record_before_the_open_is_a_409_and_no_skip(spool: Spool) -> None:
    store = _store(spool)
    old = write_record(spool, "hot", random_rows(40))
    write_record(spool, "hot", random_rows(5, seed=1), prompt_len=1)  # the rid's next record, shorter
    with pytest.raises(ApiError) as raised:
        open_bin(store, old, 40)
    assert (raised.value.status, raised.value.code) == (409, "record_replaced")
    assert not store.skipped


def test_a_bin_shorter_than_its_own_metadata_is_still_a_410_and_counted(spool: Spool) -> None:
    store = _store(spool)
    meta = write_record(spool, "short", random_rows(40))
    path = spool.bin_path("short")
    path.write_bytes(path.read_bytes()[: meta.row_bytes * 3])  # damaged in place: the rid names the same record
    with pytest.raises(ApiError) as raised:
        open_bin(store, meta, 40)
    assert raised.value.status == 410 and sum(store.skipped.values()) == 1
