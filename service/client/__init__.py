"""The trainer's side of r3-sidecar (docs/design.md, Contracts 2 and 4): the one import path trainers use.

Public, and the whole of it (`__all__`):

- `RoutedExpertsClient(url)`: the blocking client of one sidecar: `get`, `get_many`, `stream`, `fetch_bytes`,
  `ack`, `ack_many`, `engines`.
- `AsyncRoutedExpertsClient(url)`: the same methods as coroutines (`stream` an async iterator); never blocks the
  event loop.
- `RoutedExpertsRef`: one output's routed experts from any engine response (`from_response`), fetched with
  `fetch()` / `await afetch()`: decoded inline when the response carried the rows, else from its sidecar.
- `fetch_many(refs)` / `afetch_many(refs)`: a step's refs with one batch request per sidecar.
- `SidecarPool` / `AsyncSidecarPool`: the clients `fetch_many` and refs reuse, one per sidecar.
- `RoutedExperts`: rows of one record (`.array`, `.start`, `.layers`, `to_sglang_layout()`, `to_torch()`).
- `BatchItem(rid, start, end)`: one rid of `get_many` with its own token range.
- `R3Error`: what every failure raises (or `get_many` returns), with `.status`, `.detail` and `.rid`.
- `errors`: one `R3Error` subclass per answer (`errors.RecordNotFound`, `errors.NotReady`, ...) and per way a
  sidecar cannot be reached (`errors.SidecarUnreachable`, `errors.ConnectionRefused`, ...).
- `trainers`: each RL trainer's routed-experts tensor from the rows (`trainers.verl`, `.areal`, `.slime`, ...).
- `ranks`: what one training rank fetches, its pipeline stage's layers and context-parallel chunks
  (`ranks.Place`, `ranks.fetch_rank`).
- `ray_nodes`: one sidecar actor per Ray node, started by the trainer (`ray_nodes.start_node_sidecars`).
- `pinned_buffers()`: where same-node reads land rows bound for a GPU (`RoutedExpertsClient(url,
  local_buffers=pinned_buffers())`).

Every other module of this package is its inside (calls, transports, decoding, same-node reads, coalescing) and
may change without notice. The names this module exported before (`Frame`, `parse_npy`, `error_for`, each error
class, ...) still resolve, with a `DeprecationWarning`, until the next release.
"""

import importlib
import warnings
from typing import Any

from service.client import errors, ranks, ray_nodes, trainers
from service.client.calls import BatchItem
from service.client.clients import AsyncRoutedExpertsClient, RoutedExpertsClient
from service.client.decoding import RoutedExperts
from service.client.errors import R3Error
from service.client.pinned import pinned_buffers
from service.client.refs import AsyncSidecarPool, RoutedExpertsRef, SidecarPool, afetch_many, fetch_many

__all__ = [
    "AsyncRoutedExpertsClient",
    "AsyncSidecarPool",
    "BatchItem",
    "R3Error",
    "RoutedExperts",
    "RoutedExpertsClient",
    "RoutedExpertsRef",
    "SidecarPool",
    "afetch_many",
    "errors",
    "fetch_many",
    "pinned_buffers",
    "ranks",
    "ray_nodes",
    "trainers",
]

_FORMER = {
    **dict.fromkeys(
        (
            "BadRequest",
            "ConnectionLost",
            "ConnectionRefused",
            "ConnectTimedOut",
            "HostNotFound",
            "NotReady",
            "RangeNotSatisfiable",
            "ReadTimedOut",
            "RecordGone",
            "RecordNotFound",
            "RecordRestarted",
            "ServerError",
            "SidecarUnreachable",
            "Unauthorized",
            "error_for",
        ),
        "service.client.errors",
    ),
    **dict.fromkeys(("BatchRid", "Layers"), "service.client.calls"),
    **dict.fromkeys(("Frame", "FrameDecoder", "parse_npy", "read_frames"), "service.client.decoding"),
}
"""Names this module exported in the previous release, and where each is defined: removed in the next release."""


def __getattr__(name: str) -> Any:
    """A former export, with a `DeprecationWarning` that names where it lives."""
    where = _FORMER.get(name)
    if where is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    warnings.warn(
        f"service.client.{name} is deprecated: import it from {where} (service.client exports {__all__})",
        DeprecationWarning,
        stacklevel=2,
    )
    return getattr(importlib.import_module(where), name)
