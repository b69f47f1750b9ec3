"""What the OpenAPI schema says each route returns: statuses, media types, `X-R3-*` headers, bodies.

Why apart: these are descriptions, not behaviour; the routes name them (`record_responses`, `errors`) so
a route reads as what it does, and the schema stays the single documented answer of each status.
"""

from typing import Any, Literal

from pydantic import BaseModel, Field

from service.server.errors import ErrorBody
from service.wire.frames import FRAMES_MEDIA_TYPE


class Pending(BaseModel):
    rid: str
    rows: int = Field(description="Rows written so far.")
    final: Literal[False]
    detail: str = Field(description="The same, for a person: rows so far and the positions they cover.")


class Health(BaseModel):
    status: str


class Engines(BaseModel):
    engines: list[dict[str, Any]] = Field(description="Engine files (Contract 1), one per engine process.")


BINARY = {"schema": {"type": "string", "format": "binary"}}
TEXT = {"type": "string"}
_X_HEADERS = {
    "X-R3-Rid": "The rid, percent-encoded UTF-8.",
    "X-R3-Dtype": "numpy dtype of the numbers in the body (`int32` for `sglang_b64`).",
    "X-R3-Shape": "`rows,layers,topk` of the returned array.",
    "X-R3-Start": "Token position of the first returned row.",
    "X-R3-Prompt-Len": "Prompt length of the request.",
    "X-R3-Layers": "Comma list of the model layer index of each returned layer slot.",
    "X-R3-Final": "`true` when the record is complete.",
    "X-R3-Status": "The record's status: `ok`, `aborted` (the rows the request produced before it was aborted), or "
    "`suspect` (served only with `suspect=allow`: rows no true route has).",
    "X-R3-Num-Hidden-Layers": "The model's layer count (SGLang's payload width), when the record says it.",
    "X-R3-Created": "The record's creation time (Unix seconds, as in its metadata): which request wrote the rows. "
    "A rid reused by a new request gets a new record with a new value.",
    "X-R3-Clamped": "`true` when `clamp=true` cut the range asked for to the rows the record holds.",
}

_ERRORS = {
    401: "Missing or wrong bearer token (only when R3_AUTH_TOKEN is set).",
    404: "No such record.",
    410: "The record ended in error, was corrupt, or expired.",
    416: "`start`/`end` outside the record's rows (and `clamp` not set).",
    422: "Malformed parameters, layers the record does not hold, SGLang's layout of a record that cannot give it, "
    "or a `suspect` record without `suspect=allow` (`record_suspect`: the first bad row, its layer and why).",
}


def errors(*codes: int) -> dict[int | str, dict[str, Any]]:
    return {code: {"model": ErrorBody, "description": _ERRORS[code]} for code in codes}


SERVER_400: dict[int | str, dict[str, Any]] = {
    400: {
        "description": "Malformed or oversized HTTP request, refused by the HTTP server before the app sees it.",
        "content": {"text/plain": {"schema": TEXT}},
    }
}


def record_responses(auth_errors: tuple[int, ...]) -> dict[int | str, dict[str, Any]]:
    return {**_RECORD_OK, **SERVER_400, **errors(*auth_errors, 404, 410, 416, 422)}


_RECORD_OK: dict[int | str, dict[str, Any]] = {
    200: {
        "description": "The rows, in the requested format (or frames with `stream=true`).",
        "headers": {name: {"description": text, "schema": {"type": "string"}} for name, text in _X_HEADERS.items()},
        "content": {
            "application/x-npy": BINARY,
            "application/octet-stream": BINARY,
            "application/json": {"schema": {"type": "object"}},
            "text/plain": {"schema": TEXT},
            FRAMES_MEDIA_TYPE: BINARY,
        },
    },
    202: {"model": Pending, "description": "The record exists but is not final after `wait`."},
}
