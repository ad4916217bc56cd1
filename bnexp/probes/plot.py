"""Figures of probes.csv: one PNG per probe comparing runs (eta_tau: one PNG per run).

:func:`plot_probes` draws given run directories; :func:`plot_results` every run under a
results folder that has a probes.csv (the entry point for ``bnexp plot``).
"""

from __future__ import annotations

import functools
import re
from pathlib import Path
from typing import Callable, Iterator, Sequence

import numpy as np
import pandas as pd
from matplotlib.axes import Axes
from matplotlib.figure import Figure

from bnexp.probes.callback import ALL, PROBES_FILE, read_probes
from bnexp.probes.eta_tau import QUANTILES, quantity_name
from bnexp.support.errors import unknown_choice
from bnexp.support.options import print_warning
from bnexp.support.runinfo import atomic_write


def run_labels(run_dirs: Sequence[Path]) -> list[str]:
    """Each run's path relative to the runs' common parent (its own name when alone)."""
    paths = [Path(d).resolve() for d in run_dirs]
    if len(paths) == 1:
        return [literal(paths[0].name)]
    common = Path(*[parts[0] for parts in zip(*(p.parts for p in paths)) if len(set(parts)) == 1])
    return [literal(str(p.relative_to(common))) for p in paths]


def literal(text: str) -> str:
    """``text`` as matplotlib prints it (a ``$`` pair would start math, which may not parse)."""
    return text.replace("$", r"\$")


def slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9.=-]+", "_", text).strip("_")


def series(frame: pd.DataFrame, quantity: str, layer: str = ALL) -> Iterator[tuple[str, pd.DataFrame]]:
    """(run, its rows of ``quantity`` at ``layer`` by step) for every run in ``frame``."""
    rows = frame[(frame["quantity"] == quantity) & (frame["layer"] == layer)]
    for run, group in rows.groupby("run", sort=False):
        yield str(run), group.sort_values("step")


def save(fig: Figure, path: Path) -> list[Path]:
    """Write the figure as a PNG, whole or not at all."""
    fig.tight_layout()
    atomic_write(path, functools.partial(fig.savefig, format="png", dpi=120))
    return [path]


def line_plot(quantity: str, ylabel: str, title: str, log: bool) -> Callable[[pd.DataFrame, Path], list[Path]]:
    """A drawer of one whole-model quantity against steps, a line per run."""

    def draw(frame: pd.DataFrame, out_dir: Path) -> list[Path]:
        fig = Figure(figsize=(6, 4))
        ax = fig.subplots()
        for run, rows in series(frame, quantity):
            ax.plot(rows["step"], rows["value"], label=run)
        finish(ax, ylabel, log)
        ax.set_title(title)
        return save(fig, out_dir / f"probe_{frame['probe'].iloc[0]}.png")

    return draw


def finish(ax: Axes, ylabel: str, log: bool) -> None:
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    if log:
        ax.set_yscale("log")
    ax.legend(fontsize="small")


def draw_hessian(frame: pd.DataFrame, out_dir: Path, name: str = "probe_hessian.png") -> list[Path]:
    """kappa(H) (solid) and kappa(P^T H P) (dashed) per run; kappa(D) beside them."""
    fig = Figure(figsize=(11, 4))
    left, right = fig.subplots(1, 2)
    wide = frame.pivot_table(index=["run", "step"], columns="quantity", values="value", sort=False)
    for color, (run, rows) in enumerate(wide.groupby(level="run", sort=False)):
        rows = rows.droplevel("run")
        left.plot(rows.index, rows["kappa_hessian"], color=f"C{color}", label=f"{run}: H")
        left.plot(rows.index, rows["kappa_preconditioned"], color=f"C{color}", linestyle="--", label=f"{run}: P^T H P")
        right.plot(rows.index, rows["kappa_d"], color=f"C{color}", label=str(run))
    finish(left, "condition number", log=True)
    finish(right, "kappa(D)", log=True)
    left.set_title(f"Hessian over [b, w] of one output neuron of {frame['layer'].iloc[0]}")
    right.set_title("BNP scaling D = diag(1, 1/sqrt(s2))")
    return save(fig, out_dir / name)


def draw_weights(frame: pd.DataFrame, out_dir: Path) -> list[Path]:
    """||w|| and lr / ||w||^2 of every scale-invariant weight; one color per run."""
    fig = Figure(figsize=(11, 4))
    axes = fig.subplots(1, 2)
    for ax, quantity, ylabel in zip(axes, ("norm", "effective_lr"), ("||w||", "lr / ||w||^2")):
        for color, (run, rows) in enumerate(frame[frame["quantity"] == quantity].groupby("run", sort=False)):
            for i, (_, curve) in enumerate(rows.groupby("layer", sort=False)):
                curve = curve.sort_values("step")
                ax.plot(curve["step"], curve["value"], color=f"C{color}", alpha=0.5, linewidth=0.8,
                        label=str(run) if i == 0 else None)
        finish(ax, ylabel, log=True)
    axes[0].set_title("scale-invariant weights: norm")
    axes[1].set_title("effective learning rate")
    return save(fig, out_dir / "probe_weights.png")


def draw_time(frame: pd.DataFrame, out_dir: Path) -> list[Path]:
    """Seconds per training step, data loading stacked under compute, a bar per run."""
    totals = frame.pivot_table(index="run", columns="quantity", values="value", aggfunc="sum", sort=False)
    per_step = totals[["epoch_data_s", "epoch_compute_s"]].div(totals["epoch_steps"], axis=0)
    fig = Figure(figsize=(max(4, 1.2 * len(per_step)), 4))
    ax = fig.subplots()
    ax.bar(per_step.index, per_step["epoch_data_s"], label="data")
    ax.bar(per_step.index, per_step["epoch_compute_s"], bottom=per_step["epoch_data_s"], label="compute")
    ax.set_ylabel("seconds per step")
    ax.set_title("training time per step")
    ax.tick_params(axis="x", labelrotation=30)
    ax.legend(fontsize="small")
    return save(fig, out_dir / "probe_time.png")


def draw_eta_tau(frame: pd.DataFrame, out_dir: Path) -> list[Path]:
    """Per run: eta (top) and tau (bottom) quantile bands of up to three layers (first,
    middle, last): the median, 25-75% and 5-95% across channels."""
    paths = []
    for run, rows in frame.groupby("run", sort=False):
        layers = list(dict.fromkeys(rows["layer"]))
        picks = np.linspace(0, len(layers) - 1, min(3, len(layers))).round().astype(int)
        chosen = [layers[i] for i in sorted(set(picks))]
        fig = Figure(figsize=(4 * len(chosen), 6))
        axes = np.asarray(fig.subplots(2, len(chosen), squeeze=False))
        for col, layer in enumerate(chosen):
            wide = rows[rows["layer"] == layer].pivot_table(index="step", columns="quantity", values="value")
            for row, prefix in enumerate(("eta", "tau")):
                ax: Axes = axes[row, col]
                band = [wide.get(quantity_name(prefix, q)) for q in QUANTILES]
                if band[2] is None:
                    continue
                ax.fill_between(wide.index, band[0], band[4], alpha=0.2, label="5-95%")
                ax.fill_between(wide.index, band[1], band[3], alpha=0.4, label="25-75%")
                ax.plot(wide.index, band[2], label="median")
                ax.set_title(f"{prefix}: {layer}", fontsize="small")
                finish(ax, prefix, log=False)
        fig.suptitle(str(run))
        paths += save(fig, out_dir / f"probe_eta_tau_{slug(str(run))}.png")
    return paths


Reader = Callable[[Path], pd.DataFrame]  # a run directory -> its probes.csv rows
DRAWERS: dict[str, Callable[[pd.DataFrame, Path], list[Path]]] = {
    "grad_norm": line_plot("norm", "||g||", "stochastic gradient norm", log=True),
    "grad_var": line_plot("variance", "mean ||g_i - mean g||^2", "stochastic gradient variance", log=True),
    "loss": line_plot("loss", "cross-entropy", "training loss on fixed batches", log=False),
    "eta_tau": draw_eta_tau,
    "weights": draw_weights,
    "time": draw_time,
    "hessian": draw_hessian,
}


def plot_probes(run_dirs: Sequence[Path], out_dir: Path, read: Reader = read_probes) -> list[Path]:
    """One figure per probe found in the runs' probes.csv files (as ``read`` gives them: ``bnexp
    plot`` passes a reader that warns about an unusable file instead of failing), in ``out_dir``;
    the paths."""
    if not run_dirs:
        return []
    frames = [drawable(d, read).assign(run=label) for d, label in zip(run_dirs, run_labels(run_dirs))]
    out_dir.mkdir(parents=True, exist_ok=True)
    paths: list[Path] = []
    for probe, rows in pd.concat(frames, ignore_index=True).groupby("probe", sort=False):
        paths += DRAWERS[str(probe)](rows, out_dir)
    return paths


def drawable(run_dir: Path, read: Reader) -> pd.DataFrame:
    """A run's probes.csv rows (``read(run_dir)``) of the probes there is a figure for; rows of
    a probe bnexp does not know are named in a warning and left out."""
    frame = read(run_dir)
    unknown = sorted(set(frame["probe"].astype(str)) - DRAWERS.keys())
    if unknown:
        print_warning(f"{Path(run_dir) / PROBES_FILE}: {unknown_choice('probe', unknown[0], DRAWERS)}; "
                      f"its rows of {', '.join(map(repr, unknown))} are left out")
    return frame[frame["probe"].astype(str).isin(DRAWERS.keys())]


def plot_results(results: Path, out_dir: Path, read: Reader = read_probes) -> list[Path]:
    """:func:`plot_probes` over every run under ``results`` that has a probes.csv."""
    return plot_probes(sorted(p.parent for p in Path(results).rglob(PROBES_FILE)), out_dir, read)
