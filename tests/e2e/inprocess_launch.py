"""SGLang started inside the caller's process, as verl 0.9.1 starts it, and requests sent as verl sends them.

verl's `SGLangHttpServer.launch_server` (async_sglang_server.py:420-448) calls
`Engine._launch_subprocesses(...)` in its Ray actor: the tokenizer manager lives in the actor's own process
(the scheduler and detokenizer are its children), and `generate` (:650-657) awaits
`tokenizer_manager.generate_request(GenerateReqInput(...), None).__anext__()`: no HTTP. This script does the
same with the launch arguments in argv[1] (JSON: `server_args`, `requests`), prints one JSON line per request
(what `meta_info` carried), then ends its children. Run by tests/e2e/test_trainer_ingest.py.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys


def main() -> None:
    import sglang.srt.entrypoints.engine as engine
    from sglang.srt.entrypoints.http_server import Engine
    from sglang.srt.managers.io_struct import GenerateReqInput
    from sglang.srt.server_args import ServerArgs
    from sglang.srt.utils import kill_process_tree

    spec = json.loads(sys.argv[1])
    os.environ["SGLANG_BLOCK_NONZERO_RANK_CHILDREN"] = "0"  # as verl sets it
    tokenizer_manager, *_ = Engine._launch_subprocesses(
        server_args=ServerArgs(**spec["server_args"]),
        init_tokenizer_manager_func=engine.init_tokenizer_manager,
        run_scheduler_process_func=engine.run_scheduler_process,
        run_detokenizer_process_func=engine.run_detokenizer_process,
    )

    async def send(rid: str, input_ids: list[int]) -> dict:
        request = GenerateReqInput(
            rid=rid,
            input_ids=input_ids,
            sampling_params={"max_new_tokens": 6, "temperature": 0.0, "ignore_eos": True},
            return_routed_experts=True,
        )
        output = await tokenizer_manager.generate_request(request, None).__anext__()
        meta = output["meta_info"]
        inline = meta.get("routed_experts")
        return {
            "rid": rid,
            "url": meta.get("routed_experts_url"),
            "inline": inline if isinstance(inline, str) else None,
            "inline_type": type(inline).__name__,
            "prompt_tokens": meta["prompt_tokens"],
            "completion_tokens": meta["completion_tokens"],
        }

    async def run() -> list[dict]:
        return [await send(rid, ids) for rid, ids in spec["requests"]]

    try:
        for line in asyncio.run(run()):
            print("RESULT " + json.dumps(line), flush=True)
    finally:
        # A caller that SIGKILLs its engine the moment the responses arrive first lets the records they point to
        # become final (what the plugin does itself in `sglang.Engine.shutdown`): the writer thread is
        # milliseconds behind the response.
        from engine_ext.core.settings import EngineSettings
        from engine_ext.sglang.hooks.frontdoor import PROMISED

        PROMISED.settle(EngineSettings().spool_dir, timeout_s=10)
        kill_process_tree(os.getpid(), include_parent=False)
    os._exit(0)


if __name__ == "__main__":
    main()
