"""One engine import per test process: a zygote that has run a prelude once forks each child from it.

Why: the engine tests run their code in child processes (SGLang's classes through `sglang_env.run_sglang`, vLLM's
through `vllm_children.run_vllm`, SGLang's compiled capture per release), and each child used to start a fresh
interpreter whose imports (torch with SGLang or vLLM: 8-16 CPU-s here) were most of its time. A fork of a process
that has run exactly a prelude is the same process a fresh interpreter is after it: the same modules, the same
workarounds applied, nothing published, no hook applied. The child then runs the same source the fresh
interpreter would in a new `__main__`, with its output in files and its exit status reported back.

What a fork cannot reproduce is an environment variable read while the prelude imported: the zygote serves a
child only when the environment asked for differs from its own in `R3_*` and `PYTEST_*` variables alone
(`SERVED_PREFIXES`); the caller gives anything else a fresh interpreter. The zygote runs no torch operation before
it forks, so no thread pool exists to be lost in a child.

The protocol is one JSON line each way on the zygote's stdin and stdout: a request names the code, the
environment and two files for the child's stdout and stderr; the zygote answers with the child's pid at once,
then with its exit status when it ends.
"""

from __future__ import annotations

import atexit
import gc
import json
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import traceback
import types
from pathlib import Path
from typing import IO, Any

# Variables a child may have other than the zygote's: the plugin's (read when it loads, after the fork) and
# pytest's own (`PYTEST_CURRENT_TEST` names each test), neither read by the prelude's imports.
SERVED_PREFIXES = ("R3_", "PYTEST_")


def serves(started: dict[str, str], ready: dict[str, str], wanted: dict[str, str]) -> bool:
    """Whether a child with environment `wanted` may be forked from a zygote started with `started` whose prelude
    left `ready`: apart from `SERVED_PREFIXES` variables, `wanted` is `ready`, but for variables the prelude's
    imports added (SGLang sets some on import), which a fresh interpreter's import adds as well."""
    return not unserved(started, ready, wanted)


def unserved(started: dict[str, str], ready: dict[str, str], wanted: dict[str, str]) -> list[str]:
    """The variables that keep `serves` from forking a child with environment `wanted` (none: it may)."""
    return sorted(
        key
        for key in ready.keys() | wanted.keys()
        if not key.startswith(SERVED_PREFIXES)
        and ready.get(key) != wanted.get(key)
        and (key in wanted or key in started)  # a variable set otherwise, or one the prelude did not add
    )


# Before the prelude: the collector paused while it imports (about 15% of an engine import's CPU here, walking
# the heap it builds); `serve` turns it back on, its objects frozen, so each child collects as a fresh one does.
_PAUSE = "import gc as _gc\n_gc.disable()\n"
# After the prelude: this module imported from its file (the children's path stays the prelude's), then its loop.
_SERVE = f"""
import importlib.util as _util
_spec = _util.spec_from_file_location("zygote", {str(Path(__file__).resolve())!r})
_zygote = _util.module_from_spec(_spec)
_spec.loader.exec_module(_zygote)
_zygote.serve()
"""


class Zygote:
    """The test process's side: starts the zygote once, asks it for children, kills a child past its time."""

    def __init__(self, prelude: str, env: dict[str, str], cwd: Path, python: str | Path = sys.executable) -> None:
        self.started = dict(env)
        self._ready: dict[str, str] | None = None
        self.proc = subprocess.Popen(
            [str(python), "-c", _PAUSE + prelude + _SERVE],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            cwd=cwd,
            env=env,
        )
        assert self.proc.stdout is not None
        self._answers = answer_queue(self.proc.stdout)

    def serves(self, wanted: dict[str, str]) -> bool:
        """Whether this zygote may fork a child with environment `wanted`."""
        return not self.unserved(wanted)

    def unserved(self, wanted: dict[str, str]) -> list[str]:
        """The variables of `wanted` this zygote cannot give a forked child (waits for its prelude the first time)."""
        return unserved(self.started, self._ready_env(), wanted)

    def _ready_env(self) -> dict[str, str]:
        """The environment the zygote reported once its prelude ran (its first answer; waited for the first time)."""
        if self._ready is None:
            self._ready = _read_line(self._answers, 900)["env"]
        return self._ready

    def alive(self) -> bool:
        return self.proc.poll() is None

    def run(self, source: str, env: dict[str, str], out: Path, err: Path, timeout: float) -> int:
        """Run `source` in a forked child; its exit status (negative: killed by that signal)."""
        assert self.proc.stdin is not None
        request = {"source": source, "env": env, "out": str(out), "err": str(err)}
        self._ready_env()  # its first answer, before any child's
        try:
            self.proc.stdin.write(json.dumps(request) + "\n")
            self.proc.stdin.flush()
            pid = int(_read_line(self._answers, 60)["pid"])
            try:
                return int(_read_line(self._answers, timeout)["rc"])
            except TimeoutError:
                os.killpg(pid, signal.SIGKILL)
                _read_line(self._answers, 60)
                raise subprocess.TimeoutExpired(["zygote child", str(pid)], timeout) from None
        except subprocess.TimeoutExpired:
            raise
        except BaseException:
            # Interrupted between a request and its answers (pytest-timeout's exception, a dead pipe): the answers
            # still to come would be read as the next child's, so no later child may use this zygote. Seen in a
            # run at load 17: one test past its 300 s cascaded into 30 failures of later children.
            self.close()
            raise

    def run_captured(self, source: str, env: dict[str, str], timeout: float) -> tuple[int, str, str]:
        """`run` with the child's output in a temporary directory: its exit status, stdout and stderr."""
        with tempfile.TemporaryDirectory(prefix="r3-zygote-") as tmp:
            out, err = Path(tmp, "out"), Path(tmp, "err")
            returncode = self.run(source, env, out, err, timeout)
            return returncode, out.read_text(errors="replace"), err.read_text(errors="replace")

    def close(self) -> None:
        if self.alive():
            self.proc.kill()
            self.proc.wait()


def answer_queue(stream: IO[str]) -> queue.Queue[str | None]:
    """The zygote's answer lines as they arrive, read on a thread (None once it closed its end).

    Why not `select` on the pipe: a child that ends at once has its pid and its exit status written together, the
    first `readline` takes both into the stream's buffer, and a `select` then waits on a pipe with nothing left in
    it (CI-like run, 2026-11-29: `print('ok')` answered its pid, then no status within 60 s)."""
    answers: queue.Queue[str | None] = queue.Queue()

    def pump() -> None:
        for line in stream:
            answers.put(line)
        answers.put(None)

    threading.Thread(target=pump, daemon=True, name="r3-zygote-answers").start()
    return answers


def _read_line(answers: queue.Queue[str | None], timeout: float) -> dict[str, Any]:
    """The zygote's next answer, or TimeoutError; EOF (the zygote died) is an error of its own."""
    try:
        line = answers.get(timeout=timeout)
    except queue.Empty:
        raise TimeoutError from None
    if line is None:
        answers.put(None)  # still closed for whoever reads next
        raise RuntimeError("the zygote exited")
    return json.loads(line)


def serve() -> None:
    """The zygote's loop (runs after the prelude): say its environment, then fork one child per request, answer
    its pid, then its status."""
    print(json.dumps({"env": dict(os.environ)}), flush=True)
    gc.freeze()  # the prelude's imports out of every child's collections: no walk (and copy) of the shared heap
    gc.enable()
    for line in sys.stdin:
        request = json.loads(line)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            _child(request)
        print(json.dumps({"pid": pid}), flush=True)
        _, status = os.waitpid(pid, 0)
        print(json.dumps({"rc": os.waitstatus_to_exitcode(status)}), flush=True)


def _child(request: dict[str, Any]) -> None:
    """In the forked child: its own process group (killed whole on a timeout), the asked `SERVED_PREFIXES`
    variables (the others are the zygote's, which `serves` found equal, or the prelude's own), stdout and
    stderr to the request's files, the zygote's pipes closed, then the source as `python -c` runs it."""
    os.setpgid(0, 0)
    wanted = request["env"]
    for key in [k for k in os.environ if k.startswith(SERVED_PREFIXES) and k not in wanted]:
        del os.environ[key]
    os.environ.update({k: v for k, v in wanted.items() if k.startswith(SERVED_PREFIXES)})  # the rest: `serves`
    for fd, path in ((1, request["out"]), (2, request["err"])):
        target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(target, fd)
        os.close(target)
    os.close(0)
    sys.stdin = open(os.devnull)  # noqa: SIM115 (the child's stdin, as a fresh interpreter's with no input)
    main = types.ModuleType("__main__")
    sys.modules["__main__"] = main
    sys.argv = ["-c"]
    code = compile(request["source"], "<string>", "exec")
    try:
        exec(code, main.__dict__)
        status = 0
    except SystemExit as done:
        status = done.code if isinstance(done.code, int) else (0 if done.code is None else 1)
        if not isinstance(done.code, int | None):
            print(done.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
        status = 1
    _exit(status)


def _exit(status: int) -> None:
    """End the child as an interpreter ends, less its teardown: non-daemon threads are joined, the atexit handlers
    run and the streams are flushed, but no module is cleared and no last collection runs. In a fork those touch
    every page of the heap the zygote's imports built (4-5 s a child here, against 0.1 s for this)."""
    threading._shutdown()  # what `Py_FinalizeEx` does first: wait for the threads the code left running
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
