"""What an engine's response says about each output's routed experts: every response shape parsed in one place.

Pure: plain JSON values (or arrays) in, one `Output` per output out, in output order. `RoutedExpertsRef`
(service.client.refs) is built on this; the network and the decoding of rows stay out of here, except the one
decoder each inline format needs. Each engine's shapes are one parser in `PARSERS`; a response no parser
knows raises `ValueError` naming what was looked for.
"""

from __future__ import annotations

import base64
import io
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote, urlsplit

import numpy as np

from service.spool.vllm_rids import vllm_choice_rid
from service.wire.formats import sglang_wire_dtype

POINTER_PATH = "/routed_experts/"


def split_pointer(url: str) -> tuple[str, str]:
    """`http://h:p[/prefix]/routed_experts/<rid>` → (`http://h:p[/prefix]`, rid); raises ValueError otherwise."""
    parts = urlsplit(url)
    base, sep, tail = parts.path.rpartition(POINTER_PATH)
    if not sep or not tail or "/" in tail:
        raise ValueError(f"{url!r} is not a routed-experts pointer (…/routed_experts/<rid>)")
    return f"{parts.scheme}://{parts.netloc}{base}", unquote(tail)


def sidecar_base(url: str) -> str:
    """A sidecar's base URL from either its base URL or a pointer into it (never doubles the path)."""
    url = url.rstrip("/")
    try:
        return split_pointer(url)[0]
    except ValueError:
        return url


@dataclass(frozen=True, slots=True)
class Inline:
    """Rows a response carried itself. `kind` names the encoding; `data` is what the response held."""

    kind: str  # "sglang_b64": SGLang's base64 of int32 rows; "npy_b64": vLLM's base64 of a .npy file;
    # "array": an array or tensor (in-process engines)
    data: Any
    dtype: str | None = None  # SGLang's `routed_experts_dtype` when the response says it (main); None: int32
    shape: tuple[int, int, int] | None = None  # (rows, slots, topk) when the response says it (the plugin's
    # `routed_experts_shape`): SGLang's flat string then decodes without the model's numbers


@dataclass(frozen=True, slots=True)
class Output:
    """One output (a `/generate` item, an OpenAI choice) as far as routed experts go."""

    rid: str | None
    url: str | None = None
    inline: Inline | None = None
    prompt_len: int | None = None
    rows: int | None = None  # rows the inline payload holds, when the response's token counts say
    aborted: bool = False
    start: int | None = None  # the inline rows' first position, when the response says it (`routed_experts_start_len`)
    weight_version: str | None = None  # SGLang's `meta_info["weight_version"]`: the weights of the last token


# ---- SGLang: /generate (dict, batch list, stream chunks), offline Engine -------------------------------


def _sglang_output(item: dict[str, Any], start_len: int) -> Output:
    meta = item.get("meta_info") or {}
    url = meta.get("routed_experts_url")
    rid = meta.get("id")
    if rid is None and url:
        rid = split_pointer(url)[1]
    shape = _said_shape(meta.get("routed_experts_shape"))
    said_start = meta.get("routed_experts_start_len")
    start = said_start if shape is not None and isinstance(said_start, int) else None
    start_len = start if start is not None else start_len
    prompt, completion = meta.get("prompt_tokens"), meta.get("completion_tokens")
    rows = prompt + completion - 1 - start_len if isinstance(prompt, int) and isinstance(completion, int) else None
    finish = meta.get("finish_reason")
    return Output(
        rid=rid,
        url=url,
        inline=_inline(meta.get("routed_experts"), shape, meta.get("routed_experts_dtype")),
        prompt_len=prompt if isinstance(prompt, int) else None,
        rows=shape[0] if shape is not None else rows,
        aborted=isinstance(finish, dict) and finish.get("type") == "abort",
        start=start,
        weight_version=meta.get("weight_version"),
    )


def _said_shape(value: Any) -> tuple[int, int, int] | None:
    """The plugin's `routed_experts_shape` (`[rows, num_hidden_layers, topk]`), when well formed."""
    if isinstance(value, list | tuple) and len(value) == 3 and all(isinstance(x, int) and x >= 0 for x in value):
        return (value[0], value[1], value[2])
    return None


def _inline(value: Any, shape: tuple[int, int, int] | None = None, dtype: Any = None) -> Inline | None:
    if value is None:
        return None
    if isinstance(value, str):
        return Inline("sglang_b64", value, dtype, shape) if value else None
    return Inline("array", value, shape=shape)  # verl's in-process path with skip_tokenizer_init: a tensor


def parse_sglang_generate(resp: Any, start_len: int) -> list[Output] | None:
    """`/generate` (a dict, or a list for a batch), `Engine.generate`; a list of one rid's stream chunks → the last."""
    if isinstance(resp, dict) and "meta_info" in resp:
        return [_sglang_output(resp, start_len)]
    if isinstance(resp, list) and resp and all(isinstance(x, dict) and "meta_info" in x for x in resp):
        ids = [(x["meta_info"] or {}).get("id") for x in resp]
        if len(resp) > 1 and ids[0] is not None and len(set(ids)) == 1:  # one request's stream chunks
            return [_sglang_output(resp[-1], start_len)]
        return [_sglang_output(x, start_len) for x in resp]
    return None


# ---- SGLang: the OpenAI-compatible endpoints (sglext), plain and streamed -------------------------------


def _openai_outputs(n: int, sglext: dict[str, Any], rids: dict[int, str], usage: dict[str, Any] | None) -> list[Output]:
    urls = sglext.get("routed_experts_urls") or [sglext.get("routed_experts_url")]
    n = max(n, len(urls), max(rids, default=-1) + 1, 1)
    prompt = (usage or {}).get("prompt_tokens")
    out = []
    for i in range(n):
        url = urls[i] if i < len(urls) else None
        rid = split_pointer(url)[1] if url else rids.get(i)
        shape = _said_shape(sglext.get("routed_experts_shape")) if i == 0 else None
        inline = _inline(sglext.get("routed_experts"), shape, sglext.get("routed_experts_dtype")) if i == 0 else None
        start = sglext.get("routed_experts_start_len") if shape is not None else None
        out.append(
            Output(
                rid=rid,
                url=url,
                inline=inline,
                prompt_len=prompt if isinstance(prompt, int) else None,
                rows=shape[0] if shape is not None else None,
                start=start if isinstance(start, int) else None,
            )
        )
    return out


def _is_openai(obj: Any) -> bool:
    return isinstance(obj, dict) and isinstance(obj.get("choices"), list)


def parse_openai(resp: Any, start_len: int) -> list[Output] | None:
    """`/v1/completions`, `/v1/chat/completions`: a response, one streamed chunk, or a stream's chunks / SSE text."""
    del start_len  # the OpenAI shapes carry no per-choice token counts to check rows with
    chunks = _openai_chunks(resp)
    if chunks is None:
        return None
    rids: dict[int, str] = {}
    sglext: dict[str, Any] = {}
    usage = None
    n = 0
    for chunk in chunks:
        for choice in chunk["choices"]:
            index = choice.get("index", 0) if isinstance(choice, dict) else 0
            n = max(n, index + 1)
            if isinstance(chunk.get("id"), str):
                rids.setdefault(index, chunk["id"])
        if isinstance(chunk.get("sglext"), dict):
            sglext = {**sglext, **chunk["sglext"]}
        usage = chunk.get("usage") or usage
    if len(chunks) == 1 and len(chunks[0]["choices"]) > 1:
        rids = {0: rids[0]} if 0 in rids else {}  # a plain response's id is its first choice's rid
    return _openai_outputs(n, sglext, rids, usage)


def _openai_chunks(resp: Any) -> list[dict[str, Any]] | None:
    """The OpenAI objects of a response (itself), a stream's chunks, or its SSE text; None for any other shape."""
    if _is_openai(resp):
        return [resp]
    chunks = _sse_objects(resp) if isinstance(resp, str | bytes) else resp
    if not isinstance(chunks, list) or not chunks or not all(_is_openai(c) for c in chunks):
        return None
    return chunks


def _sse_objects(text: str | bytes) -> list[Any]:
    """The JSON objects of an SSE body (`data: {...}` lines); `[DONE]` and other lines left out."""
    if isinstance(text, bytes):
        text = text.decode()
    return [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]


# ---- vLLM: /v1/completions and /v1/chat/completions (routed experts per choice, base64 .npy) -----------


def _is_vllm(resp: Any) -> bool:
    """vLLM puts `routed_experts` (or the plugin's `routed_experts_url`) on each choice; SGLang uses `sglext`."""
    return (
        _is_openai(resp)
        and "sglext" not in resp
        and any(isinstance(c, dict) and ("routed_experts" in c or "routed_experts_url" in c) for c in resp["choices"])
    )


def parse_vllm_openai(resp: Any, start_len: int) -> list[Output] | None:
    """A vLLM `/v1/completions` or `/v1/chat/completions` response, or its stream (chunks or SSE text) when the
    plugin added its pointer chunk (vLLM's chunks carry no rows)."""
    if not _is_vllm(resp):
        return _parse_vllm_stream(resp)
    choices = sorted(resp["choices"], key=lambda c: c.get("index", 0))
    usage = resp.get("usage") or {}
    prompt, completion = usage.get("prompt_tokens"), usage.get("completion_tokens")
    known = len(choices) == 1 and isinstance(prompt, int) and isinstance(completion, int)
    chat = resp["id"].startswith("chatcmpl-")
    out = []
    for choice in choices:
        url = choice.get("routed_experts_url")
        payload = choice.get("routed_experts")
        out.append(
            Output(
                rid=split_pointer(url)[1] if url else vllm_choice_rid(resp["id"], choice.get("index", 0), len(choices)),
                url=url,
                inline=Inline("npy_b64", payload) if payload else None,
                prompt_len=prompt if isinstance(prompt, int) and (chat or len(choices) == 1) else None,
                rows=prompt + completion - 1 - start_len if known else None,
                aborted=choice.get("finish_reason") == "abort",
            )
        )
    return out


def _parse_vllm_stream(resp: Any) -> list[Output] | None:
    """A stream whose last chunk before `[DONE]` holds the plugin's `routed_experts_urls` (one per choice)."""
    chunks = None if isinstance(resp, dict) else _openai_chunks(resp)  # a stream, never one response
    if chunks is None:
        return None
    pointer = next((c for c in chunks if isinstance(c.get("routed_experts_urls"), list) and "sglext" not in c), None)
    if pointer is None or not isinstance(pointer.get("id"), str):
        return None
    finish = {
        c.get("index", 0): c.get("finish_reason") for chunk in chunks for c in chunk["choices"] if isinstance(c, dict)
    }
    urls = pointer["routed_experts_urls"]
    return [
        Output(
            rid=split_pointer(url)[1] if url else vllm_choice_rid(pointer["id"], k, len(urls)),
            url=url,
            aborted=finish.get(k) == "abort",
        )
        for k, url in enumerate(urls)
    ]


# ---- the parsers, tried in order ---------------------------------------------------------------------

Parser = Callable[[Any, int], list[Output] | None]

PARSERS: list[Parser] = [
    parse_sglang_generate,
    parse_vllm_openai,  # before parse_openai: both are OpenAI shapes; vLLM's carry rows on each choice
    parse_openai,
]


def parse_response(resp: Any, start_len: int = 0) -> list[Output]:
    """One `Output` per output of an engine response, in output order (see `PARSERS` for the shapes)."""
    for parser in PARSERS:
        outputs = parser(resp, start_len)
        if outputs is not None:
            return outputs
    kind = type(resp).__name__
    keys = f" with keys {sorted(resp)[:12]}" if isinstance(resp, dict) else ""
    raise ValueError(
        f"not an engine response this client knows ({kind}{keys}): want a /generate dict or list "
        "(meta_info), an OpenAI completion or chat response or its stream chunks (choices, sglext), or a vLLM "
        "completion or chat response (choices[].routed_experts or routed_experts_url)"
    )


# ---- inline rows ---------------------------------------------------------------------------------------


def decode_inline(
    inline: Inline,
    *,
    rows: int | None,
    num_hidden_layers: int | None,
    topk: int | None,
) -> np.ndarray:
    """The inline rows as `(rows, slots, topk)` in the dtype the engine sent (SGLang: int32, every layer, or the
    `routed_experts_dtype` its response names: SGLang main's `SGLANG_ROUTED_EXPERTS_DTYPE`, uint8 or uint16).

    SGLang's string is flat: its shape is the response's `routed_experts_shape` when it says one (the plugin's
    responses do), else its row width comes from `num_hidden_layers` and `topk`, or one of them and the row
    count the response's token counts give. Raises ValueError saying which to pass when none does.
    """
    if inline.kind == "npy_b64":  # vLLM: the array itself, every layer slot, uint8 or uint16
        return np.load(io.BytesIO(base64.b64decode(inline.data)), allow_pickle=False)
    if inline.shape is not None:  # the response said the shape: the model's numbers are not needed
        rows, num_hidden_layers, topk = inline.shape
    if inline.kind == "sglang_b64":
        flat = np.frombuffer(base64.b64decode(inline.data), dtype=sglang_wire_dtype(inline.dtype))
    elif inline.kind == "array":
        data = inline.data.numpy() if hasattr(inline.data, "numpy") else inline.data
        array = np.asarray(data)
        if array.ndim == 3:
            return array
        flat = array.reshape(-1)
    else:
        raise ValueError(f"inline rows of kind {inline.kind!r}: no decoder")
    return flat.reshape(-1, *_row_shape(flat.size, rows, num_hidden_layers, topk))


def _row_shape(values: int, rows: int | None, layers: int | None, topk: int | None) -> tuple[int, int]:
    if layers is None and topk is not None and rows:
        layers = values // rows // topk
    if topk is None and layers is not None and rows:
        topk = values // rows // layers
    if layers is None or topk is None or not layers or not topk:
        raise ValueError(
            "the inline rows are a flat array: pass the model's num_hidden_layers and topk "
            "(RoutedExpertsRef.from_response(resp, num_hidden_layers=..., topk=...))"
        )
    if values % (layers * topk) or (rows is not None and values != rows * layers * topk):
        raise ValueError(
            f"the inline rows hold {values} values: not {rows if rows is not None else 'whole'} rows of "
            f"{layers} layers x top-{topk}; check num_hidden_layers and topk"
        )
    return layers, topk
