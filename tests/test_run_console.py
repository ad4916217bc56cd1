"""What a run tells its user (bnexp/engine/console.py): the banner, one line per evaluation
with the test accuracy, the projected time and the CPU warning, in the console and in
train.log alike; and ``trainer.keep_best`` (best.pt)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from bnexp.engine import checkpoint, console
from bnexp.engine.identity import fingerprint
from bnexp.support.runinfo import duration
from tests.conftest import TINY, compose_cfg, read_metrics, read_summary, run_cli

EVERY_STEP = ["trainer.eval_every=1", "trainer.eval_unit=step"]


def only_run(root: Path) -> Path:
    (run,) = (root / "results" / "runs").iterdir()
    return run


def test_a_run_opens_with_a_banner_and_logs_each_evaluation(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    """Without a terminal (as under nohup or SLURM): the banner, then one line per
    evaluation holding its metrics.csv row, in the console and in train.log."""
    monkeypatch.chdir(tmp_path)
    code, out = run_cli(["train", *TINY, *EVERY_STEP], capsys)
    assert code == 0, out
    run = only_run(tmp_path)
    summary = read_summary(run)
    banner = [f"run directory {run.absolute()}",
              f"  model resnet20 ({summary['params']:,} parameters), norm bn, act relu, on cpu",
              "  data synthetic: 64 training images, batches of 16 (4 steps an epoch)",
              "  4 steps, an evaluation every step"]
    rows = read_metrics(run / "metrics.csv")
    best = [max(float(r["test_acc"]) for r in rows[: i + 1]) for i in range(len(rows))]
    evals = [f"eval at step {r['step']}/4 (epoch {float(r['epoch']):.2f}): test top-1 {float(r['test_acc']):.2f}%, "
             f"top-5 {float(r['test_top5']):.2f}% (best {b:.2f}%), test loss {float(r['test_loss']):.4f}; "
             f"train loss {float(r['train_loss']):.4f}, top-1 {float(r['train_acc']):.2f}%" for r, b in zip(rows, best)]
    assert len(rows) == 4
    for text in (out, (run / "train.log").read_text()):
        lines = [line.split(" - ", 1)[-1] for line in text.splitlines()]
        start = lines.index(banner[0])
        assert lines[start: start + 4] == banner, text
        assert [line for line in lines if line.startswith("eval at step")] == evals, text
        assert "the CPU" not in text  # seconds of training: no warning


def test_the_projected_time_follows_the_first_timed_steps(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    """Steps 2 to 21 are timed (the first, which warms up, is not); the projection is that
    pace times the steps left, and on a CPU a projection above the limit (here 0 s) warns."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(console, "TIMED_SECONDS", 1e9)  # the 20 steps however slow the machine
    monkeypatch.setattr(console, "CPU_WARNING_SECONDS", 0.0)
    code, out = run_cli(["train", *(o for o in TINY if not o.startswith("trainer.max_steps")), "trainer.max_steps=24"],
                        capsys)
    assert code == 0, out
    found = re.findall(r"timed steps 2-21: (\S+) s a step; the 3 steps left take about (.+) \(evaluations", out)
    assert len(found) == 1, out
    per_step, said = found[0]
    assert said == duration(float(per_step) * 3) or float(per_step) * 3 < 1, out  # %.4g rounds the pace shown
    assert out.count("on the CPU: bnexp's paper protocols are meant for a GPU") == 1, out
    assert "this run trains about" in (only_run(tmp_path) / "train.log").read_text()


def test_a_pack_names_each_seed_in_its_evaluation_lines(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    code, out = run_cli(["train", *TINY, "trainer.pack=2"], capsys)
    assert code == 0, out
    runs = sorted((tmp_path / "results" / "runs").iterdir())
    assert "a pack of 2 runs trained as one model:" in out and all(f"  {run.absolute()}" in out for run in runs)
    for seed, run in enumerate(runs):
        acc = float(read_metrics(run / "metrics.csv")[-1]["test_acc"])
        assert f"seed {seed}: eval at step 4/4 (epoch 1.00): test top-1 {acc:.2f}%" in out, out


def test_keep_best_keeps_the_state_of_the_best_evaluation(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    """best.pt holds the state after the step of the first best test top-1: the final state
    of the same run trained that many steps. A best.pt from a later step than training
    starts at (another run's, or left by a process whose evaluations are trained again) is
    removed: trained over with trainer.resume=never, the run writes its own again."""
    monkeypatch.chdir(tmp_path)
    steps = 6
    base = [*(o for o in TINY if not o.startswith("trainer.max_steps")), *EVERY_STEP]
    command = ["train", *base, f"trainer.max_steps={steps}", "trainer.keep_best=true"]
    assert run_cli(command, capsys)[0] == 0
    run = only_run(tmp_path)
    accs = [float(r["test_acc"]) for r in read_metrics(run / "metrics.csv")]
    best_step = accs.index(max(accs)) + 1
    best = checkpoint.load(run / checkpoint.BEST)
    assert best["step"] == best_step and best["metrics"][-1]["test_acc"] == max(accs)
    planted = dict(best, step=steps + 1)
    checkpoint.save_with_checksum(planted, run / checkpoint.BEST)
    code, out = run_cli([*command, "trainer.resume=never"], capsys)
    assert code == 0 and f"removing {run / checkpoint.BEST} of step {steps + 1}" in out, out
    again = checkpoint.load(run / checkpoint.BEST)
    assert again["step"] == best_step and all(torch.equal(again["model"][k], v) for k, v in best["model"].items())
    assert run_cli(["train", *base, f"trainer.max_steps={best_step}"], capsys)[0] == 0
    (short,) = [d for d in (tmp_path / "results" / "runs").iterdir() if d != run]
    final = checkpoint.load(short / checkpoint.FINAL)
    assert all(torch.equal(final["model"][k], v) for k, v in best["model"].items())


def test_keep_best_is_not_part_of_a_runs_identity(tmp_path: Path) -> None:
    assert fingerprint(compose_cfg(["trainer.keep_best=true"])) == fingerprint(compose_cfg([]))


def test_a_best_checkpoint_is_kept_only_up_to_where_training_starts(tmp_path: Path) -> None:
    payload = {"model": {}, "optimizer": {}, "scheduler": {}, "rng": {}, "step": 5}
    for start, kept in ((5, True), (7, True), (4, False), (0, False)):
        checkpoint.save_with_checksum(payload, tmp_path / checkpoint.BEST)
        checkpoint.drop_stale_best(tmp_path, start)
        assert (tmp_path / checkpoint.BEST).is_file() == kept == checkpoint.checksum_path(tmp_path / checkpoint.BEST).is_file()
    checkpoint.save_with_checksum(payload, tmp_path / checkpoint.BEST)
    (tmp_path / checkpoint.BEST).write_bytes(b"damaged")
    checkpoint.drop_stale_best(tmp_path, 9)
    assert not (tmp_path / checkpoint.BEST).exists()
