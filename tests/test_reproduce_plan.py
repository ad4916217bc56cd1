"""``bnexp reproduce PRESET dry_run=true``: the packs, the workers and the GPU-hours projected
from the last ``make gpu-check``; the progress bar over a whole table and its estimate."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bnexp.report import reproduce
from bnexp.report.presets import load_preset
from tests.conftest import run_cli

DRY = ["reproduce", "popnorm/table2", "scale=quick", "dry_run=true"]


def test_dry_run_names_the_packs_and_workers_and_has_no_projection_without_a_gpu_check(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    code, out = run_cli([*DRY, "hydra.launcher.per_gpu=3", f"hydra.sweep.dir={tmp_path / 'sweep'}"], capsys)
    assert code == 0, out
    assert "2 packs (2 of 2 runs) for 3 worker(s) (3 per GPU (no GPU here: counted for one)):" in out
    assert "pack 1: norm=bn: seeds 0-1" in out and "pack 2: norm=popnorm: seeds 0-1" in out
    assert "projected GPU-hours: no measurement (results/gpu-check/table-cost.json not found)" in out
    code, out = run_cli([*DRY, "hydra/launcher=pack_slurm", "hydra.launcher.nodes=2", "hydra.launcher.gpus_per_node=8",
                         "hydra.launcher.per_gpu=2", f"hydra.sweep.dir={tmp_path / 'sweep'}"], capsys)
    assert code == 0 and "2 packs (2 of 2 runs) for 32 worker(s) (2 per GPU x 8 GPUs per node x 2 node(s): " \
                         "the tasks of one SLURM job):" in out, out
    code, out = run_cli([*DRY, "hydra/launcher=basic", f"hydra.sweep.dir={tmp_path / 'sweep'}"], capsys)
    assert code == 0 and "4 packs (4 of 1 runs)" in out  # another launcher: one run at a time
    assert not (tmp_path / "sweep").exists()


def test_dry_run_projects_the_measured_setting_of_its_packs(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """GPU-hours = the runs' training images / the images/s that the last make gpu-check
    measured for packs of the plan's size and workers per GPU (the fastest where none is)."""
    p = load_preset("popnorm/table2", "quick")
    images = 4 * int(p.cfg.trainer.max_steps) * int(p.cfg.trainer.batch_size)
    env = {"device_name": "NVIDIA H200", "date": "2026-12-01T10:00:00"}
    measured = [{"name": "K=2 grouped x1", "runs": 2, "workers": 1, "model": p.cfg.model.name,
                 "images_per_second": 50.0, "env": env},
                {"name": "K=60 streams x4", "runs": 60, "workers": 4, "model": p.cfg.model.name,
                 "images_per_second": 400.0, "env": env}]
    (tmp_path / "results" / "gpu-check").mkdir(parents=True)
    (tmp_path / "results" / "gpu-check" / "table-cost.json").write_text(json.dumps(measured))
    monkeypatch.chdir(tmp_path)
    code, out = run_cli([*DRY, f"hydra.sweep.dir={tmp_path / 'sweep'}"], capsys)
    assert code == 0, out
    assert (f"projected: {images / 50.0 / 3600:,.1f} GPU-hours for the 4 runs of {p.cfg.model.name} on NVIDIA H200, "
            "at the 50 images/s of K=2 grouped x1 (measured 2026-12-01") in out
    code, out = run_cli([*DRY, "hydra.launcher.per_gpu=2", f"hydra.sweep.dir={tmp_path / 'sweep'}"], capsys)
    assert f"projected: {images / 400.0 / 3600:,.1f} GPU-hours" in out and "K=60 streams x4" in out


def test_progress_counts_the_ledgers_runs_and_estimates_the_time_left(tmp_path: Path, capsys, monkeypatch) -> None:
    """Without a terminal: a plain line whenever the count changed. Runs skipped as finished
    count as done, not toward the rate: 3 trained in 30 s with 6 left is 60 s left. A sweep
    that ended counts all its runs, those its ledger held when it was deleted unread too."""
    ledger = tmp_path / "ledger.jsonl"
    monkeypatch.setattr(reproduce, "ledger_file", lambda: ledger if ledger.exists() else None)
    clock = [1000.0]
    monkeypatch.setattr(reproduce.time, "monotonic", lambda: clock[0])
    progress = reproduce.TableProgress(10, every=0.0)
    entries = [{"planned": 5}, *({"dir": f"run{i}", "status": "completed"} for i in range(3)),
               {"dir": "old", "status": "skipped"}]
    ledger.write_text("".join(json.dumps(e) + "\n" for e in entries) + '{"dir": "half')
    clock[0] += 30
    progress.update()
    progress.update()  # no change: no second line
    ledger.unlink()  # the sweep's report read it back (one more run trained) and deleted it
    clock[0] += 10
    progress.sweep_ended(5)  # 4 trained in 40 s, 5 left
    progress.add(2)
    clock[0] += 20
    progress.update(final=True)  # between sweeps: no ledger, no change
    progress.bar.close()
    lines = capsys.readouterr().err.splitlines()
    assert lines == ["reproduce: 4/10 runs done, about 0:01:00 left", "reproduce: 5/10 runs done, about 0:00:50 left"]
    assert progress.total == 12 and progress.left() == "about 0:01:45 left"  # 60 s / 4 x 7


def test_dry_run_with_tune_seeds_states_which_seeds_select_and_which_test(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """CBN Table 1 at quick scale (seeds 0 and 1), ReLU alone, tune_seeds=1: stage 1 is the 3
    untuned rows on both seeds and the 4 tuned rows' 6 rho on seed 0; stage 2 each tuned
    row's winner on seed 1; nothing is written."""
    monkeypatch.chdir(tmp_path)
    sweep = tmp_path / "sweep"
    code, out = run_cli(["reproduce", "cbn/table1", "scale=quick", "tune_seeds=1", "dry_run=true", "act=relu",
                         f"hydra.sweep.dir={sweep}"], capsys)
    assert code == 0, out
    lines = out.splitlines()
    assert lines[0] == ("bnexp reproduce cbn/table1 (scale quick, tune_seeds=1): each tuned cell chooses its rho by "
                        "the best mean on seeds 0 (selection) and is reported and tested on seeds 1 (test)")
    assert lines[1].startswith("stage 1, 30 of the 54 runs") and lines[2] == f"30 jobs in {sweep}:"
    assert sum("norm.rho=" in line for line in lines[3:33]) == 24
    assert all("trainer.seed=0" in line for line in lines[3:33] if "norm.rho=" in line)
    assert ("stage 2, after stage 1: 4 runs, each of the 4 tuned cells at the rho with the best mean on seeds 0, "
            "on seeds 1 (test); 0 winners known from the runs there now") in lines
    assert not sweep.exists()
    code, out = run_cli(["reproduce", "popnorm/table2", "scale=quick", "tune_seeds=1", "dry_run=true"], capsys)
    assert code == 2 and "tune_seeds applies to presets whose table tunes a parameter" in out
    code, out = run_cli(["train", "-m", "experiment=cbn/table1", "tune_seeds=1", "--dry-run"], capsys)
    assert code == 2 and "tune_seeds is an option of bnexp reproduce and bnexp table" in out
