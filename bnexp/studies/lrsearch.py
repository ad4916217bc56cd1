"""``bnexp lrsearch``: the largest stable learning rate of each method (CBN Table 6).

Every (method, activation, lr, seed) candidate is one run of the CBN Table 6 protocol
(``experiment=cbn/table6``) plus the command line's Hydra overrides, trained in this
process in ``<out>/<method>/<act>/lr=<lr>,seed=<seed>``; a finished run found there is
reused. A method is an option of ``configs/cbn_part`` (none, mean_removal, l2_division,
cbn). Each run has the ``loss`` probe on: the initial training loss is the probe's value
at step 0 (before any update) and the final one its value on the final weights, both on
the same fixed training batches in training mode. A run collapses when its loss turns
non-finite (status ``diverged``), its final loss is not below its initial loss, or it
collapsed to chance (final loss at least 95% of ln(classes) and test top-1 below twice the
guessing rate); an lr is stable when none of its seeds collapses. The table reports, per method and activation,
the largest stable lr and the final test top-1 there (mean and std over the seeds).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd

from bnexp.probes.callback import enable_probe
from bnexp.report.stability import collapsed, largest_stable, loss_endpoints, recorded_classes
from bnexp.studies.runs import compose_config, list_option, run_command, run_or_reuse
from bnexp.support.errors import unknown_choice

PRESET = "experiment=cbn/table6"
OPTIONS = {
    "methods": "[none,mean_removal,l2_division,cbn]",
    "acts": "[sigmoid,tanh,relu,selu,swish]",
    "lrs": "[1e-4,1e-3,1e-2,1e-1,1]",
    "seeds": "[0]",
    "out": "results/lrsearch",
    "format": "markdown",
}
FORMATS = ("markdown", "csv")


@dataclass(frozen=True)
class Candidate:
    """One run of the search."""

    method: str
    act: str
    lr: float
    seed: int

    def overrides(self) -> list[str]:
        return [f"cbn_part={self.method}", f"act={self.act}", f"optim.lr={self.lr!r}", f"trainer.seed={self.seed}"]

    def run_dir(self, out: Path) -> Path:
        return out / self.method / self.act / f"lr={self.lr:g},seed={self.seed}"


def run_candidate(candidate: Candidate, overrides: list[str], out: Path) -> dict[str, Any]:
    """Train (or reuse) one candidate and return its row of the search."""
    cfg = compose_config([PRESET, *overrides, *candidate.overrides()])
    enable_probe(cfg, "loss")
    run_dir = candidate.run_dir(out)
    summary, reused = run_or_reuse(cfg, run_dir)
    initial, final = loss_endpoints(run_dir)
    status, top1 = summary["status"], summary.get("final_top1", math.nan)
    row = {**vars(candidate), "status": status, "initial_loss": initial, "final_loss": final,
           "collapsed": collapsed(status, initial, final, top1, recorded_classes(summary, run_dir)),
           "test_acc": top1}
    print(f"lrsearch: {candidate.method} {candidate.act} lr={candidate.lr:g} seed={candidate.seed}: {status}"
          f"{' (reused)' if reused else ''}, loss {initial:.4g} -> {final:.4g}", flush=True)
    return row


def max_stable(runs: pd.DataFrame) -> pd.DataFrame:
    """Per (method, act): the largest lr none of whose runs collapsed, and the test top-1 there."""
    rows = []
    for (method, act), group in runs.groupby(["method", "act"], sort=False):
        lr = largest_stable(group, "lr")
        lr = math.nan if lr is None else lr
        acc = group.loc[group["lr"] == lr, "test_acc"]
        rows.append({"method": method, "act": act, "max_stable_lr": lr, "test_acc": acc.mean(),
                     "test_acc_std": acc.std(), "seeds": len(acc)})
    return pd.DataFrame(rows)


def search(methods: list[str], acts: list[str], lrs: list[float], seeds: list[int], out: Path,
           overrides: list[str]) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Run every candidate; return (one row per run, the max-stable-lr table)."""
    candidates = [Candidate(m, a, lr, s) for m in methods for a in acts for lr in lrs for s in seeds]
    runs = pd.DataFrame([run_candidate(c, overrides, out) for c in candidates])
    return runs, max_stable(runs)


def main(options: dict[str, str], overrides: list[str]) -> None:
    """Search, write ``lrsearch_runs.csv`` and ``lrsearch.csv`` to ``out``, print the table."""
    if options["format"] not in FORMATS:
        raise unknown_choice("format", options["format"], FORMATS)
    out = Path(options["out"])
    runs, table = search(list_option(options["methods"], str), list_option(options["acts"], str),
                         list_option(options["lrs"], float), list_option(options["seeds"], int), out, overrides)
    out.mkdir(parents=True, exist_ok=True)
    runs.to_csv(out / "lrsearch_runs.csv", index=False)
    table.to_csv(out / "lrsearch.csv", index=False)
    print(table.to_markdown(index=False) if options["format"] == "markdown" else table.to_csv(index=False), flush=True)


def command(args: list[str]) -> None:
    """``bnexp lrsearch [methods=[...]] [acts=[...]] [lrs=[...]] [seeds=[...]] [out=DIR]
    [format=markdown|csv] [Hydra overrides for every run]``."""
    run_command(main, args, OPTIONS)
