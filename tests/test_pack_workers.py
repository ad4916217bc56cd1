"""Packs across settings and several workers per device (hydra/launcher=pack with per_gpu,
hydra/launcher=pack_slurm): every job trained once, by one worker, in its own run
directory; a killed worker's packs resumed; trainer.pack=auto measured and printed."""

from __future__ import annotations

import json
import multiprocessing
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from bnexp.app.workers import PackClaims, write_plan
from bnexp.engine import checkpoint
from bnexp.engine.identity import cell_name, fingerprint
from bnexp.support.runlock import LOCK_NAME, RunLock, read_owner
from tests.conftest import TINY, compose_cfg, read_summary, run_cli

SWEEP = [*TINY, "norm=cbn", "hydra/launcher=pack"]
CELLS = ["norm.rho=0.5,2.0", "trainer.seed=0,1,2"]  # 6 runs: one group (cbn) across rho and seeds


def summaries(root: Path) -> dict[tuple[float, int], dict]:
    """Each run's summary under a sweep folder, by (rho, seed)."""
    found = {}
    for path in root.glob("*/summary.json"):
        summary = json.loads(path.read_text())
        found[summary["config"]["norm"]["rho"], summary["config"]["trainer"]["seed"]] = summary
    return found


def test_pack_launcher_packs_across_rho_up_to_trainer_pack(tmp_path: Path, capsys) -> None:
    """The runs of one row at two rho values and three seeds train in packs of trainer.pack=4
    (the group's 6 runs: one pack of 4 across both rho, one of 2), each in the directory and
    with the fingerprint its own command gives it."""
    root = tmp_path / "sweep"
    code, out = run_cli(["train", "-m", *SWEEP, *CELLS, "trainer.pack=4", f"hydra.sweep.dir={root}"], capsys)
    assert code == 0, out
    assert "6 cells: 6 completed" in out
    runs = summaries(root)
    assert len(runs) == 6 and sorted(len(s["packed_with"]) for s in runs.values()) == [1, 1, 3, 3, 3, 3]
    big = next(s for s in runs.values() if len(s["packed_with"]) == 3)
    rhos = {read_summary(Path(d))["config"]["norm"]["rho"] for d in big["packed_with"]} | {big["config"]["norm"]["rho"]}
    assert rhos == {0.5, 2.0}
    expected = set()
    for rho, seed in runs:
        own = [*TINY, "norm=cbn", f"norm.rho={rho}", f"trainer.seed={seed}"]
        assert runs[rho, seed]["fingerprint"] == fingerprint(compose_cfg(own))
        expected.add(cell_name(own))
    assert {p.name for p in root.iterdir() if p.is_dir()} == expected


def test_trainer_pack_auto_picks_what_fits_and_says_so(tmp_path: Path, capsys, monkeypatch) -> None:
    """trainer.pack=auto measures a step of 1 and of 2 runs and fits K into the free memory
    (here set to hold 3 runs and a half): packs of 3, and the line that says why."""
    from bnexp.engine import pack_size
    from bnexp.models import DataSpec

    cfg = compose_cfg([*TINY, "norm=cbn"])
    one, two = (pack_size.step_cost(cfg, DataSpec(10, 3, 8), k, torch.device("cpu")) for k in (1, 2))
    per_run = two.bytes - one.bytes
    assert per_run > 0 and one.bytes >= per_run
    free = (one.bytes - per_run + 3.5 * per_run) / pack_size.MEMORY_SHARE
    monkeypatch.setattr(pack_size, "free_bytes", lambda device: int(free))
    root = tmp_path / "sweep"
    code, out = run_cli(["train", "-m", *SWEEP, *CELLS, "trainer.pack=auto", f"hydra.sweep.dir={root}"], capsys)
    assert code == 0, out
    assert re.search(r"trainer\.pack=auto: 3 runs per pack on cpu \(.* MiB free", out), out
    assert sorted(len(s["packed_with"]) for s in summaries(root).values()) == [2] * 6
    code, out = run_cli(["train", *TINY, "trainer.pack=auto", f"hydra.run.dir={tmp_path / 'one'}"], capsys)
    assert code == 2 and "trainer.pack=auto sizes the packs of a sweep" in out and not (tmp_path / "one").exists()


def test_trainer_pack_auto_divides_a_device_among_its_own_workers_only(monkeypatch) -> None:
    """On 4 GPUs with per_gpu=2 the launcher starts 8 workers, but each device is shared by 2:
    auto sizes the packs for 2 workers, once per kind of run."""
    from omegaconf import open_dict

    from bnexp.engine import pack_size
    from hydra_plugins.bnexp_launcher import PackLauncher

    asked: list[int] = []
    monkeypatch.setattr(pack_size, "measured_pack", lambda cfg, workers: (asked.append(workers), (7, "measured"))[1])
    config = compose_cfg([*TINY, "norm=cbn", "trainer.pack=auto"])
    with open_dict(config):
        config.hydra = {}
    launcher = PackLauncher(per_gpu=2)
    assert launcher.worker_count(["0", "1", "2", "3"]) == 8
    assert [launcher.pack_size(config, runs) for runs in (100, 5)] == [7, 5] and asked == [2]


def claim_all(folder: Path, taken: "multiprocessing.Queue") -> None:
    for pack in PackClaims(folder).take():
        time.sleep(0.05)  # long enough for the other worker to try the same pack
        taken.put(pack)
        PackClaims(folder).finish(pack, [(pack, "COMPLETED", 1.0)])


def test_workers_claim_each_pack_once(tmp_path: Path) -> None:
    """Three processes taking packs from one plan: each pack is taken by exactly one."""
    write_plan(tmp_path, [[(i, [f"trainer.seed={i}"])] for i in range(12)])
    context = multiprocessing.get_context("fork")
    taken = context.Queue()
    procs = [context.Process(target=claim_all, args=(tmp_path, taken)) for _ in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    got = sorted(taken.get(timeout=5) for _ in range(12))
    assert got == list(range(12)) and taken.empty() and not PackClaims(tmp_path).unfinished()


def test_a_dead_worker_s_pack_is_free_again(tmp_path: Path) -> None:
    """A pack whose worker died (its lock dropped by the kernel) and that has no outcome is
    taken again; one another worker holds is not."""
    write_plan(tmp_path, [[(0, [])], [(1, [])]])
    context = multiprocessing.get_context("fork")
    holder = context.Process(target=_hold, args=(tmp_path, 1))
    holder.start()
    time.sleep(2)
    dead = context.Process(target=_hold, args=(tmp_path, 0))
    dead.start()
    time.sleep(2)
    os.kill(dead.pid, signal.SIGKILL)
    dead.join()
    assert list(PackClaims(tmp_path).take()) == [0]  # pack 1 is held by a live worker; 0 is taken once
    holder.kill()
    holder.join()


def _hold(folder: Path, pack: int) -> None:
    with PackClaims(folder).claim(pack) as mine:
        assert mine
        time.sleep(60)


def cli(root: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "bnexp", "train", "-m", *SWEEP, *CELLS, "trainer.pack=3",
            "hydra.launcher.per_gpu=2", f"hydra.sweep.dir={root}", *extra]


@pytest.mark.slow
def test_two_workers_on_two_slots_train_every_job_once(tmp_path: Path) -> None:
    """per_gpu=2 on a CPU: two worker processes share the two packs of 3; every pack is
    trained by one worker, every job once, each in its own directory."""
    root = tmp_path / "sweep"
    done = subprocess.run(cli(root), capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    log = done.stdout + done.stderr
    assert "6 cells: 6 completed" in log
    assert sorted(re.findall(r"worker \d \(CPU, \d+ thread\(s\)\): pack (\d) of 2", log)) == ["1", "2"]
    runs = summaries(root)
    assert len(runs) == 6 and all(s["status"] == "completed" and "resumed_from" not in s for s in runs.values())
    assert not (root / ".packs").exists() or not any((root / ".packs").iterdir())


@pytest.mark.slow
def test_a_killed_worker_s_packs_resume(tmp_path: Path) -> None:
    """SIGKILL to the worker training the pack of rho 0.5 once its three runs have checkpointed:
    a worker (of this round or the next) takes the pack over, resumes its runs from their
    checkpoints (taking over their stale run locks), and the sweep ends with every job
    completed, each trained by one worker at a time."""
    root = tmp_path / "sweep"
    extra = ["trainer.max_steps=100", "trainer.checkpoint_every=2", "trainer.checkpoint_unit=step",
             "trainer.log_every=2", "trainer.eval_every=100", "trainer.eval_unit=step"]
    proc = subprocess.Popen(cli(root, *extra), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    victim = None
    deadline = time.monotonic() + 300
    while victim is None and time.monotonic() < deadline and proc.poll() is None:
        pack = list(root.glob("*norm.rho=0.5*/"))
        if len(pack) == 3 and all(checkpoint.periodic_checkpoints(run) for run in pack) and \
                (pack[0] / LOCK_NAME).exists():
            victim = read_owner(pack[0] / LOCK_NAME).get("pid")
        time.sleep(0.05)
    assert victim, "the pack of rho 0.5 did not checkpoint while locked"
    os.kill(victim, signal.SIGKILL)
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out[-3000:]
    assert "6 cells: 6 completed" in out
    runs = summaries(root)
    assert len(runs) == 6 and all(s["status"] == "completed" for s in runs.values())
    assert all("resumed_from" in runs[0.5, seed] for seed in range(3)), out[-3000:]
    assert "removing the stale lock" in out


@pytest.mark.slow
def test_a_run_directory_held_by_another_process_is_not_taken(tmp_path: Path) -> None:
    """A run directory whose lock another process holds: its worker leaves it (recorded as
    locked) and trains the rest of its pack; no worker writes into it."""
    root = tmp_path / "sweep"
    code = subprocess.run([*cli(root), "--dry-run"], capture_output=True, text=True)
    held = Path(re.findall(r"^\s+(\S+trainer\.seed=1\S*)\s+\[", code.stdout, re.M)[0])
    with RunLock(held):
        done = subprocess.run(cli(root), capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
        assert sorted(p.name for p in held.iterdir()) == [LOCK_NAME]
    log = done.stdout + done.stderr
    assert done.returncode != 0 and "5 completed" in log and "locked" in log
    assert len(summaries(root)) == 5


@pytest.mark.slow
def test_pack_slurm_tasks_train_the_packs(tmp_path: Path) -> None:
    """hydra/launcher=pack_slurm with submitit's local executor (cluster=local): two tasks of
    one job are the workers; the sweep's runs are those of the in-process launcher."""
    pytest.importorskip("submitit")
    root = tmp_path / "sweep"
    args = [sys.executable, "-m", "bnexp", "train", "-m", *TINY, "norm=cbn", "hydra/launcher=pack_slurm",
            "hydra.launcher.cluster=local", "hydra.launcher.gpus_per_node=0", "hydra.launcher.per_gpu=2",
            *CELLS, "trainer.pack=3", f"hydra.sweep.dir={root}"]
    done = subprocess.run(args, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    runs = summaries(root)
    assert len(runs) == 6 and all(s["status"] == "completed" and len(s["packed_with"]) == 2 for s in runs.values())
    assert read_summary(next(root.glob("*seed=0*")))["config"]["trainer"]["device"] == "cpu"


def test_the_lock_of_a_killed_process_not_yet_reaped_is_stale(tmp_path: Path) -> None:
    """A worker killed while it held run locks stays a zombie until its launcher reaps it: its
    locks are stale from the moment it dies (it can write nothing more), so another worker
    resumes its runs at once."""
    run = tmp_path / "run"
    child = os.fork()
    if child == 0:
        RunLock(run).acquire()
        time.sleep(60)
        os._exit(0)
    while not (run / LOCK_NAME).exists():
        time.sleep(0.01)
    os.kill(child, signal.SIGKILL)
    while Path(f"/proc/{child}/stat").read_text().rpartition(")")[2].split()[0] != "Z":
        time.sleep(0.01)
    with RunLock(run):  # taken over while the zombie is still there
        assert read_owner(run / LOCK_NAME)["pid"] == os.getpid()
    os.waitpid(child, 0)


def test_bad_pack_settings_are_refused_before_anything_is_written(tmp_path: Path, capsys) -> None:
    code, out = run_cli(["train", *TINY, "trainer.pack_conv=stripes", f"hydra.run.dir={tmp_path / 'run'}"], capsys)
    assert code == 2 and "unknown trainer.pack_conv 'stripes'; valid choices: auto, grouped, streams" in out
    code, out = run_cli(["train", "-m", *SWEEP, "trainer.seed=0,1", "hydra.launcher.per_gpu=0",
                         f"hydra.sweep.dir={tmp_path / 'sweep'}"], capsys)
    assert code != 0 and "hydra.launcher.per_gpu=0 is not valid: use an integer >= 1" in out
    code, out = run_cli(["train", "-m", *TINY, "trainer.pack=auto", "trainer.seed=0,1",
                         f"hydra.sweep.dir={tmp_path / 'sweep'}"], capsys)
    assert code == 2 and "trainer.pack=auto sizes the packs of a sweep, which hydra/launcher=pack" in out
    assert not (tmp_path / "run").exists() and not any((tmp_path / "sweep").glob("*/summary.json"))


@pytest.mark.slow
def test_the_readme_s_table1_pack_commands(tmp_path: Path, capsys, monkeypatch) -> None:
    """As the README writes them: Table 1's 1,350 runs in packs of at most 60 are its 20 tuned
    row x activation groups (6 rho x 10 seeds each) and 15 cells of 10 seeds."""
    monkeypatch.chdir(tmp_path)
    code, out = run_cli(["reproduce", "cbn/table1", "dry_run=true", "trainer.pack=60"], capsys)
    assert code == 0, out[-2000:]
    assert "35 packs (20 of 60, 15 of 10 runs) for " in out
    assert "pack 16: cbn_row=r2 act=sigmoid trainer.pack=60: rho=0.25 seeds 0-9, rho=0.5 seeds 0-9, " in out
    code, out = run_cli(["train", "-m", "experiment=cbn/table1", "hydra/launcher=pack", "trainer.pack=60",
                         "--dry-run"], capsys)
    assert code == 0 and "1350 jobs in results/cbn/table1" in out and not (tmp_path / "results").exists()
