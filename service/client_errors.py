"""The trainer client's errors: one exception class per HTTP status the sidecar answers (docs/design.md, Contract 2).

Both clients and `RoutedExpertsRef` raise these; `error_for` maps a status and its JSON body to one.
"""

from __future__ import annotations

from typing import Any

import orjson

__all__ = [
    "BadRequest",
    "NotReady",
    "R3Error",
    "RangeNotSatisfiable",
    "RecordGone",
    "RecordNotFound",
    "RecordRestarted",
    "ServerError",
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


def error_for(status: int, body: Any, rid: str | None = None) -> R3Error:
    """The exception for an HTTP status and its (JSON) body; `detail` falls back to the body's text."""
    if isinstance(body, dict):
        detail = body.get("detail") or body.get("error") or f"HTTP {status}"
    else:
        detail = str(body or "")[:500] or f"HTTP {status}"
    if not isinstance(detail, str):
        detail = orjson.dumps(detail).decode()
    cls = _BY_STATUS.get(status, ServerError if status >= 500 else BadRequest)
    return cls(detail, rid=rid, status=status, body=body)


def json_or_text(content: bytes) -> Any:
    try:
        return orjson.loads(content)
    except orjson.JSONDecodeError:
        return content.decode("utf-8", "replace")
