"""How pytest-xdist hands the suite's modules to its workers: which modules go together, and in what order.

Both of `make test`'s pytest runs are CPU-bound on CI's 2 cores (docs/testing.md, "Two pytest runs"), so what a
worker builds without need comes off the others, and a long module handed out last runs alone at the end.

- **Groups.** `--dist loadscope` gives each module to one worker, so what a module builds once (a fixture, a
  zygote) is built once. A process that imports an engine is built once per worker, though: every worker that
  ran one of the SGLang-children modules started its own SGLang zygote (torch and SGLang imported, about 16
  CPU-s each; vLLM's: torch and transformers, 8 CPU-s). `GROUPS` makes such modules one unit of work, so one
  worker runs them all over one zygote; likewise the two modules that read pip's build of our metadata, and the
  modules that import SGLang into the test process (5 CPU-s a worker). Every worker collects every module, so no
  module imports an engine when collected (`ENGINES_AT_COLLECTION`, recorded by conftest): SGLang imported by a
  module's import cost each worker that, and the tier waited on it before its first test.
- **Waits early.** A module that mostly waits (a TTL, a name lookup) goes out early, where its waits are other
  workers' CPU time; at the end they are idle cores.
- **Order.** Units go out in collection order, and `ORDER`'s modules are collected first, longest first, so the
  end of a run is short modules on every worker. pytest-xdist's own `loadscope` sorts units by their number of
  tests instead (`--loadscope-reorder`, on by default), which sent the one-test Ray module, one of the longest,
  out among the last (the server tier's order, read from a collection of 2026-11-30).
"""

from __future__ import annotations

from xdist.scheduler import LoadScopeScheduling

# Modules whose tests run SGLang's classes in children forked from the test process's zygote (`run_sglang`).
_SGLANG_CHILDREN = (
    "test_budget_sglang",
    "test_capture_cases",
    "test_capture_check",
    "test_capture_graph_cuda",
    "test_capture_sync",
    "test_collect",
    "test_collect_sync",
    "test_compat",
    "test_frontdoors",
    "test_live",
    "test_pd",
    "test_plugin_entry",
    "test_sglang_layout",
    "test_sglang_zygote",
)
# Modules whose tests run vLLM 0.32.0 in children forked from the test process's `.venv-vllm` zygote (`run_vllm`).
_VLLM_CHILDREN = ("test_vllm_children", "test_vllm_classes", "test_vllm_release_files", "test_vllm_spooler")
# Modules whose tests import SGLang into the test process itself (the hook table, `HookRegistry`, SGLang's own
# functions); no module imports it when collected (`test_collection_imports_no_engine`), so one worker imports it.
_SGLANG_IN_PROCESS = (
    "test_attributes",
    "test_fit",
    "test_guard",
    "test_release_wheels",
    "test_source_names",
    "test_weight_versions",
    "test_worker_app",
)
GROUPS: dict[str, str] = {
    **{f"tests/engine/sglang/{name}.py": "SGLang's zygote children" for name in _SGLANG_CHILDREN},
    "tests/benchmarks/test_bench_smoke.py": "SGLang's zygote children",
    "tests/deploy/test_deploy_chart_commands.py": "SGLang's zygote children",
    **{f"tests/engine/vllm/{name}.py": "vLLM's zygote children" for name in _VLLM_CHILDREN},
    # pip's isolated build of this checkout's metadata, made once per process (`test_pip_story.our_requirements`)
    "tests/deploy/test_pip_story.py": "pip's resolver",
    "tests/deploy/test_vllm_pip_story.py": "pip's resolver",
    **{f"tests/engine/sglang/{name}.py": "SGLang in the test process" for name in _SGLANG_IN_PROCESS},
}
# Each group's zygote: the function its modules call to fork a child from it.
FORKED_BY = {"SGLang's zygote children": "run_sglang", "vLLM's zygote children": "run_vllm"}

# The longest units first: the server tier's (a CI-like run of cd59af7, 2026-11-29: the layout smoke's ten server
# starts, vLLM's two releases' six, the front doors' six, …), then the server-free tier's (profiled 2026-11-30; the
# tier's last minute had 15-20% of the CPU idle, `vmstat`, while its other minutes had 0-5%).
ORDER = (
    "tests/e2e/test_sglang_layouts.py",
    "tests/e2e/test_vllm_plugin.py",
    "tests/e2e/test_sglang_front_doors.py",
    "tests/e2e/test_sglang_limits.py",
    "tests/e2e/test_sglang_0_5_12.py",
    "tests/ray/test_ray_cluster.py",
    "tests/e2e/test_sglang_dp_attention.py",
    "tests/e2e/test_sglang_gateway.py",
    "tests/e2e/test_sglang_fault.py",
    "tests/e2e/test_sglang_inprocess.py",
    "tests/e2e/test_vllm_build_check.py",
    "tests/e2e/test_sglang_retract.py",
    "tests/deploy/test_deploy_prometheus_live.py",
    "tests/engine/sglang/test_capture_compiled.py",
    *GROUPS,
    "tests/reliability/test_reliability_spool_model.py",
    "tests/service/server/test_retention_metrics.py",  # 18 s, 2 CPU-s: its waits are others' CPU time
    "tests/service/server/test_cli.py",  # an unknown host's lookup: 6 s, no CPU
    "tests/reliability/test_reliability_restart.py",
    "tests/engine/vllm/test_vllm_release_wheels.py",
    "tests/service/server/test_api_routes.py",
    "tests/reliability/test_reliability_security.py",
    "tests/engine/core/test_node_sidecar.py",
)


# The engines imported once this process had collected the suite (conftest's `pytest_collection_finish`).
ENGINES_AT_COLLECTION: list[str] = []
ENGINES = ("sglang", "vllm")


def module_of(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def collection_rank(nodeid: str) -> int:
    """Where a test goes in collection order: `ORDER`'s modules first, in that order; every other after them."""
    return _RANK.get(module_of(nodeid), len(_RANK))


_RANK = {module: i for i, module in enumerate(ORDER)}


class GroupedScopeScheduling(LoadScopeScheduling):
    """`loadscope` whose unit is a module's group where `GROUPS` names one, handed out in collection order."""

    def __init__(self, config, log=None) -> None:
        super().__init__(config, log)
        config.option.loadscopereorder = False  # collection order is `ORDER`'s, not the count of tests

    def _split_scope(self, nodeid: str) -> str:
        return GROUPS.get(module_of(nodeid)) or super()._split_scope(nodeid)
