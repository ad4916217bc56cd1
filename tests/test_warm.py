"""tests/warm.py: a forked warm process answers as a fresh interpreter does."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests import warm


def test_warm_process_answers_as_a_fresh_interpreter(tmp_path: Path) -> None:
    """The same exit code, stdout and stderr for a command bnexp refuses, in the given working
    directory."""
    command = [sys.executable, "-m", "bnexp", "train", "norm=nope", f"hydra.run.dir={tmp_path / 'run'}"]
    fresh = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True)
    warmed = warm.run(command, cwd=tmp_path)
    assert fresh.returncode == warmed.returncode == 2
    assert (fresh.stdout, fresh.stderr) == (warmed.stdout, warmed.stderr) and "unknown norm 'nope'" in fresh.stderr


@pytest.mark.parametrize(("ending", "status", "last_line"), [
    ("sys.exit(3)", 3, ""),
    ("sys.exit(-2)", 254, ""),  # a status, not the death by SIGINT of an uncaught Ctrl-C
    ("sys.exit('bad input')", 1, "bad input"),
    ("raise ValueError('x')", 1, "ValueError: x"),
    ("raise KeyboardInterrupt", -signal.SIGINT, "KeyboardInterrupt"),
])
def test_warm_script_ends_as_in_a_fresh_interpreter(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, ending: str,
                                                    status: int, last_line: str) -> None:
    """Working directory, environment, arguments, output, and each way a program ends: the
    status and the last line of stderr of a fresh interpreter, after it has waited for a
    thread that is still running and then run its exit functions."""
    script = tmp_path / "where.py"
    script.write_text("import atexit, os, sys, threading, time\n"
                      "print(os.getcwd(), os.environ['WARM_CHECK'], sys.argv[1:], flush=True)\n"
                      "atexit.register(print, 'at exit')\n"
                      "threading.Thread(target=lambda: (time.sleep(0.5), print('thread done'))).start()\n"
                      f"{ending}\n")
    monkeypatch.setenv("WARM_CHECK", "yes")
    fresh = subprocess.run([sys.executable, str(script), "a"], cwd=tmp_path, capture_output=True, text=True)
    warmed = warm.run([sys.executable, str(script), "a"], cwd=tmp_path)
    for done in (fresh, warmed):
        assert (done.returncode, done.stdout) == (status, f"{tmp_path} yes ['a']\nthread done\nat exit\n")
        assert (done.stderr.splitlines() or [""])[-1] == last_line


def test_warm_process_is_the_process_that_runs_the_command(tmp_path: Path) -> None:
    """Its pid is that of the process running the script, and a signal kills it as it kills
    a child (a negative return code)."""
    script = tmp_path / "sleep.py"
    script.write_text("import os, time\n(open('pid', 'w').write(str(os.getpid())))\ntime.sleep(600)\n")
    proc = warm.WarmPopen([sys.executable, str(script)], cwd=tmp_path)
    deadline = time.monotonic() + 60
    while not (tmp_path / "pid").exists() or not (tmp_path / "pid").read_text():
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.01)
    assert int((tmp_path / "pid").read_text()) == proc.pid
    proc.send_signal(signal.SIGKILL)
    assert proc.wait(timeout=60) == -signal.SIGKILL
