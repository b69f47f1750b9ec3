"""Every SGLang release from 0.5.12 to 0.5.23, its own wheel's source against the layout it gets (CI).

Why: which layout a build gets is decided at run time by `fit` importing it, and CI holds only four SGLang venvs;
the other releases' rows in `versions.RELEASES` and `compat.LAYOUTS` were checked only by `make test-matrix`
(`tests/e2e/test_sglang_releases.py`, each release imported in a venv of its own: ~35 s a release, and its venv).
Here each release's wheel (`make release-wheels`: build/release-wheels/, pinned to PyPI's sha256) is read as
files, nothing installed or imported, and asked what `fit` asks (`wheel_fit`, through `fit.fit`'s own candidate
order, so the first layout that fits is the one the release gets):

- every name the layout needs imports: its hook targets (module and qualified name), settings' getters, helpers,
  the literal app path's call, the resolution registrar (`compat.needed`);
- each setting's first attribute is on the class its getter is annotated to return;
- each hook binds its target's parameters as it reads them (`fit.signature_gap`, given the `def`'s parameters;
  a decorator that changes a signature without `functools.wraps` is not seen: the `def` is the closest fact);
- wherever the layout spells something otherwise than 0.5.23, 0.5.23's spelling is absent from the release;
- the source defines every attribute the registered hooks read off SGLang's run-time objects (`attributes`);

then, with that layout: each hook target is a `def` (so its parameters were compared); every name the
plugin's own modules import from SGLang is defined or re-exported where they import it from (`plugin_imports`;
`fit` never imports those); and where its `http_server.py` hands the tokenizer workers' and Granian's app path is
where the layout's worker-app fields say (`http_server_source`; `fit` cannot see those either). A release whose
row is None must fit no layout, its nearest candidate lacking what `NONE_ROWS` says. A missing wheel fails,
naming the make target.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator

import http_server_source
import plugin_imports
import pytest
import release_wheels
import wheel_fit
from source_names import Missing, Source

from engine_ext.sglang import attributes, compat, fit
from engine_ext.sglang.versions import RELEASES

pytestmark = [pytest.mark.sglang, pytest.mark.timeout(120)]


# A release RELEASES gives no layout → a name its nearest candidate layout lacks (none today).
NONE_ROWS: dict[str, str] = {}

# Imports the plugin makes only once what they serve is there: (module, name) → (class, attribute) that the
# importing hook reads first with `getattr(…, None)`. `hooks.delivery._weight_versions` imports SGLang's span
# function only for a Req with `weight_version_events`, which 0.5.12-0.5.18 do not have (nor the function).
CONDITIONAL: dict[tuple[str, str], tuple[str, str]] = {
    ("sglang.srt.utils.weight_versions", "compute_weight_version_spans"): (
        "sglang.srt.managers.schedule_batch.Req",
        "weight_version_events",
    ),
}


@pytest.fixture
def source(request: pytest.FixtureRequest) -> Iterator[Source]:
    """The release's `sglang` package, read from its wheel; one build's parsed files held at a time."""
    try:
        yield release_wheels.SGLANG.source(request.param)
    finally:
        attributes.forget()
        compat.use(compat.NEWEST)


def test_every_release_has_a_pinned_wheel():
    wheels = release_wheels.SGLANG
    assert list(wheels.pins()) == list(RELEASES), f"{wheels.pins_file.name}: one line per RELEASES key"


@pytest.mark.parametrize("source", list(RELEASES), indirect=True, ids=str)
def test_each_release_wheel_gets_the_layout_its_row_says(source: Source, request: pytest.FixtureRequest):
    from engine_ext.sglang.hooks.table import HOOKS  # imports SGLang: when the test runs, not at collection

    release = request.node.callspec.params["source"]
    fitted = fit.fit(release, HOOKS, lambda version, rows: wheel_fit.lacks(source, version, rows))
    assert fitted.layout == RELEASES[release], {version: gaps[:8] for version, gaps in fitted.lacking.items()}
    if fitted.layout is None:
        nearest = next(iter(fitted.lacking.values()))
        assert any(NONE_ROWS[release] in gap for gap in nearest), (NONE_ROWS.get(release), nearest)
        return
    compat.use(fitted.layout)
    assert wheel_fit.unsigned(source, wheel_fit.hook_rows()) == []
    assert missing_imports(source, compat.layout()) == []
    http_server = ast.parse(source.text(http_server_source.MODULE))
    assert http_server_source.disagreements(http_server, compat.layout()) == []


def missing_imports(source: Source, layout: compat.Layout) -> list[str]:
    """The plugin's own imports from SGLang under `layout` that the release does not define (but the conditional
    ones whose condition it lacks too)."""
    out = []
    for plugin, module, name in plugin_imports.needed_by(layout):
        if not isinstance(source.module_member(module, name), Missing):
            continue
        cls, attribute = CONDITIONAL.get((module, name), (None, None))
        if cls is not None and wheel_fit.has_attribute(source, cls, attribute) is False:
            continue
        out.append(f"{plugin}: from {module} import {name}")
    return out


@pytest.mark.parametrize(
    ("source", "layout", "gap"),
    [
        # a wrong row fails: 0.5.12 has no batch-result processor (its Scheduler's mixin processes results)
        ("0.5.12", "0.5.13", f"{compat.BRP}.process_batch_result_prefill"),
        # … a target a layout moves must be gone: 0.5.20's ServerArgs has no CuTe DSL bound of its own
        ("0.5.20", "0.5.17", "sglang.srt.server_args.ServerArgs.cutedsl_moe_max_num_tokens"),
        # … 0.5.23's spelling still there makes an older layout wrong (fit's negative direction)
        ("0.5.14", "0.5.13", "get_parallel().attn_tp_size is still here"),
        # … and a run-time object's class that the source does not have
        ("0.5.14", "0.5.13", f"{compat.ME}.cuda_graph_runner.CudaGraphRunner (no such class)"),
    ],
    indirect=["source"],
)
def test_a_layout_a_release_does_not_fit_is_named_with_what_it_lacks(source: Source, layout: str, gap: str):
    assert any(gap in found for found in wheel_fit.lacks(source, layout, wheel_fit.hook_rows()))
