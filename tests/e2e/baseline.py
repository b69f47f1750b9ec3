"""A plugin-off baseline proves it is one wherever its rows become a reference (issue 40: no reference from the
plugin itself).

A loaded plugin leaves two traces a baseline cannot: files under its spool (its telemetry writes the engine file
within a second of the scheduler's start; its writer, the records) and a pointer in its answers (its default
mode, sidecar, puts `routed_experts_url` in every answer that asks for routed experts). SGLang's and vLLM's
plugin-off servers (`SGLANG_PLUGINS=__none__`, `VLLM_PLUGINS=__none__`) get the same spool directory setting as
the others, so a plugin that loaded anyway would leave both.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


def spool_files(spool: Path) -> list[str]:
    """Every file under a spool, as paths relative to it; none where no plugin ran (the directory may not exist)."""
    if not spool.exists():
        return []
    return sorted(str(path.relative_to(spool)) for path in spool.rglob("*") if path.is_file())


def assert_plugin_off(name: str, spool: Path, meta_info: dict[str, Any]) -> None:
    """Fail, naming what the plugin left, unless `spool` is empty and the answer's `meta_info` has no pointer."""
    traces = spool_files(spool) + [key for key in ("routed_experts_url",) if key in meta_info]
    assert not traces, f"{name} is a plugin-off baseline, yet the plugin left {traces[:5]}"
