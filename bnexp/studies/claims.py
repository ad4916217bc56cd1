"""``bnexp claims``: each paper's headline claim as a small experiment on real images.

Every claim trains through the paper presets and the trainer that the real tables use
(``bnexp train -m experiment=<preset> ...``), on ``data=digits`` (scikit-learn's bundled
8x8 handwritten digits, no download) with the preset's protocol scaled down: the same
optimizer, batch, momentum, weight decay and schedule shape, fewer steps. Each claim is
judged by a criterion fixed before any of its runs was made (``docs/claims.md`` states
protocol and criterion and reports what came out); a claim that does not hold on digits
is reported as such.

A run that diverged counts as chance accuracy in the comparisons (it predicts nothing);
a failed or missing run is left out and its finding says so. Runs live in
``<out>/<claim>/``; running a claim again reuses its finished runs.

Every cell of the claims asked for is one unit of work (:func:`arm_cells`: a ``bnexp train
-m`` of that cell, its seeds trained as one pack); ``jobs`` worker processes take the units
of all the claims in turn (:func:`train_cells`), and each claim's verdicts are printed as
its last unit ends. A cell two claims read is trained once, in the folder of the claim that
owns it (:attr:`Arm.home`); the runs of rows that carry no verdict ("shown") are trained
only with ``shown=true``. docs/claims.md ("How the runs are executed") says why.
"""

from __future__ import annotations

import math
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Sequence

import pandas as pd
from joblib import Parallel, delayed

from bnexp.app.sweep import pack_groups
from bnexp.app.train import multirun
from bnexp.engine.identity import override_key
from bnexp.report.presets import SEED, job_value, load_preset
from bnexp.report.results import load_summaries
from bnexp.report.selection import select
from bnexp.report.stability import at_chance, largest_stable
from bnexp.support.errors import ConfigError, unknown_choice
from bnexp.support.options import exit_on_error, split_options
from bnexp.support.workers import ends_with_parent

SCALES = ("full", "quick")
# Batches cut in memory: with no augmentation, bit-identical to the DataLoader's (docs/claims.md)
DIGITS = ("data=digits", "data.image_size=8", "data.loader=device", "trainer.checkpoint_every=10")
# CBN's CIFAR schedule (lr / 10 at 50% and 83% of 120 epochs) over 30 digits epochs of 12 steps
CBN_DIGITS = (*DIGITS, "tags.data=digits", "trainer.epochs=30", "schedule.milestones=[15,25]")
# POP-Norm's iteration schedule (lr / 10 at 16k and 24k of 30k) over the same 360 steps
POPNORM_DIGITS = (*DIGITS, "tags.data=digits", "trainer.max_steps=360", "schedule.milestones=[192,288]")
# POP-Norm Fig. 3 (VGG-16 on CIFAR-100) on 32x32 digits: VGG-16 at 1/8 of its width (its five
# pools need 32 pixels), POP-Norm's iteration schedule over 180 steps (lr / 10 at 96 and 144)
POPNORM_ABLATION_DIGITS = (*DIGITS, "data.image_size=32", "tags.data=digits", "model.width=8",
                           "trainer.max_steps=180", "schedule.milestones=[96,144]")
# The BNP presets' protocol (constant lr, plain SGD, shuffled epochs) for 5 epochs of grey digits
BNP_DIGITS = (*DIGITS, "data.channels=1", "trainer.epochs=5")
# scale=quick: every run a few steps of a narrow model, one seed: the pipeline, not evidence
QUICK = ("trainer.max_steps=4", "trainer.eval_every=2", "trainer.eval_unit=step",
         "trainer.checkpoint_every=0", "model.width=4")

CLASSES = 10
CHANCE = 100.0 / CLASSES
CLEAR_ERROR_RATIO = 0.75  # "beats clearly": at most 3/4 of the other's test error ...
CLEAR_STANDARD_ERRORS = 2.0  # ... and a top-1 gap above two standard errors of the difference
CLOSE_POINTS = 1.0  # "close": top-1 means within one percentage point
TRAINS_TOP1 = 80.0  # "trains": every seed reaches 80 % test top-1 (chance: 10 %)
BNP_MARGIN = 5.0  # BNP above BN at batch 2 by at least five points
CONVERGED_LOSS = 0.1 * math.log(CLASSES)  # Arora: a tenth of the chance-level loss
FASTER_LOSS_RATIO = 0.9  # "trains faster": a final training loss at most 9/10 of the other's

HOLDS, FAILS, SHOWN, NOT_RUN = "holds", "does not hold", "shown", "not run"
TOO_FEW = "too few seeds"  # ran, but with fewer seeds than the criterion needs (scale=quick: one)


@dataclass(frozen=True)
class Arm:
    """One sweep of a claim: a preset, Hydra overrides (sweeps allowed) and the seeds; the
    claim whose folder holds its runs when another claim owns them (``home``), and whether
    only rows without a verdict read them (``shown``: trained with ``shown=true``)."""

    preset: str
    overrides: tuple[str, ...]
    seeds: tuple[int, ...] = (0, 1, 2)
    home: str = ""
    shown: bool = False


@dataclass(frozen=True)
class Finding:
    """One row of the claims table."""

    claim: str
    measured: str
    criterion: str
    verdict: str


@dataclass
class Sample:
    """The test top-1 of one cell's runs, a diverged run at chance; failed runs counted."""

    values: list[float] = field(default_factory=list)
    diverged: int = 0
    failed: int = 0

    @property
    def n(self) -> int:
        return len(self.values)

    @property
    def mean(self) -> float:
        return sum(self.values) / self.n if self.n else math.nan

    @property
    def std(self) -> float:
        """The sample standard deviation (0 for a single run)."""
        if self.n < 2:
            return 0.0
        return math.sqrt(sum((v - self.mean) ** 2 for v in self.values) / (self.n - 1))

    def text(self) -> str:
        if not self.n:
            return f"no runs{f' ({self.failed} failed)' if self.failed else ''}"
        notes = [f"{k} {what}" for what, k in (("diverged", self.diverged), ("failed", self.failed)) if k]
        return f"{self.mean:.2f} ± {self.std:.2f} % ({self.n}{'; ' + ', '.join(notes) if notes else ''})"


def sample(frame: pd.DataFrame, **keys: object) -> Sample:
    """The runs of ``frame`` whose config matches ``keys`` (dotted keys with ``__`` for dots)."""
    runs = select(frame, {key.replace("__", "."): value for key, value in keys.items()})
    out = Sample()
    for _, run in runs.iterrows():
        if run["status"] == "completed":
            out.values.append(float(run["final_top1"]))
        elif run["status"] == "diverged":
            out.values.append(CHANCE)
            out.diverged += 1
        else:
            out.failed += 1
    return out


def beats_clearly(a: Sample, b: Sample) -> bool:
    """``a``'s test error at most 3/4 of ``b``'s and the gap above two standard errors."""
    se = math.sqrt(a.std**2 / a.n + b.std**2 / b.n)
    return (100 - a.mean) <= CLEAR_ERROR_RATIO * (100 - b.mean) and a.mean - b.mean > CLEAR_STANDARD_ERRORS * se


def versus(names: tuple[str, str], a: Sample, b: Sample) -> str:
    """``A 98.10 ± 0.20 (3) vs B 99.00 ± 0.10 (3)``."""
    return f"{names[0]} {a.text()} vs {names[1]} {b.text()}"


def compare(claim: str, names: tuple[str, str], a: Sample, b: Sample, rule: str) -> Finding:
    """A finding comparing two cells by ``rule`` (``beats`` or ``close``), ``b`` over ``a``."""
    measured = versus(names, a, b)
    if rule == "beats":
        criterion = (f"{names[1]}'s test error <= {CLEAR_ERROR_RATIO:g} x {names[0]}'s and the top-1 gap > "
                     f"{CLEAR_STANDARD_ERRORS:g} standard errors")
        if min(a.n, b.n) < 2:  # no standard error from one run
            return Finding(claim, measured, criterion + " (needs 2 seeds a side)", TOO_FEW if a.n and b.n else NOT_RUN)
        ok = beats_clearly(b, a)
    else:
        criterion = f"|top-1 gap| <= {CLOSE_POINTS:g} point"
        if not (a.n and b.n):
            return Finding(claim, measured, criterion, NOT_RUN)
        ok = abs(a.mean - b.mean) <= CLOSE_POINTS
    return Finding(claim, measured, criterion, HOLDS if ok else FAILS)


def judge_cbn(frame: pd.DataFrame) -> list[Finding]:
    """CBN Table 1: CBN (row 2) beats BN (row 1) clearly with sigmoid and tanh, close with ReLU."""
    findings = []
    for act, rule in (("sigmoid", "beats"), ("tanh", "beats"), ("relu", "close")):
        bn, cbn = (sample(frame, tags__row=row, act__name=act) for row in (1, 2))
        text = "CBN beats BN clearly" if rule == "beats" else "CBN and BN are close"
        findings.append(compare(f"{act}: {text}", ("BN", "CBN"), bn, cbn, rule))
    return findings


def judge_popnorm(frame: pd.DataFrame) -> list[Finding]:
    """POP-Norm Table 1 (ResNet-20): POP-Norm beats BN with sigmoid."""
    bn, pop = (sample(frame, norm__name=name) for name in ("bn", "popnorm"))
    return [compare("sigmoid: POP-Norm beats BN clearly", ("BN", "POP-Norm"), bn, pop, "beats")]


FOLDER = "claim_folder"  # the column of a claim's frame naming the claim folder a run is in
# Each paper's network (METHODS.md 1), and the claim whose runs train it
FORMS = {"cbn": ("after_act", True, "cbn"), "popnorm": ("before_act", False, "popnorm")}


def judge_forms(frame: pd.DataFrame) -> list[Finding]:
    """Each paper's network form trains at lr 0.1 with sigmoid (on the runs of the claim that
    trains that cell); the other forms as measured."""
    findings = []
    for norm, (*paper_form, home) in FORMS.items():
        for join in ("after_act", "before_act"):
            for classifier in (True, False):
                own = [join, classifier] == paper_form
                runs = sample(frame, **{FOLDER: home if own else "forms"}, norm__name=norm, act__name="sigmoid",
                              norm__join=join, norm__classifier=classifier)
                form = f"join={join}, classifier={str(classifier).lower()}"
                if not own:
                    findings.append(Finding(f"{norm} {form}", runs.text(), "(not the paper's form)", SHOWN))
                    continue
                verdict = NOT_RUN if not runs.n else HOLDS if min(runs.values) >= TRAINS_TOP1 else FAILS
                findings.append(Finding(f"{norm} {form} (the paper's form) trains", runs.text(),
                                        f"every seed >= {TRAINS_TOP1:g} % top-1", verdict))
    return findings


LR_METHODS = ("none", "mean_removal", "l2_division", "cbn")


def judge_lr(frame: pd.DataFrame) -> list[Finding]:
    """CBN Table 6: none < mean removal <= l2 division <= CBN in the largest stable lr."""
    found = {}
    for method in LR_METHODS:
        runs = select(frame, {"tags.method": method})
        if runs.empty:
            return [Finding("largest stable lr: none < mean removal <= l2 division <= CBN", "", "", NOT_RUN)]
        best = largest_stable(runs, "optim.lr")
        found[method] = 0.0 if best is None else float(best)
    order = [found[m] for m in LR_METHODS]
    ok = order[0] < order[1] <= order[2] <= order[3]
    measured = "largest stable lr: " + ", ".join(f"{m} {found[m]:g}" if found[m] else f"{m} none stable"
                                                 for m in LR_METHODS)
    return [Finding("largest stable lr: none < mean removal <= l2 division <= CBN", measured,
                    "the Table 6 rule (diverged, loss not lowered, or collapsed to chance: unstable); "
                    "no stable lr counts as below the grid", HOLDS if ok else FAILS)]


def judge_bnp(frame: pd.DataFrame) -> list[Finding]:
    """BNP Figs. 3-5: BNP trains at batch 1 and 2, where BN cannot."""
    cells = {(norm, batch): sample(frame, norm__name=norm, trainer__batch_size=batch)
             for norm in ("bnp", "bn", "none") for batch in (1, 2)}
    bnp1, bnp2, bn2 = cells["bnp", 1], cells["bnp", 2], cells["bn", 2]
    measured = (f"BNP batch 1 {bnp1.text()}, batch 2 {bnp2.text()}; BN batch 2 {bn2.text()}, batch 1 refused "
                f"(batch statistics of one image); no normalization batch 1 {cells['none', 1].text()}, "
                f"batch 2 {cells['none', 2].text()}")
    criterion = f"BNP >= {TRAINS_TOP1:g} % at batch 1 and 2, and >= BN + {BNP_MARGIN:g} points at batch 2"
    if not (bnp1.n and bnp2.n and bn2.n):
        return [Finding("BNP trains at batch 1 and 2, where BN cannot", measured, criterion, NOT_RUN)]
    ok = min(bnp1.mean, bnp2.mean) >= TRAINS_TOP1 and bnp2.mean - bn2.mean >= BNP_MARGIN
    return [Finding("BNP trains at batch 1 and 2, where BN cannot", measured, criterion, HOLDS if ok else FAILS)]


def judge_hessian(frame: pd.DataFrame) -> list[Finding]:
    """BNP Fig. 8: kappa(P^T H P) below kappa(H), in the plain run and in the BNP run."""
    from bnexp.probes.callback import read_probes  # here: bnexp.probes imports torch, which the other judges do without

    parts, ok = [], True
    for _, run in frame.iterrows():
        rows = read_probes(run["run_dir"]).query("probe == 'hessian'")
        medians = rows.groupby("quantity")["value"].median()
        if rows.empty or run["status"] != "completed":
            return [Finding("BNP's preconditioned Hessian is better conditioned", "", "", NOT_RUN)]
        plain, pre = medians["kappa_hessian"], medians["kappa_preconditioned"]
        parts.append(f"{run['norm.name']}: kappa(H) {plain:.3g}, kappa(P^T H P) {pre:.3g}")
        ok &= pre < plain
    if len(parts) < 2:
        return [Finding("BNP's preconditioned Hessian is better conditioned", "; ".join(parts), "", NOT_RUN)]
    return [Finding("BNP's preconditioned Hessian is better conditioned", "; ".join(parts) + " (medians over steps)",
                    "median kappa(P^T H P) < median kappa(H) in both runs", HOLDS if ok else FAILS)]


def final_loss(frame: pd.DataFrame, **keys: object) -> float:
    """The mean final training loss of the runs matching ``keys`` (``__`` for dots): inf
    when one diverged, nan when none finished."""
    runs = select(frame, {key.replace("__", "."): value for key, value in keys.items()})
    if runs.empty:
        return math.nan
    if (runs["status"] == "diverged").any():
        return math.inf
    done = runs.loc[runs["status"] == "completed", "final_train_loss"].astype(float)
    return float(done.mean()) if len(done) else math.nan


def faster(claim: str, names: tuple[str, str], fast: float, slow: float) -> Finding:
    """``names[0]`` (final training loss ``fast``) trains faster than ``names[1]`` (``slow``)."""
    measured = f"final training loss: {names[0]} {fast:.3f}, {names[1]} {slow:.3f}"
    criterion = f"{names[0]}'s final training loss <= {FASTER_LOSS_RATIO:g} x {names[1]}'s (a diverged run: inf)"
    if math.isnan(fast) or math.isnan(slow):
        return Finding(claim, measured, criterion, NOT_RUN)
    return Finding(claim, measured, criterion, HOLDS if fast <= FASTER_LOSS_RATIO * slow else FAILS)


def judge_ablation(frame: pd.DataFrame) -> list[Finding]:
    """POP-Norm Fig. 3: with ReLU and tanh, mean removal alone (rho 1) trains faster than no
    normalization and division alone faster than mean removal alone; mean removal with the
    kappa 4 the preset had before its correction is shown beside them."""
    findings = []
    for act in ("relu", "tanh"):
        loss = {method: final_loss(frame, tags__method=method, act__name=act) for method in ("division_only", "none")}
        loss["mean_only"] = final_loss(frame, tags__method="mean_only", act__name=act, norm__rho=1.0)
        kappa4 = final_loss(frame, tags__method="mean_only", act__name=act, norm__rho=4.0)
        findings += [
            faster(f"{act}: mean removal alone trains faster than no normalization", ("mean only", "none"),
                   loss["mean_only"], loss["none"]),
            faster(f"{act}: division alone trains faster than mean removal alone", ("division only", "mean only"),
                   loss["division_only"], loss["mean_only"]),
            Finding(f"{act}: mean removal only with kappa 4 (the preset before its correction)",
                    f"final training loss {kappa4:.3f}", "(not the paper's form)", SHOWN),
        ]
    return findings


def runs_of(frame: pd.DataFrame, norm: str, key: str) -> list[pd.Series]:
    """The runs of ``norm``, in increasing order of the config value ``key``."""
    if "norm.name" not in frame:
        return []
    return [run for _, run in frame[frame["norm.name"] == norm].sort_values(key).iterrows()]


def did_not_train(run: pd.Series) -> bool:
    """Diverged, or collapsed to chance (the Table 6 rule on its final training loss)."""
    return run["status"] == "diverged" or at_chance(float(run["final_train_loss"]), float(run["final_top1"]), CLASSES)


def judge_arora(frame: pd.DataFrame) -> list[Finding]:
    """Arora et al.: with BN the final loss barely depends on lr_w over four decades; without
    BN the large learning rates do not train."""
    bn, none = runs_of(frame, "bn", "optim.lr_w"), runs_of(frame, "none", "optim.lr")
    bn_text = "final training loss: " + ", ".join(
        f"lr_w {float(r['optim.lr_w']):g}: " + (f"{float(r['final_train_loss']):.3f}" if r["status"] == "completed"
                                                else r["status"]) for r in bn)
    bn_ok = all(r["status"] == "completed" and float(r["final_train_loss"]) <= CONVERGED_LOSS for r in bn)
    losses = [float(r["final_train_loss"]) for r in bn if r["status"] == "completed"]
    if losses:
        bn_text += f" (largest / smallest: {max(losses) / min(losses):.0f}x)"
    none_text = "test top-1: " + ", ".join(
        f"lr {float(r['optim.lr']):g}: " + (f"{float(r['final_top1']):.1f} %" if r["status"] == "completed"
                                            else r["status"]) for r in none)
    large = [r for r in none if float(r["optim.lr"]) >= 10.0]
    return [
        Finding("with BN the final training loss is nearly the same for lr_w 0.01 ... 100", bn_text if bn else "no runs",
                f"every lr_w ends below {CONVERGED_LOSS:.2f} nats (a tenth of chance)",
                NOT_RUN if not bn else HOLDS if bn_ok else FAILS),
        Finding("without BN the large learning rates (10, 100) do not train", none_text if none else "no runs",
                "diverged, or collapsed to chance (the Table 6 rule)",
                NOT_RUN if not large else HOLDS if all(map(did_not_train, large)) else FAILS),
    ]


@dataclass(frozen=True)
class Claim:
    """A paper's claim: its source, the sweeps that test it and how they are judged."""

    name: str
    source: str
    arms: tuple[Arm, ...]
    judge: Callable[[pd.DataFrame], list[Finding]]


def _bnp(norm: str, batch: int, lr: float) -> Arm:
    return Arm("bnp/fc", (*BNP_DIGITS, "paper_data=mnist", f"norm={norm}", f"trainer.batch_size={batch}",
                          f"optim.lr={lr:g}", "data.standardize=true"), seeds=(0, 1))  # the claim's inputs as fixed


ACTS3 = "act=sigmoid,tanh,relu"
POPNORM_SIGMOID = (*POPNORM_DIGITS, "model=resnet20", "paper_data=cifar10", "act=sigmoid")
CLAIMS: dict[str, Claim] = {c.name: c for c in (
    Claim("cbn", "CBN Table 1 (ResNet-20)",
          (Arm("cbn/table1", (*CBN_DIGITS, "cbn_row=r1,r2", "norm.rho=1.0", ACTS3)),), judge_cbn),
    Claim("popnorm", "POP-Norm Table 1 (ResNet-20)",
          (Arm("popnorm/table1", (*POPNORM_SIGMOID, "norm=bn,popnorm")),), judge_popnorm),
    Claim("forms", "METHODS.md section 1 (ResNet-20, sigmoid, lr 0.1)",
          (Arm("cbn/table1", (*CBN_DIGITS, "cbn_row=r2", "norm.rho=1.0", "act=sigmoid"), home="cbn"),
           Arm("popnorm/table1", (*POPNORM_SIGMOID, "norm=popnorm"), home="popnorm"),
           *(Arm("cbn/table1", (*CBN_DIGITS, "cbn_row=r2", "norm.rho=1.0", "act=sigmoid", *form), seeds=(0,),
                 shown=True) for form in (("norm.join=after_act", "norm.classifier=false"),
                                          ("norm.join=before_act", "norm.classifier=true,false"))),
           *(Arm("popnorm/table1", (*POPNORM_SIGMOID, "norm=popnorm", *form), seeds=(0,), shown=True)
             for form in (("norm.join=after_act", "norm.classifier=true,false"),
                          ("norm.join=before_act", "norm.classifier=true")))),
          judge_forms),
    Claim("ablation", "POP-Norm Fig. 3 (VGG-16)",
          (Arm("popnorm/ablation", (*POPNORM_ABLATION_DIGITS, "pop_part=mean_only,division_only,none",
                                    "act=relu,tanh"), seeds=(0,)),
           Arm("popnorm/ablation", (*POPNORM_ABLATION_DIGITS, "pop_part=mean_only", "norm.rho=4.0", "act=relu,tanh"),
               seeds=(0,), shown=True)), judge_ablation),
    Claim("lr", "CBN Table 6 (ResNet-20, ReLU)",
          (Arm("cbn/table6", (*CBN_DIGITS, f"cbn_part={','.join(LR_METHODS)}", "act=relu",
                              "optim.lr=1e-4,1e-3,1e-2,1e-1,1"), seeds=(0,)),), judge_lr),
    Claim("bnp", "BNP Figs. 3-5 (3x100 MLP)",
          (_bnp("bnp", 1, 0.1), _bnp("bnp", 2, 0.05), _bnp("bn", 2, 0.05), _bnp("none", 1, 5e-4),
           _bnp("none", 2, 5e-3)), judge_bnp),
    Claim("hessian", "BNP Fig. 8 (2x100 MLP, batch 60)",
          tuple(Arm("bnp/hessian", (*BNP_DIGITS, "tags.data=digits", f"norm={norm}", f"optim.lr={lr:g}",
                                    "probes=[hessian]", "probe.hessian.every=10"), seeds=(0,))
                for norm, lr in (("none", 0.01), ("bnp", 0.1))), judge_hessian),
    Claim("arora", "Arora et al. (ResNet-20, BN, lr_g 0.1)",
          (Arm("arora/auto_rate", (*CBN_DIGITS, "optim.lr_w=1e-2,1e-1,1,1e1,1e2"), seeds=(0,)),
           Arm("arora/auto_rate", (*CBN_DIGITS, "norm=none", "optim.lr_w=null", "optim.lr_g=null", "optim.wd_w=null",
                                   "optim.lr=1e-2,1e-1,1,1e1,1e2"), seeds=(0,))), judge_arora),
)}


def key_of(override: str) -> str:
    """The config key an override sets (``norm.rho`` of ``norm.rho=2``, ``hydra/launcher``)."""
    return override.split("=", 1)[0].lstrip("+~")


def merged(*groups: Sequence[str]) -> list[str]:
    """The overrides of all groups, a later value for the same key replacing an earlier one."""
    by_key: dict[str, str] = {}
    for group in groups:
        for override in group:
            by_key[key_of(override)] = override
    return list(by_key.values())


def arm_overrides(arm: Arm, folder: Path, scale: str, extra: Sequence[str]) -> list[str]:
    """The ``bnexp train -m`` arguments of one arm."""
    seeds = arm.seeds if scale == "full" else arm.seeds[:1]
    return merged([f"experiment={arm.preset}"], arm.overrides, QUICK if scale == "quick" else (),
                  [f"trainer.seed={','.join(map(str, seeds))}", f"hydra.sweep.dir={folder}"], extra)


@dataclass(frozen=True)
class Cell:
    """One cell of a claim: the ``bnexp train -m`` arguments that train its seeds."""

    args: tuple[str, ...]


def arm_cells(arm: Arm, folder: Path, scale: str, extra: Sequence[str]) -> list[Cell]:
    """The cells of one arm: the jobs of its sweep as bnexp's sweeper expands it (the preset's
    sweeps with the arm's and the command line's values), grouped by all but the seed; a
    cell's seeds train as one pack (``hydra/launcher=pack``) when there are several. Each run
    keeps the directory the arm's sweep gives it."""
    args = arm_overrides(arm, folder, scale, extra)
    hydra = [a for a in args if a.startswith(("hydra.", "hydra/"))]
    jobs = load_preset(arm.preset, "full", [a for a in args if not a.startswith("experiment=")]).jobs
    cells = []
    for group in pack_groups(jobs, per_run=(SEED,)):
        seeds = [str(job_value(jobs[i], SEED)) for i in group]
        fixed = [o for o in jobs[group[0]] if override_key(o) != SEED]
        packed = ["hydra/launcher=pack"] if len(seeds) > 1 else []
        cells.append(Cell((f"experiment={arm.preset}", *fixed, f"{SEED}={','.join(seeds)}", *merged(packed, hydra))))
    return cells


def claim_cells(name: str, out: Path, scale: str, extra: Sequence[str], shown: bool) -> list[Cell]:
    """The cells claim ``name`` reads, each in its home claim's folder under ``out``; those of
    rows without a verdict only when ``shown``."""
    return [cell for arm in CLAIMS[name].arms if shown or not arm.shown
            for cell in arm_cells(arm, out / (arm.home or name), scale, extra)]


def claim_frame(name: str, out: Path) -> pd.DataFrame:
    """The runs of every folder claim ``name`` reads, each with its folder's claim (:data:`FOLDER`)."""
    folders = dict.fromkeys(arm.home or name for arm in CLAIMS[name].arms)
    return pd.concat([load_summaries(out / folder).assign(**{FOLDER: folder}) for folder in folders],
                     ignore_index=True)


@ends_with_parent
def train_cell(args: Sequence[str]) -> int:
    """``bnexp train -m ARGS`` in this process: 0, or EXIT_FAILED when runs failed."""
    return multirun(list(args))


def train_cells(cells: Sequence[Cell], jobs: int) -> Iterable[int]:
    """Train ``cells`` in order, ``jobs`` at a time in worker processes that stay for all of
    them (in this process for one); each one's :func:`train_cell` code as it ends, in order."""
    if jobs == 1:
        return (train_cell(cell.args) for cell in cells)
    return Parallel(n_jobs=jobs, return_as="generator")(delayed(train_cell)(cell.args) for cell in cells)


def run_claims(names: Sequence[str], out: Path, scale: str, jobs: int, extra: Sequence[str],
               shown: bool = False) -> dict[str, tuple[list[Finding], int]]:
    """Train (or reuse) every cell of the claims ``names`` under ``out/<claim>`` (a cell two
    claims read, once) and judge each claim's runs as its last cell ends (its verdicts printed
    then); each claim's findings (rows without a verdict only when ``shown``) and the exit code
    of its cells' sweeps (EXIT_FAILED when runs failed)."""
    names = list(dict.fromkeys(names))  # a claim named twice is one claim
    listed = {name: claim_cells(name, out, scale, extra, shown) for name in names}
    cells = {name: set(listed[name]) for name in names}
    left = {name: len(cells[name]) for name in names}
    codes = dict.fromkeys(names, 0)
    results: dict[str, tuple[list[Finding], int]] = {}

    def judge(name: str) -> None:
        claim = CLAIMS[name]
        findings = [f for f in claim.judge(claim_frame(name, out)) if shown or f.verdict != SHOWN]
        results[name] = findings, codes[name]
        lines = [f"  {f.claim}: {f.verdict} ({f.measured})" for f in findings]
        print("\n".join([f"== claim {name}, {claim.source}:", *lines]), flush=True)

    order = list(dict.fromkeys(cell for name in names for cell in listed[name]))
    for name in [n for n in names if not left[n]]:
        judge(name)
    for cell, code in zip(order, train_cells(order, jobs)):
        for name in [n for n in names if cell in cells[n]]:
            codes[name] = max(codes[name], code)
            left[name] -= 1
            if not left[name]:
                judge(name)
    return {name: results[name] for name in names}


def render(rows: list[tuple[Claim, Finding]], fmt: str) -> str:
    """The claims table as markdown or CSV."""
    frame = pd.DataFrame([{"source": c.source, "claim": f.claim, "measured (mean ± std (seeds))": f.measured,
                           "criterion": f.criterion, "verdict": f.verdict} for c, f in rows])
    return frame.to_markdown(index=False) + "\n" if fmt == "markdown" else frame.to_csv(index=False)


OPTIONS = {"scale": "full", "jobs": "", "out": "", "format": "markdown", "shown": "false"}
FORMATS = ("markdown", "csv")
SHOWN_CHOICES = ("false", "true")


def listing() -> str:
    """What ``bnexp claims`` prints without arguments."""
    lines = ["claims (bnexp claims all | NAME ... [scale=full|quick] [jobs=N] [out=DIR] [shown=true] "
             "[Hydra overrides]):"]
    for c in CLAIMS.values():
        shown = sum(arm.shown for arm in c.arms)
        lines.append(f"  {c.name:8} {c.source}: {len(c.arms) - shown} sweep(s)"
                     + (f" (+{shown} with shown=true)" if shown else ""))
    return "\n".join(lines)


def default_jobs() -> int:
    """Parallel runs: one per CPU core (each run then uses one thread)."""
    return max(1, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)


def main(args: list[str]) -> tuple[str, int]:
    """Run the claims the arguments name; return the table and the exit code."""
    names = [a for a in args if "=" not in a]
    if not names:
        return listing() + "\n", 0
    options, extra = split_options([a for a in args if "=" in a], OPTIONS)
    opts = {**OPTIONS, **options}
    if opts["scale"] not in SCALES:
        raise unknown_choice("scale", opts["scale"], SCALES)
    if opts["format"] not in FORMATS:
        raise unknown_choice("format", opts["format"], FORMATS)
    if opts["shown"] not in SHOWN_CHOICES:
        raise unknown_choice("shown", opts["shown"], SHOWN_CHOICES)
    chosen = list(CLAIMS) if names == ["all"] else names
    for name in chosen:
        if name not in CLAIMS:
            raise unknown_choice("claim", name, [*CLAIMS, "all"])
    try:
        jobs = int(opts["jobs"]) if opts["jobs"] else default_jobs()
    except ValueError:
        raise ConfigError(f"jobs={opts['jobs']!r} is not valid: a number of parallel runs >= 1") from None
    if jobs < 1:
        raise ConfigError(f"jobs={jobs} is not valid: a number of parallel runs >= 1")
    out = Path(opts["out"] or ("results/claims" if opts["scale"] == "full" else "results/quick/claims"))
    results = run_claims(chosen, out, opts["scale"], jobs, extra, shown=opts["shown"] == "true")
    rows = [(CLAIMS[name], finding) for name, (findings, _) in results.items() for finding in findings]
    table = render(rows, opts["format"])
    out.mkdir(parents=True, exist_ok=True)
    (out / f"claims.{'md' if opts['format'] == 'markdown' else 'csv'}").write_text(table)
    banner = "scale=quick: a smoke run of the pipeline; these verdicts are not evidence.\n\n" \
        if opts["scale"] == "quick" else ""
    text = f"{banner}Claims on scikit-learn's digits (not CIFAR or ImageNet numbers); runs in {out}\n\n{table}"
    return text, max(code for _, code in results.values())


def command(args: list[str]) -> None:
    """``bnexp claims [all | NAME ...] [scale=full|quick] [jobs=N] [out=DIR] [format=markdown|csv] [shown=true]
    [overrides]``;
    after the table, exit non-zero when some run failed."""
    def body() -> None:
        text, code = main(args)
        print(text, end="", flush=True)
        if code:
            sys.exit(code)

    exit_on_error(body)
