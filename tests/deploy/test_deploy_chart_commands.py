"""Each container's command line against the real parsers (SGLang 0.5.23's, the sidecar's CLI), and the URL the
engine advertises, built by the engine's own code from a rendered pod's environment, answered by a live sidecar.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any
from urllib.parse import unquote

import pytest
from deploy_render import (
    NAMESPACE,
    container,
    effective_values,
    one,
    render,
    resolved_env,
    scenario_values,
    scenarios,
)

from service.spool import Spool

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine" / "sglang"))  # the SGLang zygote's side
from sglang_env import run_sglang

SCENARIOS = scenarios()

# In a child of the SGLang zygote (`sglang_env.run_sglang`: SGLang's server_args imported once for the suite):
# SGLang's parser over every scenario's argv, and whatever it said while parsing (a retired flag is logged as
# "deprecated", `arg_groups/argparse_actions.py`; a warning or a print would be caught as well).
_SGLANG_PARSE = """
import argparse, contextlib, io, json, logging, sys, warnings
from importlib.metadata import version
from sglang.srt.arg_groups import argparse_actions
from sglang.srt.server_args import ServerArgs

said = []

class _Said(logging.Handler):
    def emit(self, record):
        said.append(record.getMessage())

for logger in (logging.getLogger(), argparse_actions.logger):
    logger.addHandler(_Said())
parser = argparse.ArgumentParser()
ServerArgs.add_cli_args(parser)
out = {"sglang": version("sglang")}
printed = io.StringIO()
with warnings.catch_warnings(record=True) as warned, contextlib.redirect_stderr(printed):
    warnings.simplefilter("always")
    with contextlib.redirect_stdout(printed):
        for scenario, argv in ARGV.items():
            ns = parser.parse_args(argv)
            keys = ("model_path", "port", "tp_size", "enable_return_routed_experts", "enable_metrics")
            out[scenario] = {k: getattr(ns, k) for k in keys}
said += [str(w.message) for w in warned] + printed.getvalue().splitlines()
emit([out, said])
"""


@pytest.mark.sglang
def test_engine_command_line_parses_with_sglang_0_5_23() -> None:
    """SGLang 0.5.23's own argument parser accepts every rendered engine command line, with no deprecated flag."""
    argv = {s: container(render(scenario_values(s)), "engine")["args"] for s in SCENARIOS}
    engine = container(render(), "engine")
    assert engine["command"] == ["python3", "-m", "sglang.launch_server"]
    ((parsed, said),) = run_sglang(f"ARGV = {argv!r}\n" + _SGLANG_PARSE)
    assert not [line for line in said if "deprecated" in line.lower()], said
    assert parsed.pop("sglang") == "0.5.23"
    for scenario, args in parsed.items():
        v = effective_values(scenario_values(scenario))
        assert args == {
            "model_path": v["engine"]["model"],
            "port": v["engine"]["port"],
            "tp_size": v["engine"]["tensorParallelSize"],
            "enable_return_routed_experts": True,
            "enable_metrics": v["engine"]["metrics"]["enabled"],
        }, scenario


def test_sidecar_command_line_parses_with_the_real_cli(rendered: tuple[dict, list]) -> None:
    from service.server.cli import build_parser

    values, objects = rendered
    v = effective_values(values)
    args = build_parser().parse_args(container(objects, "sidecar")["args"])
    assert args.command == "serve"
    assert int(args.setting_port) == v["sidecar"]["port"] and args.setting_host == "0.0.0.0"


def _kubelet_expand(value: str, env: dict[str, str]) -> str:
    """Kubernetes' `$(VAR)` expansion of an env value from variables defined before it."""
    return re.sub(r"\$\((\w+)\)", lambda m: env.get(m.group(1), m.group(0)), value)


@pytest.mark.parametrize("scenario", ["defaults", "pod-ip-custom-spool"])
def test_advertised_url_fetches_the_record_from_the_sidecar(scenario: str, spool: Spool, serve: Any) -> None:
    """The engine's own settings and URL builder, fed the rendered environment of pod 3, yield a URL whose
    host is that pod and whose path a live sidecar answers with the record."""
    import httpx
    from helpers import random_rows, write_record

    from engine_ext.core.records import routed_experts_url
    from engine_ext.core.settings import EngineSettings

    v = effective_values(scenario_values(scenario))
    objects = render(scenario_values(scenario))
    pod_name, pod_ip = f"{one(objects, 'StatefulSet')['metadata']['name']}-3", "10.1.2.3"
    downward = {"POD_NAME": pod_name, "POD_IP": pod_ip}
    env = {
        k: _kubelet_expand(val, downward)
        for k, val in resolved_env(objects, container(objects, "engine")).items()
        if isinstance(val, str)
    }
    assert "$(" not in env["R3_SIDECAR_URL"] and env["R3_ENGINE_ID"] == pod_name
    settings = EngineSettings.model_validate(
        {k.removeprefix("R3_").lower(): val for k, val in env.items() if k.startswith("R3_")}
    )
    rid = "chatcmpl-7f/x y"
    url = httpx.URL(routed_experts_url(settings.sidecar_url, rid))
    expected_host = (
        pod_ip
        if v["sidecar"]["advertise"] == "podIP"
        else (f"{pod_name}.{one(objects, 'StatefulSet')['spec']['serviceName']}.{NAMESPACE}.svc.{v['clusterDomain']}")
    )
    assert (url.host, url.port) == (expected_host, v["sidecar"]["port"])

    write_record(spool, rid, random_rows(6))
    base = serve()
    r = httpx.get(base + url.raw_path.decode(), params={"format": "raw"}, timeout=10)
    assert r.status_code == 200 and unquote(r.headers["X-R3-Rid"]) == rid  # the header is percent-encoded
    assert len(r.content) == 6 * 4 * 8
