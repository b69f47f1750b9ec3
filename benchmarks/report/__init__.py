"""BENCHMARKS.md and `benchmarks/plots/*.png` from one run's results: `document` writes the file, `tables` and
`targets` compute what it holds, `plots` draws the PNGs. `python -m benchmarks.report [results.json]` regenerates
it from `benchmarks/out/results.json`.

`write_report` is what the harness calls; the two markers are where the real-server benchmark's section sits,
kept by both writers.
"""

from benchmarks.report.document import REAL_SERVER_BEGIN, REAL_SERVER_END, write_report

__all__ = ["REAL_SERVER_BEGIN", "REAL_SERVER_END", "write_report"]
