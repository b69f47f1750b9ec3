"""A real Prometheus server and real sidecar processes on loopback, for the alert and dashboard tests.

Shared by the deploy tests (every alert and dashboard query, `tests/deploy/test_deploy_prometheus_live.py`) and the
real-server tests that show an alert firing on what a real engine wrote (`watching`).
The server binary is Debian's (`prometheus` package, the one .ci/run fetches for promtool): named by
`PROMETHEUS`, or found next to `PROMTOOL`, or on PATH. Targets are listed in a file_sd file that
Prometheus re-reads within a second, so a test can add and remove pods while the server runs. Every
process started here is stopped by its pid (`helpers.stop_process`: terminate, then kill) when its context
ends, on failure too.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import yaml
from helpers import REPO, bound_socket, stop_process
from waiting import wait_until

RULES_FILE = REPO / "deploy" / "prometheus" / "r3-sidecar-rules.yaml"


def prometheus_binary() -> str | None:
    """The Prometheus server binary, or None when this machine has none."""
    named = os.environ.get("PROMETHEUS")
    if named:
        return named
    promtool = os.environ.get("PROMTOOL") or shutil.which("promtool")
    if promtool and (Path(promtool).parent / "prometheus").is_file():
        return str(Path(promtool).parent / "prometheus")
    return shutil.which("prometheus")


def free_port() -> int:
    sock = bound_socket()
    try:
        return sock.getsockname()[1]
    finally:
        sock.close()


def wait_http(url: str, proc: subprocess.Popen[bytes], timeout: float = 60.0) -> None:
    with httpx.Client(timeout=1) as client:  # one client per wait: building one costs ~40 ms of CPU (its TLS context)

        def answers() -> bool:
            if proc.poll() is not None:
                raise RuntimeError(f"{proc.args[:3]} exited with {proc.returncode}")
            return client.get(url).status_code == 200

        wait_until(answers, timeout, f"{url} ready", interval=0.1, ignore=(httpx.HTTPError,))


def r3_sidecar() -> list[str]:
    """The CLI of the code under test: `python -m service.server.cli` from the repository (an installed console script
    may belong to another checkout of the project)."""
    return [sys.executable, "-m", "service.server.cli"]


@contextlib.contextmanager
def sidecar(command: str, spool_dir: Path, log: Path, **env: str) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """`r3-sidecar demo|serve` as a process on a free loopback port; yields (host:port, process)."""
    port = free_port()
    pythonpath = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
    environ = {**os.environ, "PYTHONPATH": pythonpath, "R3_SPOOL_DIR": str(spool_dir), "PYTHONUNBUFFERED": "1", **env}
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [*r3_sidecar(), command, "--host", "127.0.0.1", "--port", str(port)],
            cwd=REPO,
            env=environ,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        wait_http(f"http://127.0.0.1:{port}/readyz", proc)
        yield f"127.0.0.1:{port}", proc
    finally:
        stop_process(proc)


class CounterExporter:
    """A minimal /metrics endpoint whose one counter grows each scrape: stands in for a series no sidecar
    exports yet (r3_engine_undelivered_total, issue 12), so the rule over it meets a real Prometheus."""

    def __init__(self, text: str) -> None:
        self.text, self.value = text, 0
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                outer.value += 1
                body = outer.text.format(value=outer.value).encode()
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *_args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.address = f"127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True, name="r3-test-exporter")

    def __enter__(self) -> CounterExporter:
        self.thread.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()


def shorten_for(groups: dict[str, Any], for_: str) -> dict[str, Any]:
    """A copy of a rule file whose every `for:` is `for_` (the expressions are untouched)."""
    out = json.loads(json.dumps(groups))
    for group in out["groups"]:
        for rule in group["rules"]:
            if "for" in rule:
                rule["for"] = for_
    return out


class Prometheus:
    """One Prometheus server: 1 s scrape and evaluation, file_sd targets, the given rule files."""

    def __init__(self, binary: str, workdir: Path, rule_files: list[Path]) -> None:
        self.binary, self.workdir = binary, workdir
        self.targets_file = workdir / "targets.json"
        self.set_targets({})
        config = {
            "global": {"scrape_interval": "1s", "scrape_timeout": "900ms", "evaluation_interval": "1s"},
            "rule_files": [str(p) for p in rule_files],
            "scrape_configs": [
                {
                    "job_name": "r3-sidecar",
                    "file_sd_configs": [{"files": [str(self.targets_file)], "refresh_interval": "1s"}],
                }
            ],
        }
        (workdir / "prometheus.yml").write_text(yaml.safe_dump(config))
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen[bytes] | None = None
        # One client for every query: the scenario polls alerts 4 times a second, and each `httpx.get` would build
        # a client (its TLS context: ~40 ms of CPU each).
        self.http = httpx.Client(base_url=self.url, timeout=10)

    def set_targets(self, pods: dict[str, str]) -> None:
        """pod name → host:port; each target gets the `namespace` and `pod` labels a ServiceMonitor adds."""
        groups = [{"targets": [addr], "labels": {"namespace": "inference", "pod": pod}} for pod, addr in pods.items()]
        tmp = self.targets_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(groups))
        tmp.replace(self.targets_file)

    def __enter__(self) -> Prometheus:
        log = open(self.workdir / "prometheus.log", "wb")
        self._log = log
        self.proc = subprocess.Popen(
            [
                self.binary,
                f"--config.file={self.workdir / 'prometheus.yml'}",
                f"--storage.tsdb.path={self.workdir / 'data'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
                "--log.level=warn",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        try:
            wait_http(f"{self.url}/-/ready", self.proc)
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *_exc: object) -> None:
        if self.proc is not None:
            stop_process(self.proc)
        self._log.close()
        self.http.close()

    def query(self, expr: str) -> list[dict[str, Any]]:
        r = self.http.get("/api/v1/query", params={"query": expr})
        body = r.json()
        assert r.status_code == 200 and body["status"] == "success", (expr, body)
        return body["data"]["result"]

    def rule_groups(self) -> list[dict[str, Any]]:
        r = self.http.get("/api/v1/rules", params={"type": "alert"})
        return r.json()["data"]["groups"]

    def active_alerts(self) -> list[tuple[str, str, str, dict[str, str]]]:
        """(rule file, alert name, state, labels) of every pending or firing alert."""
        found = []
        for group in self.rule_groups():
            for rule in group["rules"]:
                for alert in rule.get("alerts", []):
                    found.append((group["file"], rule["name"], alert["state"], alert["labels"]))
        return found

    def firing(self, alert: str) -> list[dict[str, str]]:
        """The labels of each firing instance of `alert`."""
        return [labels for _, name, state, labels in self.active_alerts() if name == alert and state == "firing"]


@contextlib.contextmanager
def watching(sidecar_url: str, workdir: Path) -> Iterator[Prometheus]:
    """A real Prometheus loading the project's alert rules as shipped, scraping one sidecar (`http://host:port`)
    as pod r3-0, for a test to see an alert fire on what a real engine wrote. Needs `prometheus_binary()`."""
    binary = prometheus_binary()
    assert binary is not None, "no Prometheus server binary (.ci/run fetches it; or set PROMETHEUS)"
    workdir.mkdir(parents=True, exist_ok=True)
    with Prometheus(binary, workdir, [RULES_FILE]) as prom:
        prom.set_targets({"r3-0": sidecar_url.removeprefix("http://").rstrip("/")})
        yield prom
