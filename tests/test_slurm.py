"""A real one-node SLURM cluster (``make slurm``): a sweep through Hydra's submitit launcher, a
two-task DDP job, and a preemption by ``scontrol requeue`` whose resumed run is bit-identical
to an uninterrupted one (marked ``slurm``). They are skipped, with the reason, where no
cluster is up; that reason is tested without one."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import TINY, read_summary, run_cli, run_dir_of
from tests.test_resilience import EXACT, assert_same_run, wait_for_checkpoint

SLURM = ["-m", "hydra/launcher=submitit_slurm"]
JOB_TIMEOUT_S = 300  # a tiny job waits for nothing but its start (seconds) and a requeue (about 11 s)
NODE_UP = ("idle", "mixed", "allocated")


def cluster_problem() -> str | None:
    """Why no job can be submitted here (None: a SLURM controller answers and a node is up)."""
    if importlib.util.find_spec("hydra_plugins.hydra_submitit_launcher") is None:
        return "hydra-submitit-launcher is not installed: pip install 'bnexp[slurm]'"
    if shutil.which("sinfo") is None or shutil.which("scontrol") is None:
        return "no SLURM commands (sinfo, scontrol) on PATH: start the test cluster with `make slurm` (as root)"
    ping = subprocess.run(["scontrol", "ping"], capture_output=True, text=True, timeout=60)
    if "UP" not in ping.stdout:
        said = (ping.stdout + ping.stderr).strip().splitlines()
        return f"no SLURM controller answers (`scontrol ping`: {said[0] if said else ping.returncode}): run `make slurm`"
    nodes = subprocess.run(["sinfo", "-h", "-o", "%N %T"], capture_output=True, text=True, timeout=60).stdout.split("\n")
    if not any(line.split()[-1].rstrip("*~#") in NODE_UP for line in nodes if line.strip()):
        return f"no SLURM node is up (sinfo: {'; '.join(n for n in nodes if n) or 'none'}): run `make slurm`"
    return None


@pytest.fixture(scope="module")
def cluster() -> None:
    problem = cluster_problem()
    if problem:
        pytest.skip(problem)


def fake_command(folder: Path, name: str, output: str, code: int) -> None:
    """An executable ``folder/name`` that prints ``output`` and exits with ``code``."""
    path = folder / name
    path.write_text(f"#!{sys.executable}\nimport sys\nprint({output!r})\nsys.exit({code})\n")
    path.chmod(0o755)


@pytest.mark.parametrize("scontrol, sinfo, reason", [
    (None, None, "no SLURM commands (sinfo, scontrol) on PATH"),
    (("Slurmctld(primary) at vm is DOWN\n*****", 1), ("", 1), "`scontrol ping`: Slurmctld(primary) at vm is DOWN"),
    (("Slurmctld(primary) at vm is UP", 0), ("vm down*", 0), "no SLURM node is up (sinfo: vm down*)"),
])
def test_without_a_cluster_the_slurm_tests_say_why(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                   scontrol: tuple[str, int] | None, sinfo: tuple[str, int] | None,
                                                   reason: str) -> None:
    """The reason the `slurm` tests are skipped with, where `make slurm` did not bring a cluster up."""
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher")
    for name, fake in (("scontrol", scontrol), ("sinfo", sinfo)):
        if fake is not None:
            fake_command(tmp_path, name, *fake)
    monkeypatch.setenv("PATH", str(tmp_path))
    problem = cluster_problem()
    assert problem is not None and reason in problem and "make slurm" in problem, problem


def job_folders(where: Path) -> list[Path]:
    """submitit's per-job folders (``<sweep>/.submitit/<job id>[_<array index>]``) under ``where``."""
    return sorted(p for p in where.glob("results/multirun/*/.submitit/*") if p.is_dir())


def job_ids(where: Path) -> set[str]:
    """The SLURM job ids submitted from ``where``."""
    return {p.name.split("_")[0] for p in job_folders(where)}


def job_logs(where: Path, tail: int = 3000) -> str:
    """Every job's stdout and stderr (the last ``tail`` characters of each, for a failure
    message; 0 for all of it)."""
    return "\n".join(f"--- {log}\n{log.read_text()[-tail:]}" for folder in job_folders(where)
                     for log in sorted(folder.glob("*_log.*")))


def submitit_says(where: Path, message: str) -> int:
    """How many times submitit logged ``message`` in the jobs' outputs (its own lines, not
    their copies through the run's console log)."""
    return sum(line.startswith("submitit INFO") and message in line for line in job_logs(where, tail=0).splitlines())


def finish(proc: subprocess.Popen, where: Path) -> str:
    """Wait for the submitting ``bnexp`` to return (it waits for its jobs) and return its output;
    jobs still queued or running at the time limit are cancelled and the test fails."""
    try:
        out, _ = proc.communicate(timeout=JOB_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        subprocess.run(["scancel", *job_ids(where)], check=False)
        proc.kill()
        out, _ = proc.communicate()
        raise AssertionError(f"the SLURM jobs did not finish in {JOB_TIMEOUT_S} s\n{out[-3000:]}\n{job_logs(where)}")
    return out


def submit(where: Path, overrides: list[str]) -> subprocess.Popen:
    """``bnexp train -m hydra/launcher=submitit_slurm OVERRIDES`` in ``where``, as a user types it."""
    where.mkdir(parents=True, exist_ok=True)
    return subprocess.Popen([sys.executable, "-m", "bnexp", "train", *SLURM, *overrides], cwd=where, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def only_cell(where: Path) -> Path:
    """The run directory of a one-cell sweep (an ad-hoc sweep's cells train where single runs do)."""
    cells = [p for p in where.glob("results/runs/*") if p.is_dir()]
    assert len(cells) == 1, cells
    return cells[0]


@pytest.mark.slurm
@pytest.mark.slow
@pytest.mark.xdist_group("slurm")  # one node: the cluster tests take turns in one worker
def test_sweep_through_submitit_runs_each_cell_as_a_slurm_job(cluster: None, tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    sweep = [*TINY, "optim.lr=0.1,0.2"]
    on_slurm = tmp_path / "slurm"
    out = finish(submit(on_slurm, sweep), on_slurm)
    assert "sweep finished: 2 cells: 2 completed" in out, out[-3000:] + job_logs(on_slurm)
    assert submitit_says(on_slurm, "Job completed successfully") == 2, job_logs(on_slurm)  # a job per cell
    local = tmp_path / "local"
    local.mkdir()
    monkeypatch.chdir(local)
    code, said = run_cli(["train", "-m", *sweep], capsys)
    assert code == 0, said
    cells = sorted(p.relative_to(local) for p in local.glob("results/runs/*/summary.json"))
    assert len(cells) == 2 and cells == sorted(p.relative_to(on_slurm) for p in on_slurm.glob("results/runs/*/summary.json"))
    for cell in cells:
        assert read_summary((on_slurm / cell).parent)["status"] == "completed"
        assert_same_run((on_slurm / cell).parent, (local / cell).parent)


@pytest.mark.slurm
@pytest.mark.slow
@pytest.mark.xdist_group("slurm")  # one node: the cluster tests take turns in one worker
def test_two_slurm_tasks_train_one_ddp_run(cluster: None, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Each task is one rank (bnexp reads them from submitit); rank 0 alone writes the run
    directory, train.log included, and the run equals a torchrun run of two processes."""
    on_slurm = tmp_path / "slurm"
    out = finish(submit(on_slurm, ["hydra.launcher.tasks_per_node=2", *TINY]), on_slurm)
    assert "sweep finished: 1 cells: 1 completed" in out, out[-3000:] + job_logs(on_slurm)
    logs = job_logs(on_slurm)
    assert "global_rank=0(2)" in logs and "global_rank=1(2)" in logs, logs
    run = only_cell(on_slurm)
    assert read_summary(run)["world_size"] == 2
    assert (run / "train.log").read_text().count("status completed") == 1  # rank 1 logs to its job's output only
    code, said = run_cli(["train", *TINY, "trainer.nproc=2", *run_dir_of(tmp_path / "torchrun")], capsys)
    assert code == 0, said
    assert_same_run(run, tmp_path / "torchrun" / "run")


@pytest.mark.slurm
@pytest.mark.slow
@pytest.mark.xdist_group("slurm")  # one node: the cluster tests take turns in one worker
def test_scontrol_requeue_mid_run_resumes_bit_identically(cluster: None, tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    """SLURM sends SIGTERM to a requeued job: the run checkpoints and exits 75, the job runs
    again in the same directory and resumes; the result equals an uninterrupted run."""
    overrides = [*(o for o in TINY if not o.startswith("trainer.max_steps")), *EXACT,
                 "trainer.max_steps=100", "data.train_size=256"]
    on_slurm = tmp_path / "slurm"
    proc = submit(on_slurm, overrides)
    deadline = time.monotonic() + JOB_TIMEOUT_S
    while not list(on_slurm.glob("results/runs/*/checkpoints")) and proc.poll() is None \
            and time.monotonic() < deadline:
        time.sleep(0.05)
    wait_for_checkpoint(only_cell(on_slurm), proc, 2, timeout=JOB_TIMEOUT_S)
    (job,) = job_ids(on_slurm)
    requeue = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True, timeout=60)
    assert requeue.returncode == 0, requeue.stderr
    out = finish(proc, on_slurm)
    run = only_cell(on_slurm)
    assert "sweep finished: 1 cells: 1 completed" in out, out[-3000:] + job_logs(on_slurm)
    log = (run / "train.log").read_text()
    assert "stopped by SIGTERM after writing a checkpoint" in log, f"the requeue did not stop the run:\n{log}"
    assert "resumed from" in log, log
    assert submitit_says(on_slurm, "Starting with JobEnvironment") == 2  # the same job, started twice
    local = tmp_path / "local"
    local.mkdir()
    monkeypatch.chdir(local)
    code, said = run_cli(["train", *overrides], capsys)
    assert code == 0, said
    (reference,) = local.glob("results/runs/*")
    assert_same_run(run, reference)


@pytest.mark.slurm
@pytest.mark.slow
@pytest.mark.xdist_group("slurm")  # one node: the cluster tests take turns in one worker
def test_pack_slurm_workers_are_the_tasks_of_one_job(cluster: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """hydra/launcher=pack_slurm with per_gpu=2 on a CPU node: one SLURM job of two tasks
    trains the two packs (across rho), and each run equals the same run trained by the
    packing launcher in this process."""
    sweep = [*TINY, "norm=cbn", "norm.rho=0.5,2.0", "trainer.seed=0,1,2", "trainer.pack=3"]
    on_slurm = tmp_path / "slurm"
    on_slurm.mkdir()
    proc = subprocess.Popen([sys.executable, "-m", "bnexp", "train", "-m", "hydra/launcher=pack_slurm",
                             "hydra.launcher.gpus_per_node=0", "hydra.launcher.per_gpu=2", *sweep], cwd=on_slurm,
                            text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    out = finish(proc, on_slurm)
    assert "sweep finished: 6 cells: 6 completed" in out, out[-3000:]
    local = tmp_path / "local"
    local.mkdir()
    monkeypatch.chdir(local)
    code, said = run_cli(["train", "-m", "hydra/launcher=pack", *sweep], capsys)
    assert code == 0, said
    cells = sorted(p.parent.relative_to(local) for p in local.glob("results/runs/*/summary.json"))  # the cells listed
    assert len(cells) == 6
    for cell in cells:
        assert len(read_summary(on_slurm / cell)["packed_with"]) == 2
        assert_same_run(on_slurm / cell, local / cell)
