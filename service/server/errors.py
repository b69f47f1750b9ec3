"""Error answers of Contract 2: every error leaves as JSON `{"error": code, "detail": text}`.

Why one module: routes raise `ApiError`; FastAPI's validation errors, Starlette's 404/405 and unexpected
faults are turned into the same body by `install_error_handlers`, so a client parses one shape of error.
"""

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match
from starlette.types import Scope


class ApiError(Exception):
    """An error response: HTTP status, a short machine code and a sentence for a person."""

    def __init__(self, status: int, code: str, detail: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(detail)
        self.status, self.code, self.detail, self.headers = status, code, detail, headers


class ErrorBody(BaseModel):
    error: str = Field(description="Short machine-readable code, e.g. `not_found`.")
    detail: str = Field(description="What was wrong, for a person.")


def error_response(status: int, code: str, detail: str, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse({"error": code, "detail": detail}, status_code=status, headers=headers)


def _validation_detail(exc: RequestValidationError) -> str:
    parts = []
    for err in exc.errors():
        loc = ".".join(str(x) for x in err.get("loc", ()) if x not in ("query", "path", "body"))
        parts.append(f"{loc or 'request'}: {err.get('msg', 'invalid')}")
    return "; ".join(parts) or "invalid request"


_HTTP_CODES = {404: "not_found", 405: "method_not_allowed", 413: "body_too_large"}


def install_error_handlers(app: FastAPI) -> None:
    """Every error leaves as `{"error", "detail"}` JSON, including FastAPI's and Starlette's own."""

    @app.exception_handler(ApiError)
    async def _api_error(_request: Request, exc: ApiError) -> JSONResponse:
        return error_response(exc.status, exc.code, exc.detail, exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_request: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(422, "invalid_parameter", _validation_detail(exc))

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> JSONResponse:
        """An unexpected fault before the headers: still a JSON error (Starlette's default is plain text)."""
        detail = f"{type(exc).__name__} while answering {request.method} {request.url.path}"
        return error_response(500, "internal_error", detail)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        detail = str(exc.detail)
        if exc.status_code == 400:  # FastAPI's "error parsing the body" (e.g. not UTF-8): malformed input, 422
            return error_response(422, "invalid_body", detail)
        headers = dict(exc.headers or {})
        if exc.status_code == 404 and detail == "Not Found":
            detail = f"no route {request.method} {request.url.path}"
        if exc.status_code == 405:  # Starlette names only the first matching route's methods
            headers["Allow"] = ", ".join(sorted(_allowed_methods(app, request.scope)))
            detail = f"{request.method} not allowed here; allowed: {headers['Allow']}"
        return error_response(exc.status_code, _HTTP_CODES.get(exc.status_code, "http_error"), detail, headers)


def _allowed_methods(app: FastAPI, scope: Scope) -> set[str]:
    """Methods of every route sharing the path template of the first route that matches this path."""
    template = None
    methods: set[str] = set()
    for route in app.router.routes:
        path = getattr(route, "path_format", None)
        if template is None and path is not None and route.matches(scope)[0] != Match.NONE:
            template = path
        if template is not None and path == template:
            methods |= getattr(route, "methods", None) or set()
    return methods
