"""Benchmarks of r3-sidecar against SGLang 0.5.23's inline delivery and against the machine's limits.

`python -m benchmarks.run` measures everything in one run and writes BENCHMARKS.md and `benchmarks/plots/`.
"""
