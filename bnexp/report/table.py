"""``bnexp table <paper>/<name>``: a preset's results in the paper's layout; ``bnexp table
DIR rows=KEY cols=KEY``: any sweep's results grouped by the overrides that vary.

Each cell is ``mean ± std (n)`` over the completed runs, beside the published value, the
difference and, where the paper printed a spread and its run count, a verdict: a two-sided
Welch test at level :data:`LEVEL` (:func:`verdict`; a tuned cell's adjusted for its
selection, or chosen on held-apart seeds with ``tune_seeds``), optionally an equivalence
test, all read together in closing lines (:func:`legend_of`). Runs that diverged or failed,
and runs the sweep should have made but did not, are counted in the cell (``8 of 10; 2
diverged``) and in the closing lines, never dropped silently. A preset's table counts only
the runs whose fingerprint is one of its cells' (:attr:`Preset.expected`); the others in its
folder are reported as not in the table. Runs at a toy scale or on other data get no verdict.
"""

from __future__ import annotations

import base64
import functools
import html
import io
import itertools
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, NamedTuple, Sequence

import pandas as pd

from bnexp.reference import published
from bnexp.report.layouts import METRIC_LABELS, METRICS, Layout, same
from bnexp.report.presets import SEED, Preset, parse_command, read_preset, sweep_folder
from bnexp.report.results import load_summaries, seconds_per_epoch
from bnexp.report.selection import choose, combos, completed, preset_runs, select, tuned_key, unlike_paper, varying
from bnexp.report.verdicts import benjamini_hochberg, holm, selection_adjusted, tost, welch, welch_p
from bnexp.support.errors import ConfigError, unknown_choice
from bnexp.support.options import OUT_ELSEWHERE, exit_on_error, output_errors
from bnexp.support.runinfo import atomic_write

FORMATS = ("markdown", "latex", "csv", "html")
# Characters of bnexp's tables that pdflatex does not take as they are, and what it takes.
LATEX_TEXT = {"±": r"$\pm$", "Δ": r"$\Delta$", "–": "--", "×": r"$\times$", "ρ": r"$\rho$", "η": r"$\eta$",
              "κ": r"$\kappa$", "τ": r"$\tau$", "≤": r"$\leq$", "≥": r"$\geq$", "≡": r"$\equiv$",
              "≢": r"$\not\equiv$"}
LATEX_SPECIAL = {"\\": r"\textbackslash{}", "&": r"\&", "%": r"\%", "$": r"\$", "#": r"\#", "_": r"\_", "{": r"\{",
                 "}": r"\}", "~": r"\textasciitilde{}", "^": r"\textasciicircum{}"}
LEVEL = 0.05  # level of the two-sided Welch test of a cell against its published mean ± std
DEFAULT_MARGIN = 1.0  # equivalence=on: within one point (of top-1 %) of the published mean
# Characters of cell texts that would change a markdown table: raw HTML, a column break, a backslash
# escape, a line break; written as markdown shows them as text.
MARKDOWN_SPECIAL = {"\\": "\\\\", "|": "\\|", "<": "\\<", "\n": " ", "\r": " "}
LEGEND = ("cell: mean ± std (completed runs; where some are not, 'n of N' and the diverged, failed and missing runs); "
          "paper: the published value; Δ: ours minus paper")
TEST_LEGEND = (f"test: two-sided Welch t-test of our runs against the published mean ± std and run count at level "
               f"{LEVEL:g}, agree (p ≥ {LEVEL:g}) or differ, with its p-value; missing: fewer than 2 completed runs")
VERDICTS = ("agree", "differ", "missing")


@dataclass(frozen=True)
class Tests:
    """How a preset's cells are tested: ``margin`` (points) for the equivalence test (None:
    none), ``tune_seeds`` (a tuned cell's setting is chosen on the seeds below it and tested on
    the others; None: chosen on the tested runs, as the papers did), ``unlike_paper`` (why the
    runs cannot be compared with the paper's, :func:`~bnexp.report.selection.unlike_paper`:
    then no verdicts at all)."""

    margin: float | None = None
    tune_seeds: int | None = None
    unlike_paper: str = ""

    @property
    def comparable(self) -> bool:
        return not self.unlike_paper


@dataclass
class Cell:
    """The statistics of one table cell."""

    mean: float = math.nan
    std: float = math.nan
    n: int = 0
    diverged: int = 0
    failed: int = 0
    missing: int = 0
    choice: Any = None  # the tuned value reported (best rho, largest stable lr)
    candidates: int = 1  # > 1: the choice was made among this many values on the runs reported

    def text(self, tune_name: str) -> str:
        value = "–" if self.n == 0 else f"{self.mean:.2f}" if self.n == 1 else f"{self.mean:.2f} ± {self.std:.2f}"
        notes = [f"{count} {what}" for what, count in
                 (("diverged", self.diverged), ("failed", self.failed), ("missing", self.missing)) if count]
        counts = f"({self.n} of {self.total}; {', '.join(notes)})" if notes else f"({self.n})"
        tuned = f" {tune_name}={self.choice:g}" if self.choice is not None else ""
        return f"{value} {counts}{tuned}"

    @property
    def total(self) -> int:
        """The runs the cell should have: completed, diverged, failed and missing."""
        return self.n + self.diverged + self.failed + self.missing


def stats(runs: pd.DataFrame, metric: str, expected: int, choice: Any = None) -> Cell:
    """Mean and sample std of ``metric`` over completed runs that recorded a finite value; the
    other runs counted (a completed run without a finite value counts as failed)."""
    status = runs["status"] if "status" in runs else pd.Series(dtype=str)
    done = runs.loc[status == "completed", metric].astype(float) if metric in runs else pd.Series(dtype=float)
    done = done[done.map(math.isfinite)]
    n, diverged = len(done), int((status == "diverged").sum())
    std = float(done.std(ddof=1)) if n > 1 else math.nan
    mean = float(done.mean()) if n else math.nan
    # anything neither completed with a value nor diverged counts as failed
    return Cell(mean, std, n, diverged, len(runs) - n - diverged, max(0, expected - len(runs)), choice)


def expected_runs(layout: Layout, keys: Mapping[str, Any], default_seed: int, tests: Tests = Tests()) -> int:
    """How many runs a cell should have: its sweep's seeds (0 for a cell no sweep makes); a
    cell tuned on held-apart seeds, the seeds it is tested on."""
    sweep = layout.sweep_of(keys)
    seeds = [] if sweep is None else [int(s) for s in sweep.get(SEED, [default_seed])]
    return len([s for s in seeds if not held_apart(layout, keys, tests) or s >= tests.tune_seeds])


def held_apart(layout: Layout, keys: Mapping[str, Any], tests: Tests) -> bool:
    """Whether this cell's tuned value is chosen on seeds other than those it is tested on."""
    return tests.tune_seeds is not None and layout.is_tuned(keys) and layout.select == "best"


def cell(frame: pd.DataFrame, layout: Layout, keys: Mapping[str, Any], metric: str, expected: int,
         tests: Tests = Tests()) -> Cell:
    """One cell; a tuned cell reports the winning value's runs: with ``tests.tune_seeds``, the
    value with the best mean on the seeds below it and its runs on the others; without, the
    value with the best mean and the same runs (counting the values it was chosen among)."""
    runs = select(frame, keys)
    if not layout.is_tuned(keys):
        return stats(runs, metric, expected)
    if held_apart(layout, keys, tests):
        seeds = runs[SEED].astype(int) if SEED in runs else pd.Series(dtype=int)
        choice = choose(layout, runs[seeds < tests.tune_seeds], metric)
        tested = runs[seeds >= tests.tune_seeds]
        return stats(select(tested, {layout.tune: choice}) if choice is not None else tested.iloc[0:0], metric,
                     expected, choice)
    choice = choose(layout, runs, metric)
    if choice is None:
        return stats(runs.iloc[0:0], metric, expected)
    found = stats(select(runs, {layout.tune: choice}), metric, expected, choice)
    if layout.select == "best":
        found.candidates = int(completed(runs, metric)[layout.tune].nunique())
    return found


class Published(NamedTuple):
    """A published cell: its mean, std and the paper's runs per cell (NaN where not printed)."""

    mean: float
    std: float
    runs: float


def paper_value(layout: Layout, keys: Mapping[str, Any], metric: str) -> Published | None:
    """(mean, std, runs) published for this cell, if the paper printed one."""
    if layout.paper is None:
        return None
    ref = published_cells(layout.paper, layout.table, metric)
    for axis in (*layout.rows, *layout.columns):
        if axis.published:
            ref = [row for row in ref if same(row[axis.published], keys[axis.key])]
    return Published(*(float(ref[0][col]) for col in Published._fields)) if ref else None


@functools.lru_cache(maxsize=None)
def published_cells(paper: str, table: str, metric: str) -> tuple[dict[str, Any], ...]:
    """The published rows of one paper's table and metric, in the file's order."""
    ref = published()
    return tuple(ref[(ref["paper"] == paper) & (ref["table"] == table) & (ref["metric"] == metric)].to_dict("records"))


def fmt_paper(value: Published | None) -> str:
    """A published value: ``mean ± std``, or the mean alone where no std was printed."""
    if value is None:
        return ""
    return f"{value.mean:.2f}" if math.isnan(value.std) else f"{value.mean:.2f} ± {value.std:.2f}"


@dataclass(frozen=True)
class Verdict:
    """A cell's test against its published value: ``p`` (Welch's, selection-adjusted for a
    cell chosen on its own runs), the equivalence test's p-value (None without a margin)."""

    p: float = math.nan  # NaN: missing (fewer than 2 completed runs)
    candidates: int = 1
    equivalence_p: float | None = None

    @property
    def kind(self) -> str:
        return "missing" if math.isnan(self.p) else "agree" if self.p >= LEVEL else "differ"

    def text(self, margin: float | None) -> str:
        """``agree p=0.31``, ``differ p=0.002``, ``missing``; a selected cell adds how, an
        equivalence test its outcome (``≡±1 p=0.01``: within the margin; ``≢±1``: not shown to be)."""
        if self.kind == "missing":
            return "missing"
        selected = f" (selected on these runs among {self.candidates}: p × {self.candidates})" \
            if self.candidates > 1 else ""
        within = "" if self.equivalence_p is None else \
            f"; {'≡' if self.equivalence_p < LEVEL else '≢'}±{margin:g} p={self.equivalence_p:.2g}"
        return f"{self.kind} p={self.p:.2g}{selected}{within}"


def verdict(ours: Cell, paper: Published | None, margin: float | None = None) -> Verdict | None:
    """The Welch test at :data:`LEVEL` of a cell against the published mean, std and run
    count (missing with fewer than 2 completed runs), and with ``margin`` the equivalence test
    (:mod:`bnexp.report.verdicts`); None where the paper printed no std or fewer than 2 runs."""
    if paper is None or math.isnan(paper.std) or not paper.runs >= 2:
        return None
    if ours.n < 2:
        return Verdict()
    w = welch(ours.mean, ours.std, ours.n, paper.mean, paper.std, int(paper.runs))
    adjust = functools.partial(selection_adjusted, candidates=ours.candidates)
    return Verdict(adjust(welch_p(w)), ours.candidates, None if margin is None else adjust(tost(w, margin)))


def test_columns(table: pd.DataFrame) -> list[str]:
    """The table's ``test`` columns (the verdicts)."""
    return [c for c in table.columns if str(c).endswith(" test")]


def legend_of(table: pd.DataFrame) -> str:
    """The legend, and the closing lines: with verdicts, how many cells agree with, differ
    from and miss their published value read as many tests (:func:`test_lines`); the runs of
    the cells that did not complete (:func:`runs_line`)."""
    tests: Tests = table.attrs.get("tests", Tests())
    verdicts: list[Verdict] = table.attrs.get("verdicts", [])
    legend, lines = LEGEND, []
    if tests.tune_seeds is not None:
        legend += (f"; a tuned cell: the value with the best mean on seeds below {tests.tune_seeds} (selection), "
                   f"reported on the other seeds (test)")
    if verdicts:
        legend += f"; {TEST_LEGEND}"
        if any(v.candidates > 1 for v in verdicts):
            legend += ("; a tuned cell chosen on the runs it is tested on (selected on these runs): its p-values "
                       "multiplied by the number of values it was chosen among (Bonferroni)")
        if tests.margin is not None:
            legend += f"; ≡±M: within ±M points of the paper by two one-sided Welch tests at level {LEVEL:g}"
        lines = test_lines(verdicts, tests.margin)
    elif not tests.comparable:
        lines = [f"No verdicts: {tests.unlike_paper}"]
    cells: list[Cell] = table.attrs.get("cells", [])
    return "\n\n".join([legend, "\n".join([*lines, *([runs_line(cells)] if cells else [])])]).rstrip()


def test_lines(verdicts: Sequence[Verdict], margin: float | None) -> list[str]:
    """The verdicts read as many: their counts, the "differ" verdicts chance alone gives, the
    counts after Holm's and Benjamini-Hochberg's adjustments, the equivalence test's count."""
    counts = ", ".join(f"{sum(v.kind == k for v in verdicts)} {k}" for k in VERDICTS)
    tested = [v for v in verdicts if v.kind != "missing"]
    lines = [f"Welch test at level {LEVEL:g} over the cells with a published mean ± std: {counts}"]
    if not tested:
        return lines
    p = [v.p for v in tested]
    lines.append(f"Of {len(p)} tests, {LEVEL * len(p):.2g} would say differ by chance alone if every cell reproduced; "
                 f"adjusted for {len(p)} tests, {sum(q < LEVEL for q in holm(p))} differ by Holm's method (family-wise "
                 f"error {LEVEL:g}) and {sum(q < LEVEL for q in benjamini_hochberg(p))} by Benjamini-Hochberg's "
                 f"(false discovery rate {LEVEL:g})")
    if margin is not None:
        within = sum(v.equivalence_p is not None and v.equivalence_p < LEVEL for v in tested)
        lines.append(f"Equivalence within ±{margin:g} points (two one-sided Welch tests at level {LEVEL:g}): "
                     f"{within} of {len(p)} tested cells shown equivalent")
    return lines


def runs_line(cells: Sequence[Cell]) -> str:
    """How many of the runs the table's cells should have completed, and what became of the others."""
    count = {what: sum(getattr(c, what) for c in cells) for what in ("n", "diverged", "failed", "missing")}
    return (f"Runs: {count['n']} of {sum(count.values())} completed, {count['diverged']} diverged, "
            f"{count['failed']} failed, {count['missing']} missing")


def fmt_diff(a: float, b: float) -> str:
    """``a - b`` with its sign, or nothing when either is unknown."""
    return "" if math.isnan(a) or math.isnan(b) else f"{a - b:+.2f}"


def with_metrics(frame: pd.DataFrame, layout: Layout) -> pd.DataFrame:
    """Add the derived metric columns a layout needs (seconds per epoch)."""
    if "seconds_per_epoch" in layout.metrics and "run_dir" in frame:
        steps = frame.get("steps_per_epoch", pd.Series(math.nan, index=frame.index))
        frame = frame.assign(seconds_per_epoch=[seconds_per_epoch(run, n) for run, n in zip(frame["run_dir"], steps)])
    return frame


# What a cell reads of a run besides its layout's keys and metrics; the stability rule of a
# tuned cell (bnexp.report.stability) reads the run's folder, class count, top-1 and any
# recorded collapse.
CELL_FIELDS = ("status", SEED)
STABILITY_FIELDS = ("run_dir", "num_classes", "final_top1", "collapsed")


def cell_columns(frame: pd.DataFrame, layout: Layout) -> pd.DataFrame:
    """``frame`` with only the columns a table's cells read (:data:`CELL_FIELDS`, the layout's
    keys and metrics, the :data:`STABILITY_FIELDS` where it chooses the largest stable value):
    selecting the runs of each cell then copies a few columns, not all."""
    used = {*CELL_FIELDS, *(a.key for a in (*layout.rows, *layout.columns)), layout.tune,
            *(METRICS[m] for m in layout.metrics), *(STABILITY_FIELDS if layout.select == "max_stable" else ())}
    return frame[[c for c in frame.columns if c in used]]


def build(layout: Layout, frame: pd.DataFrame, default_seed: int = 0, tests: Tests = Tests()) -> pd.DataFrame:
    """The table as text: row label columns, flag columns, then per column ours/paper/Δ/test.

    A cell that no sweep of the preset makes shows ``n/a``; rows and columns of such cells
    only are left out. The cells, their verdicts and ``tests`` ride along in ``table.attrs``
    for the closing lines (:func:`legend_of`); runs not ``tests.comparable`` get no verdicts.
    """
    frame = cell_columns(with_metrics(frame, layout), layout)
    rows, cols = combos(layout.rows), combos(layout.columns)

    def made(keys: Mapping[str, Any]) -> bool:
        return layout.sweep_of(keys) is not None

    cols = [c for c in cols if any(made({**r, **c}) for r in rows)]
    rows = [r for r in rows if any(made({**r, **c}) for c in cols)]
    lines: list[dict[str, str]] = []
    cells: list[Cell] = []
    verdicts: list[Verdict] = []
    baseline: dict[str, tuple[float, float]] = {}
    for row in rows:
        # each cell's runs are among its row's (by the row's keys that no column sets again)
        row_runs = select(frame, {k: v for k, v in row.items() if all(k != a.key for a in layout.columns)})
        line = {a.name: a.label(row[a.key]) for a in layout.rows}
        line |= {flag: "x" if any(same(v, row[layout.rows[0].key]) for v in marked) else ""
                 for flag, marked in layout.flags.items()}
        improv = {name: "" for name in line} | {layout.rows[0].name: "Improv."}
        means: dict[str, tuple[float, float]] = {}
        for col, metric in itertools.product(cols, layout.metrics):
            name, keys = column_name(layout, col, metric), {**row, **col}
            paper = paper_value(layout, keys, metric)
            ours = Cell()
            if made(keys):
                ours = cell(row_runs, layout, keys, METRICS[metric], expected_runs(layout, keys, default_seed, tests),
                            tests)
                cells.append(ours)
            line[name] = ours.text(layout.tune_name) if made(keys) else "n/a"
            means[name] = (ours.mean, paper[0] if paper else math.nan)
            improv[name] = fmt_diff(ours.mean, baseline[name][0]) if baseline else ""
            if layout.paper:
                tested = verdict(ours, paper, tests.margin) if made(keys) and tests.comparable else None
                verdicts += [tested] if tested else []
                line |= {f"{name} paper": fmt_paper(paper), f"{name} Δ": fmt_diff(*means[name]),
                         f"{name} test": tested.text(tests.margin) if tested else ""}
                improv |= {f"{name} paper": fmt_diff(paper[0] if paper else math.nan, baseline[name][1]) if baseline else "",
                           f"{name} Δ": "", f"{name} test": ""}
        lines.append(line)
        if layout.improv and baseline:
            lines.append(improv)
        baseline = baseline or means
    table = pd.DataFrame(lines)
    table = table.drop(columns=[c for c in test_columns(table) if not table[c].any()])  # no published spread
    table.attrs.update(cells=cells, verdicts=verdicts, tests=tests)
    return table


def column_name(layout: Layout, col: Mapping[str, Any], metric: str) -> str:
    """A column's header: its values' labels (single-valued axes left out), then the metric."""
    name = " ".join(a.label(col[a.key]) for a in layout.columns if len(a.values) > 1 or len(layout.columns) == 1)
    return f"{name} {METRIC_LABELS[metric]}".strip() if len(layout.metrics) > 1 else name


def render(table: pd.DataFrame, fmt: str, title: str, figure: bytes | None = None, legend: str = LEGEND) -> str:
    """Markdown (pandas + tabulate), LaTeX (pandas Styler, booktabs), CSV, or a
    self-contained HTML page (with ``figure``, a PNG, embedded)."""
    table = table.copy(deep=False)
    table.attrs = {}  # what build keeps there is read by legend_of; pandas would copy it at every step
    if fmt == "markdown":
        text = table.map(markdown_text).rename(columns=markdown_text).to_markdown(index=False, disable_numparse=True)
        return f"{markdown_text(title)}\n\n{text}\n\n{legend}\n"
    if fmt == "latex":
        return latex(table, f"{title}. {' '.join(legend.split())}.")
    if fmt == "csv":
        return table.to_csv(index=False)
    if fmt == "html":
        return html_page(table, title, figure, legend)
    raise unknown_choice("format", fmt, FORMATS)


def grouped(table: pd.DataFrame) -> pd.DataFrame:
    """The table with two header rows, as the papers print it: each measured column with its
    ``paper``, ``Δ`` and ``test`` columns under one heading (``ours``, ``paper``, ``Δ``,
    ``test``); the label columns' names on the lower row."""
    names = list(table.columns)
    measured = {n.removesuffix(" paper") for n in names if n.endswith(" paper")}
    if not measured:  # a sweep's table: one header row
        return table
    header = []
    for n in names:
        if n in measured:
            header.append((n, "ours"))
        elif n.endswith(" paper") and n.removesuffix(" paper") in measured:
            header.append((n.removesuffix(" paper"), "paper"))
        elif n.endswith(" Δ") and n.removesuffix(" Δ") in measured:
            header.append((n.removesuffix(" Δ"), "Δ"))
        elif n.endswith(" test") and n.removesuffix(" test") in measured:
            header.append((n.removesuffix(" test"), "test"))
        else:
            header.append(("", n))
    out = table.copy()
    out.columns = pd.MultiIndex.from_tuples(header)
    return out


def markdown_text(text: Any) -> str:
    """``text`` as markdown shows it (values in run folders may hold HTML or a ``|``)."""
    return "".join(MARKDOWN_SPECIAL.get(c, c) for c in str(text))


def latex_text(text: str) -> str:
    """``text`` escaped for LaTeX, its non-ASCII symbols written as pdflatex takes them."""
    escaped = "".join(LATEX_SPECIAL.get(c, c) for c in str(text))
    return "".join(LATEX_TEXT.get(c, c) for c in escaped)


def latex(table: pd.DataFrame, caption: str) -> str:
    """A booktabs ``table`` environment (``\\usepackage{booktabs}``) that pdflatex compiles:
    grouped headers (:func:`grouped`), label columns left-aligned, the rest centred."""
    frame = grouped(table)
    if isinstance(frame.columns, pd.MultiIndex):
        labels = sum(1 for top, _ in frame.columns if top == "")
        frame.columns = pd.MultiIndex.from_tuples([(latex_text(a), latex_text(b)) for a, b in frame.columns])
    else:
        labels = 1
        frame.columns = [latex_text(c) for c in frame.columns]
    frame = frame.map(latex_text)
    styler = frame.style.hide(axis="index")
    text = styler.to_latex(caption=latex_text(caption), hrules=True, multicol_align="c", position_float="centering",
                           column_format="l" * labels + "c" * (len(frame.columns) - labels))
    if not isinstance(frame.columns, pd.MultiIndex):
        return text
    spans, start = [], 0  # a \cmidrule under each heading, as booktabs draws a grouped header
    for top, group in itertools.groupby(frame.columns.get_level_values(0)):
        width = len(list(group))
        if top:
            spans.append(f"\\cmidrule(lr){{{start + 1}-{start + width}}}")
        start += width
    lines = text.splitlines()
    first = next(i for i, line in enumerate(lines) if "\\multicolumn" in line)
    return "\n".join([*lines[:first + 1], " ".join(spans), *lines[first + 1:]]) + "\n"


def html_page(table: pd.DataFrame, title: str, figure: bytes | None, legend: str) -> str:
    """One HTML file holding the table (grouped headers), its legend and ``figure``; every
    text in it escaped (cells and headers hold values from run folders, which anyone may
    have written)."""
    body = grouped(table).style.hide(axis="index").format(escape="html").format_index(escape="html", axis=1).to_html()
    image = "" if figure is None else f'<p><img alt="training curves" src="data:image/png;base64,' \
        f'{base64.b64encode(figure).decode()}"></p>'
    style = ("body{font-family:sans-serif;margin:2em} table{border-collapse:collapse} "
             "th,td{border-bottom:1px solid #ccc;padding:.25em .6em;text-align:center} img{max-width:100%}")
    return (f"<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\"><title>{html.escape(title)}</title>"
            f"<style>{style}</style></head>\n<body><h1>{html.escape(title)}</h1>\n{body}\n"
            f"<p>{html.escape(legend)}</p>\n{image}\n</body></html>\n")


def plotting() -> Any:
    """:mod:`bnexp.report.plot`, or a ConfigError naming the extra that brings matplotlib."""
    try:
        from bnexp.report import plot
    except ImportError as err:
        raise ConfigError(f"format=html embeds the training curves, which need matplotlib ({err}): "
                          "pip install 'bnexp[plot]'") from err
    return plot


def figure_png(draw: Callable[[Any], Any]) -> bytes:
    """The PNG of the figure ``draw(plot)`` makes with :mod:`bnexp.report.plot` (``bnexp
    plot``'s, for an HTML page); a ConfigError naming the extra when matplotlib is missing."""
    plot = plotting()
    import matplotlib.pyplot as plt

    fig = draw(plot)
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=110)
    plt.close(fig)
    return buffer.getvalue()


def table_text(p: Preset, results: Path, fmt: str = "markdown", margin: float | None = None,
               tune_seeds: int | None = None) -> str:
    """The rendered table of preset ``p`` from the summaries under ``results`` (for HTML,
    with the curves of ``bnexp plot`` embedded); ``margin`` and ``tune_seeds`` as :class:`Tests`.
    A title says when the runs are not comparable with the paper's, and then no cell is tested."""
    if not results.is_dir():
        raise ConfigError(f"{results}: no such folder, so no runs of {p.name} to tabulate; run them with "
                          f"`bnexp reproduce {p.name}{'' if p.scale == 'full' else ' scale=' + p.scale}` "
                          "or point results=DIR at their folder")
    if tune_seeds is not None:
        tuned_key(p)
    runs = preset_runs(p, load_summaries(results), results)
    tests = Tests(margin, tune_seeds, unlike_paper(p, runs))
    table = build(p.layout, runs, int(p.cfg.trainer.seed), tests)
    figure = None
    if fmt == "html" and not runs.empty:
        figure = figure_png(lambda plot: plot.draw(p.layout, runs, ("train_loss", "test_acc"), ()))
    return render(table, fmt, titled(p.layout.title, results, tests.unlike_paper), figure, legend_of(table))


def titled(title: str, results: Path, unlike: str = "") -> str:
    """A table's or figure's title: the paper's, the results folder, and in brackets why the
    runs are not comparable with the paper's when they are not."""
    return f"{title} ({results})" + (f" [{unlike}]" if unlike else "")


# ---- any sweep's folder ----------------------------------------------------------------
SWEEP_OPTIONS = {"rows": "", "cols": "", "metric": "top1", "format": "markdown", "out": ""}
UNSET = "(not set)"  # a row or column key of a run that its overrides do not give


def column_of(frame: pd.DataFrame, key: str, valid: Sequence[str]) -> str:
    """The frame column holding ``key``: its override, else the config key itself."""
    for column in (f"overrides.{key}", key):
        if column in frame:
            return column
    raise ConfigError(f"unknown key {key!r} for rows/cols: the overrides that vary here are "
                      f"{', '.join(valid) or 'none'}; any config key (act.name, optim.lr) works too")


def ordered(values: pd.Series) -> list[Any]:
    """A column's distinct values, numbers in numeric order, text in alphabetical order."""
    distinct = list(dict.fromkeys(values.dropna().tolist()))
    try:
        return sorted(distinct, key=float)
    except (TypeError, ValueError):
        return sorted(distinct, key=str)


def keyed(frame: pd.DataFrame, columns: Sequence[str]) -> list[tuple[str, ...]]:
    """Each run's values of ``columns``, as text (:data:`UNSET` where it has none)."""
    def text(value: Any) -> str:
        return UNSET if value is None or (isinstance(value, float) and math.isnan(value)) else str(value)

    return [tuple(map(text, values)) for values in zip(*(frame[c] for c in columns))] if columns else [()] * len(frame)


def combinations(keys: Sequence[tuple[str, ...]]) -> list[tuple[str, ...]]:
    """The distinct ``keys`` (:func:`keyed`), ordered key by key as :func:`ordered` orders
    values, :data:`UNSET` last: only the combinations that runs have, never more than runs."""
    found = set(keys)
    ranks = [{v: i for i, v in enumerate(ordered(pd.Series([v for v in values if v != UNSET], dtype=object)))}
             for values in zip(*found)]
    return sorted(found, key=lambda combo: tuple(rank.get(v, len(rank)) for rank, v in zip(ranks, combo)))


def sweep_table(frame: pd.DataFrame, rows: Sequence[str], cols: Sequence[str], metric: str,
                label: str = "") -> pd.DataFrame:
    """Cells ``mean ± std (n; diverged, failed)`` of ``metric`` (headed ``label``) for every
    combination of the ``rows`` keys (one line each) and the ``cols`` keys (one column each)
    that some run has: each run in exactly one cell, the table no larger than the runs make it."""
    valid = varying(frame)
    row_of = keyed(frame, [column_of(frame, k, valid) for k in rows])
    col_of = keyed(frame, [column_of(frame, k, valid) for k in cols])
    cells: dict[tuple[tuple[str, ...], tuple[str, ...]], list[int]] = {}
    for i, key in enumerate(zip(row_of, col_of)):
        cells.setdefault(key, []).append(i)
    columns = combinations(col_of)
    lines = []
    for row in combinations(row_of):
        line = dict(zip(rows, row)) or {"runs": "all"}
        for col in columns:
            name = " ".join(f"{k}={v}" for k, v in zip(cols, col)) or label or metric
            line[name] = stats(frame.iloc[cells.get((row, col), [])], metric, 0).text("")
        lines.append(line)
    return pd.DataFrame(lines)


def sweep_text(folder: Path, options: Mapping[str, str]) -> str:
    """``bnexp table DIR``: the sweep's runs by ``rows`` and ``cols`` (default: every varying
    override as a row key)."""
    frame = load_summaries(folder)
    if frame.empty:
        raise ConfigError(f"no summary.json under {folder}: nothing to tabulate")
    cols = [k for k in options["cols"].split(",") if k]
    rows = [k for k in options["rows"].split(",") if k] or [k for k in varying(frame) if k not in cols]
    metric = METRICS.get(options["metric"], options["metric"])
    if metric not in frame or not pd.api.types.is_numeric_dtype(frame[metric]):
        numeric = [c for c in frame.columns if c.startswith(("final_", "best_"))]
        raise ConfigError(f"metric={options['metric']!r}: no run recorded it as a number; valid: {', '.join(METRICS)}, "
                          f"{', '.join(numeric)}")
    table = sweep_table(frame, rows, cols, metric, METRIC_LABELS.get(options["metric"], options["metric"]))
    figure = None
    if options["format"] == "html":
        figure = figure_png(lambda plot: plot.draw_sweep(frame, ("train_loss", "test_acc"), str(folder)))
    return render(table, options["format"], f"{folder}: {options['metric']}", figure, SWEEP_LEGEND)


SWEEP_LEGEND = "cell: mean ± std (completed runs; where some are not, 'n of N' and the diverged and failed runs)"


def command(args: list[str]) -> None:
    """``bnexp table <paper>/<name> [results=DIR] [format=...] [scale=quick]`` or
    ``bnexp table DIR [rows=KEY,...] [cols=KEY,...] [metric=top1] [format=...]``; ``format=html``
    writes a page (``out=FILE``, default ``<results>/table.html``) and prints its path."""
    exit_on_error(lambda: print(text_for(args), end=""))


def text_for(args: list[str]) -> str:
    """The table the command line asks for (an HTML page: the path it was written to)."""
    folder = sweep_folder(args, SWEEP_OPTIONS)
    if folder:
        text, results, options = sweep_text(*folder), folder[0], folder[1]
    else:
        usage = ("bnexp table <paper>/<name> [results=DIR] [format=markdown|latex|csv|html] [out=FILE] "
                 "[scale=full|quick] [equivalence=off|on|POINTS] [tune_seeds=N], or bnexp table DIR [rows=KEY,...] "
                 "[cols=KEY,...] [metric=top1] [format=...]")
        defaults = {"results": "", "format": "markdown", "scale": "full", "out": "", "equivalence": "off",
                    "tune_seeds": ""}
        name, options, overrides = parse_command(args, usage, defaults)
        p = read_preset(name, options["scale"], overrides)
        results = Path(options["results"] or p.results_dir)
        text = table_text(p, results, options["format"], equivalence_margin(options["equivalence"]),
                          seed_count(options["tune_seeds"], "tune_seeds"))
    if options["format"] != "html":
        return text
    page = Path(options["out"] or results / "table.html")
    with output_errors(f"cannot write {page}", OUT_ELSEWHERE):
        page.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(page, lambda f: f.write(text.encode("utf-8")))
    return f"{page}\n"


def equivalence_margin(text: str) -> float | None:
    """``equivalence=``: ``off`` (no equivalence test), ``on`` (:data:`DEFAULT_MARGIN` points)
    or a margin in points > 0; a ConfigError naming the value otherwise."""
    if text.lower() in ("off", "false", "no", ""):
        return None
    if text.lower() in ("on", "true", "yes"):
        return DEFAULT_MARGIN
    try:
        margin = float(text)
    except ValueError:
        margin = math.nan
    if not (math.isfinite(margin) and margin > 0):
        raise ConfigError(f"equivalence={text!r} is not valid: use off, on (±{DEFAULT_MARGIN:g} points) or a margin "
                          "in points > 0")
    return margin


def seed_count(text: str, name: str) -> int | None:
    """A count of seeds ``N >= 1`` given as ``name=N`` (None when empty); a ConfigError otherwise."""
    if not text:
        return None
    if not text.isdigit() or int(text) < 1:
        raise ConfigError(f"{name}={text!r} is not valid: a whole number of seeds >= 1")
    return int(text)
