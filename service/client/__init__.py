"""Trainer-side client for the sidecar's HTTP API (docs/design.md, Contracts 2 and 4): the import path trainers use.

`RoutedExpertsRef.from_response(resp)` turns an engine response into refs that fetch their rows (inline or
through the sidecar); `RoutedExpertsClient(url).get(rid)` is the direct call. The blocking and the asyncio
client have the same methods and share everything but their transport: each method is a `Call` built in
service.client.calls, sent under the shared retry policy, and read by service.client.decoding.
"""

from service.client.calls import BatchItem, BatchRid, Layers
from service.client.clients import AsyncRoutedExpertsClient, RoutedExpertsClient
from service.client.decoding import Frame, FrameDecoder, RoutedExperts, parse_npy, read_frames
from service.client.errors import (
    BadRequest,
    ConnectionLost,
    ConnectionRefused,
    ConnectTimedOut,
    HostNotFound,
    NotReady,
    R3Error,
    RangeNotSatisfiable,
    ReadTimedOut,
    RecordGone,
    RecordNotFound,
    RecordRestarted,
    ServerError,
    SidecarUnreachable,
    Unauthorized,
    error_for,
)
from service.client.refs import AsyncSidecarPool, RoutedExpertsRef, SidecarPool, afetch_many, fetch_many

__all__ = [
    "AsyncRoutedExpertsClient",
    "AsyncSidecarPool",
    "BadRequest",
    "BatchItem",
    "BatchRid",
    "ConnectTimedOut",
    "ConnectionLost",
    "ConnectionRefused",
    "Frame",
    "FrameDecoder",
    "HostNotFound",
    "Layers",
    "NotReady",
    "R3Error",
    "RangeNotSatisfiable",
    "ReadTimedOut",
    "RecordGone",
    "RecordNotFound",
    "RecordRestarted",
    "RoutedExperts",
    "RoutedExpertsClient",
    "RoutedExpertsRef",
    "ServerError",
    "SidecarPool",
    "SidecarUnreachable",
    "Unauthorized",
    "afetch_many",
    "error_for",
    "fetch_many",
    "parse_npy",
    "read_frames",
]
