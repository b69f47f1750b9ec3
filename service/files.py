"""Deprecated alias of `service.spool.files` (the spool contract's package): removed in the next release."""

import sys
import warnings

from service.spool import files as _moved

warnings.warn("service.files is deprecated: import service.spool.files", DeprecationWarning, stacklevel=2)
sys.modules[__name__] = _moved  # one module under both names: what one patches, the other sees
