"""Front-door hooks (the main process and tokenizer workers): the `routed_experts_url` pointer in `meta_info`
and in the OpenAI-compatible responses' `sglext`, the shape and start of rows a response carries inline, and
the bounded wait at an offline engine's shutdown for the records responses promised (`promised`).

Bodies of the "pointer" and "inline" rows of `hooks.HOOKS`; what they compute is `frontdoors`' plain functions.
"""

from __future__ import annotations

import logging
import os
from collections.abc import MutableMapping
from contextvars import ContextVar
from functools import partial

from engine_ext.core.settings import EngineSettings, Mode
from engine_ext.sglang import compat, fit, frontdoors
from engine_ext.sglang.delivery import PROCESS
from engine_ext.sglang.promised import Promised
from engine_ext.sglang.worker_app import SGLANG_APP, WORKER_APP


def why_no_pointer(settings: EngineSettings, server_args: object | None = None) -> str | None:
    """Why this launch's responses cannot carry `routed_experts_url` (None: they can, or none is configured).
    `server_args`: the launch's settings where SGLang has not published them yet (the budget check)."""
    from engine_ext.sglang.frontdoors import pointer_unreachable

    if not settings.sidecar_url:  # no pointer anywhere: trainers fetch by rid from a sidecar they know
        return None
    layout = compat.layout()
    if server_args is None:
        workers = compat.read("tokenizer_worker_num")
    else:
        workers = getattr(server_args, "tokenizer_worker_num", 1)
    spawned = layout.granian_spawns_one and getattr(
        compat.read("server_args") if server_args is None else server_args, "enable_http2", False
    )
    return pointer_unreachable(
        tokenizer_worker_num=int(workers or 1),
        rust_server=bool(compat.read("rust_server")),
        granian_worker=layout.version if spawned else None,
    )


def rust_server_note(settings: EngineSettings) -> str | None:
    """What still works under SGLang's Rust front end (`SGLANG_RUST_SERVER`), or None when it is off."""
    from engine_ext.sglang.frontdoors import rust_server_note as note

    return note(bool(compat.read("rust_server")), settings.mode)


def point_workers_here(env_name: str | None, environ: MutableMapping[str, str] = os.environ) -> bool:
    """Have SGLang's tokenizer worker processes (`--tokenizer-worker-num > 1`) import `http_worker`'s app, which
    applies the "inline" hooks there (True); not where this SGLang names no such setting (`env_name` None), nor
    where the launch set it to an app of its own, which it keeps (False, said in the log at start)."""
    if env_name is None:
        return False
    current = environ.get(env_name)
    if current in (None, "", SGLANG_APP, WORKER_APP):
        environ[env_name] = WORKER_APP
        return True
    logging.getLogger("r3_sidecar").warning(
        "r3-sidecar: %s=%s is the launch's own: with --tokenizer-worker-num > 1 the inline rows of responses do "
        "not say their shape and start (routed_experts_shape, routed_experts_start_len)",
        env_name,
        current,
    )
    return False


_pointer_rids: ContextVar[frozenset[str] | None] = ContextVar("r3_pointer_rids", default=None)


_inline_shapes: ContextVar[dict[str, dict] | None] = ContextVar("r3_inline_shapes", default=None)


PROMISED = Promised()


async def _around_handle_batch_output(original, self, recv_obj, *args, **kwargs):
    """Note which rids of this batch get a pointer (the meta_info hook has no `self`): those that asked, less
    those whose rows the spool refused in sidecar mode (`frontdoors.pointer_rids`); and the shape and start of
    each output's inline rows (`frontdoors.inline_shape`)."""
    settings = PROCESS.settings
    states, rids = self.rid_to_state, list(recv_obj.rids)
    asked = [
        (settings is not None and settings.capture_all)
        or ((state := states.get(rid)) is not None and bool(getattr(state.obj, "return_routed_experts", False)))
        for rid in rids
    ]
    mode = frontdoors.pointing_mode(settings.mode, fit.installed().proven) if settings is not None else Mode.OFF
    inline = getattr(recv_obj, "routed_experts", None)
    refused = frontdoors.refused_rids(rids, asked, inline, mode)
    wanted = frontdoors.pointer_rids(rids, asked, refused)
    if settings is not None and settings.sidecar_url:  # their `error` records, for the shutdown wait
        for rid in refused:
            PROMISED.add(rid)
    shapes = _inline_shapes_of(self, list(recv_obj.rids), getattr(recv_obj, "routed_experts", None))
    token, shapes_token = _pointer_rids.set(wanted), _inline_shapes.set(shapes)
    try:
        return await original(self, recv_obj, *args, **kwargs)
    finally:
        _pointer_rids.reset(token)
        _inline_shapes.reset(shapes_token)


def _inline_shapes_of(manager, rids: list[str], inline: list | None, obj=None) -> dict[str, dict]:
    """rid → `meta_info` fields saying the shape and start of the rows this batch carries inline for it (the start
    from the request `obj` when given, else from the request state the manager still holds)."""
    if not inline:
        return {}
    layers, topk = _model_numbers(manager)
    shapes = {}
    for rid, payload in zip(rids, inline, strict=False):
        state = manager.rid_to_state.get(rid) if obj is None else None
        request = obj if obj is not None else getattr(state, "obj", None)
        start = getattr(request, "routed_experts_start_len", 0)
        fields = frontdoors.inline_shape(
            payload, num_hidden_layers=layers, topk=topk, start_len=start if isinstance(start, int) else 0
        )
        if fields:
            shapes[rid] = fields
    return shapes


def _model_numbers(manager) -> tuple[int, int]:
    """(num_hidden_layers, topk) of the served model, off a tokenizer manager: the width of SGLang's inline rows."""
    hf = manager.model_config.hf_text_config
    return int(hf.num_hidden_layers), int(getattr(hf, "num_experts_per_tok", 0) or 0)


def _around_build_out_dict(original, recv_obj, i, meta_info, *args, **kwargs):
    """Runs once per output right after `meta_info` is complete: add `routed_experts_url`, and the shape and
    start of inline rows."""
    from engine_ext.core.records import routed_experts_url

    settings = PROCESS.settings
    wanted = _pointer_rids.get()
    rid = meta_info.get("id") if isinstance(meta_info, dict) else None
    if settings is not None and settings.sidecar_url and wanted is not None and rid in wanted:
        meta_info["routed_experts_url"] = routed_experts_url(settings.sidecar_url, rid)
        PROMISED.add(rid)
    shape = (_inline_shapes.get() or {}).get(rid) if rid is not None else None
    if shape and meta_info.get("routed_experts") is not None:
        meta_info.update(shape)
    return original(recv_obj, i, meta_info, *args, **kwargs)


async def _around_wait_one_response(original, self, obj, *args, **kwargs):
    """Where meta_info is built inline (≤ 0.5.16): add `routed_experts_url` to each response of a request that
    asked, less those whose rows the spool refused in sidecar mode (they still carry the inline payload); and
    the shape and start of inline rows."""
    settings = PROCESS.settings
    asked = settings is not None and bool(settings.sidecar_url)
    asked = asked and (settings.capture_all or bool(getattr(obj, "return_routed_experts", False)))
    async for out in original(self, obj, *args, **kwargs):
        meta = out.get("meta_info") if isinstance(out, dict) else None
        rid = meta.get("id") if isinstance(meta, dict) else None
        if rid is not None:
            _complete_meta(self, obj, meta, rid, settings if asked else None)
        yield out


def _complete_meta(manager, obj, meta: dict, rid: str, pointing: EngineSettings | None) -> None:
    """One response's `meta_info`: where `pointing`, its pointer (unless its rows were refused: they are inline)
    and its record noted for the shutdown wait; the shape and start of its inline rows."""
    from engine_ext.core.records import routed_experts_url

    if pointing is not None:
        mode = frontdoors.pointing_mode(pointing.mode, fit.installed().proven)
        refused = rid in frontdoors.refused_rids([rid], [True], [meta.get("routed_experts")], mode)
        if not refused:
            meta["routed_experts_url"] = routed_experts_url(pointing.sidecar_url, rid)
        PROMISED.add(rid)  # a pointer's record, or the refused rows' `error` record
    if meta.get("routed_experts") is not None:
        meta.update(_inline_shapes_of(manager, [rid], [meta["routed_experts"]], obj).get(rid) or {})


def _around_engine_shutdown(original, self, *args, **kwargs):
    """`sglang.Engine.shutdown` kills the scheduler (SIGKILL): first let the records that this process's responses
    promised become final, for at most `R3_SHUTDOWN_WAIT_S` (`sglang.promised`)."""
    settings = PROCESS.settings
    if settings is not None and settings.sidecar_url and settings.mode is not Mode.OFF:
        PROMISED.settle(settings.spool_dir, settings.shutdown_wait_s)
    return original(self, *args, **kwargs)


_sglext_models: dict[type, type] = {}


def _with_pointer_model(response_cls: type) -> type:
    """`response_cls` whose `sglext` also has `routed_experts_url(s)` (SGLang's `SglExt` drops unknown fields)."""
    cls = _sglext_models.get(response_cls)
    if cls is None:
        from typing import Optional

        from pydantic import create_model
        from sglang.srt.entrypoints.openai.protocol import SglExt

        ext = _sglext_models.get(SglExt)
        if ext is None:
            ext = create_model(
                "SglExt",
                __base__=SglExt,
                routed_experts_url=(Optional[str], None),  # noqa: UP045 (pydantic field spelling)
                routed_experts_urls=(Optional[list[Optional[str]]], None),  # noqa: UP045
                routed_experts_shape=(Optional[list[int]], None),  # noqa: UP045
                routed_experts_start_len=(Optional[int], None),  # noqa: UP045
            )
            _sglext_models[SglExt] = ext
        cls = create_model(response_cls.__name__, __base__=response_cls, sglext=(Optional[ext], None))  # noqa: UP045
        _sglext_models[response_cls] = cls
    return cls


def _around_openai_response(original, self, request, ret, *args, **kwargs):
    """Non-streaming `/v1/completions`, `/v1/chat/completions`: copy the choices' pointers into `sglext`, and the
    shape and start of the first choice's inline rows (upstream's `sglext.routed_experts`)."""
    response = original(self, request, ret, *args, **kwargs)
    from sglang.srt.entrypoints.openai.protocol import SglExt

    urls = [(item.get("meta_info") or {}).get("routed_experts_url") for item in ret]
    pointer = frontdoors.sglext_pointer(urls) or {}
    old = getattr(response, "sglext", None)
    if old is not None and getattr(old, "routed_experts", None) is not None and ret:
        first = ret[0].get("meta_info") or {}
        pointer |= {k: first[k] for k in ("routed_experts_shape", "routed_experts_start_len") if k in first}
    if not pointer or not hasattr(response, "sglext"):  # an ORJSONResponse (e.g. return_meta_info)
        return response
    cls = _with_pointer_model(type(response))
    ext_cls = _sglext_models[SglExt]
    old = response.sglext
    fields = {name: getattr(old, name) for name in SglExt.model_fields} if old is not None else {}
    values = {name: getattr(response, name) for name in type(response).model_fields}
    values["sglext"] = ext_cls(**fields, **pointer)
    return cls.model_construct(**values)


async def _around_openai_stream(original, self, adapted_request, request, raw_request, *args, **kwargs):
    """Streaming `/v1/completions`, `/v1/chat/completions`: the choices' pointers in an `sglext` chunk, and the
    shape and start of the inline rows in the chunk that carries them (SGLang's own `sglext` chunk)."""
    settings = PROCESS.settings
    stream = None
    if settings is not None and (getattr(request, "return_routed_experts", False) or settings.capture_all):
        layers, topk = _model_numbers(self.tokenizer_manager)
        start = getattr(request, "routed_experts_start_len", 0)
        stream = frontdoors.PointerStream(
            base_url=settings.sidecar_url,
            n=int(getattr(request, "n", 1) or 1),
            object_name="chat.completion.chunk" if hasattr(request, "messages") else "text_completion",
            model=getattr(request, "model", None),
            shape_of=partial(
                frontdoors.inline_shape,
                num_hidden_layers=layers,
                topk=topk,
                start_len=start if isinstance(start, int) else 0,
            ),
        )
    async for chunk in original(self, adapted_request, request, raw_request, *args, **kwargs):
        if stream is None:
            yield chunk
            continue
        for piece in stream.feed(chunk):  # fails: the guard passes this chunk and the rest on as SGLang made them
            yield piece
