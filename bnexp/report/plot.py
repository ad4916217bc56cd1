"""``bnexp plot <paper>/<name>``: training curves per method, mean over seeds and min-max band;
``bnexp plot DIR``: the same for any sweep, one line per combination of the varying overrides.

For a preset: one panel per table column (an activation, a data set and batch size), one
line per table row (a method; a tuned row at its winning value), one panel row per metric
(training loss and test accuracy by default); only the runs of the preset's cells count
(:func:`bnexp.report.table.preset_runs`). Written as PNG and PDF.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any, Mapping, Sequence

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402

from bnexp.probes.plot import literal, plot_results  # noqa: E402
from bnexp.report.layouts import Layout, same  # noqa: E402
from bnexp.report.presets import Preset, load_preset, parse_command, sweep_folder  # noqa: E402
from bnexp.report.results import load_metrics, load_probes, load_summaries  # noqa: E402
from bnexp.report.selection import choose, combos, preset_runs, select, varying  # noqa: E402
from bnexp.support.errors import ConfigError  # noqa: E402
from bnexp.support.options import OUT_ELSEWHERE, exit_on_error, output_errors  # noqa: E402
from bnexp.support.runinfo import atomic_write  # noqa: E402

METRIC_NAMES = {"train_loss": "training loss", "test_loss": "test loss", "test_acc": "test top-1 (%)",
                "train_acc": "training top-1 (%)", "test_top5": "test top-5 (%)"}


def curves(runs: pd.DataFrame) -> list[pd.DataFrame]:
    """The runs' metrics.csv files (each read once: an unusable one is named once)."""
    return [load_metrics(run) for run in runs["run_dir"]]


def band(metrics: Sequence[pd.DataFrame], metric: str) -> pd.DataFrame:
    """Mean, min and max of ``metric`` over the runs' metrics.csv (:func:`curves`), indexed by
    epoch (an epoch listed twice in one file: its last row)."""
    series = [m.drop_duplicates("epoch", keep="last").set_index("epoch")[metric] for m in metrics if metric in m]
    if not series:
        return pd.DataFrame(columns=["mean", "min", "max"])
    joined = pd.concat(series, axis=1)
    return pd.DataFrame({"mean": joined.mean(axis=1), "min": joined.min(axis=1), "max": joined.max(axis=1)})


def line_runs(frame: pd.DataFrame, layout: Layout, keys: Mapping[str, Any]) -> tuple[pd.DataFrame, str]:
    """The runs one line shows (a tuned cell: its winner's) and the suffix naming the winner."""
    runs = select(frame, keys)
    if not layout.is_tuned(keys) or runs.empty:
        return runs, ""
    choice = choose(layout, runs, "final_top1")
    if choice is None:
        return runs.iloc[0:0], ""
    return select(runs, {layout.tune: choice}), f" {layout.tune_name}={choice:g}"


def draw(layout: Layout, frame: pd.DataFrame, metrics: Sequence[str], rows: Sequence[str]) -> plt.Figure:
    """The figure: metrics x columns panels, a mean line and min-max band per row."""
    lines = [r for r in combos(layout.rows) if not rows or any(same(r[layout.rows[0].key], v) for v in rows)]
    cols = combos(layout.columns)
    fig, axes = plt.subplots(len(metrics), len(cols), squeeze=False, figsize=(3.4 * len(cols), 2.8 * len(metrics)))
    for j, col in enumerate(cols):
        axes[0][j].set_title(" ".join(a.label(col[a.key]) for a in layout.columns), fontsize=9)
        for row in lines:
            keys = {**row, **col}
            if layout.sweep_of(keys) is None:  # a cell the paper never ran
                continue
            runs, suffix = line_runs(frame, layout, keys)
            label = " ".join(a.label(row[a.key]) for a in layout.rows) + suffix
            files = curves(runs)
            for i, metric in enumerate(metrics):
                curve = band(files, metric)
                if curve.empty:
                    continue
                (drawn,) = axes[i][j].plot(curve.index, curve["mean"], label=label, linewidth=1.2)
                axes[i][j].fill_between(curve.index, curve["min"], curve["max"], color=drawn.get_color(), alpha=0.2)
    for i, metric in enumerate(metrics):
        axes[i][0].set_ylabel(METRIC_NAMES.get(metric, metric))
        for ax in axes[i]:
            ax.set_xlabel("epoch")
            ax.legend(fontsize=6) if ax.lines else None
    fig.suptitle(layout.title, fontsize=10)
    fig.tight_layout()
    return fig


def draw_sweep(frame: pd.DataFrame, metrics: Sequence[str], title: str) -> plt.Figure:
    """Any sweep: one panel per metric, one line (mean, min-max band over seeds) per
    combination of the overrides that vary."""
    keys = varying(frame)
    columns = [f"overrides.{k}" for k in keys]
    fig, axes = plt.subplots(1, len(metrics), squeeze=False, figsize=(4.2 * len(metrics), 3.2))
    groups = frame.groupby(columns, dropna=False, sort=True) if columns else [((), frame)]
    for values, runs in groups:
        values = values if isinstance(values, tuple) else (values,)
        label = literal(" ".join(f"{k}={v}" for k, v in zip(keys, values))) or "all runs"
        files = curves(runs)
        for ax, metric in zip(axes[0], metrics):
            curve = band(files, metric)
            if not curve.empty:
                (drawn,) = ax.plot(curve.index, curve["mean"], label=label, linewidth=1.2)
                ax.fill_between(curve.index, curve["min"], curve["max"], color=drawn.get_color(), alpha=0.2)
    for ax, metric in zip(axes[0], metrics):
        ax.set_xlabel("epoch")
        ax.set_ylabel(METRIC_NAMES.get(metric, metric))
        ax.legend(fontsize=6) if ax.lines else None
    fig.suptitle(literal(title), fontsize=9)
    fig.tight_layout()
    return fig


def save(fig: plt.Figure, out: Path, stem: str) -> list[Path]:
    """Write the figure as PNG and PDF under ``out`` (each whole or not at all); return the
    paths. A folder that cannot be written is one line naming it."""
    paths = [out / f"{stem}.{ext}" for ext in ("png", "pdf")]
    try:
        with output_errors(f"cannot write {out}", OUT_ELSEWHERE):
            out.mkdir(parents=True, exist_ok=True)
            for path in paths:
                atomic_write(path, functools.partial(fig.savefig, format=path.suffix[1:], dpi=150))
    finally:
        plt.close(fig)
    return paths


def summaries(results: Path) -> pd.DataFrame:
    """The runs under ``results``; an error when there are none."""
    frame = load_summaries(results)
    if frame.empty:
        raise ConfigError(f"no summary.json under {results}: run the sweep first")
    return frame


def plot(p: Preset, results: Path, out: Path, metrics: Sequence[str] = ("train_loss", "test_acc"),
         rows: Sequence[str] = ()) -> list[Path]:
    """Draw preset ``p``'s table layout from its runs under ``results``; return the PNG and PDF paths."""
    fig = draw(p.layout, preset_runs(p, summaries(results), results), metrics, rows)
    return save(fig, out, p.name.replace("/", "_"))


def command(args: list[str]) -> None:
    """``bnexp plot <paper>/<name> [results=DIR] [out=DIR] [metrics=a,b] [rows=v,w] [scale=quick]``
    or ``bnexp plot DIR [out=DIR] [metrics=a,b]``."""
    exit_on_error(lambda: plot_for(args))


SWEEP_OPTIONS = {"out": "", "metrics": "train_loss,test_acc"}


def plot_for(args: list[str]) -> None:
    """Draw what the command line asks for and print the files written."""
    folder = sweep_folder(args, SWEEP_OPTIONS)
    if folder:
        results, opts = folder
        out = Path(opts["out"] or results / "plots")
        fig = draw_sweep(summaries(results), opts["metrics"].split(","), str(results))
        paths = save(fig, out, "sweep")
    else:
        usage = ("bnexp plot <paper>/<name> [results=DIR] [out=DIR] [metrics=train_loss,test_acc] [rows=...], or "
                 "bnexp plot DIR [out=DIR] [metrics=...]")
        defaults = {"results": "", "out": "", "metrics": "train_loss,test_acc", "rows": "", "scale": "full"}
        name, opts, overrides = parse_command(args, usage, defaults)
        p = load_preset(name, opts["scale"], overrides)
        results = Path(opts["results"] or p.results_dir)
        out = Path(opts["out"] or results / "plots")
        paths = plot(p, results, out, opts["metrics"].split(","), [v for v in opts["rows"].split(",") if v])
    with output_errors(f"cannot write {out}", OUT_ELSEWHERE):
        paths += plot_results(results, out, load_probes)
    for path in paths:
        print(path)
