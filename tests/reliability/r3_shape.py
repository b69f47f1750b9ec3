"""Shape of the reliability suite's synthetic records: small, but with every dimension > 1, so layer subsets
and ranges matter.

Why its own module: writer processes need only these numbers, and `r3_harness` (which re-exports them) imports
httpx and a process harness: 0.35 s of a spool model writer's 0.7 s start, paid again at every respawn.
"""

from __future__ import annotations

LAYERS = (1, 3, 4, 7, 9, 12)
NUM_HIDDEN_LAYERS = 14  # the model: layers 0-13, the ones not in LAYERS dense (SGLang's payload has 14 slots)
TOPK = 4
NUM_EXPERTS = 64
