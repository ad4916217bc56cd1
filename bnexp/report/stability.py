"""The largest-stable-learning-rate rule of CBN Table 6, shared by ``bnexp table cbn/table6``,
``bnexp lrsearch`` and ``bnexp claims lr`` (docs/instruments/lrsearch.md).

A run collapses when its loss turns non-finite (status ``diverged``), when its final loss
(the ``loss`` probe on the final weights) is not below its initial loss (the probe at step
0), or when it collapsed to chance: a final loss at least 95 % of ln(classes) with a test
top-1 below twice the rate of guessing. A value (an lr) is stable when none of its runs
collapses; the rule reports the largest stable value.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Mapping, Optional

import pandas as pd

from bnexp.report.results import load_probes
from bnexp.support.errors import ConfigError

CHANCE_LOSS_BAND = 0.05  # a final loss no more than 5% below ln(classes) ...
CHANCE_TOP1_FACTOR = 2.0  # ... with a test top-1 below twice the guessing rate: collapsed to chance


def loss_endpoints(run_dir: Path) -> tuple[float, float]:
    """The ``loss`` probe's values at step 0 and on the final weights (NaN when missing)."""
    rows = load_probes(run_dir).query("probe == 'loss'").sort_values("step")
    if rows.empty or rows["step"].iloc[0] != 0:
        return math.nan, math.nan
    return float(rows["value"].iloc[0]), float(rows["value"].iloc[-1])


def at_chance(final: float, top1: float, classes: int) -> bool:
    """The run predicts no better than a constant: its final loss has not gone below
    ln(classes), what a uniform prediction scores (a confident constant scores more), and its
    test top-1 is below twice the rate of guessing."""
    return final >= (1 - CHANCE_LOSS_BAND) * math.log(classes) and top1 < CHANCE_TOP1_FACTOR * 100 / classes


def recorded_classes(summary: Mapping[str, Any], run_dir: Path) -> int:
    """The number of classes a run's summary.json records (the collapse rule needs it)."""
    classes = summary.get("num_classes")
    if classes is None or classes != classes:  # missing, or NaN in a frame of summaries
        raise ConfigError(f"{run_dir}/summary.json does not record num_classes, which the stability rule needs "
                          "(made by an older bnexp): train it again with trainer.resume=never")
    return int(classes)


def collapsed(status: str, initial: float, final: float, top1: float, classes: int) -> bool:
    """A diverged run (non-finite training loss), a final loss not below the initial one, or
    a run that collapsed to chance (:func:`at_chance`; its loss can still be below a large
    initial loss)."""
    return status != "completed" or not (math.isfinite(final) and final < initial) or at_chance(final, top1, classes)


def run_collapsed(run: Mapping[str, Any]) -> bool:
    """The rule on one run (a row of :func:`bnexp.report.results.load_summaries`)."""
    if run["status"] != "completed":
        return True
    initial, final = loss_endpoints(Path(run["run_dir"]))
    if math.isnan(initial):
        raise ConfigError(f"{run['run_dir']} has no step-0 rows of the loss probe in probes.csv, which the stability "
                          "rule needs: train it with probes=[loss] (experiment=cbn/table6 does)")
    classes = recorded_classes(run, Path(run["run_dir"]))
    return collapsed(run["status"], initial, final, float(run["final_top1"]), classes)


def largest_stable(runs: pd.DataFrame, key: str) -> Optional[Any]:
    """The largest value of ``key`` none of whose runs collapsed: by their ``collapsed``
    column when they have one, else by :func:`run_collapsed`. None when no value is stable."""
    flags = runs["collapsed"] if "collapsed" in runs else runs.apply(run_collapsed, axis=1)
    stable = [value for value, group in flags.groupby(runs[key]) if not group.any()]
    return max(stable, key=float) if stable else None
