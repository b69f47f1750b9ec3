"""Front doors, plain values: which layouts can carry a pointer, and the pointers in an OpenAI SSE stream."""

from __future__ import annotations

import json
from functools import partial

from sglang_env import run_sglang

from engine_ext.core.settings import Mode
from engine_ext.sglang.frontdoors import (
    PointerStream,
    delivery_report,
    effective_mode,
    inline_shape,
    layout_refusal,
    pointer_rids,
    pointer_unreachable,
    refused_rids,
    rust_server_note,
    sglext_pointer,
)


def chunk(obj: dict) -> str:
    return f"data: {json.dumps(obj)}\n\n"


def test_layouts_without_a_pointer_keep_inline_rows_and_refuse_capture_all():
    assert pointer_unreachable(tokenizer_worker_num=1) is None
    why = pointer_unreachable(tokenizer_worker_num=2)
    assert "--tokenizer-worker-num 2" in why
    assert "SGLANG_RUST_SERVER" in pointer_unreachable(tokenizer_worker_num=1, rust_server=True)
    granian = pointer_unreachable(tokenizer_worker_num=1, granian_worker="0.5.12")
    assert "--enable-http2 on SGLang 0.5.12" in granian and "spawns" in granian
    assert effective_mode(Mode.SIDECAR, granian) is Mode.MIRROR
    assert effective_mode(Mode.SIDECAR, why) is Mode.MIRROR
    assert effective_mode(Mode.SIDECAR, None) is Mode.SIDECAR
    assert effective_mode(Mode.OFF, why) is Mode.OFF
    assert delivery_report(Mode.SIDECAR, why) == {"mode": "mirror", "configured_mode": "sidecar", "inline_kept": why}
    assert delivery_report(Mode.MIRROR, why)["inline_kept"] is None  # mirror is what was asked for
    assert layout_refusal(mode=Mode.SIDECAR, capture_all=False, unreachable=why) is None
    assert layout_refusal(mode=Mode.SIDECAR, capture_all=True, unreachable=None) is None
    refusal = layout_refusal(mode=Mode.MIRROR, capture_all=True, unreachable=why)
    assert "--tokenizer-worker-num 1" in refusal and "R3_CAPTURE_ALL" in refusal


def test_sglext_pointer_lists_every_choice():
    assert sglext_pointer([None, None]) is None
    assert sglext_pointer(["u0", "u1"]) == {"routed_experts_url": "u0", "routed_experts_urls": ["u0", "u1"]}


def test_stream_pointers_go_before_done_when_sglang_sends_no_sglext():
    stream = PointerStream(base_url="http://sc:1/", n=2, object_name="text_completion", model="m")
    sent = []
    for piece in [
        chunk({"id": "r1", "created": 5, "model": "m", "choices": [{"index": 1, "text": "a"}]}),
        chunk({"id": "r0", "created": 5, "model": "m", "choices": [{"index": 0, "text": "b"}]}),
        chunk({"id": "r0", "created": 5, "model": "m", "choices": [], "usage": {"total_tokens": 3}}),
        "data: [DONE]\n\n",
    ]:
        sent.extend(stream.feed(piece))
    assert sent[-1] == "data: [DONE]\n\n" and len(sent) == 5
    extra = json.loads(sent[-2][len("data: ") :])
    assert extra["choices"] == [] and extra["object"] == "text_completion" and extra["id"] == "r0"
    assert extra["sglext"]["routed_experts_urls"] == ["http://sc:1/routed_experts/r0", "http://sc:1/routed_experts/r1"]
    assert extra["sglext"]["routed_experts_url"] == "http://sc:1/routed_experts/r0"


def test_stream_pointers_join_sglangs_own_sglext_chunk():
    stream = PointerStream(base_url="http://sc:1", n=1, object_name="chat.completion.chunk", model="m")
    sent = []
    for piece in [
        chunk({"id": "a/b", "choices": [{"index": 0, "delta": {"content": "x"}}]}),
        chunk({"id": "a/b", "choices": [], "sglext": {"routed_experts": "AAAA"}}),
        "data: [DONE]\n\n",
    ]:
        sent.extend(stream.feed(piece))
    assert len(sent) == 3  # no chunk of our own: the pointers went into SGLang's
    merged = json.loads(sent[1][len("data: ") :])
    assert merged["sglext"] == {
        "routed_experts": "AAAA",
        "routed_experts_url": "http://sc:1/routed_experts/a%2Fb",
        "routed_experts_urls": ["http://sc:1/routed_experts/a%2Fb"],
    }


def test_stream_chunk_with_sglangs_rows_says_their_shape_and_start():
    """SGLang's own `sglext` chunk carries the first choice's flat rows: the shape and start go beside them, with the
    pointers (mirror) or without any (no sidecar URL, several tokenizer workers); no other chunk changes."""
    rows = "A" * 64  # 48 bytes: 12 int32 = 2 rows of 3 layers x top-2
    shape_of = partial(inline_shape, num_hidden_layers=3, topk=2, start_len=5)
    for base_url in ("http://sc:1", None):
        stream = PointerStream(base_url=base_url, n=1, object_name="text_completion", model="m", shape_of=shape_of)
        text = chunk({"id": "r", "choices": [{"index": 0, "text": "x"}]})
        sent = stream.feed(text) + stream.feed(chunk({"id": "r", "choices": [], "sglext": {"routed_experts": rows}}))
        sent += stream.feed("data: [DONE]\n\n")
        assert sent[0] == text and sent[-1] == "data: [DONE]\n\n" and len(sent) == 3, base_url
        ext = json.loads(sent[1][len("data: ") :])["sglext"]
        assert (ext["routed_experts_shape"], ext["routed_experts_start_len"]) == ([2, 3, 2], 5), base_url
        assert ext["routed_experts"] == rows and ("routed_experts_url" in ext) == bool(base_url), base_url
    stream = PointerStream(base_url=None, n=1, object_name="text_completion", model="m", shape_of=shape_of)
    other = chunk({"id": "r", "choices": [], "sglext": {"cached_tokens_details": {"device": 1}}})
    assert stream.feed(other) == [other]  # no rows: nothing to say
    assert stream.feed("data: [DONE]\n\n") == ["data: [DONE]\n\n"]


def test_stream_without_choices_gets_no_pointer():
    stream = PointerStream(base_url="http://sc:1", n=1, object_name="text_completion", model="m")
    assert stream.feed('data: {"error": "boom"}\n\n') == ['data: {"error": "boom"}\n\n']
    assert stream.feed("data: [DONE]\n\n") == ["data: [DONE]\n\n"]


def test_pointer_only_for_rows_the_spool_took():
    """Sidecar mode: an output that still carries SGLang's payload was refused by the spool: rows, no pointer."""
    rids, asked = ["a", "b", "c", "d"], [True, True, False, True]
    inline = [None, "AAAA", None, None]
    assert pointer_rids(rids, asked, refused_rids(rids, asked, inline, Mode.SIDECAR)) == {"a", "d"}
    assert pointer_rids(rids, asked, refused_rids(rids, asked, inline, Mode.MIRROR)) == {"a", "b", "d"}  # both
    assert pointer_rids(rids, asked, refused_rids(rids, asked, None, Mode.SIDECAR)) == {"a", "b", "d"}  # no rows
    assert refused_rids(rids, asked, inline, Mode.SIDECAR) == {"b"}  # its `error` record, for the shutdown wait
    assert refused_rids(rids, asked, ["x", "x", "x", None], Mode.SIDECAR) == {"a", "b"}  # c did not ask
    assert refused_rids(rids, asked, inline, Mode.MIRROR) == frozenset()


def test_versions_that_build_meta_info_inline_follow_the_same_rule():
    """≤ 0.5.16 builds `meta_info` inside `_wait_one_response`, where the plugin adds the pointer per response:
    a response that still carries SGLang's rows in sidecar mode gets none; mirror mode points at both."""
    (got,) = run_sglang(
        """
        import asyncio
        from types import SimpleNamespace
        from engine_ext.core.settings import EngineSettings
        from engine_ext.sglang.hooks import frontdoor as frontdoor_hooks
        from engine_ext.sglang.delivery import PROCESS

        async def original(self, obj):
            yield {"meta_info": {"id": "took"}}
            yield {"meta_info": {"id": "refused", "routed_experts": "AAAA"}}

        async def run(mode):
            PROCESS.settings = EngineSettings(mode=mode, sidecar_url="http://sc:1")
            obj = SimpleNamespace(return_routed_experts=True)
            hf = SimpleNamespace(num_hidden_layers=2, num_experts_per_tok=2)
            manager = SimpleNamespace(model_config=SimpleNamespace(hf_text_config=hf), rid_to_state={})
            outs = frontdoor_hooks._around_wait_one_response(original, manager, obj)
            return [sorted(out["meta_info"]) async for out in outs]

        emit({mode: asyncio.run(run(mode)) for mode in ("sidecar", "mirror")})
        """
    )
    assert got["sidecar"] == [["id", "routed_experts_url"], ["id", "routed_experts"]]
    assert got["mirror"] == [["id", "routed_experts_url"], ["id", "routed_experts", "routed_experts_url"]]


def test_the_rust_front_end_is_named_with_what_still_works():
    """Under SGLANG_RUST_SERVER the front-door hooks never fire: the note says capture and spool work, pointers do
    not; the engine file carries it (`delivery.front_door`), and the sidecar's parser keeps it."""
    from service.spool.engine_report import DeliveryMode

    note = rust_server_note(True, Mode.SIDECAR)
    assert "capture and the spool" in note and "routed_experts_url" in note and "rid" in note
    assert rust_server_note(False, Mode.SIDECAR) is None and rust_server_note(True, Mode.OFF) is None
    report = delivery_report(Mode.SIDECAR, pointer_unreachable(tokenizer_worker_num=1, rust_server=True), note)
    assert report["front_door"] == note and DeliveryMode.from_dict(report).to_dict() == report
    assert "front_door" not in delivery_report(Mode.SIDECAR, None)  # older readers see the same object


def test_plugin_start_detects_sglangs_rust_server_by_sglangs_own_setting():
    """`register()` in a real SGLang 0.5.23 process: SGLang's own `envs.SGLANG_RUST_SERVER` (an EnvBool) decides,
    and the warning is logged at start, before any hook could stay silent. One child: SGLang's import is slow.
    `SGLANG_RUST_SERVER=1` is in the child's environment before `register()` runs (`read_late`: SGLang reads it
    when asked, not on import, so the child is forked from the zygote rather than a fresh interpreter)."""
    code = """
        import logging, os
        logged = []
        class Keep(logging.Handler):
            def emit(self, record):
                logged.append(record.getMessage())
        logging.getLogger("r3_sidecar").addHandler(Keep())
        from sglang.srt.environ import envs
        from engine_ext.core.settings import EngineSettings
        from engine_ext.sglang import announce_front_door, register
        register()  # SGLANG_RUST_SERVER=1 from the child's environment
        seen = {"1": [envs.SGLANG_RUST_SERVER.get(), [m for m in logged if "SGLANG_RUST_SERVER" in m]]}
        for value in ("true", "0", "no"):
            os.environ["SGLANG_RUST_SERVER"] = value
            seen[value] = [envs.SGLANG_RUST_SERVER.get(), announce_front_door(EngineSettings())]
        emit(seen)
        """
    (got,) = run_sglang(code, env={"R3_SPOOL_DIR": "/tmp/r3-rust-note-test"}, read_late={"SGLANG_RUST_SERVER": "1"})
    on, logged = got["1"]
    assert on is True and len(logged) == 1 and "capture and the spool" in logged[0] and "pointers" in logged[0]
    assert got["true"][0] is True and "routed_experts_url" in got["true"][1]
    assert got["0"] == [False, None] and got["no"] == [False, None]


def test_inline_rows_get_their_shape_and_the_requests_start_where_meta_info_is_built_inline():
    """≤ 0.5.16: the shape from the payload and the model config, the start from the request being answered (the
    manager's request state is gone by the time a finished output is yielded), with or without a pointer."""
    (got,) = run_sglang(
        """
        import asyncio, base64
        from types import SimpleNamespace
        from engine_ext.core.settings import EngineSettings
        from engine_ext.sglang.hooks import frontdoor as frontdoor_hooks
        from engine_ext.sglang.delivery import PROCESS

        rows = base64.b64encode(bytes(4 * 3 * 6 * 2)).decode()  # 3 rows of 6 layers x top-2, int32
        manager = SimpleNamespace(
            model_config=SimpleNamespace(hf_text_config=SimpleNamespace(num_hidden_layers=6, num_experts_per_tok=2)),
            rid_to_state={},
        )

        async def original(self, obj):
            yield {"meta_info": {"id": "r"}}
            yield {"meta_info": {"id": "r", "routed_experts": rows}}

        async def run(url):
            PROCESS.settings = EngineSettings(mode="mirror", sidecar_url=url)
            obj = SimpleNamespace(return_routed_experts=True, routed_experts_start_len=17)
            return [out["meta_info"] async for out in frontdoor_hooks._around_wait_one_response(original, manager, obj)]

        emit({str(url): asyncio.run(run(url)) for url in (None, "http://sc:1")})
        """
    )
    for url, (first, last) in got.items():
        assert "routed_experts_shape" not in first, url  # a chunk without rows says nothing
        assert (last["routed_experts_shape"], last["routed_experts_start_len"]) == ([3, 6, 2], 17), url
