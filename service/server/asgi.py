"""ASGI pieces under the routes: the request-body limit, the send timeout, and rids that hold any character.

Why apart from the routes: they act on raw ASGI messages (scope, receive, send), before or around FastAPI,
and each guards the server against a client (an oversized body, a reader that stopped reading).
"""

import asyncio
import re

from fastapi import FastAPI
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from service.server.errors import error_response


class BodyLimit:
    """Pure ASGI middleware: refuse request bodies over `max_bytes` with 413 before the app reads them."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "DELETE", "OPTIONS"):
            await self.app(scope, receive, send)
            return
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_bytes):
            await self._refuse(scope, receive, send)
            return
        messages: list[Message] = []
        size = 0
        while True:
            message = await receive()
            messages.append(message)
            if message["type"] != "http.request":
                break
            size += len(message.get("body", b""))
            if size > self.max_bytes:
                await self._refuse(scope, receive, send)
                return
            if not message.get("more_body", False):
                break

        async def replay() -> Message:
            return messages.pop(0) if messages else await receive()

        await self.app(scope, replay, send)

    async def _refuse(self, scope: Scope, receive: Receive, send: Send) -> None:
        detail = f"request body over {self.max_bytes} bytes"
        await error_response(413, "body_too_large", detail)(scope, receive, send)


class ClientGone(OSError):
    """The client closed its connection, or stopped reading, while its answer was being sent."""


class SidecarApp(FastAPI):
    """FastAPI with a send timeout: a client that takes no body chunk for `send_timeout_s` is cut off.

    Without it, a stalled reader holds its connection, a body chunk and an open `.bin` forever (the
    server's `send` waits on flow control). The timeout watches the server's own `send`, outside every
    middleware, so on expiry it can abort the transport (uvicorn exposes it on the bound `send`),
    which frees the socket at once instead of waiting for buffered bytes that will never drain. One
    timer per request watches every send (a timeout context per send costs more than the rest of a small
    response's sends together).
    """

    send_timeout_s: float | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        timeout = self.send_timeout_s
        if timeout is None or scope["type"] != "http":
            await super().__call__(scope, receive, send)
            return
        loop = asyncio.get_running_loop()
        task = asyncio.current_task()
        transport = getattr(getattr(send, "__self__", None), "transport", None)
        sending_since: float | None = None
        aborted = False

        def watch() -> None:
            nonlocal watchdog, aborted
            now = loop.time()
            if sending_since is not None and now - sending_since >= timeout:
                aborted = True
                if transport is not None:
                    transport.abort()  # the server's pending send returns; watched_send raises
                elif task is not None:
                    task.cancel()  # a server without a transport to abort: interrupt the pending send
                return
            watchdog = loop.call_at((sending_since if sending_since is not None else now) + timeout, watch)

        async def watched_send(message: Message) -> None:
            nonlocal sending_since
            if transport is not None and transport.is_closing() and message["type"] == "http.response.body":
                # uvicorn drops writes to a closed connection without a word: the body would run to its end
                # and be counted as served. Stop it here; the body counts the answer 499.
                raise ClientGone("client closed the connection")
            if not aborted:
                sending_since = loop.time()
                try:
                    await send(message)
                except asyncio.CancelledError:
                    if not aborted or task is None:
                        raise
                    task.uncancel()
                finally:
                    sending_since = None
            if aborted:
                raise ClientGone(f"client read nothing for {timeout}s; connection closed")

        watchdog = loop.call_later(timeout, watch)
        try:
            await super().__call__(scope, receive, watched_send)
        except ClientGone:
            pass  # nobody to answer, nothing wrong with the server: no traceback in the log (counted 499)
        finally:
            watchdog.cancel()


def any_char_rids(app: FastAPI) -> None:
    """Let `{rid:path}` match every character: Starlette's `.*$` stops at a newline (and `$` matches before a
    trailing one), so a rid holding `%0A` would not reach its route or would arrive cut short."""
    for route in app.router.routes:
        regex = getattr(route, "path_regex", None)
        if regex is not None and "(?P<rid>.*)" in regex.pattern and regex.pattern.endswith("$"):
            route.path_regex = re.compile(regex.pattern[:-1] + r"\Z", re.DOTALL)
