"""No worker process outlives its command (bnexp.support.workers), and every sweep's report
counts what it ran, also when joblib's workers are kept from one sweep to the next."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests.conftest import TINY, run_cli

# A command that trains in two joblib (loky) workers, each job stopping as a run does on
# SIGTERM: it records the signal, then returns, as a run returns after its checkpoint.
COMMAND = textwrap.dedent("""
    import os, signal, sys, time
    from pathlib import Path
    from joblib import Parallel, delayed
    from bnexp.support.workers import ends_with_parent

    @ends_with_parent
    def job(out):
        stop = []
        signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
        Path(out, f"started-{os.getpid()}").touch()
        while not stop:
            time.sleep(0.05)
        Path(out, f"stopped-{os.getpid()}").touch()

    if __name__ == "__main__":
        Parallel(n_jobs=2)(delayed(job)(sys.argv[1]) for _ in range(2))
""")


def running(pid: int) -> bool:
    """Whether process ``pid`` exists and is not a zombie (one that ended, not yet reaped)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, IndexError):
        return False


def wait_for(condition, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGKILL], ids=lambda s: s.name)
def test_joblib_workers_end_with_their_command(sig: signal.Signals, tmp_path: Path) -> None:
    """Whichever signal ends the command, both workers stop their job and end within seconds
    (long before the watcher's SIGKILL, GRACE_SECONDS after the command's end)."""
    (tmp_path / "command.py").write_text(COMMAND)
    # started as from a terminal: Ctrl-C not ignored, even where the test runner inherited an ignored
    # SIGINT (a job a non-interactive shell put in the background, as `nohup ... &` does)
    command = subprocess.Popen([sys.executable, str(tmp_path / "command.py"), str(tmp_path)], start_new_session=True,
                               stderr=subprocess.DEVNULL, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    workers: list[int] = []
    try:
        assert wait_for(lambda: len(list(tmp_path.glob("started-*"))) == 2, 120)
        workers = [int(p.name.split("-")[1]) for p in tmp_path.glob("started-*")]
        os.kill(command.pid, sig)
        assert command.wait(timeout=30) == -sig
        assert wait_for(lambda: not any(map(running, workers)), 20), [w for w in workers if running(w)]
        if sig != signal.SIGINT:  # on Ctrl-C joblib ends its workers itself
            assert sorted(p.name for p in tmp_path.glob("stopped-*")) == sorted(f"stopped-{w}" for w in workers)
    finally:
        for pid in [command.pid, *workers]:
            if running(pid):
                os.kill(pid, signal.SIGKILL)


@pytest.mark.slow
def test_sweeps_in_kept_joblib_workers_report_their_own_runs(tmp_path: Path, capsys) -> None:
    """Two sweeps through the joblib launcher, the second in the worker processes the first
    started: each report counts its own two runs, and no ledger is left behind."""
    for n in (1, 2):
        code, out = run_cli(["train", "-m", *TINY, "act=relu,tanh", f"hydra.sweep.dir={tmp_path / str(n)}",
                             "hydra/launcher=joblib", "hydra.launcher.n_jobs=2"], capsys)
        assert code == 0 and "sweep finished: 2 cells: 2 completed, 0 diverged, 0 failed\n" in out, out[-2000:]
    assert not list(tmp_path.rglob(".sweep-*"))


@pytest.mark.slow
def test_a_joblib_sweep_killed_leaves_no_worker_and_resumable_runs(tmp_path: Path) -> None:
    """``bnexp train -m ... hydra/launcher=joblib`` ended by SIGKILL: its workers checkpoint
    their runs (status preempted, as after SIGTERM) and end."""
    command = subprocess.Popen([sys.executable, "-m", "bnexp", "train", "-m", *TINY, "trainer.max_steps=1000000",
                                "act=relu,tanh", f"hydra.sweep.dir={tmp_path}", "hydra/launcher=joblib",
                                "hydra.launcher.n_jobs=2"], start_new_session=True, stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL)
    workers: list[int] = []
    try:
        assert wait_for(lambda: len(list(tmp_path.glob("*/metrics.csv"))) == 2, 300)
        workers = [int(p) for p in Path(f"/proc/{command.pid}/task/{command.pid}/children").read_text().split()]
        os.kill(command.pid, signal.SIGKILL)
        assert wait_for(lambda: not any(map(running, workers)), 30), [w for w in workers if running(w)]
        from bnexp.support.runinfo import read_run_json

        for summary in tmp_path.glob("*/summary.json"):
            assert read_run_json(summary)["status"] == "preempted"
            assert list(summary.parent.glob("checkpoints/*.pt"))
    finally:
        for pid in [command.pid, *workers]:
            if running(pid):
                os.kill(pid, signal.SIGKILL)
