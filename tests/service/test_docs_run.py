"""Docs that run: every ```python block of README.md and docs/, executed as written against a real
`r3-sidecar demo` (a subprocess on a free 127.0.0.1 port, as `make demo` runs it).

Blocks fenced ```python no-run show a framework's own code (names that exist only inside verl, slime, …); they
are listed, not run, and their first line says why. The docs say `http://127.0.0.1:8000` (the demo's default);
the test's demo listens on a free port, so that one string is replaced by its URL. Nothing else in a block
changes, except in the recipes (`tests/docs_blocks.py`): each also runs with its stand-in response replaced by
the three a real engine gives for the same record: the pointer only (sidecar mode), SGLang's inline rows only (a
refused spool, several tokenizer workers) and both (mirror mode), the rows saying their shape and start as the
plugin's front doors write them (`engine_ext.sglang.frontdoors.inline_shape`). The same recipes against a real
SGLang server's responses: `tests/e2e/test_sglang_plain.py`.
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from docs_blocks import ALL, DOC_URL, DOCS, MODES, RECIPES, REPO, RUNNABLE, Block
from helpers import bound_socket, wait_sidecar_ready

from engine_ext.sglang.frontdoors import inline_shape


def test_every_python_block_is_run_or_says_why_not() -> None:
    unknown = [(b.id, b.info) for b in ALL if b.info not in ("", "no-run")]
    assert not unknown, f"a python fence is `python` (run in CI) or `python no-run` (a framework's code): {unknown}"
    silent = [b.id for b in ALL if b.info == "no-run" and not b.code.lstrip().startswith("#")]
    assert not silent, f"a `python no-run` block starts with a comment saying why it cannot run: {silent}"
    assert {"README.md", "docs/api.md"} <= {b.doc for b in RUNNABLE}
    assert len(RECIPES) >= 2, "README's and the trainer pages' recipes hand a response to from_response"
    assert all(doc in DOCS for doc in ("README.md", "docs/trainers.md"))


LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


def test_every_link_names_a_file_in_the_repository() -> None:
    """Relative links of README.md and docs/ resolve (every other citation of a document: test_doc_references)."""
    broken = []
    for doc in DOCS:
        for target in LINK.findall((REPO / doc).read_text()):
            if "://" not in target and not ((REPO / doc).parent / target).exists():
                broken.append((doc, target))
    assert not broken, broken


@pytest.mark.parametrize("block", [b for b in ALL if b.info == "no-run"], ids=lambda b: b.id)
def test_no_run_blocks_are_valid_python(block: Block) -> None:
    """A framework's code cannot run here, but it must parse (top-level `await`: it sits in an async def there)."""
    compile(block.code, block.id, "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)


@pytest.fixture(scope="module")
def demo_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    sock = bound_socket()
    port = sock.getsockname()[1]
    sock.close()
    script = Path(sys.executable).with_name("r3-sidecar")
    cmd = [str(script)] if script.exists() else [sys.executable, "-m", "service.server.cli"]
    env = {**os.environ, "R3_SPOOL_DIR": str(tmp_path_factory.mktemp("docs") / "spool")}
    proc = subprocess.Popen(
        [*cmd, "demo", "--host", "127.0.0.1", "--port", str(port), "--step-ms", "5"],
        cwd=REPO,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"

    try:
        wait_sidecar_ready(url, 30, proc)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.mark.parametrize("block", RUNNABLE, ids=[b.id for b in RUNNABLE])
def test_block_runs_as_written(demo_url: str, block: Block) -> None:
    source = block.code.replace(DOC_URL, demo_url)
    exec(compile(source, block.id, "exec"), {"__name__": "__docs__"})


def engine_response(stand_in: dict, mode: str) -> dict:
    """What an engine with the plugin answers for the stand-in's record in `mode`: its pointer, SGLang's inline
    rows (the sidecar's `sglang_b64`: byte-identical to SGLang's payload) with their shape and start, or both."""
    meta = dict(stand_in["meta_info"])
    if mode != "pointer":
        got = httpx.get(meta["routed_experts_url"], params={"format": "sglang_b64", "wait": 30}, timeout=40)
        assert got.status_code == 200, got.text
        topk = int(got.headers["X-R3-Shape"].split(",")[2])
        layers, start = int(got.headers["X-R3-Num-Hidden-Layers"]), int(got.headers["X-R3-Start"])
        said = inline_shape(got.text, num_hidden_layers=layers, topk=topk, start_len=start)
        assert said is not None
        meta |= {"routed_experts": got.text, **said}
    if mode == "inline":
        del meta["routed_experts_url"]
    return {"meta_info": meta}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("block", RECIPES, ids=[b.id for b in RECIPES])
def test_recipe_runs_in_every_delivery_mode(demo_url: str, block: Block, mode: str) -> None:
    stand_in = ast.literal_eval(block.stand_in().replace(DOC_URL, demo_url))
    source = block.with_response("__response__").replace(DOC_URL, demo_url)
    env = {"__name__": "__docs__", "__response__": engine_response(stand_in, mode)}
    exec(compile(source, f"{block.id}[{mode}]", "exec"), env)


def test_readme_blocks_run_again(demo_url: str) -> None:
    """README's block acknowledges `demo-000000`; a second run must work too (the demo writes its documented rids
    again), not wait 30 s and fail. Runs after every block has run once (pytest keeps definition order)."""
    for block in (b for b in RUNNABLE if b.doc == "README.md"):
        exec(compile(block.code.replace(DOC_URL, demo_url), f"{block.id} (again)", "exec"), {"__name__": "__docs__"})
