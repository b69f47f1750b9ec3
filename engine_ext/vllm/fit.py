"""Which matrix row a vLLM build gets when its version is not a proven release: decided from what its code has.

Why: trainers run vLLM builds the matrix does not name (a post or dev build between its rows, a `+cu` build). Keyed
by exact release, the plugin refused them although their code takes the same hooks. A row fits a build when every
hooked attribute exists there (`hooks.HOOKS`), `--enable-return-routed-experts` lands where the row says
(`Release.capture_flag`: a field of `VllmConfig`, then of that config), and the row's source of experts and top-k
is there (`Release.shape_from`). Rows are tried nearest release first, at or below the build's, then above.

A build no test ran keeps vLLM's inline rows: sidecar mode acts as mirror there (the record is vLLM's own array,
so responses carry it and the pointer both), and the start-up line and the engine file say so (`build`).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from packaging.version import InvalidVersion, Version

from engine_ext.vllm.versions import MATRIX, Release, base_version, release, supported_range


@dataclass(frozen=True)
class Plan:
    """What the plugin does on the installed vLLM: the row applied (None: refused, `reason` says why), proven or not."""

    found: str | None
    row: Release | None
    proven: bool
    reason: str | None = None

    def describe(self) -> str:
        """The start-up line."""
        if self.row is None:
            return str(self.reason)
        if self.proven:
            return f"r3-sidecar: vLLM {self.found}: matrix row {self.row.version} (proven: {self.row.proven})"
        return f"r3-sidecar: vLLM {self.found}: matrix row {self.row.version} applied ({UNPROVEN})"


UNPROVEN = "fits, but no test ran this build: vLLM's inline rows are kept beside the records (mirror)"


def plan(found: str | None, lacking: Callable[[Release], list[str]] | None = None) -> Plan:
    """A proven release's own row; else the first row the build's code fits; else a refusal naming the gap."""
    if found is None:
        return Plan(None, None, False, "r3-sidecar: vLLM is not installed; the vLLM plugin does nothing")
    exact = release(found)
    if exact is not None:
        return Plan(found, exact, True)
    row, seen = fitting(found, lacking)
    if row is not None:
        return Plan(found, row, False)
    nearest, gaps = next(iter(seen.items()))
    return Plan(
        found,
        None,
        False,
        f"r3-sidecar: vLLM {found} fits none of the support matrix's rows ({supported_range()}; the nearest, "
        f"{nearest}, lacks: {', '.join(gaps[:6])}); capture stays vLLM's own (inline routed_experts, no spool records)",
    )


def candidates(found: str | None, rows: Iterable[str] = MATRIX) -> list[str]:
    """The matrix rows to try for build `found`: at or below it nearest first, then above it nearest first."""
    ordered = sorted(rows, key=Version, reverse=True)
    try:
        at = Version(base_version(found or ""))
    except InvalidVersion:
        return ordered
    return [v for v in ordered if Version(v) <= at] + sorted((v for v in ordered if Version(v) > at), key=Version)


def fitting(found: str | None, lacking: Callable[[Release], list[str]] | None = None) -> tuple[Release | None, dict]:
    """The first row whose runtime facts the installed vLLM has, and what each row tried lacked."""
    check = lacking or what_row_lacks
    seen: dict[str, list[str]] = {}
    for version in candidates(found):
        seen[version] = check(MATRIX[version])
        if not seen[version]:
            return MATRIX[version], seen
    return None, seen


def what_row_lacks(row: Release) -> list[str]:
    """What of `row` the installed vLLM does not have (empty: it fits)."""
    from engine_ext.vllm.hooks import HOOKS

    out = [hook.target for hook in HOOKS if not _attribute(hook.target)]
    config, _, flag = row.capture_flag.partition(".")
    if not _has_field("vllm.config:VllmConfig", config):
        out.append(f"VllmConfig.{config}")
    elif not _has_field(_config_class(config), flag):
        out.append(f"{config}.{flag}")
    if row.shape_from == "model_config":
        shape = [f"vllm.config:ModelConfig.{n}" for n in ("get_num_experts", "get_num_experts_per_tok")]
    else:
        shape = [f"{row.shape_from}:{n}" for n in ("get_num_experts", "_get_num_experts_per_tok")]
    out += [name for name in shape if not _attribute(name)]
    return out


def _attribute(target: str) -> bool:
    """`module:Class.attribute` (or `module:function`) exists in the installed vLLM."""
    module_name, _, path = target.partition(":")
    try:
        value = importlib.import_module(module_name)
    except ImportError:
        return False
    for name in filter(None, path.split(".")):
        if not hasattr(value, name):
            return False
        value = getattr(value, name)
    return True


def _has_field(cls_target: str | None, name: str) -> bool:
    if cls_target is None or not _attribute(cls_target):
        return False
    module_name, _, cls_name = cls_target.partition(":")
    cls = getattr(importlib.import_module(module_name), cls_name)
    fields = getattr(cls, "__dataclass_fields__", {}) or getattr(cls, "model_fields", {})
    return name in fields or hasattr(cls, name)


def _config_class(field: str) -> str | None:
    """The class of `VllmConfig.<field>` (`model_config` → `vllm.config:ModelConfig`)."""
    cls = importlib.import_module("vllm.config").VllmConfig
    annotation = getattr(cls, "__dataclass_fields__", {}).get(field)
    kind = getattr(annotation, "type", None)
    name = kind if isinstance(kind, str) else getattr(kind, "__name__", None)
    return f"vllm.config:{name}" if name else None
