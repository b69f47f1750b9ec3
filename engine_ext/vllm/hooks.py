"""The one module that names vLLM internals: the hook table, the patcher, and what each hook reads.

vLLM has no hook registry, so the table below is applied here: each row wraps one attribute of a vLLM class
(an AROUND hook, `hook(original, self, *args, **kwargs)`), once per process, and marks it so a second
`install` changes nothing. Every hook reads vLLM's objects into plain values and calls `spooler` (no vLLM
there); an error in a hook is logged once per place and vLLM's own path goes on.

All rows act in the API server process. vLLM (0.32) loads general plugins in the engine core and worker too,
so `install` wraps only the first row there (the API server's engine client, `AsyncLLM`, is never built in
those processes); building it wraps the others, whose modules the API server imports anyway.

    from engine_ext.vllm import hooks
    for hook in hooks.HOOKS: print(hook.target, hook.function)
"""

from __future__ import annotations

import atexit
import functools
import importlib
import inspect
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from engine_ext.core.build_check import BuildMismatch
from engine_ext.core.degraded import DEGRADED
from engine_ext.core.records import Finished, ModelShape, moe_layer_ids
from engine_ext.core.settings import EngineSettings
from engine_ext.vllm.fit import Plan
from engine_ext.vllm.spooler import Spooler, status_of
from engine_ext.vllm.versions import MATRIX, SUPPORTED_VLLM, Release, release
from service.spool.vllm_rids import record_rid, vllm_choice_rid

log = logging.getLogger("r3_sidecar.vllm")

_OP = "vllm.v1.engine.output_processor"
_SERVING = "vllm.entrypoints.openai"


@dataclass(frozen=True)
class Hook:
    """One row: the class attribute wrapped (`module:Class.attribute`) and the function of this module around it."""

    target: str
    function: str


HOOKS: tuple[Hook, ...] = (
    # the API server's engine client: model shape and the client index, once (builds the Spooler)
    Hook("vllm.v1.engine.async_llm:AsyncLLM.__init__", "_around_async_llm_init"),
    # each request's routed_experts_prompt_start, kept on its state for the record's `start`
    Hook(f"{_OP}:OutputProcessor.add_request", "_around_add_request"),
    # a finished (or aborted) request's joined rows: the record; sidecar mode drops them from the output
    Hook(f"{_OP}:RequestState._new_completion_output", "_around_completion_output"),
    # `routed_experts_url` on each choice whose record the spool accepted
    Hook(f"{_SERVING}.completion.serving:OpenAIServingCompletion.request_output_to_completion_response", "_pointers"),
    Hook(f"{_SERVING}.chat_completion.serving:OpenAIServingChat.chat_completion_full_generator", "_apointers"),
    # streams: one last chunk before `data: [DONE]` with `routed_experts_urls` (choices: [])
    Hook(f"{_SERVING}.completion.serving:OpenAIServingCompletion.completion_stream_generator", "_stream_pointers"),
    Hook(f"{_SERVING}.chat_completion.serving:OpenAIServingChat.chat_completion_stream_generator", "_stream_pointers"),
)

_settings: EngineSettings | None = None
_vllm_version = ""
_release: Release = MATRIX[SUPPORTED_VLLM[-1]]  # `install` sets the running vLLM's row
_plan: Plan | None = None  # `install` sets the build's plan: the row applied, proven or not
SPOOLER: Spooler | None = None
_failed: set[str] = set()


def install(settings: EngineSettings, vllm_version: str, plan: Plan | None = None) -> None:
    """Wrap the first row of `HOOKS`; the API server's `AsyncLLM` wraps the rest and builds the Spooler. `plan`:
    the row the build fits (`fit.plan`; None: its own release's), and whether a test proved that build."""
    global _settings, _vllm_version, _release, _plan
    _settings, _vllm_version = settings, vllm_version
    _plan = plan
    _release = plan.row if plan is not None and plan.row is not None else release(vllm_version) or _release
    _wrap(HOOKS[0])


def _wrap(hook: Hook) -> None:
    module_name, _, path = hook.target.partition(":")
    cls_name, attr = path.split(".")
    cls = getattr(importlib.import_module(module_name), cls_name)
    original = cls.__dict__[attr]
    if getattr(original, "_r3_hook", False):
        return
    around = globals()[hook.function]
    if inspect.isasyncgenfunction(original):

        @functools.wraps(original)
        async def wrapper(*args: Any, **kwargs: Any) -> Any:
            async for item in around(original, *args, **kwargs):
                yield item
    elif inspect.iscoroutinefunction(original):

        @functools.wraps(original)
        async def wrapper(*args: Any, **kwargs: Any) -> Any:
            return await around(original, *args, **kwargs)
    else:

        @functools.wraps(original)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            return around(original, *args, **kwargs)

    wrapper._r3_hook = True  # type: ignore[attr-defined]
    setattr(cls, attr, wrapper)


def _contained(where: str, fn: Callable[[], Any]) -> Any:
    """Run `fn`; an error is logged once per place and vLLM goes on without the plugin's part."""
    try:
        return fn()
    except Exception:
        if where not in _failed:
            _failed.add(where)
            log.exception("r3-sidecar: %s failed; vLLM's own path goes on", where)
        return None


# ---- hooks -----------------------------------------------------------------------------------------


def capture_enabled(vllm_config: Any, flag: str | None = None) -> bool:
    """`--enable-return-routed-experts`, where this vLLM keeps it (`Release.capture_flag`: `model_config` on
    Model Runner V1's releases, `aux_output_config` since the AuxOutput connector)."""
    value: Any = vllm_config
    for name in (flag or _release.capture_flag).split("."):
        value = getattr(value, name, None)
    return bool(value)


def experts_and_topk(model_config: Any, shape_from: str | None = None) -> tuple[int, int]:
    """Experts and top-k as this vLLM's own capturer reads them (`Release.shape_from`)."""
    where = shape_from or _release.shape_from
    if where == "model_config":
        return int(model_config.get_num_experts()), int(model_config.get_num_experts_per_tok())
    capturer = importlib.import_module(where)
    hf = model_config.hf_text_config
    return int(capturer.get_num_experts(hf)), int(capturer._get_num_experts_per_tok(hf))


def model_shape(model_config: Any) -> ModelShape:
    """Experts, top-k and layers from vLLM's model config; MoE layers from the HF config's dense-layer fields."""
    hf = model_config.hf_text_config
    num_layers = int(model_config.get_total_num_hidden_layers())
    num_experts, topk = experts_and_topk(model_config)
    return ModelShape(
        num_experts=num_experts,
        topk=topk,
        num_hidden_layers=num_layers,
        layers=moe_layer_ids(
            num_layers,
            first_k_dense=int(getattr(hf, "first_k_dense_replace", 0) or 0),
            sparse_step=int(getattr(hf, "decoder_sparse_step", 1) or 1),
            mlp_only=getattr(hf, "mlp_only_layers", None) or (),
        ),
    )


def _around_async_llm_init(original: Callable[..., Any], self: Any, *args: Any, **kwargs: Any) -> Any:
    result = original(self, *args, **kwargs)
    _contained("starting the spool writer", lambda: _start(self.vllm_config, kwargs.get("client_index", 0)))
    return result


def _start(vllm_config: Any, client_index: int) -> None:
    global SPOOLER
    if SPOOLER is not None or _settings is None:
        return
    if not capture_enabled(vllm_config):
        log.info("r3-sidecar: vLLM runs without --enable-return-routed-experts: nothing to capture")
        return
    for hook in HOOKS[1:]:
        _wrap(hook)
    engine = f"{_settings.engine_id}/api{client_index}"
    proven = _plan is None or _plan.proven
    SPOOLER = Spooler(
        _settings, model_shape(vllm_config.model_config), engine=engine, vllm=_vllm_version, row=_release.version,
        proven=proven, why="" if _plan is None else _plan.why(),
    )  # fmt: skip
    atexit.register(SPOOLER.close)
    log.info(
        "r3-sidecar: vLLM routed experts to the spool %s (R3_MODE=%s, engine %s)",
        _settings.spool_dir,
        _settings.mode,
        engine,
    )


def _around_add_request(original: Callable[..., Any], self: Any, request: Any, *args: Any, **kwargs: Any) -> Any:
    result = original(self, request, *args, **kwargs)
    if SPOOLER is not None:
        state = self.request_states.get(request.request_id)
        params = getattr(request, "sampling_params", None)
        if state is not None and params is not None:
            state._r3_start = int(getattr(params, "routed_experts_prompt_start", 0) or 0)
    return result


def _around_completion_output(original: Callable[..., Any], self: Any, *args: Any, **kwargs: Any) -> Any:
    output = original(self, *args, **kwargs)
    if SPOOLER is not None and output.finish_reason is not None:
        keep = _contained("writing a finished request's record", lambda: _deliver(self, output))
        if keep is False:
            output.routed_experts = None
    return output


def _deliver(state: Any, output: Any) -> bool:
    """The Spooler's decision for one finished request; a build check that disagrees keeps vLLM's rows, and
    vLLM's own path from then on (`_step_aside`)."""
    assert SPOOLER is not None
    try:
        return SPOOLER.finish(_finished(state, output))
    except BuildMismatch as exc:
        _step_aside(HOOKS[2], exc)
        return True


def _step_aside(hook: Hook, error: BaseException) -> None:
    """The plugin's own code disagrees with vLLM on a build no test ran: it takes nothing over in this process
    from now on (no records, no pointers; vLLM's inline rows stay), loudly: one ERROR line, the engine file's
    `degraded` (`r3_engine_degraded_hooks_total`, `R3EngineDegraded`) and `delivery.inline_kept`."""
    if SPOOLER is not None:
        SPOOLER.step_aside(f"{type(error).__name__}: {error}")
    if DEGRADED.note(hook.function, hook.target, error):
        log.error(
            "r3-sidecar: hook %s (%s) failed: %s: %s; r3-sidecar steps aside in this process: vLLM's own inline "
            "routed_experts, no records (degraded)",
            hook.function,
            hook.target,
            type(error).__name__,
            error,
            exc_info=(type(error), error, error.__traceback__),  # the traceback R3EngineDegraded sends readers to
        )


def _finished(state: Any, output: Any) -> Finished:
    """A finished `RequestState` and its `CompletionOutput` as plain values."""
    parent = state.parent_req
    return Finished(
        rid=record_rid(state.external_req_id, state.request_index, parent.n) if parent else state.external_req_id,
        rows=output.routed_experts,
        start=getattr(state, "_r3_start", 0),
        prompt_len=int(state.prompt_len),
        status=status_of(output.finish_reason),
    )


def _attach(response: Any) -> None:
    """Set `routed_experts_url` on each choice of a built response whose record the spool accepted."""
    if SPOOLER is None or not getattr(response, "choices", None) or not isinstance(response.id, str):
        return
    for choice in response.choices:
        url = SPOOLER.pointer(vllm_choice_rid(response.id, choice.index, len(response.choices)))
        if url is not None:
            choice.routed_experts_url = url  # the response models allow extra fields


def _pointers(original: Callable[..., Any], self: Any, final_res_batch: Any, request: Any, *a: Any, **kw: Any) -> Any:
    response = original(self, final_res_batch, request, *a, **kw)
    _contained("attaching pointers", lambda: _attach(response))
    return response


async def _stream_pointers(original: Callable[..., Any], *args: Any, **kwargs: Any) -> AsyncIterator[str]:
    """vLLM's SSE chunks as they are; before `data: [DONE]`, one chunk with each choice's pointer (or null)."""
    bound = inspect.signature(original).bind(*args, **kwargs).arguments
    request, response_id = bound["request"], bound["request_id"]
    choices = int(getattr(request, "n", 1) or 1) * int(bound.get("num_prompts", 1) or 1)
    async for chunk in original(*args, **kwargs):
        if isinstance(chunk, str) and chunk.startswith("data: [DONE]") and SPOOLER is not None:
            extra = _contained("attaching stream pointers", lambda: _pointer_chunk(bound, response_id, choices))
            if extra:
                yield extra
        yield chunk


def _pointer_chunk(bound: dict[str, Any], response_id: str, choices: int) -> str | None:
    assert SPOOLER is not None
    urls = [SPOOLER.pointer(vllm_choice_rid(response_id, k, choices)) for k in range(choices)]
    if not any(urls):
        return None
    chat = response_id.startswith("chatcmpl-")
    body = {
        "id": response_id,
        "object": "chat.completion.chunk" if chat else "text_completion",
        "created": bound.get("created_time", int(time.time())),
        "model": bound.get("model_name"),
        "choices": [],
        "routed_experts_urls": urls,
    }
    return f"data: {json.dumps(body, separators=(',', ':'))}\n\n"


async def _apointers(original: Callable[..., Any], self: Any, request: Any, *args: Any, **kwargs: Any) -> Any:
    response = await original(self, request, *args, **kwargs)
    _contained("attaching pointers", lambda: _attach(response))
    return response
