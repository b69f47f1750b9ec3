"""A build no test proved, in a real SGLang server: the plugin turns on through `fit`, checks itself, then takes over.

The build is miles' case: its image installs its own `sglang-miles` branch editable over an SGLang release image,
and that install reports a setuptools-scm dev version (`0.5.17.devN+g<sha>`: in setuptools-scm's default scheme, N
commits after a 0.5.16 tag; miles' branch itself was not read here). Here SGLang 0.5.16's code
(`.venv-sglang-0.5.16`) with metadata that reads `0.5.17.dev12+g5ee1f00` (a dist-info of that version put first
on the path, its RECORD an editable install's): no test ran that build, and no row of the plugin's matrix names
it, so only what the code has decides. A dev build sorts before its release, so `fit` tries 0.5.16's layout
first. In sidecar mode:

- the start-up line names the build, the layout its code fits (0.5.16's) and that it is unproven;
- the first records are checked: their responses carry SGLang's own inline rows and the pointer, and the spool
  gets exactly those rows; the engine file's `build.check` reaches `agreed`, and `r3_engine_build_info` says so;
- then the plugin delivers: the same prompts' responses carry the pointer only, and the records, gathered the
  plugin's way, are the rows SGLang returned inline for them before.

Made to disagree (a test-only `sitecustomize` that swaps the first two rows of every read the plugin gathers, as
a slice off by one would), on a build that calls itself 0.5.16, a proven release, but is installed editable (its
RECORD lists no source, so nothing shows its files are the release's: `release_files`), which therefore runs
unproven and checks itself as well: the first checked record stops the plugin in that process; SGLang keeps
answering with its own inline rows, one ERROR line, the engine file's `degraded` names the record and row, and
the sidecar counts it in `r3_engine_degraded_hooks_total` (what `R3EngineDegraded` fires on).
"""

from __future__ import annotations

import json
import os
import textwrap
from pathlib import Path

import httpx
import numpy as np
import pytest
from sglang_server import REPO, Config, Stack
from waiting import wait_until

pytestmark = [pytest.mark.sglang, pytest.mark.timeout(900)]

CODE = "0.5.16"  # the release whose code runs: the one a `0.5.17.devN` build follows
DEV_BUILD = "0.5.17.dev12+g5ee1f00"
PROMPTS = [[5 + i, 17, 33 + i, 2, 9, 41 + 2 * i, 12, 7, 30 + i] for i in range(3)]
SWAP = textwrap.dedent(
    """
    import engine_ext.sglang.gather as gather

    _real = gather.gather_slots

    def gather_slots(host_buffer, slots):  # test-only: the plugin's gathered rows, first two swapped
        rows = _real(host_buffer, slots).clone()
        if rows.shape[0] > 1:
            rows[[0, 1]] = rows[[1, 0]]
        return rows

    gather.gather_slots = gather_slots
    """
)


def shadow_build(root: Path, *, swap: bool, version: str = DEV_BUILD) -> str:
    """A PYTHONPATH whose first entry says SGLang is `version`, installed editable: a RECORD that lists none of
    its sources (and, with `swap`, shifts the plugin's rows)."""
    root.mkdir(parents=True, exist_ok=True)
    info = root / f"sglang-{version}.dist-info"
    info.mkdir(exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: sglang\nVersion: {version}\n")
    (info / "RECORD").write_text(f"__editable__.sglang-{version}.pth,,\n{info.name}/RECORD,,\n")
    if swap:
        (root / "sitecustomize.py").write_text(SWAP)
    return os.pathsep.join(filter(None, [str(root), str(REPO), os.environ.get("PYTHONPATH")]))


def config(name: str, path: str) -> Config:
    env = {"PYTHONPATH": path, "R3_MODE": "sidecar", "R3_BUILD_CHECK_RECORDS": "2"}
    return Config(name, env=env, python=str(REPO / f".venv-sglang-{CODE}" / "bin" / "python"))


def engine_file(stack: Stack) -> dict:
    (path,) = (stack.spool / "v1" / "engines").glob("*.json")
    return json.loads(path.read_text())


def ask(stack: Stack, prompt: list[int]) -> dict:
    return stack.generate(prompt, return_routed_experts=True)["meta_info"]


def inline(stack: Stack, meta: dict) -> np.ndarray | None:
    return stack.inline_rows({"meta_info": meta})


@pytest.fixture(scope="module")
def checked(sglang_stack, tmp_path_factory) -> tuple[Stack, list[np.ndarray]]:
    """The dev build's server, its first requests (checked) answered; SGLang's inline rows of each prompt."""
    stack = sglang_stack(config("unproven-build", shadow_build(tmp_path_factory.mktemp("dev"), swap=False)))
    metas = [ask(stack, prompt) for prompt in PROMPTS[:2]]
    return stack, metas


def test_the_plugin_turns_on_for_a_dev_build_naming_the_layout_it_fits(checked):
    stack, _ = checked
    log = stack.server.log_text()
    line = f"r3-sidecar: sglang=={DEV_BUILD}: layout {CODE} applied (fits, but no test ran this build"
    assert line in log, stack.server.log_tail()
    assert "registering no hooks" not in log


def test_checked_records_keep_sglangs_rows_and_the_pointer_and_equal_them(checked):
    stack, metas = checked
    for meta in metas:
        rows = inline(stack, meta)
        assert rows is not None and meta.get("routed_experts_url"), meta.keys()  # both, while checking
        _, stored = stack.final_record(meta["id"])
        np.testing.assert_array_equal(stored.astype(np.int32), rows)


def test_once_agreed_the_plugin_delivers_what_sglang_returned_inline(checked):
    stack, metas = checked
    check = wait_until(
        lambda: (engine_file(stack).get("build") or {}).get("check", {}).get("state") == "agreed" or None,
        60,
        lambda: f"the build check agreed (engine file build: {engine_file(stack).get('build')})",
    )
    assert check
    build = engine_file(stack)["build"]
    assert build == {"found": DEV_BUILD, "layout": CODE, "proven": False, "check": build["check"]}
    assert build["check"] == {"state": "agreed", "agreed": 2, "needed": 2}
    for prompt, before in zip(PROMPTS[:2], metas, strict=True):
        meta = ask(stack, prompt)
        assert meta.get("routed_experts") is None and meta.get("routed_experts_url"), meta.keys()  # sidecar mode
        _, stored = stack.final_record(meta["id"])
        np.testing.assert_array_equal(stored.astype(np.int32), inline(stack, before))
    metrics = httpx.get(f"{stack.sidecar_url}/metrics", timeout=10).text
    info = [line for line in metrics.splitlines() if line.startswith("r3_engine_build_info{")]
    assert len(info) == 1 and f'found="{DEV_BUILD}"' in info[0] and f'layout="{CODE}"' in info[0], info
    assert 'proven="false"' in info[0] and 'check="agreed"' in info[0] and info[0].endswith(" 1.0"), info
    engines = httpx.get(f"{stack.sidecar_url}/v1/engines", timeout=10).json()
    assert [e["build"]["found"] for e in engines["engines"]] == [DEV_BUILD], engines


def test_a_build_made_to_disagree_leaves_sglang_in_charge_loudly(checked, sglang_stack, tmp_path_factory):
    """This build calls itself 0.5.16, a proven release, but is installed editable: its files cannot be shown to
    be the release's (a patched image's may not be), so it runs unproven and checks itself too."""
    _, metas = checked  # SGLang's own rows of the same prompts, from the same code's build that agreed
    shadow = shadow_build(tmp_path_factory.mktemp("swap"), swap=True, version=CODE)
    stack = sglang_stack(config("disagreeing-build", shadow))
    line = f"r3-sidecar: sglang=={CODE}: layout {CODE} applied (fits, but no test ran this build"
    assert line in stack.server.log_text() and "its files are not the release's: no .py file" in stack.server.log_text()
    first = ask(stack, PROMPTS[0])
    np.testing.assert_array_equal(inline(stack, first), inline(stack, metas[0]))  # SGLang's own rows, answered

    def degraded() -> list | None:
        return engine_file(stack).get("degraded") or None

    (fault,) = wait_until(degraded, 60, lambda: f"a degraded entry (engine file: {engine_file(stack)})")
    assert f"record {first['id']!r}" in fault["error"] and "row 0, layer slot 0" in fault["error"], fault
    assert "differs from SGLang's own" in fault["error"] and CODE in fault["error"], fault
    again = ask(stack, PROMPTS[1])  # SGLang's path from now on: its inline rows
    np.testing.assert_array_equal(inline(stack, again), inline(stack, metas[1]))
    errors = [line for line in stack.server.log_text().splitlines() if "failed: BuildMismatch" in line]
    assert len(errors) == 1 and "r3-sidecar: hook" in errors[0], errors
    metrics = httpx.get(f"{stack.sidecar_url}/metrics", timeout=10).text
    assert any(
        line.startswith("r3_engine_degraded_hooks_total{") and line.endswith(" 1.0") for line in metrics.splitlines()
    ), metrics
