"""The Ray suite reuses the real-server harness in tests/e2e, whose modules import each other by bare name."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "e2e"))
