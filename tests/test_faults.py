"""Run identity, one writer per run, faults survived, honest exits, tables of any sweep.

Each test is named in docs/resilience.md's fault table.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import os
import resource
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from bnexp.engine import checkpoint
from bnexp.engine.identity import NEUTRAL_SINCE_ADDED, cell_name, fingerprint, run_name
from bnexp.support import runlock
from bnexp.support.errors import EXIT_CONFIG, EXIT_FAILED, EXIT_INTERRUPTED, EXIT_LOCKED, EXIT_PREEMPTED, ConfigError
from bnexp.support.runlock import LOCK_NAME
from tests import warm
from tests.conftest import QUICK_PRESET, TINY, compose_cfg, copy_runs, read_metrics, read_summary, run_cli, run_dir_of
from tests.test_resilience import CrashAt, assert_same_run, cli_command, run_inprocess, wait_for_checkpoint

STEPS = ["trainer.checkpoint_every=2", "trainer.checkpoint_unit=step"]


def train_args(tmp_path: Path, *extra: str) -> list[str]:
    return ["train", *TINY, *STEPS, *extra, *run_dir_of(tmp_path)]


HOOKED = [sys.executable, str(Path(__file__).with_name("fault_hooks.py"))]  # bnexp with a fault at an exact moment


def only_run(folder: Path) -> Path:
    """The one run directory a command run in ``folder`` made (the default run directory)."""
    (run,) = (folder / "results" / "runs").iterdir()
    return run


# ---- 1. run identity -------------------------------------------------------------------

def test_rerun_with_other_settings_is_refused_and_changes_nothing(tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    assert run_cli(train_args(tmp_path), capsys)[0] == 0
    run = tmp_path / "run"
    before = {name: (run / name).read_bytes() for name in ("summary.json", "metrics.csv", "checkpoint.pt", "train.log",
                                                           "config.yaml")}
    hydra_before = (run / ".hydra" / "overrides.yaml").read_text()
    for change in ("trainer.max_steps=5", "data.noise=0.5"):
        code, out = run_cli(train_args(tmp_path, change), capsys)
        assert code == EXIT_CONFIG, out
        key, _, value = change.partition("=")
        assert f"holds a run completed with other settings ({key}: " in out and "trainer.resume=never" in out
        assert {name: (run / name).read_bytes() for name in before} == before
        assert (run / ".hydra" / "overrides.yaml").read_text() == hydra_before
    code, out = run_cli(train_args(tmp_path, "trainer.max_steps=5", "trainer.resume=never"), capsys)
    assert code == 0 and read_summary(run)["steps"] == 5


def test_unfinished_run_with_other_settings_is_refused_before_writing(tmp_path: Path,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(RuntimeError):
        run_inprocess(tmp_path / "run", ["trainer.max_steps=8"], [CrashAt(5)])
    run = tmp_path / "run"
    before = {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()}
    code, out = run_cli(train_args(tmp_path, "optim.lr=0.2"), capsys)
    assert code == EXIT_CONFIG and "holds an unfinished run (failed) to resume with other settings (optim.lr: " in out
    assert {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()} == before


def test_same_settings_rerun_is_skipped(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert run_cli(train_args(tmp_path), capsys)[0] == 0
    stamp = (tmp_path / "run" / "summary.json").stat().st_mtime_ns
    code, out = run_cli(train_args(tmp_path, "trainer.log_every=1", "trainer.device=cpu"), capsys)  # not result keys
    assert code == 0 and "skipped: already completed" in out
    assert (tmp_path / "run" / "summary.json").stat().st_mtime_ns == stamp


NPZ = [*(o for o in TINY if not o.startswith("data")), "data=npz", "data.path=d.npz"]


def write_npz(path: Path, classes: int) -> None:
    """An npz data set of 8 x 8 images whose labels cycle through ``classes`` classes."""
    rng = np.random.default_rng(0)
    np.savez(path, x_train=rng.integers(0, 256, (64, 8, 8, 3), dtype=np.uint8), y_train=np.arange(64) % classes,
             x_test=rng.integers(0, 256, (32, 8, 8, 3), dtype=np.uint8), y_test=np.arange(32) % classes)


def test_data_file_replaced_under_the_same_path_is_other_settings(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    write_npz(tmp_path / "d.npz", 10)
    assert run_cli(["train", *NPZ], capsys)[0] == 0
    run = only_run(tmp_path)
    before = {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()}
    write_npz(tmp_path / "d.npz", 11)
    code, out = run_cli(["train", *NPZ], capsys)
    assert code == EXIT_CONFIG, out
    assert "holds a run completed with other settings (data file d.npz: " in out and " sha256 " in out
    assert f"{(tmp_path / 'd.npz').stat().st_size} bytes, sha256 " \
           f"{hashlib.sha256((tmp_path / 'd.npz').read_bytes()).hexdigest()[:12]}... here" in out
    assert {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()} == before
    code, out = run_cli(["train", *NPZ, "trainer.resume=never"], capsys)
    assert code == 0 and read_summary(run)["num_classes"] == 11


def test_unchanged_data_file_is_reused_as_before(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """The run records its data file's size and sha256; a re-run skips it, also when only the
    file's modification time changed (its bytes are compared then)."""
    monkeypatch.chdir(tmp_path)
    write_npz(tmp_path / "d.npz", 10)
    assert run_cli(["train", *NPZ], capsys)[0] == 0
    recorded = read_summary(only_run(tmp_path))["data_files"]["d.npz"]
    data = (tmp_path / "d.npz").read_bytes()
    assert (recorded["size"], recorded["sha256"]) == (len(data), hashlib.sha256(data).hexdigest())
    for touch in (False, True):
        if touch:
            os.utime(tmp_path / "d.npz", ns=(recorded["mtime_ns"] + 10**9,) * 2)
        code, out = run_cli(["train", *NPZ], capsys)
        assert code == 0 and "skipped: already completed" in out, touch


def test_fingerprint_and_directory_name_follow_the_result_settings() -> None:
    base = compose_cfg(TINY)
    same = ["trainer.log_every=7", "trainer.checkpoint_every=3", "trainer.keep_checkpoints=5", "logger=tensorboard",
            "trainer.resume=never"]
    assert fingerprint(compose_cfg([*TINY, *same])) == fingerprint(base)
    assert fingerprint(compose_cfg([*TINY, "optim.lr=1"])) == fingerprint(compose_cfg([*TINY, "optim.lr=1.0"]))
    for other in ("trainer.max_steps=5", "optim.lr=0.2", "data.noise=0.5", "trainer.amp=bf16", "data.num_workers=2"):
        assert fingerprint(compose_cfg([*TINY, other])) != fingerprint(base), other
    assert fingerprint(compose_cfg(["data.root=/a"])) != fingerprint(compose_cfg(["data.root=/b"]))
    assert run_name(["norm=cbn", "data.root=/data/cifar", *same]) == "data.root=_data_cifar,norm=cbn"
    assert run_name(["experiment=cbn/table1", "scale=quick"]) == "experiment=cbn_table1,scale=quick"
    assert cell_name(["experiment=cbn/table1", "scale=quick", "act=tanh"]) == "act=tanh"  # in the preset's folder
    long = run_name([f"tags.x={'a' * 300}", "optim.lr=" + "1" * 300])
    assert len(long) <= 200 and long.startswith("optim.lr=111")


@pytest.mark.parametrize("overrides", [[], ["model=vgg16", "norm=cbn"], ["norm=bnp", "model=resnet110"], ["norm=none"]])
def test_settings_added_later_keep_older_fingerprints_at_their_neutral_value(overrides: list[str]) -> None:
    """norm.input, model.init_scale and schedule.warmup_unit came after runs were recorded:
    at the value that computes what those runs did, a config fingerprints as if the key
    were absent (the config an older bnexp wrote); any other value is another run."""
    cfg = compose_cfg([*TINY, *overrides])
    tree = OmegaConf.to_container(cfg, resolve=True)
    for key in NEUTRAL_SINCE_ADDED:
        group, name = key.split(".")
        # the shipped default is the neutral one (norm.input exists only for norms that have a placement)
        assert tree[group].pop(name, NEUTRAL_SINCE_ADDED[key]) == NEUTRAL_SINCE_ADDED[key], key
    assert fingerprint(cfg) == fingerprint(tree)
    for other in ("model.init_scale=0.5", "schedule.warmup_unit=step"):
        assert fingerprint(compose_cfg([*TINY, *overrides, other])) != fingerprint(cfg), other


def test_resume_from_a_checkpoint_of_other_settings_is_refused(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError):
        run_inprocess(tmp_path / "run", ["trainer.max_steps=8"], [CrashAt(5)])
    with pytest.raises(ConfigError, match=r"written by a run with other settings \(optim.lr: 0.1 there, 0.2 here\)"):
        run_inprocess(tmp_path / "run", ["trainer.max_steps=8", "optim.lr=0.2"])


# ---- 2. one writer per run ---------------------------------------------------------------

@pytest.mark.slow
def test_second_process_on_a_running_run_stops(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = tmp_path / "run"
    first = warm.WarmPopen(cli_command(run, 100_000))
    wait_for_checkpoint(run, first, 2)
    owner = json.loads((run / LOCK_NAME).read_text())
    assert owner == {"pid": first.pid, "host": socket.gethostname()}
    code, out = run_cli(cli_command(run, 100_000)[3:], capsys)  # the same command, in this process
    assert code == EXIT_LOCKED, out
    assert f"is being written by process {first.pid} on {socket.gethostname()}" in out
    first.send_signal(signal.SIGKILL)  # leaves a stale lock behind
    first.wait()
    code, out = run_cli(cli_command(run, 12)[3:] + ["trainer.resume=never"], capsys)
    assert code == 0, out
    assert "removing the stale lock" in out and not (run / LOCK_NAME).exists()
    assert len(read_metrics(run / "metrics.csv")) == 3  # 12 steps, eval every 4: one writer's rows


def test_lock_held_on_another_host_is_named(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / LOCK_NAME).write_text(json.dumps({"pid": 1, "host": "node-17"}))
    code, out = run_cli(train_args(tmp_path), capsys)
    assert code == EXIT_LOCKED
    assert "being written by process 1 on node-17" in out and f"delete {tmp_path / 'run' / LOCK_NAME}" in out
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == [LOCK_NAME]  # nothing written


def test_lock_is_released_however_the_run_ends(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert run_cli(train_args(tmp_path / "ok"), capsys)[0] == 0
    assert run_cli(train_args(tmp_path / "bad", "trainer.batch_size=100"), capsys)[0] == EXIT_CONFIG  # > 64 images
    assert not (tmp_path / "ok" / "run" / LOCK_NAME).exists() and not (tmp_path / "bad" / "run" / LOCK_NAME).exists()


def nfs_flock(flock: Callable[[int, int], None]) -> Callable[[int, int], None]:
    """``flock`` with the rule of Linux's NFS client, which emulates it with byte-range locks:
    a shared lock needs a descriptor open for reading, an exclusive one for writing (EBADF)."""
    def checked(fd: int, operation: int) -> None:
        mode = fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE
        needs = os.O_WRONLY if operation & fcntl.LOCK_EX else os.O_RDONLY
        if mode not in (needs, os.O_RDWR):
            raise OSError(errno.EBADF, "Bad file descriptor")
        flock(fd, operation)
    return checked


def test_run_lock_descriptors_suit_nfs_flock(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The lock file's descriptors are open for what NFS's flock needs: the owner's shared
    lock is taken, and a re-run taking over a dead owner's lock sees it still held. This
    checks the open modes against NFS's rule on a local file system (``nfs_flock``); it does
    not run on NFS, and says nothing of the locks NFS does not pass on to forked processes."""
    monkeypatch.setattr(fcntl, "flock", nfs_flock(fcntl.flock))
    monkeypatch.setattr(runlock, "STALE_WAIT", 0.3)
    dead = subprocess.Popen([sys.executable, "-c", ""])
    dead.wait()
    with runlock.RunLock(tmp_path) as held:  # still holds its flock when its PID is gone:
        (tmp_path / LOCK_NAME).write_text(json.dumps({"pid": dead.pid, "host": socket.gethostname()}))
        with pytest.raises(runlock.RunLocked, match="is still being written by processes of the run of process"):
            runlock.RunLock(tmp_path).acquire()
        assert held.held and (tmp_path / LOCK_NAME).exists()


# ---- 3. faults survived ------------------------------------------------------------------

def limit_file_size(size: int) -> None:
    """In the child: files may not grow past ``size`` bytes; a write past it fails with EFBIG."""
    resource.setrlimit(resource.RLIMIT_FSIZE, (size, size))
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)


@pytest.mark.slow
def test_full_disk_loses_checkpoints_not_the_run(tmp_path: Path) -> None:
    """RLIMIT_FSIZE of 64 KiB: every checkpoint (about 200 KiB) fails to write, the small
    files do not. The run trains to the end, stays completed, and lists each failure."""
    run = tmp_path / "run"
    done = subprocess.run(cli_command(run, 12), capture_output=True, text=True,
                          preexec_fn=lambda: limit_file_size(64 * 1024))
    assert done.returncode == 0, done.stderr[-3000:]
    summary = read_summary(run)
    assert summary["status"] == "completed" and summary["steps"] == 12
    errors = summary["checkpoint_errors"]
    assert [e.split(":")[0] for e in errors] == [f"step {s}, step-{s:09d}.pt" for s in (2, 4, 6, 8, 10)] + [
        "step 12, checkpoint.pt"]
    assert all("File too large" in e for e in errors)
    assert "the run's metrics and summary stand (status completed)" in (run / "train.log").read_text()
    assert len(read_metrics(run / "metrics.csv")) == 3 and not (run / "checkpoint.pt").exists()
    assert not (run / checkpoint.CHECKPOINT_DIR).exists()  # no empty folder left


@pytest.mark.slow
def test_file_size_limit_is_one_line_not_a_traceback(tmp_path: Path) -> None:
    """``ulimit -f 1`` (1 KiB): the first file that outgrows it (Hydra's ``hydra.yaml``) ends
    the run with one line naming the run and the error, exit 1."""
    done = subprocess.run([sys.executable, "-m", "bnexp", "train", *TINY], cwd=tmp_path, capture_output=True, text=True,
                          preexec_fn=lambda: limit_file_size(1024))
    assert done.returncode == EXIT_FAILED, done.stderr[-3000:]
    (line,) = done.stderr.splitlines()
    assert line.startswith(f"bnexp: error: cannot write to {only_run(tmp_path)} (OSError: [Errno 27] File too large)")


@pytest.mark.slow
def test_run_log_that_cannot_grow_is_one_warning(tmp_path: Path) -> None:
    """8 KiB: the run's other small files fit, its ``train.log`` (a line per step) does not:
    one warning names it, the log keeps what it holds, and the run trains to the end (as
    when its checkpoints cannot be written: the final one is too large here)."""
    args = [*(o for o in TINY if not o.startswith("trainer.max_steps")), "trainer.max_steps=100",
            "trainer.log_every=1", "trainer.eval_every=100", "trainer.eval_unit=step"]
    done = subprocess.run([sys.executable, "-m", "bnexp", "train", *args], cwd=tmp_path, capture_output=True,
                          text=True, preexec_fn=lambda: limit_file_size(8192))
    assert done.returncode == 0, done.stderr[-3000:]
    run = only_run(tmp_path)
    (line,) = done.stderr.splitlines()
    assert line.startswith(f"bnexp: warning: cannot write to {run / 'train.log'} (OSError: [Errno 27] File too large)")
    assert read_summary(run)["status"] == "completed"
    log = (run / "train.log").read_text()
    assert len(log) == 8192 and "step 1/100 " in log


@pytest.mark.parametrize("error", [OSError(28, "No space left on device"),
                                   RuntimeError("[enforce fail at inline_container.cc:595] . unexpected pos 832")])
def test_checkpoint_write_errors_of_any_kind_are_survived(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                          error: Exception) -> None:
    real_save = torch.save
    calls = {"n": 0}

    def failing_save(obj: object, f: object) -> None:
        calls["n"] += 1
        if calls["n"] == 2:
            raise error
        real_save(obj, f)

    monkeypatch.setattr(checkpoint.torch, "save", failing_save)
    summary = run_inprocess(tmp_path / "run", ["trainer.max_steps=8"])
    assert summary["status"] == "completed"
    assert summary["checkpoint_errors"] == [f"step 4, step-000000004.pt: {type(error).__name__}: {error}"]


def test_flipped_byte_in_newest_checkpoint_falls_back(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    run_inprocess(tmp_path / "reference", ["trainer.max_steps=12"])
    with pytest.raises(RuntimeError):
        run_inprocess(tmp_path / "resumed", ["trainer.max_steps=12"], [CrashAt(7)])
    newest = checkpoint.periodic_checkpoints(tmp_path / "resumed")[0]
    data = bytearray(newest.read_bytes())
    data[len(data) // 2] ^= 0x01  # one bit of one weight: torch.load would read it without complaint
    newest.write_bytes(bytes(data))
    summary = run_inprocess(tmp_path / "resumed", ["trainer.max_steps=12"])
    assert summary["resumed_from"].endswith("step-000000004.pt")
    assert f"damaged checkpoint {newest}: its sha256 is" in caplog.text
    assert_same_run(tmp_path / "reference", tmp_path / "resumed")


def test_checksum_file_is_in_sha256sum_format(tmp_path: Path) -> None:
    run_inprocess(tmp_path / "run", ["trainer.max_steps=4"])
    final = tmp_path / "run" / "checkpoint.pt"
    assert (tmp_path / "run" / "checkpoint.pt.sha256").read_text() == \
        f"{hashlib.sha256(final.read_bytes()).hexdigest()}  checkpoint.pt\n"
    assert not (tmp_path / "run" / checkpoint.CHECKPOINT_DIR).exists()  # no empty folder left


def test_damaged_final_checkpoint_is_reported_by_the_rerun(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert run_cli(train_args(tmp_path), capsys)[0] == 0
    final = tmp_path / "run" / "checkpoint.pt"
    final.write_bytes(final.read_bytes()[:1000])
    code, out = run_cli(train_args(tmp_path), capsys)
    assert code == 0
    assert "skipped: already completed" in out and "WARNING: its final checkpoint is unusable: damaged checkpoint" in out
    assert "Its metrics and summary stand; trainer.resume=never trains it again" in out


# ---- 5. honest exits -----------------------------------------------------------------------

@pytest.mark.slow
def test_ctrl_c_checkpoints_and_exits_130(tmp_path: Path) -> None:
    run = tmp_path / "run"
    proc = warm.WarmPopen(cli_command(run, 100_000))
    wait_for_checkpoint(run, proc, 2)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == EXIT_INTERRUPTED == 130
    assert "Traceback" not in out + err and "stopped by Ctrl-C (SIGINT) after writing a checkpoint" in err
    summary = read_summary(run)
    assert summary["status"] == "interrupted"
    assert checkpoint.load(checkpoint.periodic_checkpoints(run)[0])["step"] == summary["steps"]
    assert not (run / LOCK_NAME).exists()


@pytest.mark.slow
def test_ctrl_c_stops_a_sweep_after_its_report(tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    command = [*cli_command(tmp_path / "unused", 100_000), "-m", "act=relu,tanh", f"hydra.sweep.dir={sweep}"]
    proc = warm.WarmPopen(command)
    deadline = time.monotonic() + 120
    while not list(sweep.glob("*/checkpoints/step-*.pt")):
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.01)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == EXIT_INTERRUPTED
    assert "Traceback" not in out + err
    assert "sweep stopped: 2 cells: 0 completed, 0 diverged, 0 failed, 1 interrupted, 1 not run" in out


def test_sweep_of_failing_cells_exits_nonzero(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out = run_cli(["train", "-m", *TINY, "trainer.batch_size=100,200", *run_dir_of(tmp_path)], capsys)  # 64 images
    assert code == EXIT_FAILED
    assert "sweep finished: 2 cells: 0 completed, 0 diverged, 2 failed" in out


def test_failed_run_says_why_in_train_log(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert run_cli(train_args(tmp_path, "trainer.batch_size=100"), capsys)[0] == EXIT_CONFIG
    assert "trainer.batch_size=100 is larger than the 64 training images" in (tmp_path / "run" / "train.log").read_text()


def test_unwritable_output_folder_is_one_message(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "file").write_text("not a folder")
    code, out = run_cli(["train", *TINY, f"hydra.run.dir={tmp_path / 'file' / 'run'}"], capsys)
    assert code == EXIT_CONFIG
    assert out.startswith(f"bnexp: error: cannot write to the output folder {tmp_path / 'file' / 'run'} "
                          "(NotADirectoryError") and "hydra.run.dir=PATH" in out and out.count("\n") == 1


# ---- 6. tables and plots of any sweep ----------------------------------------------------------

@pytest.fixture(scope="module")
def lr_sweep(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An ad-hoc sweep: 2 activations x 2 learning rates x 2 seeds, and a cell that fails (it
    resumes from a file that is no checkpoint; trainer.resume is not one of the varying keys)."""
    folder = tmp_path_factory.mktemp("sweep")
    args = ["train", "-m", *TINY, "act=relu,tanh", "optim.lr=0.05,0.1", "trainer.seed=0,1", f"hydra.sweep.dir={folder}"]
    from bnexp.cli import main

    main(args)
    garbage = tmp_path_factory.mktemp("garbage") / "step-000000002.pt"
    garbage.write_text("not a checkpoint")
    with pytest.raises(SystemExit):
        main(["train", "-m", *TINY, "act=relu", "optim.lr=0.2", f"trainer.resume={garbage}", f"hydra.sweep.dir={folder}"])
    return folder


@pytest.mark.xdist_group("lr_sweep")  # in one worker: the sweep is made once
def test_table_of_any_sweep(lr_sweep: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out = run_cli(["table", str(lr_sweep), "rows=act", "cols=optim.lr"], capsys)
    assert code == 0, out
    lines = [line for line in out.splitlines() if line.startswith("|")]
    assert [c.strip() for c in lines[0].strip("|").split("|")] == ["act", "optim.lr=0.05", "optim.lr=0.1",
                                                                  "optim.lr=0.2"]
    relu = [c.strip() for c in lines[2].strip("|").split("|")]
    assert relu[0] == "relu" and relu[1].endswith("(2)") and relu[2].endswith("(2)") and relu[3] == "– (0 of 1; 1 failed)"
    code, out = run_cli(["table", str(lr_sweep), "metric=top5"], capsys)  # rows: every varying override
    assert code == 0 and "| act   | optim.lr   | top-5" in out
    code, out = run_cli(["table", str(lr_sweep), "rows=actt"], capsys)
    assert code == EXIT_CONFIG and "unknown key 'actt' for rows/cols: the overrides that vary here are act, optim.lr" in out


@pytest.mark.xdist_group("lr_sweep")  # in one worker: the sweep is made once
def test_plot_of_any_sweep(lr_sweep: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out = run_cli(["plot", str(lr_sweep), f"out={tmp_path}"], capsys)
    assert code == 0, out
    assert out.split() == [str(tmp_path / "sweep.png"), str(tmp_path / "sweep.pdf")]
    assert (tmp_path / "sweep.png").stat().st_size > 10_000


@pytest.mark.xdist_group("quick_preset")  # with the other users of quick_preset_runs
def test_preset_table_counts_only_its_own_runs(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                quick_preset_runs: Path) -> None:
    root = copy_runs(quick_preset_runs, tmp_path / "sweep")
    preset = [*QUICK_PRESET[1:], f"hydra.sweep.dir={root}"]
    assert run_cli(["reproduce", *preset], capsys)[0] == 0
    code, before = run_cli(["table", "popnorm/table2", "scale=quick", f"results={root}"], capsys)
    assert code == 0 and "not in this table" not in before
    # the same preset again with another lr: its runs land in the same folder
    assert run_cli(["train", "-m", "experiment=popnorm/table2", "scale=quick", "optim.lr=0.5",
                    f"hydra.sweep.dir={root}", "trainer.device=cpu"], capsys)[0] == 0
    code, after = run_cli(["table", "popnorm/table2", "scale=quick", f"results={root}"], capsys)
    assert code == 0
    assert "4 of the 8 runs under" in after and "not in this table" in after and "they differ in optim.lr" in after
    assert table_lines(after) == table_lines(before)  # the cells still count the preset's 4 runs


def table_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("|")]


def test_dry_run_lists_cells_without_running(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    root = tmp_path / "sweep"
    code, out = run_cli(["reproduce", "popnorm/table2", "scale=quick", "dry_run=true", f"hydra.sweep.dir={root}"],
                        capsys)
    assert code == 0 and "4 jobs in" in out and out.count("[to run]") == 4 and not root.exists()
    code, out = run_cli(["train", "-m", *TINY, "act=relu,tanh", f"hydra.sweep.dir={root}", "--dry-run"], capsys)
    assert code == 0 and "2 jobs in" in out and str(root / "act=relu,") in out and not root.exists()
    monkeypatch.chdir(tmp_path)  # the default folder, named after the command line
    code, out = run_cli(["train", "-m", "act=relu,tanh", "norm=cbn", "--dry-run"], capsys)
    assert code == 0, out
    assert "2 jobs in results/multirun/act=relu,tanh,norm=cbn:" in out and not (tmp_path / "results").exists()
    code, out = run_cli(["train", "-m", "act=relu,tanh", "--cfg", "job"], capsys)  # Hydra refuses the pair
    assert code == EXIT_CONFIG and "--cfg shows the config of one job and cannot be used with -m" in out


def test_each_adhoc_sweep_has_its_own_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    first = ["train", "-m", *TINY, "act=relu,tanh"]
    assert run_cli(first, capsys)[0] == 0
    assert run_cli(["train", "-m", *TINY, "act=sigmoid"], capsys)[0] == 0
    folders = sorted(p.name for p in (tmp_path / "results" / "multirun").iterdir())
    assert len(folders) == 2 and folders[0].startswith("act=relu,tanh,data.image_size=8")
    for folder in folders:
        assert (tmp_path / "results" / "multirun" / folder / "multirun.yaml").is_file()
    code, out = run_cli(first, capsys)  # the same command finds its folder again
    assert code == 0 and "2 cells: 0 completed, 0 diverged, 0 failed, 2 skipped" in out


@pytest.mark.slow
def test_sigterm_while_the_final_checkpoint_is_written(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """The signal waits for the final checkpoint: the run completes, leaves no lock and no
    temporary file, the process exits 75 as on any SIGTERM with one line saying the run
    completed (not that it can be resumed), and the re-run skips the run, whose result is an
    uninterrupted run's."""
    args = ["train", *TINY, *STEPS]
    for name in ("signalled", "reference"):
        (tmp_path / name).mkdir()
    done = warm.run([*HOOKED, "sigterm-in-final-save", *args], cwd=tmp_path / "signalled")
    assert done.returncode == EXIT_PREEMPTED, done.stderr[-3000:]
    run = only_run(tmp_path / "signalled")
    assert [line for line in done.stderr.splitlines() if line.startswith("bnexp:")] == [
        f"bnexp: warning: {run} completed, nothing to resume; SIGTERM came as it "
        "ended and stopped the command"], done.stderr[-3000:]
    assert "Traceback" not in done.stderr
    assert read_summary(run)["status"] == "completed"
    assert not list(run.rglob("*.tmp")) and not (run / LOCK_NAME).exists()
    monkeypatch.chdir(tmp_path / "signalled")
    code, out = run_cli(args, capsys)
    assert code == 0 and "skipped: already completed" in out
    monkeypatch.chdir(tmp_path / "reference")
    assert run_cli(args, capsys)[0] == 0
    assert_same_run(only_run(tmp_path / "reference"), run)


@pytest.mark.slow
@pytest.mark.parametrize("hook,resumed_from", [("sigkill-in-final-save", "checkpoints/step-000000002.pt"),
                                               ("sigkill-after-final-save", "checkpoint.pt")])
def test_sigkill_around_the_final_checkpoint_resumes_from_the_newest_one(
        hook: str, resumed_from: str, tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Killed while the final checkpoint is written (its temporary file and the lock stay
    behind) or just after (the periodic checkpoints already removed, no summary yet): the
    re-run takes over the lock, removes the temporary file, resumes from the newest
    checkpoint there and ends as an uninterrupted run."""
    args = ["train", *TINY, *STEPS]
    for name in ("killed", "reference"):
        (tmp_path / name).mkdir()
    done = warm.run([*HOOKED, hook, *args], cwd=tmp_path / "killed")
    assert done.returncode == -signal.SIGKILL, done.stderr[-3000:]
    run = only_run(tmp_path / "killed")
    assert (run / LOCK_NAME).exists()
    monkeypatch.chdir(tmp_path / "killed")
    code, out = run_cli(args, capsys)
    assert code == 0, out
    assert read_summary(run)["resumed_from"] == str(run / resumed_from)
    removed = f"removing {run / '.checkpoint.pt.tmp'}, left by a write that did not finish"
    assert (removed in (run / "train.log").read_text()) == (hook == "sigkill-in-final-save")
    assert not list(run.rglob("*.tmp")) and not (run / LOCK_NAME).exists()
    monkeypatch.chdir(tmp_path / "reference")
    assert run_cli(args, capsys)[0] == 0
    assert_same_run(only_run(tmp_path / "reference"), run)
