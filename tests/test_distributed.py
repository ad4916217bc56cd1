"""Two CPU processes (gloo): replicas stay identical; synced statistics match one process."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from bnexp.app.compose import config_dir, prepare_config_tree
from bnexp.app.torchrun import RUN_DIR_ENV, torchrun_command
from bnexp.engine.identity import run_name
from bnexp.engine.trainer import train
from bnexp.support import runlock
from bnexp.support.distributed import Dist, split_batch
from bnexp.support.errors import EXIT_LOCKED, EXIT_PREEMPTED, ConfigError
from tests.conftest import TINY, compose_cfg, read_summary, run_cli
from tests.test_resilience import assert_same_run, wait_for_checkpoint

WORKER = Path(__file__).resolve().parent / "ddp_worker.py"
BASE = [o for o in TINY if not o.startswith(("trainer.max_steps", "trainer.batch_size", "data.train_size"))]


def run_two_processes(out: Path, jobs: dict[str, list[str]]) -> None:
    spec = ";".join(" ".join([name, *overrides]) for name, overrides in jobs.items())
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(WORKER),
           str(out), spec]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]


@pytest.mark.slow
@pytest.mark.xdist_group("ddp_runs")  # in one worker: the module's two-process runs are made once
@pytest.mark.parametrize("norm", ["bn", "cbn", "popnorm", "bnp", "bnp_gn"])
def test_replicas_bit_identical_after_20_steps(replicas: Path, norm: str) -> None:
    a = torch.load(replicas / f"{norm}.rank0.pt")
    b = torch.load(replicas / f"{norm}.rank1.pt")
    assert a.keys() == b.keys() and len(a) > 10
    if norm.startswith("bnp"):
        assert any(k.startswith("bnp.") for k in a)
    for key in a:
        assert torch.equal(a[key], b[key]), key
    summary = read_summary(replicas / norm)
    assert summary["status"] == "completed" and summary["steps"] == 20
    writers = {p.name.split(".")[-2] for p in (replicas / norm).rglob("events.out.tfevents.*")}  # <time>.<host>.<pid>.<n>
    assert len(writers) == 1  # rank 0's only (its scalars and its hparams file)


SYNC = [*BASE, "trainer.batch_size=16", "data.train_size=64", "trainer.max_steps=10", "data.sampling=shuffle",
        "data.augment=false", "norm.sync=true", "optim.lr=0.005"]  # small lr: AMAT stays well conditioned


SYNCED = {norm: [f"norm={norm}"] for norm in ("bn", "cbn", "bnp")}
# CBN runs with its default r_mu bound (norm.amat_r_max=3). Unclipped, the ratio mu_A / mu_B
# on the stem's normalized images (batch means: noise around 0) reaches |r_mu| = 18 here by
# step 7 and amplifies the float32 rounding differences of summing over one or two processes
# (4e-5 in the weights by step 10, against 2e-6 clipped): not what this test checks.
# BNP with one sample per process: the shares' statistics pool into those of the batch of 2.
SYNCED["bnp_batch1"] = ["norm=bnp", "model=mlp3x100", "trainer.batch_size=2"]


REPLICAS = [*BASE, "trainer.batch_size=16", "data.train_size=128", "trainer.max_steps=20", "optim.lr=0.02",
            "trainer.eval_every=10", "trainer.eval_unit=step", "logger=tensorboard"]


@pytest.fixture(scope="module")
def ddp_runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The module's two-process runs in one launch (each launch starts three fresh processes):
    ``replicas/<norm>`` and ``synced/<name>``."""
    out = tmp_path_factory.mktemp("ddp")
    jobs = {f"replicas/{norm}": [*REPLICAS, f"norm={norm}"] for norm in ("bn", "cbn", "popnorm", "bnp", "bnp_gn")}
    jobs.update({f"synced/{name}": [*SYNC, *extra] for name, extra in SYNCED.items()})
    run_two_processes(out, jobs)
    return out


@pytest.fixture
def replicas(ddp_runs: Path) -> Path:
    return ddp_runs / "replicas"


@pytest.fixture
def synced(ddp_runs: Path) -> Path:
    return ddp_runs / "synced"


@pytest.mark.slow
@pytest.mark.xdist_group("ddp_runs")  # in one worker: the module's two-process runs are made once
@pytest.mark.parametrize("norm", SYNCED)
def test_synced_two_processes_match_one(synced: Path, tmp_path: Path, norm: str) -> None:
    single = train(compose_cfg([*SYNC, *SYNCED[norm]]), tmp_path / "one")
    assert single["status"] == "completed"
    two = torch.load(synced / f"{norm}.rank0.pt")
    state = torch.load(tmp_path / "one" / "checkpoint.pt", weights_only=False)
    bnp = [v for k, v in state["callbacks"].items() if k.endswith(":BnpPreconditioner")]
    one = {**state["model"], **{f"bnp.{k}": v for part in bnp for k, v in part.items()}}
    params = [k for k in one if one[k].is_floating_point()]
    assert params and (any(k.startswith("bnp.") for k in params) == norm.startswith("bnp"))
    for key in params:
        torch.testing.assert_close(two[key], one[key], atol=1e-5, rtol=1e-5, msg=key)


@pytest.mark.slow
def test_cli_nproc_launch_writes_one_directory(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run_dir = tmp_path / "run"
    code, out = run_cli(["train", *BASE, "trainer.batch_size=16", "trainer.max_steps=4", "trainer.nproc=2",
                         f"hydra.run.dir={run_dir}"], capsys)
    assert code == 0, out
    summary = read_summary(run_dir)
    assert summary["status"] == "completed" and summary["world_size"] == 2
    assert sorted(p.name for p in run_dir.iterdir() if p.is_dir()) == [".hydra"]
    assert (run_dir / "metrics.csv").read_text().count("\n") == 2  # header + the final evaluation


def test_batch_not_divisible(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out = run_cli(["train", *BASE, "trainer.batch_size=15", "trainer.nproc=2", f"hydra.run.dir={tmp_path}"],
                        capsys)
    assert code == 2
    assert "trainer.batch_size=15 is not divisible by the 2 processes" in out


def test_split_batch_under_torchrun() -> None:
    """A process started by torchrun directly (trainer.nproc left at 1) checks the split too."""
    assert split_batch(256, Dist(0, 8, 0)) == 32
    with pytest.raises(ConfigError, match="batch_size=256 is not divisible by the 3 processes.*"
                                          "trainer.nproc, or torchrun's nnodes x nproc_per_node"):
        split_batch(256, Dist(1, 3, 1))


# ---- the README's command (trainer.nproc=2) in the default run directory, and its faults ----

# Enough steps that a signal sent after the checkpoint at step 2 arrives long before the
# end; one evaluation, at the end, so that its metrics.csv row spans any restart.
STEPS = 100
NPROC_RUN = ["trainer.nproc=2", *BASE, "trainer.batch_size=16", f"trainer.max_steps={STEPS}", "trainer.deterministic=true",
             "trainer.checkpoint_every=2", "trainer.checkpoint_unit=step", "trainer.eval_every=1000",
             "trainer.eval_unit=step"]
NPROC_COMMAND = [sys.executable, "-m", "bnexp", "train", *NPROC_RUN]  # exactly as a user types it


def default_run_dir(cwd: Path, overrides: list[str] = NPROC_RUN) -> Path:
    """Where ``bnexp train OVERRIDES`` started in ``cwd`` writes: the default hydra.run.dir."""
    return cwd / "results" / "runs" / run_name(overrides)


@contextmanager
def launched(cwd: Path, *extra: str) -> Iterator[subprocess.Popen]:
    """NPROC_COMMAND (and ``extra``) started in ``cwd``; whatever is left of it when the block
    ends (a failed assertion) is killed, the launcher and every process below it."""
    cwd.mkdir(exist_ok=True)
    proc = subprocess.Popen([*NPROC_COMMAND, *extra], cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True)
    try:
        yield proc
    finally:
        for pid in descendants(proc.pid) if proc.poll() is None else []:
            os.kill(pid, signal.SIGKILL)  # first: they hold proc's stderr open
        proc.kill()
        proc.communicate()


def finish(proc: subprocess.Popen, timeout: float = 300) -> tuple[int, str]:
    """Wait up to ``timeout`` seconds for ``proc``; its exit code and stderr."""
    try:
        _, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"still running after {timeout} s") from None
    return proc.returncode, err


def descendants(pid: int) -> list[int]:
    """Every live process below ``pid`` (its children, theirs, ...), from /proc."""
    parents: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parents.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        children = parents.get(todo.pop(), [])
        found += children
        todo += children
    return [p for p in found if alive(p)]


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, dead but not yet reaped, does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def wait_until_gone(pids: list[int], timeout: float) -> list[int]:
    """The processes of ``pids`` still alive after waiting up to ``timeout`` seconds for them."""
    deadline = time.monotonic() + timeout
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    return [p for p in pids if alive(p)]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The 2-process run of NPROC_COMMAND, uninterrupted, in the default run directory."""
    cwd = tmp_path_factory.mktemp("uninterrupted")
    with launched(cwd) as proc:
        code, err = finish(proc)
    assert code == 0, err[-3000:]
    return default_run_dir(cwd)


@pytest.mark.slow
@pytest.mark.xdist_group("ddp_uninterrupted")  # in one worker: `uninterrupted` runs once
def test_readme_command_runs_in_the_default_run_directory(uninterrupted: Path) -> None:
    """The directory's name holds '=' and ',', which the ranks once parsed as overrides."""
    assert "=" in uninterrupted.name and "," in uninterrupted.name
    summary = read_summary(uninterrupted)
    assert summary["status"] == "completed" and summary["world_size"] == 2 and summary["steps"] == STEPS
    hydra_yaml = (uninterrupted / ".hydra" / "hydra.yaml").read_text()  # the launcher's, as the user ran it
    overrides = OmegaConf.load(uninterrupted / ".hydra" / "hydra.yaml").hydra.overrides
    assert RUN_DIR_ENV not in hydra_yaml
    assert not [o for o in [*overrides.hydra, *overrides.task] if o.startswith("hydra.run.dir")]


def test_run_directory_reaches_the_ranks_whatever_its_name(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The override the launcher gives the ranks resolves to the directory, character for character."""
    name = tmp_path / "results" / "runs" / "act=relu,norm=bn 'q\" [1]:{2} $HOME \\"
    override = torchrun_command(2, ["norm=bn"])[-1]
    monkeypatch.setenv(RUN_DIR_ENV, str(name))
    prepare_config_tree()
    with initialize_config_dir(config_dir=str(config_dir()), version_base="1.3"):
        cfg = compose(config_name="train", overrides=[override], return_hydra_config=True)
    assert OmegaConf.select(cfg, "hydra.run.dir") == str(name)


@pytest.mark.slow
@pytest.mark.xdist_group("ddp_uninterrupted")  # in one worker: `uninterrupted` runs once
def test_sigterm_then_rerun_resumes_bit_identically(uninterrupted: Path, tmp_path: Path) -> None:
    """metrics.csv's row spanning the restart too: each process checkpoints its own train sums."""
    run_dir = default_run_dir(tmp_path)
    with launched(tmp_path) as proc:
        wait_for_checkpoint(run_dir, proc, 2, timeout=300)
        proc.send_signal(signal.SIGTERM)
        code, err = finish(proc)
    assert code == EXIT_PREEMPTED, err[-3000:]
    assert read_summary(run_dir)["steps"] < STEPS
    with launched(tmp_path) as proc:
        code, err = finish(proc)
    assert code == 0, err[-3000:]
    assert "resumed_from" in read_summary(run_dir)
    assert_same_run(uninterrupted, run_dir)


@pytest.mark.slow
def test_frozen_rank_ends_the_run_within_its_timeout(tmp_path: Path) -> None:
    """A rank stopped with SIGSTOP: the other waits trainer.dist_timeout seconds, then the run
    stops (torchrun kills the frozen one after its 30 s grace)."""
    timeout = 5
    extra = ["trainer.max_steps=100000", f"trainer.dist_timeout={timeout}"]
    run_dir = default_run_dir(tmp_path, [*NPROC_RUN, *extra])
    with launched(tmp_path, *extra) as proc:
        wait_for_checkpoint(run_dir, proc, 2, timeout=300)
        [rank] = [p for p in descendants(proc.pid) if b"RANK=1" in Path(f"/proc/{p}/environ").read_bytes().split(b"\0")]
        os.kill(rank, signal.SIGSTOP)
        code, err = finish(proc, timeout=150)  # 5 s + 30 s, and room for a loaded machine
    assert code != 0
    assert f"did not answer for trainer.dist_timeout={timeout} s" in err, err[-3000:]
    assert err.rstrip().splitlines()[-1].startswith("bnexp: error: the 2 processes of"), err[-3000:]
    assert "Traceback" not in err and "ChildFailedError" not in err, err[-3000:]


@pytest.mark.slow
def test_failed_ranks_end_without_torchrun_traceback(tmp_path: Path) -> None:
    """The ranks of the README's command stop with bnexp's exit 2 (trainer.init_from names a
    file that is no checkpoint): torchrun's log names the failed rank, and the launcher ends
    with that exit code and its one line, without torchrun's ChildFailedError traceback."""
    (tmp_path / "weights.pt").write_bytes(b"not a checkpoint")
    with launched(tmp_path, "trainer.init_from=weights.pt") as proc:
        code, err = finish(proc)
    assert code == 2, err[-3000:]
    assert "failed (exitcode: 2) local_rank:" in err, err[-3000:]
    assert "Traceback" not in err and "ChildFailedError" not in err, err[-3000:]
    assert err.rstrip().splitlines()[-1].startswith("bnexp: error: the 2 processes of"), err[-3000:]


@pytest.mark.slow
@pytest.mark.xdist_group("ddp_uninterrupted")  # in one worker: `uninterrupted` runs once
def test_sigkill_of_the_launcher_ends_every_process_of_the_run(uninterrupted: Path, tmp_path: Path) -> None:
    """No rank or torchrun agent outlives a SIGKILLed launcher; the same command run at once
    waits for them, then resumes: one writer at a time, the result bit-identical."""
    run_dir = default_run_dir(tmp_path)
    with launched(tmp_path) as proc:
        wait_for_checkpoint(run_dir, proc, 2, timeout=300)
        old = descendants(proc.pid)  # torchrun's agent and the two ranks
        for pid in old:  # frozen mid-step: none can finish the run before the check below
            os.kill(pid, signal.SIGSTOP)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        try:
            with launched(tmp_path) as rerun:
                survivors = wait_until_gone(old, 30)
                code, err = finish(rerun)
        finally:
            for pid in old:
                if alive(pid):
                    os.kill(pid, signal.SIGKILL)
    assert len(old) >= 3 and survivors == []
    assert code == 0, err[-3000:]
    assert "resumed_from" in read_summary(run_dir)
    assert_same_run(uninterrupted, run_dir)


def test_stale_lock_waits_for_every_process_of_its_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    """A lock whose owner is dead while another process of its run (a rank, a DataLoader
    worker) still holds it: the re-run waits, then stops with exit 4; once the process is
    gone the lock is taken over."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(runlock, "STALE_WAIT", 1.0)
    args = [*TINY, "trainer.max_steps=2"]
    lock = default_run_dir(tmp_path, args) / runlock.LOCK_NAME
    lock.parent.mkdir(parents=True)
    dead = subprocess.Popen(["true"])  # a process that has ended
    dead.wait()
    lock.write_text(json.dumps({"pid": dead.pid, "host": socket.gethostname()}))
    holder = subprocess.Popen([sys.executable, "-c", "import fcntl, sys, time\n"
                               f"f = open({str(lock)!r}); fcntl.flock(f, fcntl.LOCK_SH); print(flush=True); "
                               "time.sleep(600)"], stdout=subprocess.PIPE, text=True)
    try:
        holder.stdout.readline()  # it holds the lock
        code, out = run_cli(["train", *args], capsys)
        assert code == EXIT_LOCKED, out
        assert f"still being written by processes of the run of process {dead.pid}, which ended" in out
        assert sorted(p.name for p in lock.parent.iterdir()) == [runlock.LOCK_NAME]  # nothing written
    finally:
        holder.kill()
        holder.wait()
    code, out = run_cli(["train", *args], capsys)
    assert code == 0 and "removing the stale lock" in out, out
