"""The chart's scenarios, one render each, shared by the modules that check them (`test_deploy_chart*.py`)."""

from __future__ import annotations

from typing import Any

import pytest
from deploy_render import rendered_scenario, scenarios


@pytest.fixture(scope="module", params=scenarios())
def rendered(request: pytest.FixtureRequest) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """(the scenario's values, every object they render): module scope, so a module's tests run scenario by
    scenario; the render itself is made once per process (`deploy_render.rendered_scenario`)."""
    return rendered_scenario(request.param)
