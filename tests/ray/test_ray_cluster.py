"""Beside Ray-launched engines, on a real local two-node Ray cluster (`ray.cluster_utils.Cluster`).

The engine node runs a real CPU SGLang 0.5.23 server started from a Ray actor the way AReaL and verl start
theirs (a subprocess of the actor: AReaL `areal/engine/sglang_remote.py:352`), with the plugin and nothing
but environment variables (`R3_SIDECAR=auto`, mirror mode so each response also carries SGLang's own rows).
The actor turns responses into `RoutedExpertsRef`s, which travel through Ray's object store to a task on the
trainer node; it resolves them (whole, and per rank: pipeline stage 1 of 2, CP rank 1 of 2) and gets SGLang's
inline rows. Refs resolved by a task on the engine's node read the node's spool (every `source` is `spool`, the
sidecar serves no byte and counts the local reads); on the trainer node they go over HTTP (`source` is `http`):
both Ray nodes here share one kernel, so that fetch runs in a child process that sees another kernel's boot id
(`unshare -m` with the boot-id file bound over), what a client compares to tell nodes apart; the per-rank
fetch runs in the task itself. Then the actor is killed (its server dies; the sidecar does not), the sidecar is
killed by pid, and the next engine start brings it back on the same address: the first refs resolve again, nothing lost.
The explicit alternative, one sidecar actor per node (`service.client.ray_nodes`), serves on both nodes and goes
with its actors. After the job and cluster end, no r3 or SGLang process of the test is left.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import pickle
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import numpy as np
import pytest
from e2e.child_process import HEALTH_S, free_port
from e2e.child_process import _log_tail as log_tail
from e2e.sglang_server import BASE_ARGS, REPO, Config, cli_args, server_env
from e2e.tiny_model import write_model
from waiting import WaitTimeout, wait_until

from service.client.ray_nodes import start_node_sidecars

ray = pytest.importorskip("ray")
from ray.cluster_utils import Cluster  # noqa: E402

pytestmark = [
    pytest.mark.sglang,
    pytest.mark.timeout(900),
    pytest.mark.skipif(os.geteuid() != 0, reason="the trainer node's other kernel is emulated with unshare (root)"),
]

NUM_LAYERS = 4
PROMPTS = [list(range(10, 10 + n)) for n in (9, 30)]


class EngineActor:
    """A rollout engine as the trainers have it: an actor that launches `sglang.launch_server` as its child."""

    def __init__(self, cmd: list[str], env: dict[str, str], url: str, log: str) -> None:
        self.url, self.log = url, log
        with open(log, "ab") as out:
            self.proc = subprocess.Popen(cmd, env={**os.environ, **env}, stdout=out, stderr=subprocess.STDOUT)

    def ready(self, timeout: float = 300) -> int:
        client = httpx.Client(timeout=HEALTH_S)  # one for the wait: a client per poll builds a TLS context (~40 ms)

        def healthy() -> bool:
            if self.proc.poll() is not None:
                raise RuntimeError(f"SGLang did not start (exit {self.proc.poll()})")
            return client.get(f"{self.url}/health").status_code == 200

        try:
            wait_until(healthy, timeout, "SGLang's /health answers", interval=0.5, ignore=(httpx.HTTPError,))
        except (WaitTimeout, RuntimeError) as exc:  # CI keeps no file: the failure says what the server logged
            raise RuntimeError(f"{exc}; the server's log ends:\n{log_tail(Path(self.log))}") from None
        finally:
            client.close()
        return self.proc.pid

    def rollout(self, prompts: list[list[int]]) -> tuple[list, list[np.ndarray], list[int]]:
        """(refs without inline rows: what is shipped; SGLang's inline rows; each sequence's token count)."""
        from service.client.refs import RoutedExpertsRef

        refs, inline, lengths = [], [], []
        for i, ids in enumerate(prompts):
            body = {
                "input_ids": ids,
                "rid": f"ray-{os.getpid()}-{i}",
                "return_routed_experts": True,
                "sampling_params": {"max_new_tokens": 6, "temperature": 0.0, "ignore_eos": True},
            }
            resp = httpx.post(f"{self.url}/generate", json=body, timeout=120).json()
            (ref,) = RoutedExpertsRef.from_response(resp, num_hidden_layers=NUM_LAYERS)
            assert ref.url is not None and ref.inline is not None, resp["meta_info"].keys()
            inline.append(ref.fetch().array)
            refs.append(ref.without_inline())
            lengths.append(len(ids) + resp["meta_info"]["completion_tokens"])
        return refs, inline, lengths


# A trainer node's kernel has its own boot id. Both nodes of this cluster share one kernel, so the trainer
# node's fetch runs in a child process that sees another boot id (a private mount namespace with the boot-id
# file bound over), which is all a client compares to tell another node from its sidecar's.
ANOTHER_NODE = (
    "import pickle, sys\n"
    "from service.client.refs import fetch_many\n"
    "got = fetch_many(pickle.load(sys.stdin.buffer), wait=30)\n"
    "sys.stdout.buffer.write(pickle.dumps([(r.array, r.layers, r.start, r.source) for r in got]))\n"
)


def fetch_as_another_node(refs: list, workdir: str) -> list:
    fake = Path(workdir) / "other-boot-id"
    fake.write_text("00000000-0000-4000-8000-0000000000aa\n")
    bind = f'mount --bind {fake} /proc/sys/kernel/random/boot_id && exec "$@"'
    cmd = ["unshare", "-m", "--", "sh", "-c", bind, "-", sys.executable, "-c", ANOTHER_NODE]
    out = subprocess.run(cmd, input=pickle.dumps(refs), capture_output=True, timeout=120, check=True)
    return pickle.loads(out.stdout)


def train(refs: list, lengths: list[int], workdir: str) -> dict:
    """On the trainer node: resolve the refs received through the object store, whole and for one rank."""
    import ray as ray_

    from service.client.ranks import Place, fetch_rank

    whole = fetch_as_another_node(refs, workdir)
    place = Place(pp_size=2, pp_rank=1, cp_size=2, cp_rank=1)
    ranked = fetch_rank(refs, lengths, place, NUM_LAYERS, wait=30)
    return {
        "node": ray_.get_runtime_context().get_node_id(),
        "whole": [w[:3] for w in whole],
        "sources": [w[3] for w in whole],
        "ranked": [(r.array, r.positions, r.layers) for r in ranked],
        "pickled": [len(pickle.dumps(ref)) for ref in refs],
    }


def resolve_on_engine_node(refs: list) -> dict:
    """On the engine's node: the refs resolve straight from the node's spool (service.client.local.reads)."""
    import ray as ray_

    from service.client.refs import fetch_many

    got = fetch_many(refs, wait=30)
    return {
        "node": ray_.get_runtime_context().get_node_id(),
        "whole": [(r.array, r.layers, r.start) for r in got],
        "sources": [r.source for r in got],
    }


def sidecar_counts(url: str) -> dict[str, float]:
    """The sidecar's bytes served over HTTP and records read from its spool by clients."""
    out = {"r3_served_bytes_total": 0.0, "r3_local_reads_total": 0.0}
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        name, _, value = line.partition(" ")
        if name in out:
            out[name] = float(value)
    return out


def r3_processes(marker: str) -> list[tuple[int, str]]:
    """Processes whose command line names `marker` (this test's spool or model directory)."""
    found = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit() and int(proc.name) != os.getpid():
            with contextlib.suppress(OSError):
                cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                if marker in cmdline:
                    found.append((int(proc.name), cmdline[:200]))
    return found


def alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


# Ray's own deadline for a starting raylet to register with the GCS (`ray/_private/node.py`, 30 s, not settable)
STARTUP_TIMED_OUT = "The current node timed out during startup"


@pytest.fixture
def short_dirs() -> Iterator[Callable[[], str]]:
    """New directories with short paths (Ray's socket paths live under its temp dir), removed after the test."""
    made: list[str] = []

    def new_dir() -> str:
        made.append(tempfile.mkdtemp(prefix="r3ray-", dir="/tmp"))
        return made[-1]

    yield new_dir
    for path in made:
        shutil.rmtree(path, ignore_errors=True)


def two_node_cluster(monkeypatch: pytest.MonkeyPatch, new_dir: Callable[[], str], tries: int = 3) -> Cluster:
    """The head (the engine's node) and the trainer's node, with workers at the engines' priority.

    Ray starts its workers at nice 15 (`RAY_worker_niceness`), and an engine started from an actor inherits it:
    beside the other xdist worker's SGLang servers at nice 0 it got a few percent of a core, and its start ran
    past 300 s (CI, 2026-11-29). The niceness is Ray's scheduling choice, not what this test proves, so its
    workers run at 0. Ray gives a raylet 30 s to register, which a loaded 2-core machine missed once: a start
    that timed out so is stopped (its processes, found by its temp dir) and tried again."""
    monkeypatch.setenv("RAY_worker_niceness", "0")
    for attempt in range(1, tries + 1):
        temp_dir = new_dir()
        cluster = Cluster(initialize_head=False)
        try:
            cluster.add_node(num_cpus=1, resources={"engine": 2}, object_store_memory=80 << 20, temp_dir=temp_dir)
            cluster.add_node(num_cpus=1, resources={"trainer": 1}, object_store_memory=80 << 20)
            cluster.wait_for_nodes()
            return cluster
        except Exception as exc:
            cluster.shutdown()
            for pid, _ in r3_processes(temp_dir):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            if STARTUP_TIMED_OUT not in str(exc) or attempt == tries:
                raise
            print(f"Ray's node start timed out (try {attempt} of {tries}); trying again")
    raise AssertionError("unreachable")


def check_rows(got: dict, inline: list[np.ndarray], lengths: list[int]) -> None:
    for (array, layers, start), rows in zip(got["whole"], inline, strict=True):
        assert start == 0
        np.testing.assert_array_equal(array, rows[:, list(layers)])  # the sidecar's rows are SGLang's own
    for (array, positions, layers), rows, n in zip(got["ranked"], inline, lengths, strict=True):
        assert layers == (2, 3)  # pipeline stage 1 of 2: model layers 2-3
        want = [p for lo, hi in positions for p in range(lo, hi)]
        chunk = -(-n // 4)  # CP rank 1 of 2 takes chunks 1 and 2 of 4
        assert want == [p for p in [*range(chunk, 2 * chunk), *range(2 * chunk, 3 * chunk)] if p < n - 1]
        np.testing.assert_array_equal(array, rows[want][:, [2, 3]])
    assert max(got["pickled"]) < 400


def test_refs_through_ray_and_a_node_sidecar_that_survives_the_engine(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, short_dirs: Callable[[], str]
) -> None:
    t0 = time.monotonic()
    paths = [str(REPO), str(REPO / "tests"), os.environ.get("PYTHONPATH")]  # tests/: the `waiting` helper
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, paths)))
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the roles below travel by value
    spool, model = tmp_path / "spool", write_model(tmp_path / "model")
    config = Config("ray", env={"R3_MODE": "mirror", "R3_SIDECAR": "auto", "R3_SIDECAR_IDLE_S": "30"})
    env = server_env(config, spool)

    def engine_cmd() -> tuple[list[str], str]:
        port = free_port()
        args = BASE_ARGS | {"model-path": str(model), "host": "127.0.0.1", "port": port}
        return [sys.executable, "-m", "sglang.launch_server", *cli_args(args)], f"http://127.0.0.1:{port}"

    cluster = two_node_cluster(monkeypatch, short_dirs)
    try:
        ray.init(address=cluster.address, log_to_driver=False)
        engine_cls = ray.remote(num_cpus=0, resources={"engine": 1})(EngineActor)
        train_task = ray.remote(num_cpus=0, resources={"trainer": 1})(train)
        engine_node_task = ray.remote(num_cpus=0, resources={"engine": 1})(resolve_on_engine_node)

        cmd, url = engine_cmd()
        engine = engine_cls.remote(cmd, env, url, str(tmp_path / "engine1.log"))
        server_pid = ray.get(engine.ready.remote())
        assert os.getpriority(os.PRIO_PROCESS, server_pid) == 0  # Ray's worker niceness did not reach it
        refs, inline, lengths = engine.rollout.options(num_returns=3).remote(PROMPTS)
        sidecar = json.loads((spool / "sidecar.json").read_text())
        before = sidecar_counts(sidecar["url"])
        here = ray.get(engine_node_task.remote(refs))  # on the engine's node: straight from its spool
        inline, lengths = ray.get(inline), ray.get(lengths)
        assert here["sources"] == ["spool"] * len(PROMPTS)
        for (array, layers, _), rows in zip(here["whole"], inline, strict=True):
            np.testing.assert_array_equal(array, rows[:, list(layers)])
        wait_until(
            lambda: sidecar_counts(sidecar["url"])["r3_local_reads_total"] >= len(PROMPTS), 30, "reads unreported"
        )
        assert sidecar_counts(sidecar["url"])["r3_served_bytes_total"] == before["r3_served_bytes_total"]

        got = ray.get(train_task.remote(refs, lengths, str(tmp_path)))  # from the object store, on the other node
        assert got["node"] != ray.get_runtime_context().get_node_id()
        assert got["sources"] == ["http"] * len(PROMPTS)
        assert sidecar_counts(sidecar["url"])["r3_served_bytes_total"] > before["r3_served_bytes_total"]
        check_rows(got, inline, lengths)

        host = urlsplit(sidecar["url"]).hostname
        assert not ipaddress.ip_address(host).is_loopback
        assert all(urlsplit(r.url).hostname == host for r in ray.get(refs))

        ray.kill(engine)  # the engine goes: its server with it, the node's sidecar stays
        wait_until(lambda: not alive(server_pid), 60, "SGLang outlived its actor")
        assert alive(sidecar["pid"])
        assert httpx.get(f"{sidecar['url']}/readyz", timeout=5).status_code == 200

        os.kill(sidecar["pid"], signal.SIGKILL)  # the sidecar dies; the next engine start brings it back
        wait_until(lambda: not alive(sidecar["pid"]), 30, "sidecar survived SIGKILL")
        cmd, url = engine_cmd()
        engine = engine_cls.remote(cmd, env, url, str(tmp_path / "engine2.log"))
        ray.get(engine.ready.remote())
        again = json.loads((spool / "sidecar.json").read_text())
        assert again["pid"] != sidecar["pid"] and again["url"] == sidecar["url"]
        check_rows(ray.get(train_task.remote(refs, lengths, str(tmp_path))), inline, lengths)  # nothing lost
        ray.get(engine.rollout.remote(PROMPTS[:1]))
        engines = {json.loads(p.read_text())["engine"] for p in (spool / "v1" / "engines").glob("*.json")}
        assert len(engines) == 2, engines  # two engine processes on one node and spool: two engine files
        sidecar = again

        urls, actors = start_node_sidecars(str(tmp_path / "explicit-{node_id}"))  # the explicit way: an actor a node
        assert len(urls) == 2
        for node_url in urls.values():
            assert not ipaddress.ip_address(urlsplit(node_url).hostname).is_loopback
            assert httpx.get(f"{node_url}/readyz", timeout=10).status_code == 200
        for actor in actors:
            ray.kill(actor)
        wait_until(lambda: not r3_processes("explicit-"), 30, "an explicit sidecar outlived its actor")
    finally:
        ray.shutdown()
        cluster.shutdown()
    wait_until(lambda: not alive(sidecar["pid"]), 30, "the sidecar outlived the cluster")
    wait_until(lambda: not r3_processes(str(tmp_path)), 30, f"left behind: {r3_processes(str(tmp_path))}")
    print(f"ray node-sidecar test: {time.monotonic() - t0:.1f} s")
