"""tests/warm.py: a forked warm process answers as a fresh interpreter does."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from tests import warm


def test_warm_process_answers_as_a_fresh_interpreter(tmp_path: Path) -> None:
    """The same exit code, stdout and stderr for a command bnexp refuses, in the given working
    directory and with the caller's environment."""
    command = [sys.executable, "-m", "bnexp", "train", "norm=nope", f"hydra.run.dir={tmp_path / 'run'}"]
    fresh = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True)
    warmed = warm.run(command, cwd=tmp_path)
    assert fresh.returncode == warmed.returncode == 2
    assert (fresh.stdout, fresh.stderr) == (warmed.stdout, warmed.stderr) and "unknown norm 'nope'" in fresh.stderr
    script = tmp_path / "where.py"
    script.write_text("import os, sys\nprint(os.getcwd(), os.environ['WARM_CHECK'], sys.argv[1:])\nsys.exit(3)\n")
    os.environ["WARM_CHECK"] = "yes"
    try:
        done = warm.run([sys.executable, str(script), "a", "b"], cwd=tmp_path)
    finally:
        del os.environ["WARM_CHECK"]
    assert (done.returncode, done.stdout) == (3, f"{tmp_path} yes ['a', 'b']\n")


def test_warm_process_is_a_process_of_its_own(tmp_path: Path) -> None:
    """Its own pid, and killed by a signal as a child would be (a negative return code)."""
    script = tmp_path / "sleep.py"
    script.write_text("import time\nprint('up', flush=True)\ntime.sleep(600)\n")
    proc = warm.WarmPopen([sys.executable, str(script)])
    assert proc.pid != os.getpid() and proc.poll() is None
    proc.send_signal(signal.SIGKILL)
    assert proc.wait(timeout=60) == -signal.SIGKILL
