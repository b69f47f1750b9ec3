"""Every SGLang release without a module of its own, in a real CPU server: the version suite, as users get the plugin.

0.5.12, 0.5.16 and 0.5.20 have a module each (`test_sglang_0_5_12.py`, …), 0.5.23 the CI suite. The others
(0.5.12.post1 to 0.5.22) get a layout from their own code (`fit`, `versions.RELEASES`); each runs the same suite
here in its venv of `make env-sglang-releases` (upstream, mirror, sidecar mode, the dense+MoE model, tokenizer
workers, HTTP/2), as what `versions.PROVEN` says it is. A proven release takes delivery over at once, and this
run is its proof. An unproven one checks its first records against SGLang's own inline rows before it does: the
suite's `sidecar` fixture first sends the records the check needs, and the naming test asserts the check agreed.
Matrix tier (`make test-matrix`): seven server starts per release (about 5 minutes here); docs/versions.md keeps
the date and commit of each release's last run.
"""

from __future__ import annotations

import os

import pytest
from tiers import part
from version_servers import venv_python
from version_suite import *  # noqa: F403 (the suite's tests and fixtures, collected here)

from engine_ext.sglang.versions import NEWEST, RELEASES

OWN_MODULE = {"0.5.12", "0.5.16", "0.5.20", NEWEST}  # `test_sglang_0_5_12.py`, …; the CI suite for the newest


REST = part(
    [v for v, layout in RELEASES.items() if layout is not None and v not in OWN_MODULE],
    os.environ.get("R3_TEST_RELEASE_PART"),
)

pytestmark = [pytest.mark.sglang, pytest.mark.matrix, pytest.mark.timeout(900)]


@pytest.fixture(
    scope="module",
    params=[
        pytest.param(
            v,
            marks=pytest.mark.skipif(
                not venv_python(v).exists(), reason=f"needs .venv-sglang-{v} (make env-sglang-releases)"
            ),
        )
        for v in REST
    ],
)
def version(request: pytest.FixtureRequest) -> str:
    """The release under test: module scope, so one release's servers all run before the next release's."""
    return request.param
