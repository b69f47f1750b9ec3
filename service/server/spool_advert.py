"""The sidecar's side of same-node reads: where its spool is, on which node, and a probe that proves it.

`GET /v1/node` answers `advert()`; a client on the same node (equal boot id) opens the probe file at the path
named and finds the token only if it sees this very spool (not another node's directory of the same name,
not a different mount over the same path). The probe is written when the sidecar starts and removed when it
stops; its name is the token, so several sidecars over one spool do not overwrite each other's.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
from pathlib import Path
from typing import Any

from service.spool import Spool
from service.spool.files import atomic_write
from service.spool.record.meta import VERSION
from service.wire.node_identity import this_node

__all__ = ["ADVERT_VERSION", "SpoolAdvert"]

log = logging.getLogger("r3.advert")

ADVERT_VERSION = 1


class SpoolAdvert:
    """The probe file and the `/v1/node` body of one sidecar process."""

    def __init__(self, spool: Spool, ttl_s: float) -> None:
        self.spool = spool
        self.ttl_s = ttl_s
        self.token = secrets.token_hex(16)
        self.probe = Path(os.path.abspath(spool.root)) / f"v{VERSION}" / "local" / self.token
        self.written = False

    def start(self) -> None:
        """Write the probe; when that fails the sidecar still serves, and clients read over HTTP."""
        try:
            self.probe.parent.mkdir(parents=True, exist_ok=True)
            atomic_write(self.probe, self.token.encode())
            self.written = True
        except OSError as exc:
            log.warning("cannot write the local-read probe %s (%s): clients read over HTTP only", self.probe, exc)

    def stop(self) -> None:
        if self.written:
            with contextlib.suppress(OSError):
                os.unlink(self.probe)
            self.written = False

    def body(self) -> dict[str, Any]:
        """What a client needs to read this spool's final records itself, and to check that it may."""
        root = Path(os.path.abspath(self.spool.root))
        return {
            "v": ADVERT_VERSION,
            "node": this_node().to_dict(),
            "spool": str(root),
            "records": str(root / f"v{VERSION}" / "records"),
            "probe": str(self.probe) if self.written else None,
            "token": self.token if self.written else None,
            "ttl_s": self.ttl_s,
        }
