"""SGLang 0.5.16 (`make env-sglang-0.5.16`, miles' pin): the shared version suite on its real CPU server."""

from __future__ import annotations

from version_servers import marks
from version_suite import *  # noqa: F403 (the suite's tests and fixtures, collected here)

VERSION = "0.5.16"
pytestmark = marks(VERSION)
