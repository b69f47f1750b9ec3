"""Contract 4 against real sidecars: every SGLang response shape → refs → the record's rows.

Two sidecars (threaded uvicorn on 127.0.0.1), each over its own real spool, stand for two pods. The response shapes
are built with the engine's own code (`engine_ext.sglang.frontdoors`, `engine_ext.core.records.routed_experts_url`),
and SGLang's inline string is the sidecar's `format=sglang_b64`, itself tested byte-identical to SGLang 0.5.23's
encoder (tests/engine/sglang/test_sglang_layout.py). What a response says without a sidecar to ask (a pointer's
parts, the shape stated beside inline rows) is `test_engine_responses.py`'s.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import pickle
from collections.abc import Iterator

import httpx
import numpy as np
import pytest
from helpers import live_server, random_rows

from engine_ext.core.records import routed_experts_url
from engine_ext.sglang.frontdoors import PointerStream, inline_shape, sglext_pointer
from service.client import R3Error, RoutedExperts, RoutedExpertsClient, RoutedExpertsRef, afetch_many, fetch_many
from service.client.errors import BadRequest, RangeNotSatisfiable, RecordNotFound
from service.client.refs import AsyncSidecarPool, SidecarPool
from service.server.settings import Settings
from service.spool import Spool

LAYERS = (1, 2, 4)  # MoE layers of a 6-layer model: 0, 3 and 5 are dense
HIDDEN = 6
TOPK = 4


def put(spool: Spool, rid: str, rows: int, *, start: int = 0, seed: int = 0) -> np.ndarray:
    array = random_rows(rows, len(LAYERS), TOPK, 64, seed).astype(np.uint8)  # true routes: the client checks
    writer = spool.writer(
        rid,
        num_experts=64,
        topk=TOPK,
        layers=LAYERS,
        start=start,
        prompt_len=start + rows // 2,
        engine="t/dp0",
        num_hidden_layers=HIDDEN,
    )
    writer.append(array)
    writer.finalize()
    return array


def sglang_layout(array: np.ndarray) -> np.ndarray:
    out = np.zeros((len(array), HIDDEN, TOPK), dtype=np.int32)
    out[:, list(LAYERS), :] = array
    return out


@pytest.fixture(scope="module")
def pods(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[tuple[str, Spool]]]:
    """Two sidecars, each over its own spool: (base URL, spool) per pod."""
    spools = [Spool(tmp_path_factory.mktemp(f"pod{i}")) for i in range(2)]
    with live_server(Settings(spool_dir=spools[0].root)) as a, live_server(Settings(spool_dir=spools[1].root)) as b:
        yield [(a, spools[0]), (b, spools[1])]


@pytest.fixture(scope="module")
def pool() -> Iterator[SidecarPool]:
    with SidecarPool(timeout=10, retries=1, backoff_s=0.01) as p:
        yield p


def generate_response(url: str | None, rid: str, *, prompt: int, completion: int, inline: str | None = None) -> dict:
    """`/generate`'s JSON as SGLang 0.5.23 with the plugin builds it (meta_info of one output)."""
    meta = {"id": rid, "prompt_tokens": prompt, "completion_tokens": completion, "finish_reason": {"type": "length"}}
    if url is not None:
        meta["routed_experts_url"] = routed_experts_url(url, rid)
    if inline is not None:
        meta["routed_experts"] = inline
    return {"text": "…", "output_ids": [1, 2], "meta_info": meta}


def b64_of(base: str, rid: str) -> str:
    return httpx.get(f"{base}/routed_experts/{rid}", params={"format": "sglang_b64"}).text


# ---- pointers --------------------------------------------------------------------------------------------


def test_a_client_built_from_a_pointer_never_doubles_the_path(pods) -> None:
    base, spool = pods[0]
    array = put(spool, "pointer/rid", 9)
    pointer = routed_experts_url(base, "pointer/rid")
    with RoutedExpertsClient(pointer) as client:  # the README's old snippet: the pointer as the base URL
        assert client.base_url == base
        np.testing.assert_array_equal(client.get("pointer/rid").array, array)


# ---- /generate ---------------------------------------------------------------------------------------------


def test_generate_dict_pointer(pods, pool: SidecarPool) -> None:
    base, spool = pods[0]
    array = put(spool, "gen-1", 30, start=0)
    (ref,) = RoutedExpertsRef.from_response(generate_response(base, "gen-1", prompt=16, completion=15))
    assert (ref.rid, ref.sidecar, ref.inline) == ("gen-1", base, None)
    r = ref.fetch(pool=pool)
    assert isinstance(r, RoutedExperts) and r.layers == LAYERS and r.num_hidden_layers == HIDDEN
    np.testing.assert_array_equal(r.array, array)
    np.testing.assert_array_equal(ref.fetch(start=5, end=9, layers=[4], pool=pool).array, array[5:9, [2]])


def test_generate_batch_list_one_batch_request_per_sidecar(pods, pool: SidecarPool, monkeypatch) -> None:
    (a, spool_a), (b, spool_b) = pods
    arrays = [put(spool_a, "batch-0", 10, seed=1), put(spool_b, "batch-1", 11, seed=2), put(spool_a, "batch-2", 12)]
    resp = [
        generate_response(a, "batch-0", prompt=5, completion=6),
        generate_response(b, "batch-1", prompt=5, completion=7),
        generate_response(a, "batch-2", prompt=5, completion=8),
    ]
    refs = RoutedExpertsRef.from_response(resp)
    assert [r.rid for r in refs] == ["batch-0", "batch-1", "batch-2"]
    calls: list[tuple[str, list[str]]] = []
    real = RoutedExpertsClient.get_many

    def counted(self, rids, *args, **kwargs):
        calls.append((self.base_url, [item.rid for item in rids]))
        return real(self, rids, *args, **kwargs)

    monkeypatch.setattr(RoutedExpertsClient, "get_many", counted)
    got = fetch_many(refs, pool=pool)
    assert sorted(calls) == sorted([(a, ["batch-0", "batch-2"]), (b, ["batch-1"])])
    for r, want in zip(got, arrays, strict=True):
        np.testing.assert_array_equal(r.array, want)


def test_generate_stream_chunks_use_the_last(pods, pool: SidecarPool) -> None:
    base, spool = pods[1]
    array = put(spool, "gen-stream", 7)
    chunks = [generate_response(base, "gen-stream", prompt=4, completion=k) for k in (1, 2, 4)]
    (ref,) = RoutedExpertsRef.from_response(chunks)
    assert ref.rows == 4 + 4 - 1
    np.testing.assert_array_equal(ref.fetch(pool=pool).array, array)


# ---- inline rows: decoded here, no request ------------------------------------------------------------------


def test_inline_rows_decode_without_a_request(pods) -> None:
    base, spool = pods[0]
    array = put(spool, "inline-1", 23, start=3)
    text = b64_of(base, "inline-1")
    dead = "http://127.0.0.1:9"  # nothing listens: a request would fail
    resp = generate_response(dead, "inline-1", prompt=12, completion=15, inline=text)  # 12 + 15 - 1 - 3 = 23 rows
    (ref,) = RoutedExpertsRef.from_response(resp, start_len=3, num_hidden_layers=HIDDEN)
    r = ref.fetch()
    assert (r.start, r.rows, r.dtype, r.layers, r.prompt_len) == (3, 23, "int32", tuple(range(HIDDEN)), 12)
    np.testing.assert_array_equal(r.array, sglang_layout(array))
    np.testing.assert_array_equal(r.to_sglang_layout(), sglang_layout(array))
    # the same keywords as a fetch, with the sidecar's rules
    cut = ref.fetch(start=5, end=9, layers="2-4")
    assert (cut.start, cut.layers) == (5, (2, 3, 4))
    np.testing.assert_array_equal(cut.array, sglang_layout(array)[2:6, 2:5])
    clamped = ref.fetch(start=20, end=40, clamp=True)
    assert clamped.clamped and (clamped.start, clamped.end) == (20, 26)
    with pytest.raises(RangeNotSatisfiable):
        ref.fetch(start=0)
    with pytest.raises(BadRequest) as bad:
        ref.fetch(layers=[9])
    assert bad.value.status == 422 and "9" in bad.value.detail
    # the row count from the token counts shapes the flat string from topk alone, too
    (by_topk,) = RoutedExpertsRef.from_response(resp, start_len=3, topk=TOPK)
    np.testing.assert_array_equal(by_topk.fetch().array, sglang_layout(array))
    assert asyncio.run(ref.afetch(start=4)).start == 4


def said(text: str, start: int) -> dict:
    """The meta_info fields the plugin adds beside inline rows (the engine's own `frontdoors.inline_shape`)."""
    fields = inline_shape(text, num_hidden_layers=HIDDEN, topk=TOPK, start_len=start)
    assert fields is not None
    return fields


@pytest.mark.parametrize("pointer", [False, True], ids=["inline-only", "inline+pointer"])
def test_inline_rows_that_say_their_shape_need_no_model_numbers(pods, pointer: bool) -> None:
    """Mirror mode (rows and pointer) and a refused spool (rows only): `from_response(resp)[0].fetch()` as written,
    a continuation (start 9) through the same call, slime's `fetch(start=routed_experts_start_len)` included."""
    base, spool = pods[0]
    whole = put(spool, "said-1", 20, seed=5)
    cont = put(spool, "said-2", 11, start=9, seed=6)
    dead = "http://127.0.0.1:9"  # nothing listens: a request would fail
    for rid, array, start, prompt, completion in (("said-1", whole, 0, 8, 13), ("said-2", cont, 9, 15, 6)):
        text = b64_of(base, rid)
        resp = generate_response(dead if pointer else None, rid, prompt=prompt, completion=completion, inline=text)
        resp["meta_info"].update(said(text, start))
        assert resp["meta_info"]["routed_experts_shape"] == [len(array), HIDDEN, TOPK]
        r = RoutedExpertsRef.from_response(resp)[0].fetch()
        assert (r.start, r.rows, r.layers) == (start, len(array), tuple(range(HIDDEN)))
        np.testing.assert_array_equal(r.array, sglang_layout(array))
        again = RoutedExpertsRef.from_response(resp)[0].fetch(start=start, wait=60)
        np.testing.assert_array_equal(again.array, r.array)
        assert asyncio.run(RoutedExpertsRef.from_response(resp)[0].afetch(start=start)).start == start
    # the OpenAI doors: the first choice's rows in sglext say the same
    text = b64_of(base, "said-2")
    resp = {"id": "said-2", "object": "text_completion", "choices": [{"index": 0, "text": ""}]}
    resp["sglext"] = {"routed_experts": text, **said(text, 9)}
    r = RoutedExpertsRef.from_response(resp)[0].fetch(start=9)
    assert (r.start, r.rows) == (9, len(cont))


def test_in_process_tensor_payload(pods) -> None:
    """verl's in-process path (skip_tokenizer_init) hands meta_info["routed_experts"] over as an array."""
    array = sglang_layout(random_rows(5, len(LAYERS), TOPK, 64, seed=3).astype(np.uint8))
    (ref,) = RoutedExpertsRef.from_response(
        {"meta_info": {"id": "t", "routed_experts": array.reshape(5, -1)}}, num_hidden_layers=HIDDEN, topk=TOPK
    )
    np.testing.assert_array_equal(ref.fetch().array, array)


# ---- OpenAI-compatible endpoints ------------------------------------------------------------------------


@pytest.mark.parametrize("obj", ["text_completion", "chat.completion"])
def test_openai_response_one_ref_per_choice(pods, pool: SidecarPool, obj: str) -> None:
    base, spool = pods[1]
    arrays = [put(spool, f"oa-{obj}-{i}", 8 + i, seed=i) for i in range(3)]
    rids = [f"oa-{obj}-{i}" for i in range(3)]
    inline = b64_of(base, rids[0])  # mirror mode: SGLang's own first-choice rows beside the pointers
    sglext = {"routed_experts": inline, **sglext_pointer([routed_experts_url(base, r) for r in rids])}
    choice = {"text": "…"} if obj == "text_completion" else {"message": {"role": "assistant", "content": "…"}}
    resp = {
        "id": rids[0],
        "object": obj,
        "choices": [{"index": i, **choice, "finish_reason": "length"} for i in (2, 0, 1)],  # any order
        "usage": {"prompt_tokens": 5, "completion_tokens": 30},
        "sglext": sglext,
    }
    refs = RoutedExpertsRef.from_response(resp, num_hidden_layers=HIDDEN, topk=TOPK)
    assert [r.rid for r in refs] == rids
    assert refs[0].inline is not None and refs[1].inline is None and refs[2].inline is None
    got = fetch_many(refs, pool=pool)
    np.testing.assert_array_equal(got[0].array, sglang_layout(arrays[0]))  # inline: SGLang's layout
    for r, want in zip(got[1:], arrays[1:], strict=True):
        np.testing.assert_array_equal(r.array, want)
        np.testing.assert_array_equal(r.to_sglang_layout(), sglang_layout(want))


def _sse(stream: PointerStream, chunks: list[dict]) -> str:
    out: list[str] = []
    for c in chunks:
        out += stream.feed(f"data: {json.dumps(c)}\n\n")
    out += stream.feed("data: [DONE]\n\n")
    return "".join(out)


@pytest.mark.parametrize("obj", ["text_completion", "chat.completion.chunk"])
def test_openai_stream_n2(pods, pool: SidecarPool, obj: str) -> None:
    base, spool = pods[0]
    rids = [f"st-{obj}-a", f"st-{obj}-b"]
    arrays = [put(spool, rid, 6 + i, seed=i) for i, rid in enumerate(rids)]
    stream = PointerStream(base_url=base, n=2, object_name=obj, model="m")
    delta = (lambda t: {"text": t}) if obj == "text_completion" else (lambda t: {"delta": {"content": t}})
    chunks = [
        {"id": rids[i % 2], "object": obj, "choices": [{"index": i % 2, **delta("x"), "finish_reason": None}]}
        for i in range(6)
    ]
    text = _sse(stream, chunks)
    objects = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]
    for resp in (text, text.encode(), objects, objects[-1]):  # SSE text, its chunks, the final sglext chunk alone
        refs = RoutedExpertsRef.from_response(resp)
        assert [r.rid for r in refs] == rids, resp
        for r, want in zip(fetch_many(refs, pool=pool), arrays, strict=True):
            np.testing.assert_array_equal(r.array, want)


# ---- async, errors, size ------------------------------------------------------------------------------


def test_afetch_and_afetch_many_match_the_blocking_path(pods) -> None:
    (a, spool_a), (b, spool_b) = pods
    arrays = [put(spool_a, "as-0", 13, seed=4), put(spool_b, "as-1", 14, seed=5)]
    refs = RoutedExpertsRef.from_response(
        [generate_response(a, "as-0", prompt=4, completion=10), generate_response(b, "as-1", prompt=4, completion=11)]
    )

    async def main() -> tuple[RoutedExperts, list]:
        async with AsyncSidecarPool(timeout=10) as pool:
            one = await refs[1].afetch(layers=[1, 4], pool=pool)
            many = await afetch_many(refs, start=2, pool=pool)
            return one, many

    one, many = asyncio.run(main())
    np.testing.assert_array_equal(one.array, arrays[1][:, [0, 2]])
    for r, want in zip(many, arrays, strict=True):
        assert r.start == 2
        np.testing.assert_array_equal(r.array, want[2:])


def test_default_pools(pods) -> None:
    from service.client.refs import aclose_clients, close_clients

    base, spool = pods[0]
    array = put(spool, "dflt", 5)
    (ref,) = RoutedExpertsRef.from_response(generate_response(base, "dflt", prompt=3, completion=3))
    np.testing.assert_array_equal(ref.fetch().array, array)
    np.testing.assert_array_equal(fetch_many([ref])[0].array, array)
    close_clients()

    async def main() -> RoutedExperts:
        try:
            return (await afetch_many([ref]))[0]
        finally:
            await aclose_clients()

    np.testing.assert_array_equal(asyncio.run(main()).array, array)


def test_errors_raise_or_come_back_in_place(pods, pool: SidecarPool) -> None:
    base, spool = pods[0]
    array = put(spool, "err-ok", 5)
    refs = RoutedExpertsRef.from_response(
        [
            generate_response(base, "err-ok", prompt=3, completion=3),
            generate_response(base, "err-no", prompt=3, completion=3),
        ]
    )
    with pytest.raises(RecordNotFound):
        fetch_many(refs, pool=pool)
    ok, missing = fetch_many(refs, pool=pool, return_errors=True)
    np.testing.assert_array_equal(ok.array, array)
    assert isinstance(missing, RecordNotFound) and missing.rid == "err-no"
    (bare,) = RoutedExpertsRef.from_response({"meta_info": {"id": "nothing"}})
    with pytest.raises(R3Error, match="neither rows nor a pointer"):
        bare.fetch()
    with pytest.raises(ValueError, match="not an engine response"):
        RoutedExpertsRef.from_response({"foo": 1})


@pytest.mark.parametrize("tokens", [8192, 32768])
def test_a_pointer_ref_pickles_small(tokens: int) -> None:
    resp = generate_response("http://pod-17.r3.svc:8000", "3f2a" * 8, prompt=tokens // 2, completion=tokens // 2)
    (ref,) = RoutedExpertsRef.from_response(resp, num_hidden_layers=48, topk=8)
    size = len(pickle.dumps(ref))
    assert size < 600, size  # the rows would be tokens x 48 x 8 bytes (3 MB at 8k) even as uint8
    assert pickle.loads(pickle.dumps(ref)) == ref


def test_without_inline_keeps_the_pointer(pods) -> None:
    base, _ = pods[0]
    resp = generate_response(base, "wi", prompt=3, completion=3, inline="AAAA")
    (ref,) = RoutedExpertsRef.from_response(resp)
    small = ref.without_inline()
    assert small.inline is None and small.url == ref.url
    assert len(pickle.dumps(small)) < len(pickle.dumps(ref))


# ---- both clients alike ------------------------------------------------------------------------------------


def _public(cls: type) -> set[str]:
    return {n for n in dir(cls) if not n.startswith("_") and callable(getattr(cls, n))}


def test_both_clients_have_the_same_public_methods() -> None:
    from service.client import AsyncRoutedExpertsClient

    closing = {"close": "aclose"}  # the only rename: asyncio's convention for a coroutine close
    assert {closing.get(n, n) for n in _public(RoutedExpertsClient)} == _public(AsyncRoutedExpertsClient)
    for name in _public(RoutedExpertsClient) - set(closing):
        sync_sig = inspect.signature(getattr(RoutedExpertsClient, name))
        async_sig = inspect.signature(getattr(AsyncRoutedExpertsClient, name))
        assert list(sync_sig.parameters) == list(async_sig.parameters), name


def test_async_fetch_bytes_and_sglang_b64_match_the_blocking_client(pods) -> None:
    from service.client import AsyncRoutedExpertsClient

    base, spool = pods[1]
    put(spool, "bytes-1", 17)

    async def main() -> list[bytes]:
        async with AsyncRoutedExpertsClient(base) as ac:
            return [await ac.fetch_bytes("bytes-1", fmt, start=2, end=9) for fmt in ("npy", "raw", "sglang_b64")]

    with RoutedExpertsClient(base) as sc:
        want = [sc.fetch_bytes("bytes-1", fmt, start=2, end=9) for fmt in ("npy", "raw", "sglang_b64")]
    assert asyncio.run(main()) == want
    assert want[2] == httpx.get(f"{base}/routed_experts/bytes-1?format=sglang_b64&start=2&end=9").content


def test_async_client_over_https_style_transport_takes_the_httpx_path(pods) -> None:
    """A custom transport (https, proxies) is served by httpx on the loop, with the same answers."""
    from service.client import AsyncRoutedExpertsClient

    base, spool = pods[0]
    array = put(spool, "httpx-path", 8)

    async def main() -> tuple[RoutedExperts, list]:
        async with AsyncRoutedExpertsClient(base, transport=httpx.AsyncHTTPTransport()) as ac:
            assert ac._io.direct is None
            return await ac.get("httpx-path"), await ac.get_many(["httpx-path", "nope"])

    one, many = asyncio.run(main())
    np.testing.assert_array_equal(one.array, array)
    np.testing.assert_array_equal(many[0].array, array)
    assert isinstance(many[1], RecordNotFound)


# ---- a reused rid ----------------------------------------------------------------------------------------


def test_a_reused_rid_says_which_request_wrote_the_rows(pods, pool: SidecarPool) -> None:
    """verl resumes an aborted request under the same rid: the record is replaced, and every answer says which."""
    base, spool = pods[0]
    first = put(spool, "reused", 6, seed=7)
    with RoutedExpertsClient(base) as client:
        a = client.get("reused")
        (a_batch,) = client.get_many(["reused"])
        second = put(spool, "reused", 9, seed=8)
        b = client.get("reused")
        (b_batch,) = client.get_many(["reused"])
        blocks = list(client.stream("reused"))
    assert a.created is not None and b.created is not None and a.created != b.created
    assert (a_batch.created, b_batch.created) == (a.created, b.created)
    assert {blk.created for blk in blocks} == {b.created}
    np.testing.assert_array_equal(a.array, first)
    np.testing.assert_array_equal(b.array, second)
    assert spool.read_meta("reused").created == b.created
