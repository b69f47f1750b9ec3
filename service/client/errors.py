"""The trainer client's errors: one exception class per HTTP status the sidecar answers (docs/design.md, Contract 2).

Both clients and `RoutedExpertsRef` raise these; `error_for` maps a status and its JSON body to one.
"""

from __future__ import annotations

import socket
from typing import Any

import httpx
import orjson

__all__ = [
    "BadRequest",
    "ConnectTimedOut",
    "ConnectionLost",
    "ConnectionRefused",
    "HostNotFound",
    "NotReady",
    "R3Error",
    "RangeNotSatisfiable",
    "ReadTimedOut",
    "RecordGone",
    "RecordNotFound",
    "RecordRestarted",
    "ServerError",
    "SidecarUnreachable",
    "SuspectRows",
    "Unauthorized",
    "error_for",
]


class R3Error(Exception):
    """Any failure the sidecar reported; `status` is the HTTP status, `detail` the server's explanation."""

    status: int | None = None

    def __init__(self, detail: str, *, rid: str | None = None, status: int | None = None, body: Any = None) -> None:
        super().__init__(f"{rid}: {detail}" if rid else detail)
        self.detail = detail
        self.rid = rid
        self.body = body
        if status is not None:
            self.status = status


class NotReady(R3Error):
    """202: the record exists but is not final yet; `rows` says how many rows it has so far (also in the message)."""

    status = 202

    def __init__(self, detail: str, *, rid: str | None = None, status: int | None = None, body: Any = None) -> None:
        rows = body.get("rows") if isinstance(body, dict) else None
        if rows is not None and str(rows) not in detail:  # an older server's 202 carries no detail
            detail = f"record is not final yet: {rows} rows so far ({detail})"
        super().__init__(detail, rid=rid, status=status, body=body)

    @property
    def rows(self) -> int | None:
        return self.body.get("rows") if isinstance(self.body, dict) else None


class Unauthorized(R3Error):
    """401: missing or wrong bearer token."""

    status = 401


class RecordNotFound(R3Error):
    """404: no record with this rid (after waiting, when `wait` was given)."""

    status = 404


class RecordGone(R3Error):
    """410: the record ended in error, is corrupt, or has expired (an aborted record is served: `status`)."""

    status = 410


class RangeNotSatisfiable(R3Error):
    """416: `start`/`end` outside the rows the record holds."""

    status = 416


class RecordRestarted(R3Error):
    """409: the record started over while it was being streamed (its request was retracted and recomputed).

    Rows already yielded belong to the abandoned attempt: discard them and read the record again.
    """

    status = 409


class BadRequest(R3Error):
    """422 or another 4xx: the request itself was malformed."""


class SuspectRows(BadRequest):
    """422 `record_suspect`, or inline rows that failed the same check here: rows no true route has (a repeated
    or out-of-range expert id, a dense layer slot that is not zero), named by their first bad row and layer.

    An engine whose capture went wrong crashes nothing; replaying these rows trains on experts the rollout
    never used. Pass `allow_suspect=True` to get them anyway. `suspect` is the finding when the check ran
    here (inline rows), else None (the message has the sidecar's)."""

    status = 422

    def __init__(self, detail: str, *, rid: str | None = None, status: int | None = None, body: Any = None) -> None:
        super().__init__(detail, rid=rid, status=status, body=body)
        self.suspect: Any = None


class ServerError(R3Error):
    """5xx: the sidecar failed."""


RESTARTED_DETAIL = "the record started over while it was streamed (its request was retracted): read it again"

_BY_STATUS: dict[int, type[R3Error]] = {
    202: NotReady,
    401: Unauthorized,
    404: RecordNotFound,
    409: RecordRestarted,
    410: RecordGone,
    416: RangeNotSatisfiable,
}


class SidecarUnreachable(R3Error):
    """No whole answer came back: the sidecar could not be reached, or the connection failed. `url` is the request's;
    the message says what to do. Each subclass is also the httpx exception it replaces (`except httpx.ConnectError`
    still works), and the client retries the same ones as before (connection failures, not read timeouts)."""

    def __init__(self, detail: str, *, url: str, rid: str | None = None) -> None:
        super().__init__(detail, rid=rid)
        self.url = url


class ConnectionRefused(SidecarUnreachable, httpx.ConnectError):
    """Nothing listens at the URL's host and port."""


class HostNotFound(SidecarUnreachable, httpx.ConnectError):
    """The URL's host name does not resolve (DNS)."""


class ConnectTimedOut(SidecarUnreachable, httpx.ConnectTimeout):
    """The connection was not accepted in time (a wrong address, a firewall, a network policy)."""


class ReadTimedOut(SidecarUnreachable, httpx.ReadTimeout):
    """Connected, but the answer did not come in time."""


class ConnectionLost(SidecarUnreachable, httpx.ReadError, httpx.WriteError, httpx.RemoteProtocolError):
    """The connection failed part way (the sidecar restarted, or cut an answer it could not finish): each httpx
    exception it stands for still catches it."""


def _caused_by(exc: BaseException, kind: type[BaseException]) -> bool:
    """Whether `exc` or anything in its cause chain is a `kind` (httpx wraps httpcore, which wraps the OSError)."""
    seen: set[int] = set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen:
        if isinstance(cur, kind):
            return True
        seen.add(id(cur))
        cur = cur.__cause__ or cur.__context__
    return False


def unreachable(exc: httpx.TransportError, url: str, *, timeout: float, rid: str | None = None) -> R3Error:
    """The `R3Error` for a transport failure of a request to `url`: what happened, and what to do about it."""
    if isinstance(exc, R3Error):
        return exc
    why = str(exc) or type(exc).__name__
    serve = "start one there (`r3-sidecar serve`, or `r3-sidecar demo` to try) or fix the URL (R3_SIDECAR_URL)"
    if isinstance(exc, httpx.ConnectTimeout):
        return ConnectTimedOut(
            f"{url}: no connection within {timeout:g} s ({why}); check the host and port, and that no firewall "
            "or network policy drops the traffic",
            url=url,
            rid=rid,
        )
    if isinstance(exc, httpx.ConnectError):
        if _caused_by(exc, socket.gaierror) or "name or service not known" in why.lower():
            return HostNotFound(f"{url}: the host name does not resolve ({why}); check the URL", url=url, rid=rid)
        if _caused_by(exc, ConnectionRefusedError) or "refused" in why.lower():
            return ConnectionRefused(f"{url}: connection refused, no sidecar listens there; {serve}", url=url, rid=rid)
        return ConnectionRefused(f"{url}: cannot connect ({why}); {serve}", url=url, rid=rid)
    if isinstance(exc, httpx.TimeoutException):
        return ReadTimedOut(
            f"{url}: no answer within {timeout:g} s ({why}); give the client a longer timeout, or fetch with "
            "wait= / stream() for a record that is still being written",
            url=url,
            rid=rid,
        )
    return ConnectionLost(
        f"{url}: the connection failed before the whole answer ({why}); the client retried; see the sidecar's log",
        url=url,
        rid=rid,
    )


def error_for(status: int, body: Any, rid: str | None = None) -> R3Error:
    """The exception for an HTTP status and its (JSON) body; `detail` falls back to the body's text."""
    if isinstance(body, dict):
        detail = body.get("detail") or body.get("error") or f"HTTP {status}"
    else:
        detail = str(body or "")[:500] or f"HTTP {status}"
    if not isinstance(detail, str):
        detail = orjson.dumps(detail).decode()
    cls = _BY_STATUS.get(status, ServerError if status >= 500 else BadRequest)
    if isinstance(body, dict) and body.get("error") == "record_suspect":
        cls = SuspectRows
    return cls(detail, rid=rid, status=status, body=body)


def json_or_text(content: bytes) -> Any:
    try:
        return orjson.loads(content)
    except orjson.JSONDecodeError:
        return content.decode("utf-8", "replace")
