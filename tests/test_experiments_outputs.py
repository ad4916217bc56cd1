"""``bnexp plot`` on hand-made runs, and ``logger=tensorboard``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import TINY, run_cli, run_dir_of


def write_run(root: Path, row: int, act: str, seed: int) -> None:
    run = root / f"r{row}-{act}-{seed}"
    run.mkdir(parents=True)
    config = {"tags": {"row": row}, "act": {"name": act}, "norm": {"rho": 1.0}, "trainer": {"seed": seed}}
    (run / "summary.json").write_text(json.dumps({"status": "completed", "final_top1": 50.0 + seed, "config": config}))
    lines = ["step,epoch,lr,train_loss,train_acc,test_loss,test_acc,seconds"]
    lines += [f"{e * 10},{e},0.1,{2.3 / e + seed},{10 * e},{2.3 / e},{20 * e + row},{e}" for e in (1, 2, 3)]
    (run / "metrics.csv").write_text("\n".join(lines) + "\n")


def test_plot_writes_png_and_pdf(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for row in (1, 2):
        for act in ("sigmoid", "relu"):
            for seed in (0, 1):
                write_run(tmp_path / "results", row, act, seed)
    out_dir = tmp_path / "plots"
    code, out = run_cli(["plot", "cbn/table1", f"results={tmp_path / 'results'}", f"out={out_dir}", "rows=1,2"], capsys)
    assert code == 0, out
    for ext in ("png", "pdf"):
        assert (out_dir / f"cbn_table1.{ext}").stat().st_size > 1000


def test_tensorboard_logger_writes_events(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out = run_cli(["train", *TINY, "logger=tensorboard", *run_dir_of(tmp_path)], capsys)
    assert code == 0, out
    assert list((tmp_path / "run" / "tensorboard").glob("events.out.tfevents.*"))
