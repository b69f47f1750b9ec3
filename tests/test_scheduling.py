"""The suite's xdist scheduler (`scheduling.py`): a group goes to one worker, and units go out in `ORDER`.

Driven through pytest-xdist's own `LoadScopeScheduling` protocol (add nodes, their collections, schedule) with
stand-in workers that record what they were sent, and checked against the source: every module `GROUPS` names
forks its group's zygote children, and every module that does is in it; and against this process's collection,
which imported no engine.
"""

from __future__ import annotations

import ast
from pathlib import Path
from types import SimpleNamespace

import scheduling

REPO = Path(__file__).resolve().parents[1]


class _Worker:
    """What the scheduler calls on a worker: the tests it is sent, in order, and its shutdown."""

    def __init__(self, name: str) -> None:
        self.gateway = SimpleNamespace(id=name)
        self.sent: list[int] = []
        self.shutting_down = False

    def send_runtest_some(self, indexes: list[int]) -> None:
        self.sent.extend(indexes)

    def shutdown(self) -> None:
        self.shutting_down = True


def _schedule(collection: list[str], workers: int) -> list[list[str]]:
    config = SimpleNamespace(getvalue=lambda name: [f"{workers}*popen"], option=SimpleNamespace(loadscopereorder=True))
    sched = scheduling.GroupedScopeScheduling(config)
    nodes = [_Worker(f"gw{i}") for i in range(workers)]
    for node in nodes:
        sched.add_node(node)
    for node in nodes:
        sched.add_node_collection(node, collection)
    sched.schedule()
    return [[collection[i] for i in node.sent] for node in nodes]


def test_a_group_goes_to_one_worker_whole_and_units_go_out_in_order():
    first, second = [module for module, group in scheduling.GROUPS.items() if group == "SGLang's zygote children"][:2]
    collection = [
        "tests/ray/test_ray_cluster.py::test_one",  # one test: pytest-xdist's own order sends it out last
        f"{first}::test_a",
        f"{first}::test_b",
        "tests/service/test_many.py::test_1",
        "tests/service/test_many.py::test_2",
        "tests/service/test_many.py::test_3",
        f"{second}::test_c",
    ]
    sent = _schedule(collection, workers=3)
    assert sent[0] == ["tests/ray/test_ray_cluster.py::test_one"]
    assert sent[1] == [f"{first}::test_a", f"{first}::test_b", f"{second}::test_c"]
    assert sent[2] == [f"tests/service/test_many.py::test_{i}" for i in (1, 2, 3)]


def test_ordered_modules_are_collected_first_in_order_and_the_rest_keep_their_place():
    ids = ["tests/service/test_x.py::t", scheduling.ORDER[3] + "::t", "tests/a.py::t", scheduling.ORDER[0] + "::t"]
    assert sorted(ids, key=scheduling.collection_rank) == [ids[3], ids[1], ids[0], ids[2]]


def test_every_scheduled_module_exists():
    missing = [module for module in [*scheduling.ORDER, *scheduling.GROUPS] if not (REPO / module).is_file()]
    assert not missing, f"renamed or removed, still scheduled: {missing}"


def _calls(path: Path, function: str) -> bool:
    tree = ast.parse(path.read_text())
    return any(
        isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", None)) == function
        for node in ast.walk(tree)
    )


def test_each_zygote_group_is_exactly_the_modules_that_fork_its_children():
    modules = [path for path in (REPO / "tests").rglob("test_*.py") if "e2e" not in path.parts]
    for group, function in scheduling.FORKED_BY.items():
        forking = {str(path.relative_to(REPO)) for path in modules if _calls(path, function)}
        assert forking == {module for module, named in scheduling.GROUPS.items() if named == group}, group


def test_collection_imports_no_engine():
    """Every xdist worker collects every module: one that imports SGLang (or vLLM) when collected costs each worker
    that import (5 CPU-s) before its first test, where the modules that need it run on one worker
    (`scheduling.GROUPS`, "SGLang in the test process"). Read from this process's own collection."""
    assert scheduling.ENGINES_AT_COLLECTION == [], "import the engine in a fixture or the test, not at module level"
