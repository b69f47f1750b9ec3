"""Two pods behind SGLang's real gateway (`smg launch --policy round_robin`): each pointer names its record's pod.

Each pod is a real CPU SGLang server with the plugin in sidecar mode and its own sidecar and spool
(`R3_SIDECAR_URL` = that pod's sidecar, `R3_ENGINE_ID` = the pod's name), as the Helm chart lays them out. The
gateway is unchanged: it forwards requests and responses; the pointer is in the response it relays. With
`R3_CAPTURE_ALL=1`, requests that do not carry `return_routed_experts` (a gateway or client that strips the
field) get a pointer as well. Checked per request: the record is in exactly one pod's spool, the pointer names
that pod's sidecar, and the rows fetched through it have the request's shape.
"""

from __future__ import annotations

import base64
import contextlib
import os
import sys
from collections import Counter
from pathlib import Path

import httpx
import numpy as np
import pytest
from child_process import Process, free_port, spawn
from sglang_server import Config, Stack, running
from waiting import wait_until

pytestmark = [pytest.mark.sglang, pytest.mark.timeout(900)]  # two server starts on two busy cores

SMALL = {"max-total-tokens": 4096, "max-running-requests": 8}  # two servers on this machine's two cores
PODS = [
    Config(
        f"gw-{pod}",
        args=SMALL,
        env={"R3_MODE": "sidecar", "R3_CAPTURE_ALL": "1", "R3_ENGINE_ID": pod, "SGLANG_CPU_OMP_THREADS_BIND": core},
        tokenizer=True,
    )
    for pod, core in (("pod-a", "0"), ("pod-b", "1"))
]
MAX_NEW = 5


def smg(urls: list[str], workdir: Path) -> Process:
    port = free_port()
    cmd = [
        str(Path(sys.executable).with_name("smg")),
        "launch",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--worker-urls",
        *urls,
        "--policy",
        "round_robin",
        "--log-level",
        "info",
    ]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("R3_", "SGLANG_"))}
    return spawn(cmd, env, workdir / "smg.log", f"http://127.0.0.1:{port}")


def prompt(n: int, seed: int) -> list[int]:
    return np.random.default_rng(500 + seed).integers(8, 250, size=n).tolist()


@pytest.fixture(scope="module")
def two_pods(sglang_exclusive):
    root = sglang_exclusive() / "gateway"
    with contextlib.ExitStack() as stack:
        pods = [stack.enter_context(running(config, root / config.name)) for config in PODS]
        gateway = smg([pod.url for pod in pods], root)
        stack.callback(gateway.stop)
        gateway.wait_http("/readiness", 120, "smg")
        yield pods, gateway


def owner(pods: list[Stack], rid: str) -> Stack:
    """The one pod whose spool holds `rid`'s final record: both spools are looked at together until one has
    it (the request went to one pod, so the other never will)."""

    def holders() -> list[Stack]:
        return [pod for pod in pods if (meta := pod.record(rid)[0]) is not None and meta.final]

    found = wait_until(holders, 15, f"a final record of {rid} in either pod's spool")
    assert len(found) == 1, (rid, [p.config.name for p in found])
    return found[0]


def test_every_pointer_names_the_pod_holding_the_record(two_pods):
    pods, gateway = two_pods
    answers = []
    with httpx.Client(base_url=gateway.url, timeout=120) as client:
        for i in range(8):
            ids = prompt(10 + 3 * i, i)
            body = {"input_ids": ids, "sampling_params": {"max_new_tokens": MAX_NEW, "temperature": 0.0}}
            body["sampling_params"]["ignore_eos"] = True
            if i % 2 == 0:  # half ask; R3_CAPTURE_ALL=1 gives the others a record and a pointer too
                body["return_routed_experts"] = True
            response = client.post("/generate", json=body)
            assert response.status_code == 200, response.text
            meta = response.json()["meta_info"]
            answers.append((meta["id"], meta, len(ids)))
        model = client.get("/v1/models").json()["data"][0]["id"]
        for i in range(4):  # an OpenAI-compatible door through the gateway: the pointer is in sglext
            body = {"model": model, "prompt": f"w{20 + i} w30 w31 w32", "max_tokens": MAX_NEW, "temperature": 0.0}
            response = client.post("/v1/completions", json=body | {"ignore_eos": True})
            assert response.status_code == 200, response.text
            sglext = response.json()["sglext"]
            url = sglext["routed_experts_url"]
            answers.append((url.rsplit("/", 1)[1], {"routed_experts_url": url}, None))
    served = Counter()
    for rid, meta, prompt_len in answers:
        assert "routed_experts" not in meta, rid
        pod = owner(pods, rid)
        served[pod.config.name] += 1
        assert meta["routed_experts_url"] == f"{pod.sidecar_url}/routed_experts/{rid}", (rid, meta)
        fetched = httpx.get(meta["routed_experts_url"], params={"format": "sglang_b64"}, timeout=30)
        assert fetched.status_code == 200, fetched.text
        rows = np.frombuffer(base64.b64decode(fetched.text), dtype=np.int32).reshape(-1, pod.num_hidden_layers, 2)
        if prompt_len is not None:
            assert rows.shape[0] == prompt_len + MAX_NEW - 1, rid
        assert fetched.headers["x-r3-rid"] == rid
        other = next(p for p in pods if p is not pod)
        gone = httpx.get(f"{other.sidecar_url}/routed_experts/{rid}", timeout=10)
        assert gone.status_code == 404, rid  # the other pod's sidecar does not have it
    # round robin over both pods (smg's counter also advances on routed GETs such as /v1/models)
    assert set(served) == {"gw-pod-a", "gw-pod-b"} and min(served.values()) >= 3, served


def test_a_pointer_to_a_pod_that_is_gone_fails_loudly(two_pods):
    """What a trainer sees when the pod of a pointer is gone: a connection error, never empty rows."""
    pods, gateway = two_pods
    with httpx.Client(base_url=gateway.url, timeout=120) as client:
        metas = [
            client.post(
                "/generate",
                json={"input_ids": prompt(12, 40 + i), "sampling_params": {"max_new_tokens": 3, "temperature": 0.0}},
            ).json()["meta_info"]
            for i in range(2)
        ]
    victim = pods[1]
    victim.sidecar.stop()
    urls = [m["routed_experts_url"] for m in metas]
    assert any(u.startswith(victim.sidecar_url) for u in urls) and any(u.startswith(pods[0].sidecar_url) for u in urls)
    for url in urls:
        if url.startswith(victim.sidecar_url):
            with pytest.raises(httpx.ConnectError):
                httpx.get(url, timeout=5)
        else:
            assert httpx.get(url, params={"wait": 10}, timeout=30).status_code == 200
