"""`python -m benchmarks.real_server` (`make bench-sglang`): see `runner`."""

from benchmarks.real_server.runner import main

main()
