"""A TCP proxy in front of a sidecar, for the client tests that need a connection to drop or to be counted."""

from __future__ import annotations

import socket
import threading
from contextlib import suppress


class Proxy:
    """TCP proxy to the sidecar: counts connections, records request lines, and cuts every open connection
    on demand (a trainer's connection dropped mid-response)."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.connections = 0
        self.requests: list[str] = []
        self._open: list[socket.socket] = []
        self._accepted = threading.Condition()
        threading.Thread(target=self._accept, daemon=True).start()

    def wait_connections(self, n: int, timeout: float) -> bool:
        """Block until `n` connections have been accepted; False if `timeout` ran out first."""
        with self._accepted:
            return self._accepted.wait_for(lambda: self.connections >= n, timeout)

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            up = socket.create_connection(("127.0.0.1", self.upstream_port))
            self._open += [conn, up]
            with self._accepted:
                self.connections += 1
                self._accepted.notify_all()
            threading.Thread(target=self._pipe, args=(conn, up, True), daemon=True).start()
            threading.Thread(target=self._pipe, args=(up, conn, False), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket, is_request: bool) -> None:
        try:
            while data := src.recv(65536):
                if is_request and data[:4] in (b"GET ", b"POST", b"DELE"):
                    self.requests.append(data.split(b"\r\n", 1)[0].decode())
                dst.sendall(data)
        except OSError:
            pass
        finally:
            self._cut(src, dst)

    @staticmethod
    def _cut(*socks: socket.socket) -> None:
        for sock in socks:
            with suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()

    def cut_all(self) -> None:
        self._cut(*self._open)
        self._open.clear()

    def close(self) -> None:
        self.sock.close()
