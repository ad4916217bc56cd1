"""Paper presets: composition, run counts, two-stage tuning, skip-completed, quick scale."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Callable

import pytest

from bnexp.app.compose import hydra_session, is_group, parser
from bnexp.app.sweep import shape_representatives, skip_reason
from bnexp.reference import published
from bnexp.report import presets
from bnexp.report.layouts import same
from bnexp.report.presets import count, load_preset, preset_names
from bnexp.report.reproduce import reproduce, split_plan, stage_one, stage_two
from bnexp.report.selection import combos
from bnexp.report.table import paper_value
from tests.conftest import QUICK_PRESET, TINY, compose_cfg, copy_runs, read_summary, run_cli

# (3 untuned rows + 4 tuned rows x 6 rho) x 5 activations x 10 seeds
CBN_ABLATION = (3 + 4 * 6) * 5 * 10
EXPECTED_RUNS = {
    "cbn/table1": CBN_ABLATION, "cbn/table2": CBN_ABLATION, "cbn/table3": CBN_ABLATION, "cbn/table4": CBN_ABLATION,
    "cbn/table5": 3 * 2 * 5,  # models x {BN, CBN} x activations, one run each
    "cbn/table6": 4 * 5 * 5 * 10,  # components x activations x lr candidates x seeds
    "cbn/rho": 6 * 5 * 10,
    "cbn/amat": 4 * 5,  # vanilla BN, CBN without AMAT, fixed eta, AMAT x activations
    "cbn/grad_norm": 4 * 5,  # components x activations, one run
    "cbn/eta_tau": 5,
    "popnorm/table1": 2 * 3 * 2 * 2 * 10,  # models x activations x data sets x methods x seeds
    "popnorm/table2": 2,
    "popnorm/kappa": 3 * 3 * 10,
    "popnorm/ablation": 5 * 3 * 10,
    "bnp/fc": (4 + 4 + 5 + 3) * 5,  # (MNIST 60, CIFAR 60, CIFAR 6, CIFAR 1) methods with a paper lr x seeds
    "bnp/cnn5": (4 + 5 + 3) * 5,  # batch 128, 2, 1
    "bnp/resnet110": 4 * 5,
    "bnp/preact110": 4 * 5,
    "bnp/hessian": 2 * 5,
    "bnp/timing": 2 * 3,
    "bnp/fig7": 3,
    "arora/auto_rate": 5 * 3,
}


@pytest.mark.slow
def test_every_preset_composes_and_its_report_block_matches_the_published_cells() -> None:
    """Every preset composes and expands to its run count, and its table has cells its sweeps
    make; a table that claims a published table pairs each of its cells with one published
    number, and every published number of that table with a cell. (The presets sit in paper
    folders, which Hydra's experiment=glob(*) does not list: preset_names reads the folder.)"""
    assert set(EXPECTED_RUNS) <= set(preset_names())
    for name in preset_names():
        p = load_preset(name)
        assert len(p.jobs) == len({frozenset(job) for job in p.jobs}), f"{name}: duplicate runs"
        if name in EXPECTED_RUNS:
            assert len(p.jobs) == EXPECTED_RUNS[name], name
        assert p.results_dir == Path("results") / name
        layout = p.layout
        cells = [{**r, **c} for r in combos(layout.rows) for c in combos(layout.columns)]
        covered = [cell for cell in cells if layout.sweep_of(cell) is not None]
        assert covered, name
        if layout.paper is None:
            continue
        claimed = published().query(f"paper == '{layout.paper}' and table == '{layout.table}'")
        paired = []
        for cell in covered:
            for metric in layout.metrics:
                rows = claimed[claimed["metric"] == metric]
                for axis in (a for a in layout.axes if a.published):
                    rows = rows[rows[axis.published].map(lambda v, a=axis: same(v, cell[a.key]))]
                assert len(rows) == 1 and paper_value(layout, cell, metric) is not None, (name, cell, metric)
                paired.append(rows.index[0])
        assert sorted(paired) == sorted(claimed.index), name  # one to one


def test_command_line_values_choose_among_the_sweeps() -> None:
    """A value for a key some sweeps set selects from those sweeps (a sweep left with none is
    dropped; a value no sweep has is added to them); any other override applies to all."""
    p = load_preset("cbn/table1", overrides=["act=relu", "trainer.seed=0,1"])
    assert len(p.jobs) == (3 + 4 * 6) * 2 and all("act=relu" in job for job in p.jobs)
    assert len(load_preset("cbn/table1", overrides=["cbn_row=r1"]).jobs) == 5 * 10  # row 1 only, no rho grid
    grid = load_preset("cbn/table1", overrides=["norm.rho=1.0,2.0"]).jobs
    assert len(grid) == (3 + 4 * 2) * 5 * 10  # the untuned rows get no rho
    assert not any(o.startswith("norm.rho") for job in grid if "cbn_row=r1" in job for o in job)
    assert len(load_preset("bnp/fc", overrides=["paper_data=mnist"]).jobs) == 4 * 5
    more = load_preset("cbn/table1", overrides=["trainer.seed=9,10"]).jobs  # 10 is beyond the preset's range
    assert {o for job in more for o in job if o.startswith("trainer.seed")} == {"trainer.seed=9", "trainer.seed=10"}
    assert all("data.root=/d" in job for job in load_preset("cbn/table1", overrides=["data.root=/d"]).jobs)


def test_a_sweep_checks_one_job_per_shape_before_it_starts() -> None:
    """Before launching, the sweeper composes the first job of each combination of group
    choices and keys: for CBN's Table 1 one per (row, activation), not one per seed and rho."""
    jobs = load_preset("cbn/table1").jobs
    with hydra_session():
        chosen = shape_representatives(jobs, parser())

    def groups(job: list[str]) -> tuple[str, ...]:
        return tuple(o for o in job if o.split("=")[0] in ("act", "cbn_row"))

    assert len(chosen) == 7 * 5 and {groups(j) for j in chosen} == {groups(j) for j in jobs}
    assert [j for j in jobs if j in chosen] == chosen  # the first of each, in order


def test_jobs_share_a_shape_only_when_they_compose_alike() -> None:
    """Values of one kind for a plain key share a shape; a deletion, an addition or a hydra.
    key is checked for each value (Hydra compares it with what is there, or types it), and a
    list, a null or a string for a key is another shape than a number."""
    jobs = [["optim.lr=0.1"], ["optim.lr=0.2"], ["optim.lr=[1]"], ["optim.lr=null"], ["optim.lr=abc"],
            ["~optim.lr=0.1"], ["~optim.lr=0.2"], ["+tags.x=1"], ["+tags.x=2"],
            ["hydra.job.chdir=true"], ["hydra.job.chdir=1"], ["act=relu", "optim.lr=0.3"], ["act=tanh", "optim.lr=0.3"],
            ["act=tanh", "optim.lr=0.4"]]
    with hydra_session():
        chosen = shape_representatives(jobs, parser())
    assert chosen == [j for j in jobs if j not in (["optim.lr=0.2"], ["act=tanh", "optim.lr=0.4"])]


def test_a_plugin_s_own_config_group_is_a_group(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A group that only a BNEXP_PLUGINS package has (its configs/extra/) is a group choice for
    the command line's check, the sweeper and the presets' job configs, not a key."""
    (tmp_path / "toy_groups" / "configs" / "extra").mkdir(parents=True)
    (tmp_path / "toy_groups" / "__init__.py").write_text("")
    (tmp_path / "toy_groups" / "configs" / "extra" / "a.yaml").write_text("x: 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("BNEXP_PLUGINS", "toy_groups")
    with hydra_session():
        parsed = parser().parse_overrides(["+extra=a", "norm=bn", "extra.x=2", "trainer.seed=1"])
    assert [is_group(o) for o in parsed] == [True, True, False, False]


def test_quick_scale_keeps_the_layout_with_two_seeds() -> None:
    p = load_preset("cbn/table1", "quick")
    assert len(p.jobs) == CBN_ABLATION // 5 and p.seeds == [0, 1]
    assert p.results_dir == Path("results/quick/cbn/table1")
    cfg = compose_cfg(["experiment=popnorm/table1", "scale=quick", "paper_data=cifar100"])
    assert cfg.data.name == "synthetic" and cfg.tags.data == "cifar100" and cfg.trainer.max_steps == 6


def test_cbn_rows_set_the_ablation_flags() -> None:
    row5 = compose_cfg(["experiment=cbn/table1", "cbn_row=r5", "norm.rho=0.25"])
    assert (row5.norm.placement, row5.norm.decouple, row5.norm.rho, row5.norm.amat) == ("before_op", True, 0.25, False)
    assert row5.tags.row == 5 and row5.model.name == "resnet20" and row5.data.name == "cifar10"
    row2 = compose_cfg(["experiment=cbn/table4", "cbn_row=r2", "norm.rho=8"])
    assert (row2.norm.name, row2.norm.amat, row2.norm.rho, row2.model.name) == ("cbn", True, 8.0, "vgg16")
    assert row2.data.name == "cifar100" and row2.schedule.milestones == [60, 100]


def test_bnp_learning_rates_come_from_the_paper_table(tmp_path: Path) -> None:
    cfg = compose_cfg(["experiment=bnp/fc", "paper_data=cifar10", "trainer.batch_size=6", "norm=none"])
    assert cfg.optim.lr == 5e-3 and skip_reason(cfg, tmp_path) is None
    na = compose_cfg(["experiment=bnp/fc", "paper_data=cifar10", "trainer.batch_size=1", "norm=bn"])
    assert na.optim.lr is None and "N/A" in skip_reason(na, tmp_path)
    wd = compose_cfg(["experiment=bnp/resnet110", "norm=bnp_gn"])
    assert wd.optim.weight_decay == 1.5e-4 and compose_cfg(["experiment=bnp/resnet110"]).optim.weight_decay == 1e-4


def test_bnp_cnn5_trains_with_adam_where_the_paper_did() -> None:
    """BNP Appendix B: Adam for vanilla at batch 128 and for BN with 4 things (every batch
    size, batch-group normalization at 2 and 1), SGD for every other cell."""
    p = load_preset("bnp/cnn5")
    optimizers = {}
    for cfg in presets.job_configs("bnp/cnn5", "full", p.jobs):
        cell = (cfg["norm.name"], cfg["trainer.batch_size"])
        optimizers.setdefault(cell, set()).add((cfg["optim.name"], cfg.get("norm.groups")))
    adam = {("none", 128), ("bn_4things", 128), ("bn_4things", 2), ("bn_4things", 1)}
    assert {cell for cell, seen in optimizers.items() if {name for name, _ in seen} == {"adam"}} == adam
    assert all(len(seen) == 1 for seen in optimizers.values()) and len(optimizers) == 12
    assert [optimizers[("bn_4things", b)] for b in (128, 2, 1)] == [{("adam", None)}, {("adam", 4)}, {("adam", 4)}]


def fake_runs(results: Path, jobs: list[list[str]], accuracy: Callable[[list[str]], float]) -> None:
    """Finished runs of a cbn/table1 sweep as a sweep leaves them: a summary holding the
    config its job composes, and the recorded overrides."""
    for job, config in zip(jobs, presets.job_configs("cbn/table1", "full", jobs)):
        run = results / "_".join(o.split("=")[1] for o in job)
        (run / ".hydra").mkdir(parents=True)
        summary = {"status": "completed", "final_top1": accuracy(job), "config": config}
        (run / "summary.json").write_text(json.dumps(summary))
        (run / ".hydra" / "overrides.yaml").write_text("".join(f"- {o}\n" for o in job))


def test_two_stage_tuning_counts(tmp_path: Path) -> None:
    p = load_preset("cbn/table1", overrides=[f"hydra.sweep.dir={tmp_path}"])
    untuned, grid = stage_one(p, tune_seeds=2)
    assert count(p, [untuned]) == 3 * 5 * 10 and count(p, [grid]) == 4 * 6 * 5 * 2
    jobs = [[f"cbn_row=r{row}", f"norm.rho={rho}", f"act={act}", f"trainer.seed={seed}"]
            for row in (2, 5, 6, 7) for act in ("sigmoid", "tanh", "relu", "selu", "swish")
            for rho in (0.25, 0.5, 1.0, 2.0, 4.0, 8.0) for seed in (0, 1)]
    fake_runs(tmp_path, jobs, lambda job: 80 + ("norm.rho=2.0" in job))  # stage 1 done: rho = 2 wins everywhere
    second = stage_two(p, tune_seeds=2)
    assert len(second) == 4 * 5 and all("norm.rho=2.0" in sweep for sweep in second)
    assert count(p, second) == 4 * 5 * 8  # the winners' other 8 seeds: every winner at 10 seeds
    assert split_plan(p, 2) == ("each tuned cell chooses its rho by the best mean on seeds 0-1 (selection) and is "
                                "reported and tested on seeds 2-9 (test)")


def test_rerun_skips_completed_and_reruns_failed(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = ["train", "-m", *TINY, "act=relu,tanh", f"hydra.sweep.dir={tmp_path}"]
    assert run_cli(args, capsys)[0] == 0
    runs = sorted(p.parent for p in tmp_path.glob("*/summary.json"))
    assert len(runs) == 2
    failed = runs[0] / "summary.json"
    failed.write_text(json.dumps({**read_summary(runs[0]), "status": "failed"}))
    stamps = {run: (run / "summary.json").stat().st_mtime_ns for run in runs}
    code, out = run_cli(args, capsys)
    assert code == 0 and "already completed" in out
    assert read_summary(runs[0])["status"] == "completed"  # the failed cell ran again
    assert (runs[1] / "summary.json").stat().st_mtime_ns == stamps[runs[1]]  # the completed one did not


def test_full_scale_without_gpu_stops_with_estimate(monkeypatch: pytest.MonkeyPatch,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    with pytest.raises(SystemExit) as stop:
        reproduce("cbn/table1")
    err = capsys.readouterr().err
    assert stop.value.code == 2 and "1350 runs" in err and "GPU-hours" in err and "scale=quick" in err


@pytest.mark.slow
@pytest.mark.xdist_group("quick_preset")  # with the other users of quick_preset_runs
def test_quick_reproduce_fills_every_cell(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                          quick_preset_runs: Path) -> None:
    sweep = copy_runs(quick_preset_runs, tmp_path / "sweep")  # its runs, made by `bnexp reproduce` once
    table, code = reproduce("popnorm/table2", "quick", overrides=[f"hydra.sweep.dir={sweep}"])
    assert code == 0
    out = capsys.readouterr().out
    assert "4 runs" in out
    lines = [line for line in table.splitlines() if line.startswith("| ResNet-18")]
    assert len(lines) == 1
    cells = [c.strip() for c in lines[0].strip("|").split("|")]
    ours = cells[1::3]  # top-1/top-5 of BN and POP-Norm, each followed by paper and Δ
    assert len(ours) == 4 and all(c.endswith("(2)") and not c.startswith("–") for c in ours)


@pytest.mark.slow
@pytest.mark.parametrize("preset", [pytest.param("popnorm/table2", marks=pytest.mark.xdist_group("quick_preset")),
                                    "bnp/hessian"])
def test_same_runs_and_tables_as_before_the_presets_described_their_tables(
        preset: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], request: pytest.FixtureRequest) -> None:
    """tests/data/behaviour_before_refactor.json holds the run directories and the rendered
    table of two presets at quick scale, made before presets carried their own sweeps and
    report blocks: the same commands make the same runs and print the same tables (the
    measured numbers masked: their last digits follow the machine's float arithmetic)."""
    before = json.loads((Path(__file__).parent / "data" / "behaviour_before_refactor.json").read_text())[preset]
    root = tmp_path / "sweep"
    if preset == QUICK_PRESET[1]:  # its runs made once (the same command): the command finds them complete
        copy_runs(request.getfixturevalue("quick_preset_runs"), root)
    code, out = run_cli(["reproduce", preset, "scale=quick", f"hydra.sweep.dir={root}", "trainer.device=cpu"], capsys)
    assert code == 0, out
    code, table = run_cli(["table", preset, "scale=quick", f"results={root}"], capsys)
    assert code == 0
    assert sorted(str(p.parent.relative_to(root)) for p in root.rglob("summary.json")) == before["runs"]
    ours = table.replace(str(root), "RESULTS")
    title, recorded = ours.splitlines()[0], before["table"].splitlines()[0]
    assert title.startswith(f"{recorded} [scale=quick")  # since issue 38 a toy table's title says so
    assert masked(rows_of(ours)) == masked(rows_of(before["table"]))
    assert rows_of(ours).count("±") == rows_of(before["table"]).count("±")


def rows_of(table: str) -> str:
    """The table's own lines (header, alignment, cells), without its title and legend."""
    return "\n".join(line for line in table.splitlines() if line.startswith("|"))


def masked(table: str) -> str:
    """A markdown table with our measured numbers and their differences replaced by #; the
    run counts and the published columns stay. Cells are stripped and the alignment row
    dropped: the column widths follow the numbers' widths."""
    lines, header = [], []
    for line in table.splitlines():
        cells = [c.strip() for c in line.split("|")]
        if line.startswith("|") and not header:
            header = cells
        elif line.startswith("|:") or line.startswith("|-"):
            continue
        elif line.startswith("|"):
            cells = [c if h.endswith("paper") else re.sub(r"[-+]?\d+\.\d+( ± \d+\.\d+)?", "#", c)
                     for c, h in zip(cells, header)]
        lines.append("|".join(cells))
    return "\n".join(lines)
