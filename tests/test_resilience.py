"""Checkpoints, exact resume, preemption, damaged checkpoints and sweeps that survive failures."""

from __future__ import annotations

import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from bnexp.engine import checkpoint
from bnexp.engine.callbacks import Callback, TrainState
from bnexp.engine.trainer import CheckpointClock, train
from bnexp.support.errors import EXIT_FAILED, EXIT_PREEMPTED
from tests import warm
from tests.conftest import TINY, compose_cfg, read_metrics, read_summary, run_cli, run_dir_of

EXACT = ["trainer.deterministic=true", "trainer.eval_every=4", "trainer.eval_unit=step",
         "trainer.checkpoint_every=2", "trainer.checkpoint_unit=step"]


def timing_free(rows: list[dict[str, str]]) -> list[dict[str, str]]:
    return [{k: v for k, v in r.items() if k != "seconds"} for r in rows]


def assert_same_run(a: Path, b: Path) -> None:
    """Final weights bit-identical and metrics.csv equal except for the timing column."""
    wa = checkpoint.load(a / "checkpoint.pt")["model"]
    wb = checkpoint.load(b / "checkpoint.pt")["model"]
    assert wa.keys() == wb.keys()
    for key in wa:
        assert torch.equal(wa[key], wb[key]), key
    assert timing_free(read_metrics(a / "metrics.csv")) == timing_free(read_metrics(b / "metrics.csv"))


class CrashAt(Callback):
    """Raise after a given step, as a killed or crashed process would stop."""

    def __init__(self, step: int) -> None:
        self.step = step

    def after_step(self, state: TrainState) -> None:
        if state.step == self.step:
            raise RuntimeError(f"simulated crash at step {self.step}")


def run_inprocess(run_dir: Path, overrides: list[str], callbacks: list[Callback] | None = None) -> dict:
    return train(compose_cfg([*TINY, *EXACT, *overrides]), run_dir, callbacks)


def cli_command(run_dir: Path, steps: int) -> list[str]:
    overrides = [o for o in TINY if not o.startswith("trainer.max_steps")]
    return [sys.executable, "-m", "bnexp", "train", *overrides, *EXACT, f"trainer.max_steps={steps}",
            "data.train_size=256", f"hydra.run.dir={run_dir}"]


def wait_for_checkpoint(run_dir: Path, proc: subprocess.Popen | warm.WarmPopen, min_step: int,
                        timeout: float = 120) -> None:
    """Wait until a complete periodic checkpoint at ``min_step`` or later exists: the file and
    its digest, which is written after it (a kill between the two leaves a damaged checkpoint
    that resume skips, so a run killed at its first checkpoint would start over)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        paths = checkpoint.periodic_checkpoints(run_dir)
        if paths and int(paths[0].stem.split("-")[1]) >= min_step and checkpoint.checksum_path(paths[0]).exists():
            return
        time.sleep(0.005)
    raise AssertionError(f"no checkpoint at step >= {min_step} appeared (exit code {proc.poll()})")


@pytest.mark.slow
def test_sigkill_then_rerun_is_bit_identical(tmp_path: Path) -> None:
    steps = 60
    reference = tmp_path / "reference"
    run_inprocess(reference, [f"trainer.max_steps={steps}", "data.train_size=256"])  # same run, one process
    killed = tmp_path / "killed"
    proc = warm.WarmPopen(cli_command(killed, steps))
    kill_after = random.Random().randrange(2, steps - 10, 2)
    wait_for_checkpoint(killed, proc, kill_after)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not (killed / "checkpoint.pt").exists(), kill_after
    done = subprocess.run(cli_command(killed, steps), capture_output=True, text=True)  # fresh: own hash seed
    assert done.returncode == 0, (kill_after, done.stderr)
    assert "resumed_from" in read_summary(killed), kill_after
    assert_same_run(reference, killed)


@pytest.mark.slow
def test_sigterm_checkpoints_and_exits_with_code(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    proc = warm.WarmPopen(cli_command(run_dir, 100_000))
    wait_for_checkpoint(run_dir, proc, 2)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == EXIT_PREEMPTED == 75
    assert "SIGTERM" in err and "re-run the same command" in err
    summary = read_summary(run_dir)
    assert summary["status"] == "preempted"
    newest = checkpoint.periodic_checkpoints(run_dir)[0]
    assert checkpoint.load(newest)["step"] == summary["steps"]


def test_crash_then_resume_matches_uninterrupted(tmp_path: Path) -> None:
    run_inprocess(tmp_path / "reference", ["trainer.max_steps=12"])
    with pytest.raises(RuntimeError, match="simulated crash"):
        run_inprocess(tmp_path / "resumed", ["trainer.max_steps=12"], [CrashAt(7)])
    assert read_summary(tmp_path / "resumed")["status"] == "failed"
    assert [p.name for p in checkpoint.periodic_checkpoints(tmp_path / "resumed")] == [
        "step-000000006.pt", "step-000000004.pt"]  # the newest two are kept
    summary = run_inprocess(tmp_path / "resumed", ["trainer.max_steps=12"])
    assert summary["status"] == "completed" and summary["resumed_from"].endswith("step-000000006.pt")
    assert_same_run(tmp_path / "reference", tmp_path / "resumed")
    assert not checkpoint.periodic_checkpoints(tmp_path / "resumed")  # pruned once completed


class Clock(Callback):
    """A wall clock that advances 25 s per training step, for CheckpointClock."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.seconds = 0.0
        monkeypatch.setattr(CheckpointClock, "now", staticmethod(lambda: self.seconds))

    def after_step(self, state: TrainState) -> None:
        self.seconds += 25.0


def test_checkpoints_by_wall_time_resume_exactly(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every minute of wall time (looked at every 2 steps): at 25 s a step, due at step 4
    (100 s) and 8 (100 s after step 4); a crash after step 10 resumes from step 8."""
    minutes = ["trainer.max_steps=12", "trainer.checkpoint_every=1", "trainer.checkpoint_unit=minute",
               "trainer.log_every=2"]
    run_inprocess(tmp_path / "reference", minutes)
    with pytest.raises(RuntimeError, match="simulated crash"):
        run_inprocess(tmp_path / "resumed", minutes, [Clock(monkeypatch), CrashAt(10)])
    assert [p.name for p in checkpoint.periodic_checkpoints(tmp_path / "resumed")] == [
        "step-000000008.pt", "step-000000004.pt"]
    summary = run_inprocess(tmp_path / "resumed", minutes)
    assert summary["resumed_from"].endswith("step-000000008.pt")
    assert_same_run(tmp_path / "reference", tmp_path / "resumed")


def test_truncated_newest_checkpoint_falls_back(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    run_inprocess(tmp_path / "reference", ["trainer.max_steps=12"])
    with pytest.raises(RuntimeError):
        run_inprocess(tmp_path / "resumed", ["trainer.max_steps=12"], [CrashAt(7)])
    newest = checkpoint.periodic_checkpoints(tmp_path / "resumed")[0]
    newest.write_bytes(newest.read_bytes()[:1000])
    summary = run_inprocess(tmp_path / "resumed", ["trainer.max_steps=12"])
    assert summary["resumed_from"].endswith("step-000000004.pt")
    assert f"damaged checkpoint {newest}: its sha256 is" in caplog.text
    assert_same_run(tmp_path / "reference", tmp_path / "resumed")


def test_no_valid_checkpoint_starts_over(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    run_dir = tmp_path / "run"
    with pytest.raises(RuntimeError):
        run_inprocess(run_dir, ["trainer.max_steps=8"], [CrashAt(5)])
    for path in checkpoint.periodic_checkpoints(run_dir):
        path.write_bytes(b"garbage")
    summary = run_inprocess(run_dir, ["trainer.max_steps=8"])
    assert summary["status"] == "completed" and "resumed_from" not in summary
    assert "starting over" in caplog.text


def test_write_failure_keeps_previous_checkpoint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real_save = torch.save
    calls = {"n": 0}

    def failing_save(obj: object, f: object) -> None:
        calls["n"] += 1
        if calls["n"] == 2:  # the second checkpoint hits a full disk half-way
            f.write(b"partial")  # type: ignore[attr-defined]
            raise OSError(28, "No space left on device")
        real_save(obj, f)

    monkeypatch.setattr(checkpoint.torch, "save", failing_save)
    run_dir = tmp_path / "run"
    with pytest.raises(RuntimeError):
        run_inprocess(run_dir, ["trainer.max_steps=12"], [CrashAt(5)])
    summary = read_summary(run_dir)
    assert summary["checkpoint_errors"] == ["step 4, step-000000004.pt: OSError: [Errno 28] No space left on device"]
    paths = checkpoint.periodic_checkpoints(run_dir)
    assert [p.name for p in paths] == ["step-000000002.pt"]
    assert checkpoint.load(paths[0])["step"] == 2
    assert not list((run_dir / checkpoint.CHECKPOINT_DIR).glob(".*.tmp"))


def test_explicit_resume_path_and_never(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError):
        run_inprocess(tmp_path / "a", ["trainer.max_steps=8"], [CrashAt(5)])
    source = checkpoint.periodic_checkpoints(tmp_path / "a")[0]
    summary = run_inprocess(tmp_path / "b", ["trainer.max_steps=8", f"trainer.resume={source}"])
    assert summary["resumed_from"] == str(source)
    summary = run_inprocess(tmp_path / "a", ["trainer.max_steps=8", "trainer.resume=never"])
    assert "resumed_from" not in summary and summary["status"] == "completed"


def test_sweep_survives_failed_and_diverged_cells(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # 64 training images (TINY): batches of 100 fail once the data is loaded
    args = ["train", "-m", *TINY, "norm=none", "optim.lr=0.01,1e12", "trainer.batch_size=16,100", *run_dir_of(tmp_path)]
    code, out = run_cli(args, capsys)
    assert code == EXIT_FAILED, out  # after its report, a sweep with a failed cell exits non-zero
    statuses = {p.parent.name: read_summary(p.parent)["status"] for p in (tmp_path / "sweep").glob("*/summary.json")}
    by_cell = {tuple(part for part in name.split(",") if part.startswith(("optim.lr=", "trainer.batch_size="))): s
               for name, s in statuses.items()}
    assert by_cell == {("optim.lr=0.01", "trainer.batch_size=16"): "completed",
                       ("optim.lr=1000000000000.0", "trainer.batch_size=16"): "diverged",
                       ("optim.lr=0.01", "trainer.batch_size=100"): "failed",
                       ("optim.lr=1000000000000.0", "trainer.batch_size=100"): "failed"}
    assert "4 cells: 1 completed, 1 diverged, 2 failed" in out
    assert "trainer.batch_size=100 is larger than the 64 training images" in out and "failed: " in out

    stamps = {p.parent.name: p.stat().st_mtime_ns for p in (tmp_path / "sweep").glob("*/summary.json")}
    code, out = run_cli(args, capsys)  # the re-run trains only the failed cell again
    assert code == EXIT_FAILED, out
    changed = {p.parent.name for p in (tmp_path / "sweep").glob("*/summary.json")
               if p.stat().st_mtime_ns != stamps[p.parent.name]}
    assert changed == {name for name, status in statuses.items() if status == "failed"}
    assert "4 cells: 0 completed, 0 diverged, 2 failed, 2 skipped" in out


@pytest.mark.slow
def test_sigterm_to_the_torchrun_launcher_reaches_the_ranks(tmp_path: Path) -> None:
    """trainer.nproc=2: the signal goes to the launching process only (plain sbatch with B:)."""
    run_dir = tmp_path / "run"
    command = [*cli_command(run_dir, 100_000), "trainer.nproc=2", "trainer.batch_size=8"]
    # fresh, its stderr a pipe the ranks inherit: communicate returns once every process has let go of it
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    wait_for_checkpoint(run_dir, proc, 2, timeout=300)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == EXIT_PREEMPTED, err[-3000:]
    assert "Traceback" not in err, err[-3000:]  # torchrun's agent printed 30 lines of SignalException
    summary = read_summary(run_dir)
    assert summary["status"] == "preempted" and summary["world_size"] == 2
    assert checkpoint.load(checkpoint.periodic_checkpoints(run_dir)[0])["step"] == summary["steps"]


def test_resumed_run_keeps_every_time_probe_row(tmp_path: Path) -> None:
    """The time probe reads its steps when a checkpoint is taken; those rows are in the file
    before the checkpoint notes its length, so a resume neither loses nor repeats them."""
    timed = ["trainer.max_steps=12", "probes=[time]", "probe.time.every=1"]
    with pytest.raises(RuntimeError, match="simulated crash"):
        run_inprocess(tmp_path / "run", timed, [CrashAt(7)])
    run_inprocess(tmp_path / "run", timed)
    rows = [line.split(",") for line in (tmp_path / "run" / "probes.csv").read_text().splitlines()[1:]]
    steps = [int(r[0]) for r in rows if r[3] == "data_s"]
    assert steps == list(range(12))
