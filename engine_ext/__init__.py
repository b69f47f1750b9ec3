"""r3-sidecar's engine side: one core that every engine shares, and one adapter package per engine.

- `engine_ext.core`: what does not depend on an engine: settings (`R3_*`), the spool writer thread, the engine
  file (telemetry), the per-node sidecar, the pointer and layer rules every record shares (records).
- `engine_ext.sglang`: the SGLang plugin (`sglang.srt.plugins` entry point `engine_ext.sglang:register`):
  capture sizing and slicing, budget checks, collection, live rows, front doors, weight versions, the support
  matrix (versions), hook timers; the folder `hooks/`, the hook table (`hooks/table.py`) and its rooms (`capture`,
  `budget`, `delivery`, `live`, `frontdoor`), holds the only modules that name SGLang internals.
- `engine_ext.vllm`: the vLLM plugin (`vllm.general_plugins` entry point `engine_ext.vllm:register`);
  `hooks.py` is the only module that names vLLM internals.

A third engine is one more package beside these two, built on `core`.
"""
