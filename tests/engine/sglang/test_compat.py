"""`compat`: each release's layout, and 0.5.23's reads through it equal SGLang's own runtime context.

Whether an older version's layout imports there is checked with that version's own python
(`tests/e2e/test_sglang_versions.py`, `after_layout`); its real server runs the hooks (`version_suite.py`).
"""

from __future__ import annotations

import pytest
from sglang_env import run_sglang

from engine_ext.sglang import compat, compat_shims
from engine_ext.sglang.versions import PROVEN, RELEASES


def test_every_proven_release_has_a_layout_and_every_layout_is_a_release_with_plugins():
    from packaging.version import Version

    assert {RELEASES[v] for v in PROVEN} <= set(compat.LAYOUTS)
    assert all(Version(v) >= Version("0.5.12") for v in compat.LAYOUTS)
    assert {v: layout.version for v, layout in compat.LAYOUTS.items()} == {v: v for v in compat.LAYOUTS}


def test_a_layout_names_only_what_0_5_23_reads_and_calls():
    for layout in compat.LAYOUTS.values():
        assert set(layout.reads) <= set(compat.READS), layout.version
        assert set(layout.functions) <= set(compat.FUNCTIONS), layout.version


def test_every_retarget_names_a_hook_row_and_a_function_of_hooks():
    """Read in a child of the SGLang zygote (the hook table imports SGLang; this worker need not)."""
    (wrong,) = run_sglang(
        """
        from engine_ext.sglang import compat
        from engine_ext.sglang.hooks import table

        rows, wrong = {hook.target for hook in table.HOOKS}, []
        for version, layout in compat.LAYOUTS.items():
            wrong += [[version, target] for target in sorted(set(layout.targets) - rows)]
            compat.use(version)
            for hook in table.HOOKS:
                where = compat.hook(hook.target, hook.function)
                if where is not None and not callable(table.body(where[1])):
                    wrong.append([version, list(where)])
        emit(wrong)
        """
    )
    assert wrong == []


def test_a_version_without_a_layout_is_never_guessed():
    with pytest.raises(KeyError):
        compat.use("0.5.10.post1")
    assert compat.layout().version == "0.5.23"


def test_split_read():
    assert compat.split_read("m.n.get_x().a.b") == ("m.n.get_x", ("a", "b"))
    assert compat.split_read("m.get_x()") == ("m.get_x", ())


def test_a_single_entry_per_replica_list_is_this_rank_without_asking_sglang():
    assert compat_shims.slot_in_by_attention_dp_rank([17]) == 0


@pytest.mark.sglang
def test_0_5_23_reads_through_the_layout_are_sglang_own_values():
    (result,) = run_sglang(
        """
        from sglang_env import publish_args
        from sglang.srt.runtime_context import get_exec, get_parallel, get_schedule, get_serving, get_spec
        from engine_ext.sglang import compat

        publish_args(chunked_prefill_size=64, max_running_requests=16, max_prefill_tokens=1024)
        compat.use("0.5.23")
        emit({
            "read": {name: repr(compat.read(name)) for name in compat.READS if name != "server_args"},
            "own": {
                "chunked_prefill_size": repr(get_schedule().chunked_prefill_size),
                "max_prefill_tokens": repr(get_schedule().max_prefill_tokens),
                "speculative_eagle_topk": repr(get_spec().speculative_eagle_topk),
                "cuda_graph_config": repr(get_exec().graph.cuda_graph_config),
                "weight_version": repr(get_serving().weight_version),
                "num_dp_ranks": repr(get_parallel().num_dp_ranks),
                "attn_tp_size": repr(get_parallel().attn_tp_size),
            },
            "slot": compat.function("dp_gather_slot")(),
            "unresolved": compat.unresolved([]),
        })
        """
    )
    for name, value in result["own"].items():
        assert result["read"][name] == value, name
    assert result["read"]["chunked_prefill_size"] == "64" and result["slot"] == 0
    assert result["unresolved"] == []
