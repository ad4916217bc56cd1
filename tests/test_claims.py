"""``bnexp claims``: the criteria on hand-made results, and the pipeline at toy size."""

from __future__ import annotations

import itertools
import json
import math
import shutil
from pathlib import Path

import pandas as pd
import pytest

from bnexp.engine.identity import cell_name
from bnexp.report.presets import load_preset
from bnexp.report.results import load_summaries
from bnexp.studies.claims import (
    CHANCE,
    CLAIMS,
    FAILS,
    HOLDS,
    NOT_RUN,
    SHOWN,
    TOO_FEW,
    Sample,
    arm_cells,
    arm_overrides,
    beats_clearly,
    claim_cells,
    claim_frame,
    judge_ablation,
    judge_arora,
    judge_bnp,
    judge_cbn,
    judge_forms,
    judge_hessian,
    judge_lr,
    merged,
)
from bnexp.studies.claims import main as claims_main
from tests.conftest import run_cli


def write_run(root: Path, name: str, config: dict, status: str = "completed", top1: float = 90.0, **summary) -> Path:
    run = root / name
    run.mkdir(parents=True)
    (run / "summary.json").write_text(json.dumps({"status": status, "final_top1": top1, "num_classes": 10,
                                                  "config": config, **summary}))
    return run


def test_beats_clearly_needs_both_the_error_ratio_and_two_standard_errors() -> None:
    bn = Sample([90.0, 91.0, 92.0])  # error 9 %, std 1
    assert beats_clearly(Sample([93.5, 93.2, 93.8]), bn)  # error 6.5 % <= 6.75 %, gap 2.5 >> 2 SE
    assert not beats_clearly(Sample([93.0, 93.1, 92.9]), bn)  # error 7 % > 0.75 x 9 %
    assert not beats_clearly(Sample([99.0, 89.0, 94.0]), bn)  # error 6 % but the gap (3) < 2 SE (5.9)


def test_sample_counts_a_diverged_run_as_chance(tmp_path: Path) -> None:
    cfg = {"tags": {"row": 2}, "act": {"name": "tanh"}}
    write_run(tmp_path, "a", cfg, top1=97.0)
    write_run(tmp_path, "b", cfg, status="diverged", top1=95.0)
    write_run(tmp_path, "c", cfg, status="failed")
    from bnexp.studies.claims import sample

    got = sample(load_summaries(tmp_path), tags__row=2, act__name="tanh")
    assert got.values == [97.0, CHANCE] and (got.diverged, got.failed) == (1, 1)
    assert got.text() == "53.50 ± 61.52 % (2; 1 diverged, 1 failed)"


def test_cbn_judge_per_activation(tmp_path: Path) -> None:
    for seed, (bn_sig, cbn_sig, bn_relu, cbn_relu) in enumerate([(80, 90, 95, 95.5), (81, 90.5, 95.2, 95.1),
                                                                 (79, 89.5, 94.8, 95.4)]):
        for row, act, top1 in ((1, "sigmoid", bn_sig), (2, "sigmoid", cbn_sig), (1, "relu", bn_relu),
                               (2, "relu", cbn_relu)):
            write_run(tmp_path, f"{row}{act}{seed}", {"tags": {"row": row}, "act": {"name": act}}, top1=top1)
    sigmoid, tanh, relu = judge_cbn(load_summaries(tmp_path))
    assert sigmoid.verdict == HOLDS and sigmoid.measured == "BN 80.00 ± 1.00 % (3) vs CBN 90.00 ± 0.50 % (3)"
    assert tanh.verdict == NOT_RUN  # no tanh runs (make demo runs sigmoid and relu only)
    assert relu.verdict == HOLDS


def test_forms_judge_marks_only_the_papers_forms(tmp_path: Path) -> None:
    """Each paper's form is judged on the runs of the claim that trains that cell (cbn's and
    popnorm's folders, sigmoid only); the other forms are shown from the forms folder, where
    a copy of a paper's form left from before is not read."""
    for norm, home in (("cbn", "cbn"), ("popnorm", "popnorm")):
        for join in ("after_act", "before_act"):
            for classifier in (True, False):
                top1 = 10.0 if (join, classifier) == ("after_act", False) else 95.0
                write_run(tmp_path / "forms", f"{norm}{join}{classifier}",
                          {"norm": {"name": norm, "join": join, "classifier": classifier}, "act": {"name": "sigmoid"}},
                          top1=top1 if norm == "cbn" or join == "after_act" else 50.0)
        paper = {"after_act": True} if norm == "cbn" else {"before_act": False}
        for (join, classifier), (act, top1) in itertools.product(paper.items(), (("sigmoid", 97.0), ("relu", 20.0))):
            for seed in (0, 1):
                write_run(tmp_path / home, f"{act}{seed}", {"norm": {"name": norm, "join": join, "classifier": classifier},
                                                           "act": {"name": act}}, top1=top1 + seed)
    findings = judge_forms(claim_frame("forms", tmp_path))
    found = {f.claim: f for f in findings}
    assert found["cbn join=after_act, classifier=true (the paper's form) trains"].verdict == HOLDS
    assert found["cbn join=after_act, classifier=true (the paper's form) trains"].measured == "97.50 ± 0.71 % (2)"
    assert found["popnorm join=before_act, classifier=false (the paper's form) trains"].verdict == HOLDS
    assert found["cbn join=after_act, classifier=false"].verdict == SHOWN and len(findings) == 8
    assert found["cbn join=after_act, classifier=false"].measured == "10.00 ± 0.00 % (1)"
    assert found["popnorm join=before_act, classifier=true"].measured == "50.00 ± 0.00 % (1)"
    assert judge_forms(claim_frame("forms", tmp_path / "nothing-here"))[0].verdict == NOT_RUN


def test_a_cell_two_claims_read_trains_once_and_shown_rows_only_on_request(tmp_path: Path,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """forms judges each paper's form on a cell of the cbn and popnorm claims (the same
    arguments, trained once, in their folders) and trains its other forms, and ablation its
    kappa 4 part, only with shown=true, whose rows are left out otherwise."""
    from bnexp.studies import claims

    trained: list[tuple[str, ...]] = []
    judged: dict[str, set[tuple[str, ...]]] = {}  # the cells trained when each claim was judged

    def train_cells(cells: list, jobs: int):
        for cell in cells:
            trained.append(cell.args)
            yield 0

    def claim_frame(name: str, out: Path, frame=claims.claim_frame) -> pd.DataFrame:
        judged[name] = set(trained)
        return frame(name, out)

    monkeypatch.setattr(claims, "train_cells", train_cells)
    monkeypatch.setattr(claims, "claim_frame", claim_frame)
    names = ["cbn", "popnorm", "forms", "ablation"]
    shared = claim_cells("forms", tmp_path, "full", [], shown=False)
    assert len(shared) == 2 and set(shared) <= {*claim_cells("cbn", tmp_path, "full", [], False),
                                                *claim_cells("popnorm", tmp_path, "full", [], False)}
    assert {f"hydra.sweep.dir={tmp_path / home}" in c.args for c, home in zip(shared, ("cbn", "popnorm"))} == {True}
    quick = claim_cells("forms", tmp_path, "quick", ["act=relu"], shown=False)  # with the command line's values
    assert set(quick) <= {*claim_cells("cbn", tmp_path, "quick", ["act=relu"], False),
                          *claim_cells("popnorm", tmp_path, "quick", ["act=relu"], False)}
    results = claims.run_claims(names, tmp_path, "full", 2, [])
    assert len(trained) == len(set(trained)) == 6 + 2 + 6  # cbn, popnorm, ablation's judged part; forms nothing new
    for name in names:  # each claim judged once all its cells, shared ones included, were trained
        assert {c.args for c in claim_cells(name, tmp_path, "full", [], False)} <= judged[name]
    assert not any(f.verdict == SHOWN for findings, _ in results.values() for f in findings)
    assert [len(results[n][0]) for n in names] == [3, 1, 2, 4]
    trained.clear()
    results = claims.run_claims(names, tmp_path, "full", 2, [], shown=True)
    assert len(trained) == len(set(trained)) == 6 + 2 + 6 + 8 and sum("/forms" in " ".join(a) for a in trained) == 6
    assert [len(results[n][0]) for n in names] == [3, 1, 8, 6]
    trained.clear()
    judged.clear()
    results = claims.run_claims(["popnorm", "popnorm"], tmp_path / "again", "full", 2, [])  # named twice: one claim
    assert len(trained) == 2 and len(judged["popnorm"]) == 2 and list(results) == ["popnorm"]


def write_lr(root: Path, method: str, lr: float, collapse: bool) -> None:
    run = write_run(root, f"{method}/{lr}", {"tags": {"method": method}, "optim": {"lr": lr}},
                    status="diverged" if collapse else "completed", top1=10.0 if collapse else 90.0)
    (run / "probes.csv").write_text(f"step,probe,layer,quantity,value\n0,loss,all,loss,2.4\n9,loss,all,loss,"
                                    f"{0.3 if not collapse else math.nan}\n")


def test_lr_judge_orders_the_largest_stable_rates(tmp_path: Path) -> None:
    for limits, verdict in (({"none": 0.01, "mean_removal": 0.1, "l2_division": 0.1, "cbn": 1.0}, HOLDS),
                            ({"none": 0.01, "mean_removal": 0.1, "l2_division": 0.1, "cbn": 0.01}, FAILS)):
        root = tmp_path / verdict
        for method, limit in limits.items():
            for lr in (0.01, 0.1, 1.0):
                write_lr(root, method, lr, collapse=lr > limit)
        (finding,) = judge_lr(load_summaries(root))
        assert finding.verdict == verdict
    assert finding.measured == "largest stable lr: none 0.01, mean_removal 0.1, l2_division 0.1, cbn 0.01"


def test_bnp_judge(tmp_path: Path) -> None:
    for norm, batch, top1 in (("bnp", 1, 90.0), ("bnp", 2, 91.0), ("bn", 2, 60.0), ("none", 1, 50.0),
                              ("none", 2, 70.0)):
        write_run(tmp_path, f"{norm}{batch}", {"norm": {"name": norm}, "trainer": {"batch_size": batch}}, top1=top1)
    (finding,) = judge_bnp(load_summaries(tmp_path))
    assert finding.verdict == HOLDS and "batch 1 refused" in finding.measured
    write_run(tmp_path, "bnp1b", {"norm": {"name": "bnp"}, "trainer": {"batch_size": 1}}, top1=60.0)
    assert judge_bnp(load_summaries(tmp_path))[0].verdict == FAILS  # BNP at batch 1 now averages 75 %


def test_hessian_judge_reads_the_probe(tmp_path: Path) -> None:
    for norm, (plain, pre) in (("none", (100.0, 20.0)), ("bnp", (50.0, 60.0))):
        run = write_run(tmp_path, norm, {"norm": {"name": norm}})
        rows = [f"{s},hessian,x,{q},{v}" for s in (0, 10) for q, v in (("kappa_hessian", plain),
                                                                       ("kappa_preconditioned", pre))]
        (run / "probes.csv").write_text("step,probe,layer,quantity,value\n" + "\n".join(rows) + "\n")
    (finding,) = judge_hessian(load_summaries(tmp_path))
    assert finding.verdict == FAILS and "bnp: kappa(H) 50, kappa(P^T H P) 60" in finding.measured


def test_arora_judge(tmp_path: Path) -> None:
    for lr_w, loss in ((0.01, 0.05), (100.0, 0.2)):
        write_run(tmp_path, f"bn{lr_w}", {"norm": {"name": "bn"}, "optim": {"lr_w": lr_w, "lr": 0.1}},
                  final_train_loss=loss)
    write_run(tmp_path, "none10", {"norm": {"name": "none"}, "optim": {"lr_w": None, "lr": 10.0}},
              status="diverged", top1=10.0)
    write_run(tmp_path, "none100", {"norm": {"name": "none"}, "optim": {"lr_w": None, "lr": 100.0}},
              top1=9.0, final_train_loss=math.log(10))
    bn, none = judge_arora(load_summaries(tmp_path))
    assert bn.verdict == HOLDS and none.verdict == HOLDS
    assert none.measured == "test top-1: lr 10: diverged, lr 100: 9.0 %"


def test_user_overrides_replace_a_claims_own() -> None:
    assert merged(["act=sigmoid,tanh,relu", "norm.rho=1"], ["act=sigmoid,relu", "+x=1"]) == \
        ["act=sigmoid,relu", "norm.rho=1", "+x=1"]
    args = arm_overrides(CLAIMS["cbn"].arms[0], Path("OUT"), "quick", ["act=relu"])
    assert "act=relu" in args and "trainer.seed=0" in args
    assert "trainer.max_steps=4" in args and "hydra.sweep.dir=OUT" in args


def test_a_claims_cells_train_its_sweeps_runs_with_each_cells_seeds_packed() -> None:
    """The cbn claim's sweep, cut into its cells: rows 1 and 2 x 3 activations, the 3 seeds of
    each as one pack at full scale, seed 0 alone at quick scale; together the runs of the
    claim's one sweep, each in the directory that sweep gives it."""
    arm = CLAIMS["cbn"].arms[0]
    full = arm_cells(arm, Path("OUT"), "full", ["act=sigmoid,relu"])
    assert len(full) == 4 and all("trainer.seed=0,1,2" in c.args and "hydra/launcher=pack" in c.args for c in full)
    assert all(c.args[0] == "experiment=cbn/table1" and "hydra.sweep.dir=OUT" in c.args for c in full)
    assert {(c.args.count("cbn_row=r1"), c.args.count("act=relu")) for c in full} == {(0, 0), (0, 1), (1, 0), (1, 1)}
    quick = arm_cells(arm, Path("OUT"), "quick", [])
    assert len(quick) == 6 and all("trainer.seed=0" in c.args and "hydra/launcher=pack" not in c.args for c in quick)
    sweep = arm_overrides(arm, Path("OUT"), "full", ["act=sigmoid,relu"])
    runs = {cell_name(job) for job in load_preset("cbn/table1", overrides=sweep[1:]).jobs}
    assert len(runs) == 12 and runs == {cell_name(job) for cell in full for job in
                                        load_preset("cbn/table1", overrides=[a for a in cell.args[1:]
                                                                             if a != "hydra/launcher=pack"]).jobs}


def test_listing_and_bad_names(capsys: pytest.CaptureFixture[str]) -> None:
    code, out = run_cli(["claims"], capsys)
    assert code == 0 and all(name in out for name in CLAIMS)
    code, out = run_cli(["claims", "cnb"], capsys)
    assert code == 2 and "unknown claim 'cnb'" in out and "cbn" in out
    code, out = run_cli(["claims", "cbn", "scale=huge"], capsys)
    assert code == 2 and "full, quick" in out
    code, out = run_cli(["claims", "cbn", "shown=yes"], capsys)
    assert code == 2 and "unknown shown 'yes'" in out and "false, true" in out


@pytest.fixture(scope="module")
def every_claim(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str, int]:
    """``bnexp claims all`` at toy size (what the command prints, and its exit code): the runs of
    every claim, trained once for the tests that read them."""
    out = tmp_path_factory.mktemp("claims")
    text, code = claims_main(["all", "scale=quick", "jobs=1", f"out={out}", "format=csv", "trainer.device=cpu"])
    return out, text, code


@pytest.mark.slow
@pytest.mark.xdist_group("every_claim")  # in one worker: every_claim trains once
def test_every_claim_runs_through_the_presets_at_toy_size(every_claim: tuple[Path, str, int],
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    folder, out, code = every_claim
    assert code == 0, out[-3000:]
    assert "verdicts are not evidence" in out and "not CIFAR or ImageNet numbers" in out
    table = pd.read_csv(folder / "claims.csv")
    # no row without a verdict (shown=true adds them): forms 2 rows, ablation 4
    assert set(table["verdict"]) <= {HOLDS, FAILS, NOT_RUN, TOO_FEW} and len(table) == 3 + 1 + 2 + 4 + 1 + 1 + 1 + 2
    forms = table[table["source"] == CLAIMS["forms"].source]  # read from the cbn and popnorm claims' runs
    assert set(forms["verdict"]) <= {HOLDS, FAILS} and all(m.endswith("(1)") for m in forms["measured (mean ± std (seeds))"])
    for claim in CLAIMS.values():  # every run of every claim trained on the real digits
        frame = claim_frame(claim.name, folder)
        assert len(frame) and set(frame["status"]) <= {"completed", "diverged"} and set(frame["data.name"]) == {"digits"}
    code, out = run_cli(["claims", "popnorm", "scale=quick", "jobs=1", f"out={folder}", "trainer.device=cpu"], capsys)
    assert code == 0 and out.count(": 1 cells: 0 completed, 0 diverged, 0 failed, 1 skipped") == 2  # runs reused


def test_ablation_judge_orders_the_final_training_losses(tmp_path: Path) -> None:
    """relu: mean only 1.0 <= 0.9 x none's 2.2, division only 0.5 <= 0.9 x 1.0: both hold.
    tanh: mean only 2.1 > 0.9 x 2.2 = 1.98, and division only diverged (inf): both fail."""
    runs = {("mean_only", 1.0): (1.0, 2.1), ("mean_only", 4.0): (2.3, 2.3), ("division_only", 4.0): (0.5, None),
            ("none", None): (2.2, 2.2)}
    for (method, rho), losses in runs.items():
        norm = {"rho": rho} if rho is not None else {"name": "none"}
        for act, loss in zip(("relu", "tanh"), losses):
            cfg = {"tags": {"method": method}, "act": {"name": act}, "norm": norm}
            if loss is None:
                write_run(tmp_path, f"{act}{method}{rho}", cfg, status="diverged", top1=10.0)
            else:
                write_run(tmp_path, f"{act}{method}{rho}", cfg, final_train_loss=loss)
    relu_mean, relu_division, relu_kappa4, tanh_mean, tanh_division, _ = judge_ablation(load_summaries(tmp_path))
    assert (relu_mean.verdict, relu_division.verdict, relu_kappa4.verdict) == (HOLDS, HOLDS, SHOWN)
    assert relu_mean.measured == "final training loss: mean only 1.000, none 2.200"
    assert relu_kappa4.measured == "final training loss 2.300"
    assert (tanh_mean.verdict, tanh_division.verdict) == (FAILS, FAILS)
    assert tanh_division.measured == "final training loss: division only inf, mean only 2.100"
    assert judge_ablation(load_summaries(tmp_path / "nothing-here"))[0].verdict == NOT_RUN


@pytest.mark.slow
@pytest.mark.xdist_group("every_claim")  # in one worker: every_claim trains once
def test_ablation_claim_runs_at_toy_size_and_gives_its_verdict_rows(tmp_path: Path, every_claim: tuple[Path, str, int],
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    shutil.copytree(every_claim[0] / "ablation", tmp_path / "ablation")  # its runs, as `claims all` trained them
    code, out = run_cli(["claims", "ablation", "scale=quick", "jobs=1", f"out={tmp_path}", "format=csv",
                         "shown=true", "trainer.device=cpu"], capsys)  # the kappa 4 runs trained now
    assert code == 0, out[-3000:]
    table = pd.read_csv(tmp_path / "claims.csv")
    assert list(table["source"].unique()) == ["POP-Norm Fig. 3 (VGG-16)"] and len(table) == 6
    assert set(table["verdict"]) <= {HOLDS, FAILS, SHOWN} and (table["verdict"] == SHOWN).sum() == 2
    frame = load_summaries(tmp_path / "ablation")
    assert len(frame) == 8 and set(frame["data.name"]) == {"digits"} and set(frame["model.name"]) == {"vgg16"}
    assert sorted(frame.loc[frame["tags.method"] == "mean_only", "norm.rho"].astype(float)) == [1.0, 1.0, 4.0, 4.0]


@pytest.mark.slow
def test_claims_in_worker_processes_print_each_verdict_as_it_comes(tmp_path: Path,
                                                                    capfd: pytest.CaptureFixture[str]) -> None:
    """``bnexp claims popnorm hessian scale=quick`` with its default jobs (one per core): the
    two claims' four cells in worker processes, each cell's sweep counting its own run (also
    in a worker kept from an earlier cell), each claim's verdicts printed as it ends, no
    ledger left behind."""
    text, code = claims_main(["popnorm", "hessian", "scale=quick", f"out={tmp_path}"])
    captured = capfd.readouterr()
    printed = captured.out + captured.err
    assert code == 0, printed[-3000:]
    assert printed.count(": 1 cells: 1 completed, 0 diverged, 0 failed\n") == 4, printed[-3000:]
    assert "== claim popnorm, POP-Norm Table 1 (ResNet-20):\n  sigmoid: POP-Norm beats BN clearly: " in printed
    assert "== claim hessian, BNP Fig. 8 (2x100 MLP, batch 60):\n  BNP's preconditioned Hessian" in printed
    assert "BNP's preconditioned Hessian is better conditioned" in text and not list(tmp_path.rglob(".sweep-*"))
    assert len(load_summaries(tmp_path / "popnorm")) == 2 and len(load_summaries(tmp_path / "hessian")) == 2
