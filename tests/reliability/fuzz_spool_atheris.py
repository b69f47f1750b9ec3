"""Atheris (libFuzzer) target for the spool reader: `python fuzz_spool_atheris.py CORPUS_DIR -runs=N -max_total_time=S`.

Input = metadata bytes, a NUL, then `.bin` bytes. The property is `spool_cases.check_read`'s: only
`SpoolFormatError`, never a byte past `rows`. Any other exception is a crash libFuzzer reports.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import atheris

sys.path.insert(0, str(Path(__file__).resolve().parent))

# Coverage of the spool package only: instrumenting every module its import pulls in (82 of numpy's) took 7 s of
# CPU before the first input (36 s at load 13), and fed numpy's branches into the coverage that guides the fuzzer.
with atheris.instrument_imports(include=["service.spool"]):
    from service.spool import Spool
from spool_cases import check_read, seed_corpus

from service.spool.record.meta import SpoolFormatError, safe_name

SPOOL = Spool(tempfile.mkdtemp(prefix="r3-atheris-"))


def one_input(data: bytes) -> None:
    meta_bytes, _, bin_data = data.partition(b"\x00")
    try:
        import orjson

        rid = orjson.loads(meta_bytes).get("rid")
        stem = safe_name(rid) if isinstance(rid, str) and rid else "fuzz"
    except (ValueError, AttributeError):
        stem = "fuzz"
    try:
        check_read(SPOOL, stem, meta_bytes, bin_data[: 1 << 20])
    except SpoolFormatError:
        raise AssertionError("check_read lets no SpoolFormatError escape") from None


def main() -> None:
    corpus = Path(sys.argv[1])
    seed_corpus(corpus)
    atheris.Setup(sys.argv, one_input)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
