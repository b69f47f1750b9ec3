"""Deprecated alias of `service.spool.engine_report` (the spool contract's package): removed in the next release."""

import sys
import warnings

from service.spool import engine_report as _moved

warnings.warn(
    "service.engine_report is deprecated: import service.spool.engine_report", DeprecationWarning, stacklevel=2
)
sys.modules[__name__] = _moved  # one module under both names: what one patches, the other sees
