"""`source_cache`: the attribute check runs once per build, and again when any file of the build changes."""

from __future__ import annotations

import importlib.machinery
import os

import pytest

from engine_ext.sglang import source_cache


@pytest.fixture
def build(tmp_path, monkeypatch):
    """A stand-in `sglang` package whose files the key reads, and a cache directory of the test's own."""
    package = tmp_path / "site" / "sglang"
    (package / "srt").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "srt" / "scheduler.py").write_text("class Scheduler: ...\n")
    spec = importlib.machinery.ModuleSpec("sglang", None, is_package=True)
    spec.submodule_search_locations = [str(package)]
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: spec if name == "sglang" else real(name, *a))
    monkeypatch.setenv(source_cache.ENV, str(tmp_path / "cache"))
    return package


def test_the_answer_is_computed_once_per_build_and_layout(build):
    calls = []

    def compute():
        calls.append(1)
        return ["sglang.srt.x.Y.z"]

    assert source_cache.cached("0.5.16", {"b", "a"}, compute) == ["sglang.srt.x.Y.z"]
    assert source_cache.cached("0.5.16", {"a", "b"}, compute) == ["sglang.srt.x.Y.z"]
    assert len(calls) == 1
    source_cache.cached("0.5.12", {"a", "b"}, compute)  # another layout: another answer
    assert len(calls) == 2


def test_a_patched_file_is_another_build(build):
    calls = []
    source_cache.cached("0.5.16", set(), lambda: calls.append(1) or [])
    path = build / "srt" / "scheduler.py"
    path.write_text("class Scheduler:\n    patched = True\n")
    os.utime(path, ns=(1, 1))
    source_cache.cached("0.5.16", set(), lambda: calls.append(1) or [])
    assert len(calls) == 2


def test_an_unwritable_cache_computes_every_time(build, monkeypatch, tmp_path):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    monkeypatch.setenv(source_cache.ENV, str(blocker / "cache"))
    calls = []
    for _ in range(2):
        assert source_cache.cached("0.5.16", set(), lambda: calls.append(1) or ["x"]) == ["x"]
    assert len(calls) == 2


def test_a_corrupt_cache_file_is_computed_again(build):
    source_cache.cached("0.5.16", set(), lambda: ["x"])
    (path,) = source_cache.cache_dir().glob("attributes-*.json")
    for damaged in ("{not json", '{"a": 1}', "[1, 2]"):
        path.write_text(damaged)
        assert source_cache.cached("0.5.16", set(), lambda: ["y"]) == ["y"]
