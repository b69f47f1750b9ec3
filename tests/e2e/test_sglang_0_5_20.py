"""SGLang 0.5.20 (`make env-sglang-0.5.20`): the shared version suite (`version_suite.py`) on its real CPU server."""

from __future__ import annotations

from version_servers import marks
from version_suite import *  # noqa: F403 (the suite's tests and fixtures, collected here)

VERSION = "0.5.20"
pytestmark = marks(VERSION)
