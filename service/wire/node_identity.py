"""Which machine and which file-system view a process runs in: what a sidecar advertises and a client checks.

Why not the host name: two pods on one node have different host names, and one host name can name several
machines (a cluster's default image). The kernel's boot id (`/proc/sys/kernel/random/boot_id`) is random per
boot and shared by every container on one kernel: equal boot ids mean the same node, now. The mount namespace
(`/proc/self/ns/mnt`) says whether two processes see the same mounts; containers of one pod differ here and
may still share the spool's tmpfs as a volume, so it is reported, and the probe file (service.server.spool_advert)
decides whether the spool's files are the same ones.
"""

from __future__ import annotations

import os
import socket
from dataclasses import asdict, dataclass
from typing import Any

__all__ = ["NodeIdentity", "this_node"]


@dataclass(frozen=True, slots=True)
class NodeIdentity:
    """A process's node (boot id), its machine id (may differ between containers of one node) and its mounts."""

    boot_id: str
    machine_id: str
    mount_ns: str
    hostname: str

    def to_dict(self) -> dict[str, str]:
        return asdict(self)

    @classmethod
    def from_dict(cls, obj: Any) -> NodeIdentity | None:
        """The identity a sidecar sent, or None when it is not one (an older sidecar, a malformed answer)."""
        if not isinstance(obj, dict) or not all(isinstance(obj.get(k), str) for k in cls.__slots__):
            return None
        return cls(**{k: obj[k] for k in cls.__slots__})

    def same_node(self, other: NodeIdentity) -> bool:
        """One running kernel: both boot ids known and equal."""
        return bool(self.boot_id) and self.boot_id == other.boot_id


def _read(path: str) -> str:
    try:
        with open(path, encoding="ascii", errors="replace") as f:
            return f.read().strip()
    except OSError:
        return ""


def this_node() -> NodeIdentity:
    """This process's identity (empty strings where the platform does not say: no local reads then)."""
    try:
        mount_ns = os.readlink("/proc/self/ns/mnt")
    except OSError:
        mount_ns = ""
    return NodeIdentity(
        boot_id=_read("/proc/sys/kernel/random/boot_id"),
        machine_id=_read("/etc/machine-id"),
        mount_ns=mount_ns,
        hostname=socket.gethostname(),
    )
