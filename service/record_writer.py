"""Deprecated alias of `service.spool.record_writer` (the spool contract's package): removed in the next release."""

import sys
import warnings

from service.spool import record_writer as _moved

warnings.warn(
    "service.record_writer is deprecated: import service.spool.record_writer", DeprecationWarning, stacklevel=2
)
sys.modules[__name__] = _moved  # one module under both names: what one patches, the other sees
