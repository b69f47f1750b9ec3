"""The vLLM plugin under an in-process `AsyncLLM` (how verl, NeMo-RL, SkyRL and prime-rl drive vLLM): the record
of `generate(request_id=R)` is `R` (`R-<j>` for child `j` of `n > 1`) and holds that output's own array."""

from __future__ import annotations

import os
import subprocess

import numpy as np
import pytest
import vllm_server

from service.spool import Spool

pytestmark = [pytest.mark.vllm, pytest.mark.skipif(not vllm_server.available(), reason=vllm_server.MISSING)]


def test_in_process_asyncllm_records_equal_its_outputs(tmp_path, sglang_exclusive):
    sglang_exclusive()  # no SGLang server of the real-engine suite stays up beside this engine
    model = vllm_server.write_model(tmp_path / "model")
    spool, out = tmp_path / "spool", tmp_path / "out.npz"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("R3_", "VLLM_"))}
    env |= vllm_server.CPU_ENV | {
        "R3_SPOOL_DIR": str(spool),
        "R3_MODE": "mirror",
        "R3_ENGINE_ID": "inproc",
        "PYTHONPATH": str(vllm_server.REPO),
    }
    script = vllm_server.REPO / "tests/e2e/vllm_inprocess.py"
    done = subprocess.run(
        [str(vllm_server.VLLM_PYTHON), str(script), str(model), str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=280,
        start_new_session=True,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    arrays = dict(np.load(out))
    assert sorted(arrays) == ["grpo-2-0", "grpo-2-1", "verl-req-1"]
    reader = Spool(spool, create=False)
    for rid, array in arrays.items():
        meta = reader.read_meta(rid)
        assert meta is not None and meta.final and meta.status == "ok", rid
        rows = reader.read_array(meta)
        assert rows.dtype == array.dtype and rows.tobytes() == array.tobytes(), rid
        assert meta.rows == meta.prompt_len + 6 - 1
    assert not np.array_equal(arrays["grpo-2-0"], arrays["grpo-2-1"])  # two samples, two routings
