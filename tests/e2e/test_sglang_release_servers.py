"""Every SGLang release no thin module proves, in a real CPU server: the version suite, as users get the plugin there.

The proven releases have a module each (`test_sglang_0_5_12.py`, …). The others (0.5.12.post1 to 0.5.22 but
0.5.16 and 0.5.20) get a layout from their own code (`fit`, `versions.RELEASES`) and run as unproven builds: the
plugin checks its first records against SGLang's own inline rows before it takes delivery over. Here each runs
the same suite in its venv of `make env-sglang-releases` (upstream, mirror, sidecar mode, the dense+MoE model,
tokenizer workers, HTTP/2), the self-check included: the suite's `sidecar` fixture first sends the records the
check needs, and the naming test asserts the check agreed. Matrix tier (`make test-matrix`): seven server starts
per release (about 6 minutes here); docs/versions.md keeps the date and commit of each release's last run.
"""

from __future__ import annotations

import pytest
from version_suite import *  # noqa: F403 (the suite's tests and fixtures, collected here)
from version_suite import venv_python

from engine_ext.sglang.versions import RELEASES, support

UNPROVEN = [v for v, layout in RELEASES.items() if layout is not None and not support(v, layout).proven]

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
        for v in UNPROVEN
    ],
)
def version(request: pytest.FixtureRequest) -> str:
    """The release under test: module scope, so one release's servers all run before the next release's."""
    return request.param
