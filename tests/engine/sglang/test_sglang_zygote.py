"""The zygote `run_sglang` forks its children from: each child is a process of its own, as a fresh interpreter
would be (nothing one child changes reaches the next), with the environment asked for; an environment the
zygote cannot give (a variable other than `R3_*`, `PYTEST_*` changed) gets a fresh interpreter; and one zygote
serves every test of the process (the children of two tests share a parent)."""

from __future__ import annotations

import os
import subprocess

import pytest
import sglang_env
import zygote as protocol
from sglang_env import fork_refusal, run_sglang
from zygote import Zygote, serves

WHO = """
import os, sglang.srt.server_args as server_args
emit({"pid": os.getpid(), "parent": os.getppid(), "mark": getattr(server_args, "R3_MARK", None),
      "r3": {k: v for k, v in os.environ.items() if k.startswith("R3_Z")}, "other": os.environ.get("OTHER_Z")})
server_args.R3_MARK = "set by an earlier child"
"""
FRESH_WHO = 'import os\nemit({"parent": os.getppid(), "other": os.environ.get("OTHER_Z")})\n'


def test_only_served_variables_may_differ_but_for_what_the_prelude_added() -> None:
    started = {"PATH": "/bin", "R3_MODE": "mirror"}
    ready = started | {"SET_BY_IMPORT": "1"}  # the prelude's imports added it
    assert serves(started, ready, started | {"R3_SPOOL_DIR": "/x"})
    assert serves(started, ready, {"PATH": "/bin"})  # an R3_ variable removed; the import adds SET_BY_IMPORT again
    assert serves(started, ready, ready | {"PYTEST_CURRENT_TEST": "t.py::test (call)"})  # pytest's, every test
    assert not serves(started, ready, started | {"SGLANG_RUST_SERVER": "1"})
    assert not serves(started, ready, {"PATH": "/usr/bin", "R3_MODE": "mirror"})
    assert not serves(started, ready, started | {"SET_BY_IMPORT": "2"})  # set otherwise before the import


@pytest.mark.sglang
def test_each_child_is_a_new_process_with_its_own_environment(monkeypatch) -> None:
    first, second = (run_sglang(WHO, env={"R3_Z": str(i)})[0] for i in range(2))
    forked = first["parent"] == second["parent"] != os.getpid()  # the zygote's
    assert first["pid"] != second["pid"] and forked, fork_refusal({"R3_Z": "1"})
    assert (first["mark"], second["mark"]) == (None, None)  # the first child's change stayed in it
    assert (first["r3"], second["r3"]) == ({"R3_Z": "0"}, {"R3_Z": "1"})
    # The fresh interpreter's prelude cut to `emit` alone: what the prelude imports runs in a fresh interpreter each
    # time a zygote starts; what is checked here is the way there (13 CPU-s of SGLang imports less).
    monkeypatch.setattr(sglang_env, "_PRELUDE", sglang_env._EMIT)
    (fresh,) = run_sglang(FRESH_WHO, env={"OTHER_Z": "yes"})
    assert fresh["parent"] == os.getpid() and fresh["other"] == "yes"  # not the zygote's: a fresh interpreter
    assert fork_refusal({"OTHER_Z": "yes"}) == "variables differ from the zygote's: OTHER_Z"


@pytest.mark.sglang
def test_a_later_test_forks_from_the_same_zygote() -> None:
    (child,) = run_sglang(WHO)
    forked = child["parent"] != os.getpid()  # pytest changed PYTEST_CURRENT_TEST, which a fork may differ in
    assert forked and child["mark"] is None, fork_refusal()


@pytest.mark.sglang
def test_a_failing_child_reports_its_status_and_output() -> None:
    with pytest.raises(AssertionError, match=r"(?s)exited 1.*--- stdout ---\nbefore.*ZeroDivisionError"):
        run_sglang("print('before', flush=True)\n1 / 0")
    with pytest.raises(AssertionError, match="exited 3"):
        run_sglang("import sys\nsys.exit(3)")


@pytest.mark.sglang
def test_a_child_past_its_time_is_killed_and_the_next_one_runs() -> None:
    with pytest.raises(subprocess.TimeoutExpired):
        run_sglang("import time\ntime.sleep(120)", timeout=2)  # not a wait: the child must outlive its limit
    assert run_sglang("emit('next')") == ["next"]


def test_answers_written_together_are_each_read() -> None:
    """A child that ends at once has its pid and exit status written in one go; both must be read, though the pipe
    then holds nothing more (a `select` on it waited 60 s for the status, read already into the stream's buffer)."""
    read, write = os.pipe()
    os.write(write, b'{"pid": 7}\n{"rc": 0}\n')  # the write end stays open: no EOF wakes the reader
    try:
        answers = protocol.answer_queue(os.fdopen(read))
        assert protocol._read_line(answers, 10) == {"pid": 7}
        assert protocol._read_line(answers, 10) == {"rc": 0}
    finally:
        os.close(write)


def test_a_run_cut_short_retires_its_zygote(tmp_path, monkeypatch) -> None:
    """A run interrupted between its request and its answers (pytest-timeout raises in the test's thread) leaves
    answers that the next run would read as its own: the zygote is closed, so later children start fresh."""
    zygote = Zygote("", dict(os.environ), tmp_path)  # no prelude: the protocol alone
    assert zygote.serves(dict(os.environ))
    out, err = tmp_path / "out", tmp_path / "err"
    assert zygote.run("print('ok')", {}, out, err, 60) == 0 and out.read_text() == "ok\n"
    answers = iter([protocol._read_line])

    def cut_short(stream, timeout):
        reader = next(answers, None)
        if reader is None:
            raise KeyboardInterrupt  # where pytest-timeout's exception lands: waiting for the exit status
        return reader(stream, timeout)

    monkeypatch.setattr(protocol, "_read_line", cut_short)
    with pytest.raises(KeyboardInterrupt):
        zygote.run("import time\ntime.sleep(30)", {}, out, err, 60)  # not a wait: a child still running
    assert not zygote.alive()
