"""``bnexp plot <paper>/<name>``: the paper's figure from the preset's runs, mean over seeds and
min-max band; ``bnexp plot DIR``: curves of any sweep, one line per combination of the varying
overrides.

For a preset: one panel per table column (an activation, a data set and batch size), one
line per table row (a method; a tuned row at its winning value), the series the paper plots
(its ``report.figure``: training loss for CBN and POP-Norm, loss dashed with accuracy solid
for BNP, the gradient variance or norm from the probes, eta and tau across channels;
:class:`FigureSpec`); only the runs of the preset's cells count
(:func:`bnexp.report.selection.preset_runs`). Written as PNG and PDF.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Mapping, Sequence

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402
from matplotlib.axes import Axes  # noqa: E402

from bnexp.probes.callback import PROBES_FILE  # noqa: E402
from bnexp.probes.eta_tau import quantity_name  # noqa: E402
from bnexp.probes.plot import literal, plot_probes  # noqa: E402
from bnexp.report.layouts import Layout, same  # noqa: E402
from bnexp.report.presets import Preset, parse_command, read_preset, sweep_folder  # noqa: E402
from bnexp.report.results import load_metrics, load_probes, load_summaries, run_dirs  # noqa: E402
from bnexp.report.selection import choose, combos, preset_runs, select, unlike_paper, varying  # noqa: E402
from bnexp.support.errors import ConfigError  # noqa: E402
from bnexp.support.options import OUT_ELSEWHERE, exit_on_error, output_errors  # noqa: E402
from bnexp.support.runinfo import atomic_write  # noqa: E402

METRIC_NAMES = {"train_loss": "training loss", "test_loss": "test loss", "test_acc": "test top-1 (%)",
                "train_acc": "training top-1 (%)", "test_top5": "test top-5 (%)",
                "grad_var": "variance of the stochastic gradient", "grad_norm": "gradient norm",
                "eta": "eta (across channels)", "tau": "tau (across channels)"}
# Series a figure draws from probes.csv: (probe, layer, quantity), against training steps.
PROBE_SERIES = {"grad_var": ("grad_var", "all", "variance"), "grad_norm": ("grad_norm", "all", "norm")}
DEFAULT_SERIES = ("train_loss", "test_acc")
BAND = 0.2  # opacity of a line's min-max band over seeds


@dataclass(frozen=True)
class FigureSpec:
    """How a preset's figure looks (``report.figure``): its series (metrics.csv columns or
    :data:`PROBE_SERIES`), drawn in one panel per table column and series, or both series in
    one panel on two axes (``overlay``: BNP's figures, loss dashed, accuracy solid); the x
    axis (``epoch`` or ``step``), series on a log axis, the table rows it shows, a title; and
    ``kind: eta_tau`` for CBN Figs. 2-3 (quantile bands across channels of ``layers``)."""

    series: tuple[str, ...] = DEFAULT_SERIES
    overlay: bool = False
    x: str = "epoch"
    log: tuple[str, ...] = ()
    rows: tuple[str, ...] = ()
    title: str = ""
    kind: str = "curves"
    layers: tuple[str, ...] = ()


def figure_spec(layout: Layout) -> FigureSpec:
    """The :class:`FigureSpec` of a preset's report block (the defaults where it has none)."""
    raw = dict(layout.figure)
    for key in ("series", "log", "rows", "layers"):
        if key in raw:
            raw[key] = tuple(str(v) for v in raw[key])
    return FigureSpec(**raw)


def curves(runs: pd.DataFrame) -> list[pd.DataFrame]:
    """The runs' metrics.csv files (each read once: an unusable one is named once)."""
    return [load_metrics(run) for run in runs["run_dir"]]


def series_of(runs: pd.DataFrame, name: str, x: str) -> list[pd.Series]:
    """Each run's ``name`` indexed by ``x`` (a probe series by step; a point listed twice in a
    file: its last value)."""
    if name in PROBE_SERIES:
        probe, layer, quantity = PROBE_SERIES[name]
        rows = [load_probes(run) for run in runs["run_dir"]]
        found = [f[(f["probe"] == probe) & (f["layer"] == layer) & (f["quantity"] == quantity)] for f in rows]
        return [f.drop_duplicates("step", keep="last").set_index("step")["value"] for f in found if len(f)]
    return [m.drop_duplicates(x, keep="last").set_index(x)[name] for m in curves(runs) if name in m and x in m]


def band(series: Sequence[pd.Series]) -> pd.DataFrame:
    """Mean, min and max over the runs' ``series``, by x."""
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


def shown_rows(layout: Layout, rows: Sequence[str]) -> list[dict[str, Any]]:
    """The table rows a figure draws a line for (all when ``rows`` is empty)."""
    return [r for r in combos(layout.rows) if not rows or any(same(r[layout.rows[0].key], v) for v in rows)]


def x_of(spec: FigureSpec, name: str) -> str:
    """The x column of a series: training steps for a probe's, else the figure's x."""
    return "step" if name in PROBE_SERIES else spec.x


def draw(layout: Layout, frame: pd.DataFrame, metrics: Sequence[str] = (), rows: Sequence[str] = (),
         note: str = "") -> plt.Figure:
    """The figure: one panel per table column (and per series, unless the figure overlays
    its two series), a mean line and min-max band over seeds per table row. ``metrics``
    given: those series in panel rows; else the preset's figure (:func:`figure_spec`).
    ``note`` (why the runs are not the paper's) goes into the title."""
    spec = figure_spec(layout)
    if metrics:
        spec = replace(spec, series=tuple(metrics), overlay=False, kind="curves")
    if spec.kind == "eta_tau":
        return draw_eta_tau(layout, frame, spec, rows, note)
    lines = shown_rows(layout, rows or spec.rows)
    cols = combos(layout.columns)
    panel_rows = 1 if spec.overlay else len(spec.series)
    fig, axes = plt.subplots(panel_rows, len(cols), squeeze=False, figsize=(max(6.0, 3.4 * len(cols)), 2.8 * panel_rows))
    for j, col in enumerate(cols):
        axes[0][j].set_title(" ".join(a.label(col[a.key]) for a in layout.columns), fontsize=9)
        twin = axes[0][j].twinx() if spec.overlay else None
        for color, row in enumerate(lines):
            keys = {**row, **col}
            if layout.sweep_of(keys) is None:  # a cell the paper never ran
                continue
            runs, suffix = line_runs(frame, layout, keys)
            label = " ".join(a.label(row[a.key]) for a in layout.rows) + suffix
            for i, name in enumerate(spec.series):
                ax = (twin if i else axes[0][j]) if spec.overlay else axes[i][j]
                curve = band(series_of(runs, name, x_of(spec, name))) if len(runs) else band([])
                if curve.empty:
                    continue
                style = "--" if spec.overlay and i == 0 else "-"
                ax.plot(curve.index, curve["mean"], style, color=f"C{color}", linewidth=1.2,
                        label=label if i == 0 or not spec.overlay else None)
                ax.fill_between(curve.index, curve["min"], curve["max"], color=f"C{color}", alpha=BAND)
        label_axes(spec, axes[:, j], twin, first=j == 0, last=j == len(cols) - 1)
    fig.suptitle(literal(title_of(layout, spec, note)), fontsize=10, wrap=True)
    fig.tight_layout()
    return fig


def label_axes(spec: FigureSpec, column: Sequence[Axes], twin: Axes | None, first: bool, last: bool) -> None:
    """Log scales, legends and x labels of one column of panels; the y labels on the first
    column (an overlay's second series on the last column's right axis)."""
    panels = [column[0], twin] if twin is not None else list(column)
    for ax, name in zip(panels, spec.series):
        if (first and ax is not twin) or (last and ax is twin):
            ax.set_ylabel(METRIC_NAMES.get(name, name) + (" (dashed)" if twin is not None and ax is not twin else ""))
        if name in spec.log:
            ax.set_yscale("log")
    for ax, name in zip(column, spec.series):
        ax.set_xlabel("iteration" if x_of(spec, name) == "step" else "epoch")
        if ax.lines:
            ax.legend(fontsize=6)


def title_of(layout: Layout, spec: FigureSpec, note: str) -> str:
    """The figure's title (the preset's table title unless its figure names one), and why the
    runs are not the paper's, in brackets."""
    return (spec.title or layout.title) + (f" [{note}]" if note else "")


def draw_eta_tau(layout: Layout, frame: pd.DataFrame, spec: FigureSpec, rows: Sequence[str], note: str) -> plt.Figure:
    """CBN Figs. 2-3: eta (top) and tau (bottom) across channels of each of ``spec.layers``
    during training, a median line and 25-75 % band per table row (the quantiles averaged over
    its runs). A layer the runs do not have (a smaller model at ``scale=quick``) is replaced by
    the first, middle and last the runs have."""
    lines = shown_rows(layout, rows or spec.rows)
    probes = {i: pd.concat([load_probes(r) for r in select(frame, row)["run_dir"]] or [pd.DataFrame()])
              for i, row in enumerate(lines)}
    present = list(dict.fromkeys(name for f in probes.values() if "layer" in f for name in f["layer"]))
    layers = [layer for layer in spec.layers if layer in present] or evenly(present, 3)
    fig, axes = plt.subplots(2, max(1, len(layers)), squeeze=False, figsize=(4 * max(1, len(layers)), 5.6))
    for col, layer in enumerate(layers):
        for top, prefix in enumerate(("eta", "tau")):
            ax = axes[top][col]
            for i, row in enumerate(lines):
                rows_of = probes[i]
                if "layer" not in rows_of:
                    continue
                wide = rows_of[rows_of["layer"] == layer].pivot_table(index="step", columns="quantity", values="value")
                names = [quantity_name(prefix, q) for q in (0.25, 0.5, 0.75)]
                if not set(names) <= set(wide.columns):
                    continue
                label = " ".join(a.label(row[a.key]) for a in layout.rows)
                ax.plot(wide.index, wide[names[1]], color=f"C{i}", linewidth=1.2, label=label)
                ax.fill_between(wide.index, wide[names[0]], wide[names[2]], color=f"C{i}", alpha=BAND)
            ax.set_title(f"{prefix}: {layer}", fontsize=9)
            ax.set_xlabel("iteration")
            ax.set_ylabel(METRIC_NAMES[prefix])
            if ax.lines:
                ax.legend(fontsize=6)
    fig.suptitle(literal(title_of(layout, spec, note)), fontsize=10, wrap=True)
    fig.tight_layout()
    return fig


def evenly(items: Sequence[str], count: int) -> list[str]:
    """Up to ``count`` of ``items`` spread evenly: the first, the middle, the last."""
    if len(items) <= count:
        return list(items)
    return [items[round(i * (len(items) - 1) / (count - 1))] for i in range(count)]


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
            curve = band([m.drop_duplicates("epoch", keep="last").set_index("epoch")[metric] for m in files
                          if metric in m and "epoch" in m])
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


def plot(p: Preset, results: Path, out: Path, metrics: Sequence[str] = (), rows: Sequence[str] = ()) -> list[Path]:
    """Draw preset ``p``'s figure (``metrics``: those series instead) from its runs under
    ``results``; return the PNG and PDF paths."""
    runs = preset_runs(p, summaries(results), results)
    fig = draw(p.layout, runs, metrics, rows, unlike_paper(p, runs))
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
        defaults = {"results": "", "out": "", "metrics": "", "rows": "", "scale": "full"}
        name, opts, overrides = parse_command(args, usage, defaults)
        p = read_preset(name, opts["scale"], overrides)
        results = Path(opts["results"] or p.results_dir)
        out = Path(opts["out"] or results / "plots")
        paths = plot(p, results, out, [m for m in opts["metrics"].split(",") if m],
                     [v for v in opts["rows"].split(",") if v])
    with output_errors(f"cannot write {out}", OUT_ELSEWHERE):
        # the runs a sweep folder lists count too (an ad-hoc sweep's cells train where single runs do)
        paths += plot_probes([d for d in run_dirs(results) if (d / PROBES_FILE).is_file()], out, load_probes)
    for path in paths:
        print(path)
