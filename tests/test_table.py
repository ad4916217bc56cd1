"""``bnexp table``: the renderer on hand-made summary files."""

from __future__ import annotations

import json
import math
from pathlib import Path

import mpmath
import pandas as pd
import pytest
from omegaconf import OmegaConf

from bnexp.report.layouts import LABELS, Axis, Layout
from bnexp.report.presets import load_preset
from bnexp.report.results import load_summaries
from bnexp.report.table import build, render
from bnexp.support.errors import ConfigError
from tests.conftest import compose_cfg, run_cli

LAYOUT = Layout(
    "Test table",
    rows=(Axis("tags.row", (1, 2), "Method", "row", {1: "1 BN (baseline)", 2: "2 CBN"}, sweep="tags.row"),),
    columns=(Axis("act.name", ("sigmoid", "tanh", "relu"), "Activation", "activation", sweep="act"),),
    paper="cbn", table="1", tune="norm.rho", tuned_rows=frozenset({2}), improv=True, flags={"AMAT": frozenset({2})},
    sweeps=({"tags.row": ["1", "2"], "act": ["sigmoid", "tanh", "relu"], "trainer.seed": ["0", "1"]},),
)
# (row, activation, rho, seed, status, top-1); seeds 0 and 1 are expected in every cell
RUNS = [
    (1, "sigmoid", 1.0, 0, "completed", 80.0), (1, "sigmoid", 1.0, 1, "completed", 81.0),
    (1, "tanh", 1.0, 0, "completed", 87.0),  # seed 1 missing
    (1, "relu", 1.0, 0, "completed", 90.0), (1, "relu", 1.0, 1, "diverged", None),
    (2, "sigmoid", 1.0, 0, "completed", 85.0), (2, "sigmoid", 1.0, 1, "completed", 86.0),
    (2, "sigmoid", 2.0, 0, "completed", 88.0), (2, "sigmoid", 2.0, 1, "completed", 89.0),
    # row 2 tanh: nothing ran
    (2, "relu", 1.0, 0, "completed", 91.0), (2, "relu", 1.0, 1, "failed", None),
    (2, "relu", 2.0, 0, "completed", 90.0),  # rho 1 wins on the seed both completed
]

EXPECTED = """\
Test table

| Method          | AMAT   | Sigmoid                | Sigmoid paper   | Sigmoid Δ   | Sigmoid test                                         | Tanh                      | Tanh paper   | Tanh Δ   | Tanh test   | ReLU                           | ReLU paper   | ReLU Δ   | ReLU test   |
|:----------------|:-------|:-----------------------|:----------------|:------------|:-----------------------------------------------------|:--------------------------|:-------------|:---------|:------------|:-------------------------------|:-------------|:---------|:------------|
| 1 BN (baseline) |        | 80.50 ± 0.71 (2)       | 78.97 ± 0.53    | +1.53       | agree p=0.17                                         | 87.00 (1 of 2; 1 missing) | 87.59 ± 0.12 | -0.59    | missing     | 90.00 (1 of 2; 1 diverged)     | 91.13 ± 0.09 | -1.13    | missing     |
| 2 CBN           | x      | 88.50 ± 0.71 (2) rho=2 | 91.20 ± 0.06    | -2.70       | agree p=0.23 (selected on these runs among 2: p × 2) | – (0 of 2; 2 missing)     | 91.73 ± 0.07 |          | missing     | 91.00 (1 of 2; 1 failed) rho=1 | 91.98 ± 0.06 | -0.98    | missing     |
| Improv.         |        | +8.00                  | +12.23          |             |                                                      |                           | +4.14        |          |             | +1.00                          | +0.85        |          |             |

cell: mean ± std (completed runs; where some are not, 'n of N' and the diverged, failed and missing runs); paper: the published value; Δ: ours minus paper
"""


def write_runs(root: Path) -> None:
    for i, (row, act, rho, seed, status, top1) in enumerate(RUNS):
        run = root / f"run{i}"
        run.mkdir(parents=True)
        config = {"tags": {"row": row}, "act": {"name": act}, "norm": {"rho": rho}, "trainer": {"seed": seed}}
        summary = {"status": status, "final_top1": top1, "config": config}
        (run / "summary.json").write_text(json.dumps(summary))


def test_markdown_counts_every_run(tmp_path: Path) -> None:
    write_runs(tmp_path)
    assert render(build(LAYOUT, load_summaries(tmp_path)), "markdown", "Test table") == EXPECTED


def test_latex_and_csv(tmp_path: Path) -> None:
    write_runs(tmp_path)
    table = build(LAYOUT, load_summaries(tmp_path))
    latex = render(table, "latex", "Test table")
    assert latex.startswith("\\begin{table}") and "\\toprule" in latex and r"88.50 $\pm$ 0.71 (2) rho=2" in latex
    csv = render(table, "csv", "Test table").splitlines()
    assert csv[0].startswith("Method,AMAT,Sigmoid,Sigmoid paper") and len(csv) == 4


def write_preset_runs(root: Path, runs: list[tuple] = RUNS) -> None:
    """``runs`` as runs of CBN Table 1's sweeps: each summary holds the config its job composes."""
    for i, (row, act, rho, seed, status, top1) in enumerate(runs):
        job = [f"cbn_row=r{row}", f"act={act}", f"trainer.seed={seed}", *([f"norm.rho={rho}"] if row == 2 else [])]
        config = OmegaConf.to_container(compose_cfg(["experiment=cbn/table1", *job]), resolve=True)
        (root / f"run{i}").mkdir(parents=True)
        (root / f"run{i}" / "summary.json").write_text(json.dumps({"status": status, "final_top1": top1,
                                                                    "config": config}))


def test_a_runs_fingerprint_and_result_config_are_the_engines_of_its_recorded_config(tmp_path: Path) -> None:
    """A table reads each run's result config once and its fingerprint from it: the values of
    bnexp.engine.identity on the config the summary recorded, for a composed config and for one
    with what result_config leaves out or rewrites (a hydra node, non-result and neutral keys, a
    float that is an integer, a data root elsewhere, an empty node)."""
    from bnexp.engine.identity import fingerprint, result_config

    composed = OmegaConf.to_container(compose_cfg(["experiment=cbn/table1", "cbn_row=r2", "act=relu"]), resolve=True)
    odd = {"hydra": {"run": {"dir": "x"}}, "optim": {"lr": 1.0, "momentum": 0.9}, "norm": {"input": True, "rho": 0.5},
           "data": {"name": "cifar10", "root": "/elsewhere"}, "model": {"init_scale": 1.0}, "tags": {"row": "r1"},
           "lookup": {"warmup": {"cbn": 3}}, "trainer": {"seed": 3, "log_every": 7}, "empty": {}}
    for i, config in enumerate((composed, odd)):
        (tmp_path / f"run{i}").mkdir()
        (tmp_path / f"run{i}" / "summary.json").write_text(json.dumps({"status": "completed", "config": config}))
    rows = load_summaries(tmp_path).set_index("run_dir")
    for i, config in enumerate((composed, odd)):
        row = rows.loc[str(tmp_path / f"run{i}")]
        assert row["fingerprint"] == fingerprint(config) and row["result_config"] == result_config(config)


def test_table_command_on_a_results_folder(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    write_preset_runs(tmp_path)
    code, out = run_cli(["table", "cbn/table1", f"results={tmp_path}"], capsys)
    assert code == 0, out
    assert "not in this table" not in out
    lines = out.splitlines()
    assert lines[0] == f"CBN Table 1: ResNet-20 on CIFAR-10, top-1 % ({tmp_path})"
    rows = [line.split("|")[1].strip() for line in lines if line.startswith("| ")][1:]
    assert rows == ["1 BN (baseline)", "2 CBN", "Improv.", "3", "Improv.", "4", "Improv.", "5", "Improv.",
                    "6", "Improv.", "7", "Improv."]
    assert "– (0 of 10; 10 missing)" in out and "90.00 (1 of 10; 1 diverged, 8 missing)" in out
    assert run_cli(["table", "cbn/table9"], capsys)[0] == 2


def welch_p(ours: list[float], mean: float, std: float, runs: int) -> float:
    """Welch's two-sided p-value written out: the t statistic, Welch-Satterthwaite degrees of
    freedom, and the Student t tail from mpmath's regularized incomplete beta function."""
    n = len(ours)
    m = mpmath.fsum(ours) / n
    a, b = mpmath.fsum((v - m) ** 2 for v in ours) / (n - 1) / n, mpmath.mpf(std) ** 2 / runs
    t = (m - mean) / mpmath.sqrt(a + b)
    df = (a + b) ** 2 / (a**2 / (n - 1) + b**2 / (runs - 1))
    return float(mpmath.betainc(df / 2, 0.5, 0, df / (df + t**2), regularized=True))


@pytest.mark.slow
def test_table_tests_each_cell_against_the_published_runs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Made-up runs of CBN Table 1 (published: mean ± std of 10 trials per cell): the paper's
    own mean agrees, a far-off cell differs, cells near the 0.05 boundary fall on the side
    their p-value says, a cell with one run (or none) is missing, and the cell printed
    without a std (CBN row 2, SELU) gets no verdict and no count."""
    values = {"sigmoid": [78.47, 79.47],  # mean 78.97, the paper's: p = 1
              "tanh": [85.0, 85.2],  # 2.5 below 87.59 ± 0.12
              "relu": [91.28, 91.38, 91.48],  # 91.13 + 0.25, p about 0.03
              "swish": [91.29, 91.39, 91.49],  # 91.24 + 0.15, p about 0.1
              "selu": [89.69]}  # one run
    runs = [(1, act, 1.0, seed, "completed", v) for act, vs in values.items() for seed, v in enumerate(vs)]
    runs += [(2, "selu", 0.25, seed, "completed", 91.5 + 0.1 * seed) for seed in range(3)]
    write_preset_runs(tmp_path, runs)
    code, out = run_cli(["table", "cbn/table1", f"results={tmp_path}"], capsys)
    assert code == 0, out
    header, *lines = [[c.strip() for c in line.split("|")[1:-1]] for line in out.splitlines() if line.startswith("| ")]
    table = {line[0]: dict(zip(header, line)) for line in lines if line[0] != "Improv."}
    paper = {"sigmoid": (78.97, 0.53), "tanh": (87.59, 0.12), "relu": (91.13, 0.09), "swish": (91.24, 0.11)}
    for act, (mean, std) in paper.items():
        p = welch_p(values[act], mean, std, 10)
        assert table["1 BN (baseline)"][f"{LABELS[act]} test"] == f"{'agree' if p >= 0.05 else 'differ'} p={p:.2g}", act
    assert [table["1 BN (baseline)"][f"{LABELS[a]} test"].split()[0] for a in paper] == ["agree", "differ", "differ",
                                                                                          "agree"]
    assert table["1 BN (baseline)"]["SELU test"] == "missing" and table["3"]["ReLU test"] == "missing"
    assert table["2 CBN"]["SELU paper"] == "91.57" and table["2 CBN"]["SELU test"] == ""
    counts, _, runs = out.rstrip().splitlines()[-3:]
    assert counts == "Welch test at level 0.05 over the cells with a published mean ± std: 2 agree, 2 differ, 30 missing"
    assert runs == "Runs: 14 of 350 completed, 0 diverged, 0 failed, 336 missing"


def write_lr_run(root: Path, lr: float, first_epoch_loss: float, probe_losses: tuple[float, ...] | None,
                 top1: float | None = None) -> None:
    """A completed CBN Table 6 run: metrics.csv's first-epoch mean loss, the loss probe's values."""
    run = root / f"lr={lr}"
    run.mkdir(parents=True)
    config = {"tags": {"method": "cbn"}, "act": {"name": "relu"}, "optim": {"lr": lr}, "trainer": {"seed": 0}}
    final = probe_losses[-1] if probe_losses else 1.0
    summary = {"status": "completed", "final_top1": 50.0 + lr if top1 is None else top1, "final_train_loss": final,
               "num_classes": 10, "config": config}
    (run / "summary.json").write_text(json.dumps(summary))
    (run / "metrics.csv").write_text(f"step,epoch,train_loss\n10,1,{first_epoch_loss}\n20,2,{final}\n")
    if probe_losses:
        rows = [f"{step},loss,all,loss,{value}" for step, value in zip((0, 20), probe_losses)]
        (run / "probes.csv").write_text("\n".join(["step,probe,layer,quantity,value", *rows]) + "\n")


def relu_cbn_cell(root: Path) -> str:
    table = build(load_preset("cbn/table6").layout, load_summaries(root))
    return table.set_index("Method").loc["CBN", "ReLU"]


def test_table6_stability_compares_the_loss_probe_at_step_0_and_the_end(tmp_path: Path) -> None:
    # lr 1: the first epoch's mean loss (5.0) is above the final loss but the initial loss
    # (1.5) is below it, a collapse; lr 0.1 lowers the loss and is the largest stable lr
    write_lr_run(tmp_path, 1.0, first_epoch_loss=5.0, probe_losses=(1.5, 2.0))
    write_lr_run(tmp_path, 0.1, first_epoch_loss=2.5, probe_losses=(2.3, 1.0))
    assert relu_cbn_cell(tmp_path) == "50.10 (1 of 10; 9 missing) lr=0.1"  # the preset runs 10 seeds


def test_table6_counts_a_collapse_to_chance_as_unstable(tmp_path: Path) -> None:
    # lr 1 lowers the loss from 6.0 to ln(10), where a constant prediction sits, at 10 % top-1
    write_lr_run(tmp_path, 1.0, first_epoch_loss=5.0, probe_losses=(6.0, math.log(10)), top1=10.0)
    write_lr_run(tmp_path, 0.1, first_epoch_loss=2.5, probe_losses=(2.3, 1.0))
    assert relu_cbn_cell(tmp_path) == "50.10 (1 of 10; 9 missing) lr=0.1"  # the preset runs 10 seeds


def test_table6_needs_the_loss_probe(tmp_path: Path) -> None:
    write_lr_run(tmp_path, 1.0, first_epoch_loss=5.0, probe_losses=None)
    with pytest.raises(ConfigError, match=r"probes=\[loss\]"):
        relu_cbn_cell(tmp_path)


def test_timing_reads_training_seconds_from_the_time_probe(tmp_path: Path) -> None:
    run = tmp_path / "bn16"
    run.mkdir()
    config = {"norm": {"name": "bn"}, "trainer": {"batch_size": 16, "seed": 0}}
    summary = {"status": "completed", "steps_per_epoch": 10, "config": config}
    (run / "summary.json").write_text(json.dumps(summary))
    (run / "metrics.csv").write_text("step,epoch,seconds\n15,1.5,30.0\n")  # wall clock, evaluation included
    rows = [(10, "epoch_s", 4.0), (10, "epoch_steps", 10), (15, "epoch_s", 3.0), (15, "epoch_steps", 5)]
    (run / "probes.csv").write_text("step,probe,layer,quantity,value\n"
                                    + "".join(f"{s},time,all,{q},{v}\n" for s, q, v in rows))
    table = build(load_preset("bnp/timing").layout, load_summaries(tmp_path)).set_index("Method")
    assert table.loc["BN", "batch 16"] == "4.67 (1)"  # (4 + 3) s / 15 steps x 10 steps per epoch


def test_the_tuned_value_is_the_best_mean_over_the_seeds_every_value_completed() -> None:
    """best_choice, on frames with missing seeds, failed and diverged runs, runs without the
    metric and tied means, picks what the rule written out plainly picks: each value's runs
    on the seeds every value completed (all its runs where no seed is common), their mean, the
    highest (the smallest value among ties)."""
    import random

    from bnexp.report.selection import best_choice

    def plainly(runs: pd.DataFrame) -> float | None:
        done = runs[(runs["status"] == "completed") & runs["final_top1"].notna()]
        if done.empty:
            return None
        groups = dict(tuple(done.groupby("norm.rho")))
        common = set.intersection(*(set(g["trainer.seed"]) for g in groups.values()))
        means = {v: g[g["trainer.seed"].isin(common)]["final_top1"].mean() if common else g["final_top1"].mean()
                 for v, g in groups.items()}
        return max(sorted(means), key=lambda v: means[v])

    draw = random.Random(0)
    chosen = set()
    for _ in range(300):
        runs = pd.DataFrame([{"norm.rho": rho, "trainer.seed": seed, "status": draw.choice(["completed"] * 6 + ["failed", "diverged"]),
                              "final_top1": draw.choice([None, 80.0, 80.5, 81.0, 90.1, draw.uniform(70, 95)])}
                             for rho in (0.5, 1.0, 2.0, 4.0) for seed in range(draw.randint(1, 4))
                             if draw.random() < 0.8])
        if runs.empty:
            continue
        assert best_choice(runs, "norm.rho", "final_top1") == plainly(runs), runs
        chosen.add(plainly(runs))
    assert chosen == {0.5, 1.0, 2.0, 4.0}
    assert best_choice(runs.assign(status="failed"), "norm.rho", "final_top1") is None


def test_a_key_on_both_axes_selects_by_the_columns_value(tmp_path: Path) -> None:
    """A layout whose rows and columns set the same key: a cell's runs are those of the
    column's value (its keys are the row's updated by the column's), whatever the row."""
    from dataclasses import replace

    write_runs(tmp_path)
    both = replace(LAYOUT, rows=(Axis("act.name", ("sigmoid", "relu"), "Row act", "activation", sweep="act"),),
                   paper=None, tune=None, tuned_rows=frozenset(), improv=False, flags={})
    table = build(both, load_summaries(tmp_path))
    cells = table.drop(columns=["Row act"])
    assert len(table) == 2 and cells.iloc[0].tolist() == cells.iloc[1].tolist(), table
    assert cells.iloc[0]["Tanh"].startswith("87.00 (1 of 2"), table
