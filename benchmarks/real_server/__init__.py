"""`make bench-sglang`: the plugin inside a real SGLang server, against upstream, on this CPU machine.

`runner` starts the servers, runs the rotated repetitions and sums them up (`python -m benchmarks.real_server`,
its `main`); `workloads` is what each server is asked (its launch, the three workloads); `section` renders the
BENCHMARKS.md section and splices it in. Nothing is imported here: the runner puts the real-engine suite's
harness (`tests/e2e`) on `sys.path`, which only a run should do.
"""
