"""SGLang 0.5.12 (`make env-sglang-0.5.12`, verl 0.9.1's pin): the shared version suite on its real CPU server."""

from __future__ import annotations

from version_servers import marks
from version_suite import *  # noqa: F403 (the suite's tests and fixtures, collected here)

VERSION = "0.5.12"
pytestmark = marks(VERSION)
