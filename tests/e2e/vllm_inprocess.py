"""Run in the vLLM venv: an in-process `AsyncLLM`, as verl, NeMo-RL, SkyRL and prime-rl drive vLLM.

    python tests/e2e/vllm_inprocess.py MODEL_DIR OUT.npz

`generate(prompt, params, request_id=R)` for `n = 1` and `n = 2`; every output's own `routed_experts` goes to
OUT.npz under the rid its record should have (`R`, `R-<child>`), for the test to compare with the spool.
"""

from __future__ import annotations

import asyncio
import sys

import numpy as np
from vllm import SamplingParams
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.v1.engine.async_llm import AsyncLLM


async def main(model: str, out: str) -> None:
    args = AsyncEngineArgs(
        model=model, enforce_eager=True, enable_return_routed_experts=True, max_model_len=1024, dtype="bfloat16"
    )
    llm = AsyncLLM.from_engine_args(args)
    arrays: dict[str, np.ndarray] = {}
    try:
        for rid, n in (("verl-req-1", 1), ("grpo-2", 2)):
            params = SamplingParams(max_tokens=6, n=n, temperature=1.0, seed=3, ignore_eos=True)
            async for result in llm.generate("In-process prompt", params, request_id=rid):
                for output in result.outputs:  # n > 1: a child's finished output comes once, maybe alone
                    if output.finish_reason is not None:
                        arrays[rid if n == 1 else f"{rid}-{output.index}"] = output.routed_experts
    finally:
        llm.shutdown()
    np.savez(out, **arrays)


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2]))
