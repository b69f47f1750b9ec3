"""README's install, `r3-sidecar[engine]` next to each supported SGLang, changes neither SGLang, torch nor FlashInfer.

pip's own resolver answers, in a bare venv per version holding that SGLang's published metadata (PyPI's
PEP 658 metadata of the real release, fetched by pip): our requirements as pip builds them from this
checkout, the `engine` extra's applied in that venv with `--dry-run --report`, must install nothing. The
`engine-fresh` extra in verl's 0.5.12 venv shows the check can fail: it would replace SGLang. Each of README's
three forms (a checkout, a git URL, the wheel `make wheel` builds) is resolved once (with `--no-deps` its plan does not
depend on the SGLang beside it): it brings the plugin and its base dependencies, no engine package, and every base
dependency it shares with each SGLang has a version both accept (SGLang's own pins stay satisfiable).
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import sysconfig
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import Version

from engine_ext.sglang.versions import supported

pytestmark = pytest.mark.timeout(600)

REPO = Path(__file__).resolve().parents[2]
ENGINE_PACKAGES = {"sglang", "torch", "flashinfer-python", "sgl-kernel", "sglang-kernel"}


def pip_report(*args: str, python: Path | None = None) -> dict:
    """`pip install --dry-run --report -` with `args`; the resolver's plan as JSON."""
    target = ["--python", str(python)] if python else []
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # the venv sees only what is installed in it
    done = subprocess.run(
        [sys.executable, "-m", "pip", *target, "install", "--dry-run", "-q", "--report", "-", *args],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


@functools.cache
def published(name: str, version: str) -> dict:
    """PyPI's metadata of `name==version` (pip fetches it, PEP 658). Cached for the session: a release's published
    metadata does not change, and each fetch is a resolver run of several seconds (it was fetched 23 times)."""
    (meta,) = pip_report("--no-deps", "--ignore-installed", f"{name}=={version}")["install"]
    return meta["metadata"]


@functools.cache
def _our_requires_dist() -> tuple[str, ...]:
    (ours,) = pip_report("--no-deps", "--ignore-installed", str(REPO))["install"]
    return tuple(ours["metadata"]["requires_dist"])


@pytest.fixture(scope="module")
def our_requirements() -> list[Requirement]:
    """`Requires-Dist` of this checkout as pip builds it (setuptools, not our reading of pyproject.toml); built once
    per session (both pip-story modules read it)."""
    return [Requirement(r) for r in _our_requires_dist()]


def extra(requirements: list[Requirement], name: str | None) -> list[str]:
    """The requirements that `name` (None: the base install) adds, as pip strings without markers."""
    env = default_environment()
    picked = []
    for req in requirements:
        if req.marker is None:
            wanted = name is None
        else:
            wanted = name is not None and req.marker.evaluate(env | {"extra": name})
            wanted = wanted and not req.marker.evaluate(env | {"extra": ""})
        if wanted:
            picked.append(f"{req.name}{req.specifier}")
    return picked


def bare_venv(root: Path) -> Path:
    """A venv without pip and without packages; returns its site-packages."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root)], check=True, timeout=120)
    return Path(
        sysconfig.get_path("purelib", vars={"base": str(root), "platbase": str(root)}, scheme="venv")
        if "venv" in sysconfig.get_scheme_names()
        else sysconfig.get_path("purelib", vars={"base": str(root), "platbase": str(root)})
    )


def venv_with_sglang(root: Path, version: str) -> Path:
    """A bare venv whose site-packages holds `sglang-<version>.dist-info` with PyPI's metadata of it."""
    metadata = published("sglang", version)
    purelib = bare_venv(root)
    dist_info = purelib / f"sglang-{version}.dist-info"
    dist_info.mkdir(parents=True)
    lines = ["Metadata-Version: 2.1", f"Name: {metadata['name']}", f"Version: {metadata['version']}"]
    lines += [f"Requires-Dist: {r}" for r in metadata.get("requires_dist", [])]
    (dist_info / "METADATA").write_text("\n".join(lines) + "\n")
    (dist_info / "INSTALLER").write_text("pip\n")
    (dist_info / "RECORD").write_text("")
    return root / "bin" / "python"


def test_the_base_install_names_no_engine_package(our_requirements):
    assert not {Requirement(r).name for r in extra(our_requirements, None)} & ENGINE_PACKAGES


@pytest.mark.parametrize("version", supported())  # every supported SGLang, in CI
def test_the_engine_extra_next_to_each_sglang_installs_nothing(version, our_requirements, tmp_path):
    python = venv_with_sglang(tmp_path / "venv", version)
    engine = extra(our_requirements, "engine")
    assert engine, "the engine extra names SGLang's range"
    plan = pip_report("--no-deps", *engine, python=python)
    assert plan["install"] == [], [(p["metadata"]["name"], p["metadata"]["version"]) for p in plan["install"]]


def test_the_fresh_extra_would_replace_verls_sglang(our_requirements, tmp_path):
    python = venv_with_sglang(tmp_path / "venv", "0.5.12")
    plan = pip_report("--no-deps", *extra(our_requirements, "engine-fresh"), python=python)
    installed = {p["metadata"]["name"]: p["metadata"]["version"] for p in plan["install"]}
    assert installed.get("sglang") == "0.5.23"


@pytest.fixture(scope="module")
def install_forms(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """README's three forms of `r3-sidecar[engine]`: this checkout, a git URL (a clone of its HEAD, over file://),
    and the wheel `make wheel` builds (the same `pip wheel --no-deps`)."""
    root = tmp_path_factory.mktemp("forms")
    dist = root / "dist"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--wheel-dir", str(dist), str(REPO)],
        check=True,
        timeout=300,
    )
    (wheel,) = dist.glob("r3_sidecar-*.whl")
    clone = root / "clone"
    subprocess.run(["git", "clone", "-q", str(REPO), str(clone)], check=True, timeout=120)
    return {
        "checkout": f"{REPO}[engine]",
        "git": f"r3-sidecar[engine] @ git+file://{clone}",
        "wheel": f"{wheel}[engine]",
    }


def compatible(ours: SpecifierSet, theirs: SpecifierSet) -> bool:
    """Whether some version satisfies both: tried at every version either names, and just past each."""
    named = {Version(spec.version.replace("*", "0")) for spec in (*ours, *theirs)}
    candidates = named | {Version(f"{v}.post1") for v in named} | {Version("0"), Version("999")}
    return any(ours.contains(v, prereleases=True) and theirs.contains(v, prereleases=True) for v in candidates)


def sglang_requirements(version: str) -> dict[str, SpecifierSet]:
    """SGLang `version`'s unconditional requirements as published (PyPI's metadata), by name."""
    reqs = [Requirement(r) for r in published("sglang", version).get("requires_dist", [])]
    env = default_environment() | {"extra": ""}
    return {r.name.lower(): r.specifier for r in reqs if r.marker is None or r.marker.evaluate(env)}


@pytest.fixture(scope="module")
def form_plans(install_forms: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    """pip's plan for each form with `--no-deps`, once: with no dependency resolved, the plan cannot depend on the
    SGLang beside it (it was run beside each of them: 12 isolated builds of our metadata for the same answer).
    What does depend on the SGLang, its pins against ours, is checked per version below."""
    python = venv_with_sglang(tmp_path_factory.mktemp("forms-venv"), supported()[0])
    # The three resolver runs at once: each waits mostly on its build of our metadata (an isolated build env)
    # and on the index, not on this process, so together they take about as long as the slowest.
    with ThreadPoolExecutor(len(install_forms)) as pool:
        plans = {form: pool.submit(pip_report, "--no-deps", s, python=python) for form, s in install_forms.items()}
    return {form: planned.result() for form, planned in plans.items()}


def test_each_readme_install_form_brings_the_plugin_with_its_engine_extra(form_plans):
    assert sorted(form_plans) == ["checkout", "git", "wheel"]
    for form, plan in form_plans.items():
        assert [(p["metadata"]["name"], p["metadata"]["version"]) for p in plan["install"]] == [
            ("r3-sidecar", "0.1.0")
        ], form
        assert plan["install"][0]["requested_extras"] == ["engine"], form


@pytest.mark.parametrize("version", supported())  # every supported SGLang, in CI
def test_readmes_install_forms_beside_each_sglang_move_no_pin(version, our_requirements):
    theirs = sglang_requirements(version)
    for req in map(Requirement, extra(our_requirements, None)):
        if req.name.lower() in theirs:
            assert compatible(req.specifier, theirs[req.name.lower()]), (req, theirs[req.name.lower()])


def test_the_demo_installs_no_dev_tool_and_no_engine(tmp_path):
    """`make demo`'s venv (uv.lock's base layer; pip's `install -e .` here): the service's dependencies only (the dev
    extras made it 869 MB)."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(tmp_path / "venv")], check=True, timeout=120)
    plan = pip_report("-e", str(REPO), python=tmp_path / "venv" / "bin" / "python")
    names = {p["metadata"]["name"].lower() for p in plan["install"]}
    assert "r3-sidecar" in names and "fastapi" in names
    dev = {"helm-python-sdk", "kubernetes-validate", "atheris", "matplotlib", "pytest", "hypothesis", "ruff"}
    assert not names & (dev | ENGINE_PACKAGES), sorted(names & (dev | ENGINE_PACKAGES))
