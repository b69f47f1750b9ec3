"""The spool contract's former module paths keep working for one release, each with a DeprecationWarning.

A fresh interpreter per check: a module imported once warns once, so an earlier test's import would hide it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from helpers import REPO

MOVED = {
    "record_meta": "record.meta",
    "record_writer": "record.writer",
    "engine_report": "engine_report",
    "files": "files",
}
"""Former module (under `service.`) → where it lives now (under `service.spool.`)."""


def _run(code: str) -> dict:
    env = os.environ | {"PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    child = f"import json, sys, warnings\nwarnings.simplefilter('always')\n{code}"
    done = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, env=env, timeout=60)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.splitlines()[-1])


@pytest.mark.parametrize("name", MOVED)
def test_a_former_module_path_is_the_moved_module_and_warns(name: str) -> None:
    new_name = MOVED[name]
    seen = _run(
        "with warnings.catch_warnings(record=True) as caught:\n"
        f"    import service.{name} as old\n"
        f"import service.spool.{new_name} as new\n"
        "print(json.dumps({'same': old is new, 'warnings': [(w.category.__name__, str(w.message), w.filename)"
        " for w in caught]}))"
    )
    assert seen["same"]
    ((category, message, where),) = seen["warnings"]
    assert category == "DeprecationWarning" and f"service.spool.{new_name}" in message
    assert where == "<string>"  # the warning names the importer, not the alias


def test_names_the_former_spool_module_only_imported_still_resolve_with_a_warning() -> None:
    seen = _run(
        "from service.spool import Spool\n"
        "with warnings.catch_warnings(record=True) as caught:\n"
        "    from service.spool import atomic_write, safe_name\n"
        "from service.spool.files import atomic_write as new_write\n"
        "from service.spool.record.meta import safe_name as new_name\n"
        "print(json.dumps({'same': atomic_write is new_write and safe_name is new_name,"
        " 'warnings': [str(w.message) for w in caught if w.category is DeprecationWarning]}))"
    )
    assert seen["same"] and len(seen["warnings"]) == 2
    assert "service.spool.files" in seen["warnings"][0] and "service.spool.record.meta" in seen["warnings"][1]
