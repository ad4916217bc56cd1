"""``python -m bnexp ...`` (or ``python tests/fault_hooks.py ...``) in a process of its own that
skips the imports: a fork of a server that imported bnexp once (multiprocessing's forkserver).

A fresh interpreter spends about 4 s of CPU importing torch, torchvision and Hydra before
bnexp runs; the tests that signal or kill a run, or run it with a fault hook, start about a
dozen. Here each is a child of the forkserver: a real process with its own pid, signal
handlers, working directory, environment and exit code, killed, stopped and signalled as
the tests did before; only the imports were done before the fork. The tests of the README's
commands, of the DDP launcher as a user starts it, of plugins (``BNEXP_PLUGINS``) and of
resource limits keep starting a fresh interpreter.
"""

from __future__ import annotations

import atexit
import multiprocessing
import os
import runpy
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Optional, Sequence

CONTEXT = multiprocessing.get_context("forkserver")
CONTEXT.set_forkserver_preload(["bnexp.cli", "tests.warm"])
_started: list[WarmPopen] = []


def _run(argv: list[str], cwd: str, env: dict[str, str], out_dir: str) -> None:
    """In the child: become ``python ARGV`` run in ``cwd`` with ``env``, its output in
    ``out_dir``; then end as an interpreter ends (exit functions, flushed streams)."""
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    for fd, name in ((1, "stdout"), (2, "stderr")):
        target = os.open(os.path.join(out_dir, name), os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(target, fd)
        os.close(target)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        if argv[0] == "-m":  # as `python -m MODULE`: the working directory first on sys.path
            sys.path.insert(0, cwd)
            sys.argv = [argv[1], *argv[2:]]
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:  # as `python SCRIPT`
            sys.path.insert(0, str(Path(argv[0]).resolve().parent))
            sys.argv = list(argv)
            runpy.run_path(argv[0], run_name="__main__")
    finally:
        atexit._run_exitfuncs()


class WarmPopen:
    """The part of ``subprocess.Popen`` the tests use, for ``[sys.executable, *ARGV]``; stdout
    and stderr are always captured (text)."""

    def __init__(self, args: Sequence[str], cwd: Optional[Path] = None) -> None:
        if args[0] != sys.executable:
            raise ValueError(f"not a Python command: {args[0]}")
        self.args = list(args)
        self._out = tempfile.mkdtemp(prefix="bnexp-warm-")
        for name in ("stdout", "stderr"):  # there even if the child fails before it writes
            Path(self._out, name).touch()
        self._proc = CONTEXT.Process(target=_run, args=(self.args[1:], str(cwd or os.getcwd()), dict(os.environ),
                                                        self._out))
        self._proc.start()
        self.pid = self._proc.pid
        _started.append(self)

    @property
    def returncode(self) -> Optional[int]:
        return self._proc.exitcode

    def poll(self) -> Optional[int]:
        return self._proc.exitcode

    def wait(self, timeout: Optional[float] = None) -> int:
        self._proc.join(timeout)
        if self._proc.exitcode is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0)
        return self._proc.exitcode

    def send_signal(self, signum: int) -> None:
        if self._proc.exitcode is None:
            os.kill(self.pid, signum)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def communicate(self, timeout: Optional[float] = None) -> tuple[str, str]:
        """Wait for the end; its (stdout, stderr)."""
        self.wait(timeout)
        return tuple(Path(self._out, name).read_text(errors="replace") for name in ("stdout", "stderr"))


def run(args: Sequence[str], cwd: Optional[Path] = None, timeout: Optional[float] = None) -> subprocess.CompletedProcess:
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
