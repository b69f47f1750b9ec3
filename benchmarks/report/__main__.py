"""`python -m benchmarks.report [results.json]`: BENCHMARKS.md and its plots from one run's results."""

from benchmarks.report.document import main

main()
