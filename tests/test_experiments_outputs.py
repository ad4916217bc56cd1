"""``bnexp plot`` on hand-made runs, and ``logger=tensorboard``."""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import pytest

from bnexp.report.plot import draw
from bnexp.report.presets import load_preset
from bnexp.report.results import load_summaries
from tests.conftest import TINY, run_cli, run_dir_of


def write_run(root: Path, row: int, act: str, seed: int) -> None:
    run = root / f"r{row}-{act}-{seed}"
    run.mkdir(parents=True)
    config = {"tags": {"row": row}, "act": {"name": act}, "norm": {"rho": 1.0}, "trainer": {"seed": seed}}
    (run / "summary.json").write_text(json.dumps({"status": "completed", "final_top1": 50.0 + seed, "config": config}))
    lines = ["step,epoch,lr,train_loss,train_acc,test_loss,test_acc,seconds"]
    lines += [f"{e * 10},{e},0.1,{2.3 / e + seed},{10 * e},{2.3 / e},{20 * e + row},{e}" for e in (1, 2, 3)]
    (run / "metrics.csv").write_text("\n".join(lines) + "\n")


def write_runs(root: Path) -> None:
    for row in (1, 2):
        for act in ("sigmoid", "relu"):
            for seed in (0, 1):
                write_run(root, row, act, seed)


def test_plot_draws_a_mean_line_per_row_in_each_column(tmp_path: Path) -> None:
    write_runs(tmp_path)
    fig = draw(load_preset("cbn/table1").layout, load_summaries(tmp_path), ("train_loss", "test_acc"), ["1", "2"])
    axes = np.array(fig.axes).reshape(2, 5)  # metrics x activations
    assert [ax.get_title() for ax in axes[0]] == ["Sigmoid", "Tanh", "ReLU", "SELU", "Swish"]
    epochs = [1, 2, 3]
    for j in range(5):
        for i, ax in enumerate(axes[:, j]):
            if j not in (0, 2):  # tanh, selu, swish: no runs
                assert not ax.lines and ax.get_legend() is None
                continue
            assert [t.get_text() for t in ax.get_legend().get_texts()] == ["1 BN (baseline)", "2 CBN rho=1"]
            for row, line in zip((1, 2), ax.lines):
                expected = [2.3 / e + 0.5 for e in epochs] if i == 0 else [20 * e + row for e in epochs]  # seeds 0, 1
                assert list(line.get_xdata()) == epochs
                assert list(line.get_ydata()) == pytest.approx(expected)
    plt.close(fig)


def test_plot_writes_png_and_pdf(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    write_runs(tmp_path / "results")
    out_dir = tmp_path / "plots"
    code, out = run_cli(["plot", "cbn/table1", f"results={tmp_path / 'results'}", f"out={out_dir}", "rows=1,2"], capsys)
    assert code == 0, out
    for ext in ("png", "pdf"):
        assert (out_dir / f"cbn_table1.{ext}").stat().st_size > 1000


def test_tensorboard_logger_writes_events(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out = run_cli(["train", *TINY, "logger=tensorboard", *run_dir_of(tmp_path)], capsys)
    assert code == 0, out
    assert list((tmp_path / "run" / "tensorboard").glob("events.out.tfevents.*"))
