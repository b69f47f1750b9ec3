"""r3-sidecar's service: serves the routed-experts spool to RL trainers over HTTP (no torch, no SGLang).

Four packages, one per side: `spool` is the file contract shared with the engine; `server` is the sidecar
(`server.api.create_app`, `server.store`, `server.metrics`, `server.cli`); `client` is the trainer's side (its
public names are `service.client`'s `__all__`); `wire` holds what both of them read and write over HTTP (the body
formats, frames, the node identity a sidecar advertises).

The flat module paths of the previous releases (`service.refs`, `service.api`, `service.record_meta`, ...) still
import, each as the moved module under its old name with a `DeprecationWarning`, until the next release (`MOVED`).
"""

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types
import warnings

MOVED = {
    "ack": "server.ack",
    "api": "server.api",
    "asgi": "server.asgi",
    "batch": "server.batch",
    "buffers": "wire.buffers",
    "cli": "server.cli",
    "client_errors": "client.errors",
    "clients": "client.clients",
    "coalesce": "client.coalesce",
    "connections": "client.connections",
    "demo": "server.demo",
    "engine_report": "spool.engine_report",
    "errors": "server.errors",
    "fetch": "server.fetch",
    "files": "spool.files",
    "formats": "wire.formats",
    "frames": "wire.frames",
    "heap": "server.heap",
    "lifetime": "server.lifetime",
    "local_reads": "client.local.reads",
    "local_spool": "client.local.spool",
    "metrics": "server.metrics",
    "node_identity": "wire.node_identity",
    "openapi": "server.openapi",
    "pinned": "client.pinned",
    "ranks": "client.ranks",
    "ray_nodes": "client.ray_nodes",
    "record_meta": "spool.record.meta",
    "record_writer": "spool.record.writer",
    "records": "server.record_answer",
    "refs": "client.refs",
    "requests": "client.calls",
    "responses": "client.engine_responses",
    "results": "client.decoding",
    "settings": "server.settings",
    "spool_advert": "server.spool_advert",
    "store": "server.store",
    "stream": "server.stream",
    "trainers": "client.trainers",
    "transport": "client.transport",
}
"""Former module (under `service.`) → where it lives now (under `service.`): removed in the next release."""


class _MovedPaths(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports a former path as the moved module itself (one module under both names: what one patches, the other
    sees), warning the importer. Its names have no file, so it shadows none."""

    def find_spec(
        self, fullname: str, path: object = None, target: object = None
    ) -> importlib.machinery.ModuleSpec | None:
        prefix, _, name = fullname.partition(".")
        if prefix != __name__ or name not in MOVED:
            return None
        return importlib.machinery.ModuleSpec(fullname, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> None:
        return None  # the default module; `exec_module` puts the moved one in its place

    def exec_module(self, module: types.ModuleType) -> None:
        sys.modules[module.__name__] = importlib.import_module(_moved(module.__name__))

    def get_code(self, fullname: str) -> types.CodeType | None:
        """What `python -m service.cli` runs: the moved module's code."""
        new = _moved(fullname)
        return importlib.util.find_spec(new).loader.get_code(new)


def _moved(fullname: str) -> str:
    new = f"{__name__}.{MOVED[fullname.partition('.')[2]]}"
    warnings.warn(f"{fullname} is deprecated: import {new}", DeprecationWarning, stacklevel=3)
    return new


if not any(isinstance(finder, _MovedPaths) for finder in sys.meta_path):
    sys.meta_path.insert(0, _MovedPaths())  # before any finder of an installed copy that still has the old files
