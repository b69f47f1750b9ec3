"""Which matrix row a vLLM build gets, decided from its installed code: the version string is a hint, not the gate.

Why: trainers run vLLM builds the matrix does not name (a post or dev build between its rows, a `+cu` build), and
images that report a release's version over patched files. Keyed by exact release, the plugin refused the first
although their code takes the same hooks, and proved the second blindly. A row fits a build when every hooked
attribute exists there (`hooks.HOOKS`), `--enable-return-routed-experts` lands where the row says
(`Release.capture_flag`: a field of `VllmConfig`, then of that config), and the row's source of experts and top-k
is there (`Release.shape_from`). A release string is proven on its own row only while the files those facts live
in are that release's, byte for byte (`release_files`: the code a test found them in, so nothing is imported to
know it). Otherwise rows are tried by their facts, nearest release first, at or below the build's, then above.

A build no test ran checks itself before the plugin takes delivery over (`build_check`): its first records, as the
spool stores them, are compared with vLLM's own inline rows, which responses keep beside the pointer until they
agree (sidecar mode acts as mirror); a difference leaves vLLM's own path in charge in that process. The start-up
line and the engine file say so (`build`, its `check`), and which files differ from the release's where a release
string is not proven (`changed`).
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from packaging.version import InvalidVersion, Version

from engine_ext.core.release_files import shown
from engine_ext.vllm.release_files import installed_changes
from engine_ext.vllm.versions import MATRIX, Release, base_version, release, supported_range


@dataclass(frozen=True)
class Plan:
    """What the plugin does on the installed vLLM: the row applied (None: refused, `reason` says why), proven or not."""

    found: str | None
    row: Release | None
    proven: bool
    reason: str | None = None
    changed: tuple[str, ...] = ()  # a release string's files that are not the release's (`release_files`)

    def describe(self) -> str:
        """The start-up line."""
        if self.row is None:
            return str(self.reason)
        if self.proven:
            return f"r3-sidecar: vLLM {self.found}: matrix row {self.row.version} (proven: {self.row.proven})"
        return f"r3-sidecar: vLLM {self.found}: matrix row {self.row.version} applied ({UNPROVEN}{self.why()})"

    def why(self) -> str:
        """Why a release string is unproven, for the start-up line and the engine file ('' where nothing differs)."""
        return files_differ(self.changed)


def files_differ(changed: tuple[str, ...]) -> str:
    """'; its files are not the release's: ...' naming the first few, or '' where none differ."""
    return f"; its files are not the release's: {shown(changed)}" if changed else ""


UNPROVEN = "fits, but no test ran this build: inline rows are kept until its records agree with vLLM's own"
log = logging.getLogger("r3_sidecar.vllm")


def plan(
    found: str | None,
    lacking: Callable[[Release], list[str]] | None = None,
    files: Callable[[str, Release], list[str]] | None = None,
) -> Plan:
    """A release string over its release's own files: its own row, proven. Else the first row the build's code
    fits (a release string's own first): unproven, naming the files that differ; else a refusal naming the gap.
    `lacking` and `files` stand in for `what_row_lacks` and `release_files.installed_changes` in tests."""
    if found is None:
        return Plan(None, None, False, "r3-sidecar: vLLM is not installed; the vLLM plugin does nothing")
    exact = release(found)
    changed = () if exact is None else tuple(_release_changes(found, exact, files))
    if exact is not None and not changed:
        return Plan(found, exact, True)
    row, seen = fitting(found, lacking)
    if row is not None:
        return Plan(found, row, False, changed=changed)
    nearest, gaps = next(iter(seen.items()))
    return Plan(
        found,
        None,
        False,
        f"r3-sidecar: vLLM {found} fits none of the support matrix's rows ({supported_range()}; the nearest, "
        f"{nearest}, lacks: {', '.join(gaps[:6])}); capture stays vLLM's own (inline routed_experts, no spool records)"
        f"{files_differ(changed)}",
        changed,
    )


def _release_changes(found: str, exact: Release, files: Callable[[str, Release], list[str]] | None) -> list[str]:
    """The files of release string `found` that are not its release's; a check that fails keeps the version
    string's word (the plugin before this check), said once in the log, and never stops vLLM."""
    try:
        return (files or installed_changes)(found, exact)
    except Exception as exc:  # a broken RECORD or metadata must not stop vLLM's start
        log.warning(
            "r3-sidecar: vLLM %s's files were not compared with its RECORD (%r); its version is trusted", found, exc
        )
        return []


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
