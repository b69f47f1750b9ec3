"""`engine_ext.sglang.attributes` against the real installed SGLang sources of every supported version.

What each version's source has is proven per venv by `tests/e2e/test_sglang_versions.py` (its matrix row's
`missing_attributes`, empty for all four). Here: that the checker finds real absences (it would have named
0.5.12's `CudaGraphRunner.bs`, which only `replay_prepare` assigns, and 0.5.12's missing
`GenerationBatchResult.speculative_output_stride`), follows constructors, helper methods, bases and dotted
reads as the source has them, and that a build whose source lacks one is refused at start.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import textwrap
from pathlib import Path

import pytest

from engine_ext.sglang import attributes, compat

REPO = Path(__file__).resolve().parents[3]
_ME = "sglang.srt.model_executor"


def in_venv(venv: str, code: str) -> object:
    """Run `code` (which prints one JSON value last) with another SGLang venv's python."""
    python = REPO / venv / "bin" / "python"
    if not python.exists():
        pytest.skip(f"needs {venv}")
    env = os.environ | {"PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run(
        [str(python), "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=600, env=env, cwd=REPO
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_0_5_12_layouts_as_first_written_are_named_by_the_checker():
    """The layout before this check: `bs` expected from construction, 0.5.23's result fields. On 0.5.12's own
    source the checker names both, where the first forward after start and a verify step crashed."""
    missing = in_venv(
        ".venv-sglang-0.5.12",
        """
        import json
        from dataclasses import replace
        from engine_ext.sglang import attributes, compat
        layout = compat.use("0.5.12")
        compat._layout[0] = replace(layout, graph_batch_set_in=(), verify_stride=compat.Layout("x").verify_stride)
        print(json.dumps(attributes.missing()))
        """,
    )
    assert f"{_ME}.cuda_graph_runner.CudaGraphRunner.bs" in missing, missing
    assert f"{_ME}.cpu_graph_runner.CPUGraphRunner.bs" in missing, missing
    assert "sglang.srt.managers.utils.GenerationBatchResult.speculative_output_stride" in missing, missing


def test_0_5_12_with_0_5_23_graph_runner_classes_names_the_missing_class():
    missing = in_venv(
        ".venv-sglang-0.5.12",
        """
        import json
        from dataclasses import replace
        from engine_ext.sglang import attributes, compat
        layout = compat.use("0.5.12")
        compat._layout[0] = replace(layout, classes={k: v for k, v in layout.classes.items() if k != "decode_graph"})
        print(json.dumps(attributes.missing()))
        """,
    )
    assert f"{_ME}.runner.decode_cuda_graph_runner.DecodeCudaGraphRunner (no such class)" in missing, missing


def test_0_5_20_forward_batch_has_no_padded_counts_of_0_5_23():
    missing = in_venv(
        ".venv-sglang-0.5.20",
        """
        import json
        from dataclasses import replace
        from engine_ext.sglang import attributes, compat
        compat._layout[0] = replace(compat.use("0.5.20"), padded_counts="global_num_tokens_padded_cpu")
        print(json.dumps(attributes.missing()))
        """,
    )
    assert missing == [f"{_ME}.forward_batch_info.ForwardBatch.global_num_tokens_padded_cpu"], missing


@pytest.fixture
def newest():
    """0.5.23's installed source (this venv's SGLang), through its layout."""
    compat.use("0.5.23")
    yield
    compat.use("0.5.23")


def test_0_5_23_source_has_every_read(newest):
    assert attributes.missing() == []


def test_an_attribute_assigned_after_construction_counts_only_where_the_data_says(newest):
    runner = attributes.class_facts(f"{_ME}.model_runner.ModelRunner")
    assert not attributes.defines(runner, "decode_cuda_graph_runner")  # tp_worker calls init_cuda_graphs later
    assert attributes.defines(runner, "decode_cuda_graph_runner", ("init_cuda_graphs",))
    graph = attributes.class_facts(f"{_ME}.runner.decode_cuda_graph_runner.DecodeCudaGraphRunner")
    assert not attributes.defines(graph, "bs")
    assert attributes.defines(graph, "bs", ("load_batch",))
    assert attributes.defines(graph, "captured_req_width")  # __init__ itself


def test_dotted_reads_follow_the_class_the_constructor_assigns(newest):
    req = attributes.class_facts("sglang.srt.managers.schedule_batch.Req")
    assert attributes.defines(req, "kv.req_pool_idx")  # self.kv = ReqKvInfo()
    assert not attributes.defines(req, "kv.no_such_field")
    assert not attributes.defines(req, "req_pool_idx")  # 0.5.16's spelling is not 0.5.23's


def test_fields_methods_and_bases_count(newest):
    batch = attributes.class_facts(f"{_ME}.forward_batch_info.ForwardBatch")
    assert attributes.defines(batch, "global_num_tokens_padded_cpu")  # a dataclass field
    mode = attributes.class_facts(f"{_ME}.forward_batch_info.ForwardMode")
    assert attributes.defines(mode, "is_target_verify") and not attributes.defines(mode, "is_nothing")
    capturer = attributes.class_facts("sglang.srt.state_capturer.routed_experts.RoutedExpertsCapturer")
    assert attributes.defines(capturer, "device_cache")  # BaseTopkCapturer.__init__, its base
    assert attributes.class_facts("sglang.srt.managers.schedule_batch.NoSuchClass") is None


def test_every_read_names_a_role_and_a_hook_function():
    from engine_ext.sglang.hooks import table

    for read in compat.ATTRIBUTES:
        assert read.role in compat.CLASSES, read
        assert callable(table.body(read.by)), read
    for layout in compat.LAYOUTS.values():
        assert set(layout.classes) <= set(compat.CLASSES), layout.version


def test_a_build_whose_source_lacks_an_attribute_the_hooks_read_is_refused_at_start_naming_it(
    monkeypatch, caplog, tmp_path
):
    """The installed 0.5.23 with one read attribute made absent fits no layout (`fit`): one ERROR naming the
    attribute, no hook registered; the engine starts without the plugin."""
    import engine_ext.sglang as plugin
    from engine_ext.sglang import fit

    lacking = "sglang.srt.model_executor.model_runner.ModelRunner.decode_cuda_graph_runner"
    monkeypatch.setattr(attributes, "missing", lambda functions=None: [lacking])
    monkeypatch.setenv("R3_CACHE_DIR", str(tmp_path))  # the made-up answer must not reach the real cache
    fit.installed.cache_clear()
    installed = []
    monkeypatch.setattr(
        "engine_ext.sglang.hooks.table.install", lambda settings: installed.append(settings), raising=False
    )
    monkeypatch.setenv("R3_BUDGET", "warn")
    try:
        with caplog.at_level(logging.ERROR, logger="r3_sidecar"):
            plugin.register()
    finally:
        fit.installed.cache_clear()
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and lacking in errors[0] and "registering no hooks" in errors[0], errors
    assert "fits none of the plugin's layouts (the nearest, 0.5.23, lacks:" in errors[0]
    assert installed == []
