"""The flat module paths of the previous release keep working for one release, each with a DeprecationWarning.

A fresh interpreter per check: a module imported once warns once, so an earlier test's import would hide it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from helpers import REPO

import service


def _env() -> dict[str, str]:
    return os.environ | {"PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}


def _run(code: str) -> dict:
    child = f"import json, sys, warnings\nwarnings.simplefilter('always')\n{code}"
    done = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, env=_env(), timeout=60)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.splitlines()[-1])


def test_every_former_path_is_the_moved_module_and_warns_its_importer() -> None:
    """One interpreter for all: each former path is imported there for the first time, so each warns once."""
    seen = _run(
        "import importlib, service\n"
        "seen = {}\n"
        "for old, new in service.MOVED.items():\n"
        "    with warnings.catch_warnings(record=True) as caught:\n"
        "        moved = importlib.import_module(f'service.{old}')\n"
        "    same = moved is sys.modules[f'service.{new}'] is getattr(service, old)\n"
        "    seen[old] = [same, [(w.category.__name__, str(w.message)) for w in caught]]\n"
        "with warnings.catch_warnings(record=True) as caught:\n"
        "    import service.api\n"
        "seen['<where>'] = [w.filename for w in caught]\n"
        "print(json.dumps(seen))"
    )
    assert seen.pop("<where>") == []  # already imported: no second warning
    assert sorted(seen) == sorted(service.MOVED)
    for old, (same, caught) in seen.items():
        new = f"service.{service.MOVED[old]}"
        assert same, old
        assert caught == [["DeprecationWarning", f"service.{old} is deprecated: import {new}"]], old


def test_the_warning_names_the_importer() -> None:
    seen = _run(
        "with warnings.catch_warnings(record=True) as caught:\n"
        "    import service.refs\n"
        "print(json.dumps([w.filename for w in caught]))"
    )
    assert seen == ["<string>"]


def test_names_from_a_former_path_and_from_service_import_resolve() -> None:
    seen = _run(
        "with warnings.catch_warnings(record=True) as caught:\n"
        "    from service.refs import RoutedExpertsRef\n"
        "    from service import trainers\n"
        "import service.client.refs, service.client.trainers\n"
        "print(json.dumps({'same': RoutedExpertsRef is service.client.refs.RoutedExpertsRef"
        " and trainers is service.client.trainers, 'warnings': len(caught)}))"
    )
    assert seen == {"same": True, "warnings": 2}


def test_python_m_the_former_cli_runs_the_sidecar_command() -> None:
    """What a start script written for the previous release runs (`python -m service.cli serve ...`)."""
    done = subprocess.run(
        [sys.executable, "-W", "always", "-m", "service.cli", "--help"],
        capture_output=True,
        text=True,
        env=_env(),
        timeout=60,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    assert "{serve,demo,fetch}" in done.stdout
    assert "service.cli is deprecated: import service.server.cli" in done.stderr


def test_a_name_that_never_existed_is_still_an_import_error() -> None:
    with pytest.raises(ModuleNotFoundError):
        __import__("service.no_such_module")
