"""Which runs a table or a figure reads: the runs of a preset, those matching some keys, the
tuned value a cell reports, and the overrides that vary between runs."""

from __future__ import annotations

import itertools
import sys
from collections import Counter
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np
import pandas as pd

from bnexp.engine.identity import differences, is_non_result
from bnexp.report.layouts import Layout, same
from bnexp.report.presets import Preset
from bnexp.report.results import REPLICATES
from bnexp.report.stability import largest_stable
from bnexp.support.errors import ConfigError


def select(frame: pd.DataFrame, keys: Mapping[str, Any]) -> pd.DataFrame:
    """The runs whose config matches every key (none when a key was never recorded)."""
    mask = np.ones(len(frame), dtype=bool)
    for key, value in keys.items():
        if key not in frame:
            return frame.iloc[0:0]
        mask &= matches(frame[key], value)
    return frame[mask]


SCALARS = (str, int, float, bool, type(None))  # the entries matches keeps a result for


def matches(column: pd.Series, value: Any) -> np.ndarray:
    """:func:`~bnexp.report.layouts.same` of each entry of ``column`` and ``value``, computed
    once per distinct text, number, boolean or None of each type (``True`` and ``1`` are one key
    to a dict, not one text; equal tuples may differ as text, so other entries are compared
    one by one)."""
    known: dict[tuple[type, Any], bool] = {}

    def test(entry: Any) -> bool:
        if type(entry) not in SCALARS:
            return same(entry, value)
        if (type(entry), entry) not in known:
            known[type(entry), entry] = same(entry, value)
        return known[type(entry), entry]

    return np.fromiter(map(test, column.tolist()), dtype=bool, count=len(column))


def completed(runs: pd.DataFrame, metric: str) -> pd.DataFrame:
    """The completed runs that recorded ``metric``."""
    return runs[(runs["status"] == "completed") & runs[metric].notna()] if metric in runs else runs.iloc[0:0]


def best_choice(runs: pd.DataFrame, key: str, metric: str, seed: str = "trainer.seed") -> Any:
    """The tuned value with the highest mean, compared on the seeds every value completed."""
    done = completed(runs, metric)
    if done.empty:
        return None
    seeds = dict(tuple(done[seed].groupby(done[key])))
    scores = dict(tuple(done[metric].groupby(done[key])))
    found = {v: set(s) for v, s in seeds.items()}
    common = set.intersection(*found.values())
    # a value whose runs all have common seeds: its mean over all of them (the same numbers)
    means = {v: scores[v][seeds[v].isin(common)].mean() if common and found[v] != common else scores[v].mean()
             for v in scores}
    return max(sorted(means), key=lambda v: means[v])


def choose(layout: Layout, runs: pd.DataFrame, metric: str) -> Any:
    """The tuned value a cell reports: the best mean, or the largest stable value (Table 6)."""
    if not len(runs):
        return None
    return best_choice(runs, layout.tune, metric) if layout.select == "best" else largest_stable(runs, layout.tune)


def tuned_key(p: Preset) -> str:
    """The parameter the preset's table tunes for the best mean (what ``tune_seeds`` splits);
    an error without one."""
    if p.layout.tune is None or p.layout.select != "best":
        raise ConfigError(f"tune_seeds applies to presets whose table tunes a parameter for the best mean "
                          f"(cbn/table1-4), not {p.name}")
    return p.layout.tune


def combos(axes: Sequence[Any]) -> list[dict[str, Any]]:
    """Every combination of the axes' values, in order, as {key: value}."""
    return [dict(zip((a.key for a in axes), values)) for values in itertools.product(*(a.values for a in axes))]


def preset_runs(p: Preset, frame: pd.DataFrame, results: Path) -> pd.DataFrame:
    """The runs of ``frame`` that belong to preset ``p``'s table (their fingerprint is one of
    its cells'); the others are named on stderr with the settings that set them apart."""
    if frame.empty:
        return frame
    member = frame["fingerprint"].isin(p.fingerprints)
    if member.all():
        return frame
    others = frame[~member]
    print(f"bnexp: {len(others)} of the {len(frame)} runs under {results} are not in this table: their settings "
          f"match no run of {p.name} ({why_not(p, others)})", file=sys.stderr)
    return frame[member]


def why_not(p: Preset, others: pd.DataFrame, sample: int = 5) -> str:
    """The keys that set runs apart from the preset, from the nearest of its runs to each of
    the first ``sample`` of them."""
    keys: Counter[str] = Counter()
    example = ""
    for _, run in others.head(sample).iterrows():
        there = run["result_config"]
        if not there:
            keys["unreadable summary.json"] += 1
            continue
        nearest = min(p.expected.values(), key=lambda c: sum(there.get(k) != c.get(k) for k in there.keys() | c.keys()))
        keys.update(k for k in there.keys() | nearest.keys() if there.get(k) != nearest.get(k))
        example = example or f"e.g. {run['run_dir']}: {differences(there, nearest)}"
    names = [k for k, _ in keys.most_common()]
    listed = ", ".join(names[:8]) + (f" and {len(names) - 8} more" if len(names) > 8 else "")
    return "; ".join(part for part in (f"they differ in {listed}", example) if part)


def varying(frame: pd.DataFrame) -> list[str]:
    """The override keys whose values differ between the runs (seeds and settings that do
    not change the result left out), in the order they first appear."""
    keys = [c.removeprefix("overrides.") for c in frame.columns if c.startswith("overrides.")]
    return [k for k in keys if k not in REPLICATES and not is_non_result(k)
            and frame[f"overrides.{k}"].astype(str).nunique(dropna=False) > 1]


def unlike_paper(p: Preset, runs: pd.DataFrame) -> str:
    """Why the runs of preset ``p`` cannot be compared with the paper's numbers (empty when
    they can): a toy scale, or data other than the paper's (``data=digits``: a run's
    ``data.name`` differs from the data set its preset names, ``tags.data``)."""
    if p.scale != "full":
        return f"scale={p.scale}, toy runs on synthetic data, not comparable with the paper"
    named = [(p.cfg.data.name, p.cfg.tags.get("data"))]
    if {"data.name", "tags.data"} <= set(runs.columns):
        named += list(zip(runs["data.name"], runs["tags.data"]))
    other = sorted({str(used) for used, paper in named if paper is not None and used != paper})
    return f"data {', '.join(other)}, not the paper's: not comparable with the paper" if other else ""
