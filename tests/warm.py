"""``python -m bnexp ...`` (or ``python tests/fault_hooks.py ...``) in a process of its own that
skips the imports: a fork of a server that imported bnexp once (multiprocessing's forkserver).

A fresh interpreter spends about 4 s of CPU importing torch, torchvision and Hydra before
bnexp runs; the tests that kill or signal a run, or run it with a fault hook, start about a
dozen. Here each is a child of the forkserver: a real process with its own pid, signal
handlers, working directory, environment, output and exit status (negative for a signal), as a
fresh interpreter gives them, uncaught errors and Ctrl-C included. What differs:
- the imports happened before the fork: a warning raised while importing goes to the server,
  and what the interpreter or a library reads from the environment when it starts (PYTHON*,
  OMP_NUM_THREADS, MKL_*) comes from the environment of the test that started the server;
- every child has the server's string-hash seed (a fresh interpreter draws its own), its
  interpreter flags, and the test process's ``sys.path`` besides the command's own entry;
- the parent process is the forkserver, multiprocessing names the process ForkServerProcess-N,
  stdin is /dev/null, and a traceback shows this module's frames;
- at the end, buffers of C code's own stdio are not flushed (``os._exit``).
So a test that checks something across runs (a resume after a kill) re-runs in a fresh
interpreter, with a hash seed of its own. The README's commands, the DDP tests of
tests/test_distributed.py, every DDP rank, the torchrun launcher whose ranks must be gone when
it is, the plugin tests and the file-size-limit tests keep starting a fresh interpreter.
"""

from __future__ import annotations

import atexit
import contextlib
import multiprocessing
import os
import runpy
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Sequence

CONTEXT = multiprocessing.get_context("forkserver")
CONTEXT.set_forkserver_preload(["bnexp.cli", "tests.warm"])
_started: list[WarmPopen] = []


def _exit_status(exit_: SystemExit) -> int:
    """The status an interpreter ends with on ``sys.exit(code)`` (a message goes to stderr)."""
    if exit_.code is None or isinstance(exit_.code, int):
        return exit_.code or 0
    print(exit_.code, file=sys.stderr)
    return 1


def _run(argv: list[str], cwd: str, env: dict[str, str], out_dir: str) -> None:
    """In the child: become ``python ARGV`` run in ``cwd`` with ``env``, its output in
    ``out_dir``, and end as an interpreter ends: its threads joined, the exit functions,
    flushed streams, the status of ``sys.exit``, 1 after printing an uncaught error, killed by
    SIGINT after an uncaught Ctrl-C."""
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    for fd, name in ((1, "stdout"), (2, "stderr")):
        target = os.open(os.path.join(out_dir, name), os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(target, fd)
        os.close(target)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    status, interrupted = 0, False
    try:
        if argv[0] == "-m":  # as `python -m MODULE`: the working directory first on sys.path
            sys.path.insert(0, cwd)
            sys.argv = [argv[1], *argv[2:]]
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:  # as `python SCRIPT`
            sys.path.insert(0, str(Path(argv[0]).resolve().parent))
            sys.argv = list(argv)
            runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as exit_:
        status = _exit_status(exit_)
    except BaseException as err:  # an interpreter prints whatever ends its program
        sys.excepthook(type(err), err, err.__traceback__)
        status, interrupted = 1, isinstance(err, KeyboardInterrupt)
    for thread in threading.enumerate():  # an interpreter waits for its non-daemon threads
        if thread is not threading.current_thread() and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    if interrupted:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    os._exit(status)


class WarmPopen:
    """The part of ``subprocess.Popen`` the tests use, for ``[sys.executable, *ARGV]``; stdout
    and stderr are always captured (text)."""

    def __init__(self, args: Sequence[str], cwd: Path | None = None) -> None:
        if args[0] != sys.executable:
            raise ValueError(f"not a Python command: {args[0]}")
        self.args = list(args)
        self._out = tempfile.mkdtemp(prefix="bnexp-warm-")
        for name in ("stdout", "stderr"):  # there even if the child fails before it writes
            Path(self._out, name).touch()
        self._output: tuple[str, str] | None = None
        self._proc = CONTEXT.Process(target=_run, args=(self.args[1:], str(cwd or os.getcwd()), dict(os.environ),
                                                        self._out))
        self._proc.start()
        self.pid = self._proc.pid
        _started.append(self)

    @property
    def returncode(self) -> int | None:
        return self._proc.exitcode

    def poll(self) -> int | None:
        return self._proc.exitcode

    def wait(self, timeout: float | None = None) -> int:
        """The exit status, once the process has ended (its output read, its folder removed)."""
        self._proc.join(timeout)
        if self._proc.exitcode is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0)
        if self._output is None:
            out, err = (Path(self._out, name).read_text(errors="replace") for name in ("stdout", "stderr"))
            self._output = (out, err)
            shutil.rmtree(self._out, ignore_errors=True)
        return self._proc.exitcode

    def send_signal(self, signum: int) -> None:
        if self._proc.exitcode is None:
            with contextlib.suppress(ProcessLookupError):  # it ended since
                os.kill(self.pid, signum)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def communicate(self, timeout: float | None = None) -> tuple[str, str]:
        """Wait for the end; its (stdout, stderr)."""
        self.wait(timeout)
        assert self._output is not None
        return self._output


def run(args: Sequence[str], cwd: Path | None = None, timeout: float | None = None) -> subprocess.CompletedProcess:
    """``subprocess.run(args, cwd=cwd, capture_output=True, text=True)`` in a warm process."""
    proc = WarmPopen(args, cwd)
    out, err = proc.communicate(timeout)
    return subprocess.CompletedProcess(proc.args, proc.wait(), out, err)


@atexit.register
def _kill_leftovers() -> None:
    """A test that failed before ending its process leaves it running: multiprocessing would
    wait for it when the worker exits (this runs first: exit functions run in reverse)."""
    for proc in _started:
        proc.kill()
        shutil.rmtree(proc._out, ignore_errors=True)
