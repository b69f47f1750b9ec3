"""The Dockerfile: hadolint-clean, and built the way it says (no Docker engine here, so the structure is
read and the wheel stage is replayed on a copy of exactly the build context `.dockerignore` lets through).
"""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
import subprocess
import sys
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml
from deploy_render import CHART

from engine_ext.sglang.versions import NEWEST as SUPPORTED_SGLANG

REPO = Path(__file__).resolve().parents[2]
DOCKERFILE = REPO / "Dockerfile"
HADOLINT = Path(sys.executable).parent / "hadolint"


@dataclass
class Stage:
    name: str
    base: str
    instructions: list[tuple[str, str]] = field(default_factory=list)

    def all(self, op: str) -> list[str]:
        return [arg for o, arg in self.instructions if o == op]


def parse(text: str) -> tuple[dict[str, str], dict[str, Stage]]:
    """Global ARG defaults and the stages by name, continuation lines joined, comments dropped."""
    logical = re.sub(r"\\\n", " ", "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#")))
    args: dict[str, str] = {}
    stages: dict[str, Stage] = {}
    current: Stage | None = None
    for line in logical.splitlines():
        if not line.strip():
            continue
        op, _, rest = line.strip().partition(" ")
        op, rest = op.upper(), rest.strip()
        if op == "FROM":
            base, name = re.split(r"\s+AS\s+", rest, flags=re.I)
            current = stages[name] = Stage(name, base)
        elif current is None and op == "ARG":
            key, _, default = rest.partition("=")
            args[key] = default
        elif current is not None:
            current.instructions.append((op, rest))
    return args, stages


ARGS, STAGES = parse(DOCKERFILE.read_text())


def resolve(base: str) -> str:
    return re.sub(r"\$\{(\w+)\}", lambda m: ARGS[m.group(1)], base)


def test_hadolint_is_clean() -> None:
    out = subprocess.run([HADOLINT, "--format", "json", DOCKERFILE], capture_output=True, text=True, timeout=60)
    assert json.loads(out.stdout) == [], out.stdout
    assert out.returncode == 0


def test_hadolint_is_not_vacuous(tmp_path: Path) -> None:
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python:latest\nRUN apt-get update && apt-get install -y curl\nRUN pip install fastapi\n")
    out = subprocess.run([HADOLINT, "--format", "json", bad], capture_output=True, text=True, timeout=60)
    codes = {finding["code"] for finding in json.loads(out.stdout)}
    assert {"DL3007", "DL3008", "DL3013"} <= codes and out.returncode != 0


def test_two_targets_on_pinned_bases() -> None:
    assert {"engine", "sidecar"} <= STAGES.keys()
    assert resolve(STAGES["engine"].base) == f"lmsysorg/sglang:v{SUPPORTED_SGLANG}"
    for stage in STAGES.values():
        image = resolve(stage.base)
        if image in STAGES:
            continue
        _, _, tag = image.partition(":")
        assert tag and tag != "latest", f"{stage.name}: {image} is not pinned"
    python = resolve(STAGES["sidecar"].base)
    assert re.fullmatch(r"python:3\.(1[1-9])\.\d+-slim-\w+", python), python


def test_sidecar_stage_is_slim_non_root_and_healthchecked() -> None:
    sidecar = STAGES["sidecar"]
    runs = " ".join(sidecar.all("RUN"))
    assert not re.search(r"apt-get|apk |pip install|gcc|build-essential", runs), "no build tools in the final stage"
    assert all("--from=sidecar-deps" in c for c in sidecar.all("COPY")), sidecar.all("COPY")
    (user,) = sidecar.all("USER")
    uid = re.sub(r"\$\{UID\}", re.search(r"ARG UID=(\d+)", DOCKERFILE.read_text()).group(1), user).split(":")[0]
    assert int(uid) >= 10000
    (health,) = sidecar.all("HEALTHCHECK")
    assert "/healthz" in health and "--timeout=" in health
    assert json.loads(sidecar.all("ENTRYPOINT")[0]) == ["r3-sidecar"]
    cmd = json.loads(sidecar.all("CMD")[0])
    assert cmd[0] == "serve"
    # The image's defaults and the chart's agree: spool path, port.
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    env = " ".join(sidecar.all("ENV"))
    assert f"R3_SPOOL_DIR={values['spool']['mountPath']}" in env
    assert f"R3_PORT={values['sidecar']['port']}" in env
    assert cmd[cmd.index("--port") + 1] == str(values["sidecar"]["port"])
    assert sidecar.all("EXPOSE") == [str(values["sidecar"]["port"])]


def test_engine_stage_adds_only_the_plugin() -> None:
    engine = STAGES["engine"]
    (run,) = engine.all("RUN")
    assert "--constraint" in run and "pip list --format=freeze" in run, "SGLang's own package versions are frozen"
    assert "[engine]" in run and "--no-cache-dir" in run
    assert "sglang.srt.plugins" in run and "engine_ext.sglang:register" in run
    assert not engine.all("CMD") and not engine.all("ENTRYPOINT"), "SGLang's command line stays the image's own"


def _context_files() -> list[Path]:
    """Files `docker build .` sends, under this repository's allow-list `.dockerignore`."""
    lines = (REPO / ".dockerignore").read_text().splitlines()
    patterns = [p.strip() for p in lines if p.strip() and not p.startswith("#")]
    assert patterns[0] == "*", "the .dockerignore is an allow-list"
    allowed = [REPO / p[1:].rstrip("/") for p in patterns if p.startswith("!")]
    denied = [p.removeprefix("**/") for p in patterns[1:] if not p.startswith("!")]
    files = []
    for top in allowed:
        for path in [top] if top.is_file() else top.rglob("*"):
            rel = path.relative_to(REPO)
            if path.is_file() and not any(rel.match(d) or d in rel.parts for d in denied):
                files.append(rel)
    return files


def test_build_context_is_only_the_package() -> None:
    tops = {f.parts[0] for f in _context_files()}
    assert tops <= {"pyproject.toml", "README.md", "service", "engine_ext"}, tops
    assert {"pyproject.toml", "service", "engine_ext"} <= tops
    for stage in STAGES.values():
        for copy in stage.all("COPY"):
            if "--from=" in copy:
                continue
            *sources, _ = copy.split()
            for source in sources:
                assert (REPO / source).exists(), f"COPY {source}: not in the repository"
                assert Path(source).parts[0] in tops, f"COPY {source}: excluded by .dockerignore"


@pytest.mark.timeout(240)
def test_wheel_stage_builds_a_wheel_with_both_entry_points(tmp_path: Path) -> None:
    """Replay the `wheel` stage on a copy of the build context; the wheel carries the CLI and the plugin."""
    context = tmp_path / "context"
    for rel in _context_files():
        (context / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / rel, context / rel)
    out = tmp_path / "wheels"
    # Offline when this venv has setuptools (the pyproject's build backend); else pip fetches it, as Docker does.
    isolation = [] if importlib.util.find_spec("setuptools") is None else ["--no-build-isolation"]
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", *isolation, "-q", "--wheel-dir", out, context],
        check=True,
        timeout=200,
        capture_output=True,
    )
    (wheel,) = out.glob("r3_sidecar-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        entry_points = zf.read(next(n for n in names if n.endswith(".dist-info/entry_points.txt"))).decode()
        metadata = zf.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    assert "service/spool/__init__.py" in names and "engine_ext/sglang/__init__.py" in names
    assert not any(n.startswith("tests/") for n in names)
    assert re.search(
        r"\[console_scripts\]\s*r3-budget = engine_ext\.sglang\.budget\.cli:main"
        r"\s*r3-sidecar = service\.server\.cli:main",
        entry_points,
    )
    assert re.search(r"\[vllm\.general_plugins\]\s*r3_sidecar = engine_ext\.vllm:register", entry_points)
    assert re.search(r"\[sglang\.srt\.plugins\]\s*r3_sidecar = engine_ext.sglang:register", entry_points)
    assert f'Requires-Dist: sglang=={SUPPORTED_SGLANG}; extra == "engine-fresh"' in metadata
    assert re.search(r'Requires-Dist: sglang<=[\d.]+,>=0\.5\.12; extra == "engine"', metadata)


def test_healthcheck_command_passes_on_a_live_sidecar_and_fails_without_one(serve) -> None:
    """Run the image's HEALTHCHECK command here, against a real sidecar on the port R3_PORT names."""
    import os
    import socket

    (health,) = STAGES["sidecar"].all("HEALTHCHECK")
    argv = json.loads(health[health.index("CMD") + 3 :].strip())
    assert argv[0] == "python"
    port = serve().rsplit(":", 1)[1]
    env = {**os.environ, "R3_PORT": port}
    ok = subprocess.run([sys.executable, *argv[1:]], env=env, capture_output=True, timeout=30)
    assert ok.returncode == 0, ok.stderr
    with socket.socket() as unused:
        unused.bind(("127.0.0.1", 0))
        env["R3_PORT"] = str(unused.getsockname()[1])
        down = subprocess.run([sys.executable, *argv[1:]], env=env, capture_output=True, timeout=30)
    assert down.returncode != 0
