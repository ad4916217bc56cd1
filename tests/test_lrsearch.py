"""``bnexp lrsearch``: collapse detection, the max-stable-lr table, reuse of finished runs."""

from __future__ import annotations

import math
from pathlib import Path

import pandas as pd
import pytest

from bnexp.report.stability import collapsed
from bnexp.studies.lrsearch import max_stable
from tests.conftest import run_cli

# real digits, so that a stable lr learns (a run that learns nothing counts as collapsed to chance)
TOY = ["data=digits", "data.image_size=8", "data.channels=1", "model=mlp2x100", "model.width=16",
       "trainer.batch_size=32", "trainer.max_steps=20", "trainer.device=cpu"]


def test_collapse_rule() -> None:
    assert not collapsed("completed", 2.3, 2.0, 40.0, 10)
    assert collapsed("completed", 2.3, 2.3, 40.0, 10)  # not below the initial loss
    assert collapsed("completed", 2.3, math.inf, 40.0, 10)
    assert collapsed("diverged", 2.3, 1.0, 90.0, 10)
    # collapsed to chance: below a large initial loss, but at ln(10) and guessing
    assert collapsed("completed", 7.5, math.log(10), 10.3, 10)
    assert collapsed("completed", 7.5, 1.04 * math.log(10), 19.0, 10)
    assert collapsed("completed", 7.5, 2.5 * math.log(10), 10.0, 10)  # a confident constant prediction
    assert not collapsed("completed", 7.5, math.log(10), 21.0, 10)  # above twice the guessing rate
    assert not collapsed("completed", 7.5, 0.94 * math.log(10), 12.0, 10)  # the loss went below ln(10)
    assert collapsed("completed", 9.0, math.log(100), 1.5, 100)


def test_max_stable_takes_the_largest_lr_no_seed_collapses_at() -> None:
    runs = pd.DataFrame({
        "method": ["cbn"] * 6, "act": ["relu"] * 6, "lr": [0.01, 0.01, 0.1, 0.1, 1.0, 1.0], "seed": [0, 1] * 3,
        "collapsed": [False, False, False, False, False, True], "test_acc": [50.0, 52.0, 60.0, 64.0, 70.0, 10.0],
    })
    row = max_stable(runs).iloc[0]
    assert row["max_stable_lr"] == 0.1 and row["test_acc"] == 62.0 and row["seeds"] == 2


def test_lrsearch_marks_a_huge_lr_as_collapsed(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = ["lrsearch", *TOY, "methods=[none]", "acts=[relu]", "lrs=[1e-1,1e3]", f"out={tmp_path}", "format=csv"]
    code, out = run_cli(args, capsys)
    assert code == 0, out
    runs = pd.read_csv(tmp_path / "lrsearch_runs.csv").set_index("lr")
    assert not runs.loc[1e-1, "collapsed"] and runs.loc[1e-1, "final_loss"] < runs.loc[1e-1, "initial_loss"]
    assert runs.loc[1e3, "collapsed"]
    table = pd.read_csv(tmp_path / "lrsearch.csv")
    assert table[["method", "act", "max_stable_lr"]].values.tolist() == [["none", "relu", 1e-1]]
    assert (tmp_path / "none" / "relu" / "lr=0.1,seed=0" / "probes.csv").is_file()
    code, out = run_cli(args, capsys)  # finished candidates are reused, not trained again
    assert code == 0 and out.count("(reused)") == 2


def test_lrsearch_refuses_a_directory_of_another_search(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    base = ["lrsearch", *TOY, "methods=[none]", "acts=[relu]", "lrs=[1e-2]", f"out={tmp_path}"]
    assert run_cli(base, capsys)[0] == 0
    code, out = run_cli([*base, "trainer.max_steps=9"], capsys)
    assert code == 2 and "another config" in out


def test_lrsearch_honours_resume_never(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    base = ["lrsearch", *TOY, "methods=[none]", "acts=[relu]", "lrs=[1e-2]", f"out={tmp_path}"]
    assert run_cli(base, capsys)[0] == 0
    code, out = run_cli([*base, "trainer.resume=never"], capsys)  # a finished run, trained again
    assert code == 0 and "(reused)" not in out, out
