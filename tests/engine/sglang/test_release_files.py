"""`release_files`: a proven release string counts as proven only while its files are the release's own.

The distributions here are real `importlib.metadata` distributions over real files: a wheel-like install with a
RECORD (as pip and uv write it), then the same with a file patched, deleted, or installed editable; and the
SGLang wheel this test environment really installed."""

from __future__ import annotations

import base64
import hashlib
from importlib.metadata import PathDistribution, distribution
from pathlib import Path

from engine_ext.sglang.release_files import EDITABLE, changed
from engine_ext.sglang.versions import support


def _record_line(root: Path, name: str) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256((root / name).read_bytes()).digest()).rstrip(b"=").decode()
    return f"{name},sha256={digest},{(root / name).stat().st_size}"


def _install(root: Path, *, with_sources: bool = True) -> PathDistribution:
    """A wheel's layout under `root`: `sglang/` and `sglang-0.5.15.post1.dist-info/RECORD`."""
    files = {"sglang/__init__.py": "__version__ = '0.5.15.post1'\n", "sglang/srt/router.py": "TOPK = 8\n"}
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    info = root / "sglang-0.5.15.post1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: sglang\nVersion: 0.5.15.post1\n")
    lines = [_record_line(root, name) for name in files] if with_sources else ["__editable__.sglang.pth,,"]
    (info / "RECORD").write_text("\n".join([*lines, "sglang-0.5.15.post1.dist-info/RECORD,,"]) + "\n")
    return PathDistribution(info)


def test_a_wheel_install_as_released_has_no_changed_file(tmp_path):
    assert changed(_install(tmp_path)) == []


def test_a_patched_or_deleted_file_is_named(tmp_path):
    dist = _install(tmp_path)
    (tmp_path / "sglang/srt/router.py").write_text("TOPK = 8  # slime's patch\n")
    assert changed(dist) == ["sglang/srt/router.py"]
    (tmp_path / "sglang/__init__.py").unlink()
    assert changed(dist) == ["sglang/__init__.py (missing)", "sglang/srt/router.py"]


def test_a_record_hash_this_python_lacks_counts_as_changed_not_as_an_error(tmp_path):
    dist = _install(tmp_path)
    record = tmp_path / "sglang-0.5.15.post1.dist-info" / "RECORD"
    record.write_text(record.read_text().replace("sglang/srt/router.py,sha256=", "sglang/srt/router.py,nohash9="))
    assert changed(dist) == ["sglang/srt/router.py (hash 'nohash9' unknown)"]


def test_an_editable_install_cannot_be_verified(tmp_path):
    assert changed(_install(tmp_path, with_sources=False)) == [EDITABLE]


def test_the_sglang_wheel_this_environment_installed_is_intact():
    assert changed(distribution("sglang")) == []


def test_a_proven_release_string_with_changed_files_runs_unproven_and_says_why():
    plan = support("0.5.15.post1", "0.5.15", changed=["sglang/srt/router.py"])
    assert plan.full and plan.layout == "0.5.15" and not plan.proven
    assert "no test ran this build" in plan.describe() and "not the release's: sglang/srt/router.py" in plan.describe()
    assert support("0.5.15.post1", "0.5.15").proven  # the release's own files
    assert support("0.5.24", "0.5.23", changed=["x.py"]).changed == ()  # not a proven name: nothing to compare
