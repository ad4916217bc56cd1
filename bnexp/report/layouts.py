"""How a preset's results are laid out: its ``report`` block as a :class:`Layout`.

A preset's ``hydra.sweeper.report`` names the config keys (flattened, as in summary.json's
``config``) that make the rows and the columns of its table, their values in the paper's
order, the tuned parameter, and how a cell is matched to ``published_results.csv``.
``bnexp table`` and ``bnexp plot`` share it. Which cells the paper ran follows from the
preset's sweeps: a cell no sweep makes is "n/a".
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Sequence

from bnexp.support.errors import ConfigError

# How values are printed in headers and row names, unless an axis labels them itself.
LABELS = {
    "sigmoid": "Sigmoid", "tanh": "Tanh", "relu": "ReLU", "selu": "SELU", "swish": "Swish",
    "cifar10": "CIFAR-10", "cifar100": "CIFAR-100", "mnist": "MNIST", "imagenet": "ImageNet",
    "resnet20": "ResNet-20", "vgg16": "VGG-16", "resnet18": "ResNet-18", "resnet50": "ResNet-50",
    "efficientnet_b0": "EfficientNet-B0", "bn": "BN", "cbn": "CBN", "popnorm": "POP-Norm",
    "bnp": "BNP", "brn": "BN renorm", "ln": "LN", "gn": "GN", "bnp_gn": "BNP+GN",
    "bn_4things": "BN w/ 4 things",
    "mean_removal": "mean removal", "l2_division": "l2 division", "mean_only": "mean removal only",
    "division_only": "division only", "amat": "AMAT", "fixed_eta": "fixed eta 0.9", "no_amat": "no AMAT",
    "resnet110": "ResNet-110", "preact_resnet110": "pre-act ResNet-110", "mlp2x100": "2x100 MLP",
}
METRICS = {"top1": "final_top1", "top5": "final_top5", "seconds_per_epoch": "seconds_per_epoch"}
METRIC_LABELS = {"top1": "top-1", "top5": "top-5", "seconds_per_epoch": "s/epoch"}
SELECTIONS = ("best", "max_stable")  # a tuned cell reports the best mean, or the largest stable value
# Keys of a report block's ``figure`` (bnexp.report.plot.FigureSpec): the paper's figure of the preset.
FIGURE_KEYS = ("series", "overlay", "x", "log", "rows", "title", "kind", "layers")


def same(a: Any, b: Any) -> bool:
    """Equal as numbers when both are numbers, else as text."""
    try:
        return float(a) == float(b)
    except (TypeError, ValueError):
        return str(a) == str(b)


@dataclass(frozen=True)
class Axis:
    """One table dimension: a config key, its values in order, their labels, and where its
    values come from in the sweeps (``sweep``: the override key, ``options``: the override
    values paired with ``values`` when they differ, e.g. ``cbn_row=r2`` makes ``tags.row=2``)."""

    key: str
    values: tuple[Any, ...]
    name: str = ""
    published: Optional[str] = None  # the published_results.csv column it matches
    labels: Mapping[Any, str] = field(default_factory=dict)
    sweep: str = ""
    options: tuple[str, ...] = ()

    def label(self, value: Any) -> str:
        """How ``value`` is printed in headers and row names."""
        for known, text in self.labels.items():
            if same(known, value):
                return text
        return LABELS.get(value, str(value))

    def option(self, value: Any) -> Any:
        """The override value that makes ``value`` of this axis."""
        for v, option in zip(self.values, self.options):
            if same(v, value):
                return option
        return value


def axis_from(spec: Mapping[str, Any]) -> Axis:
    """An :class:`Axis` from one entry of a report block's ``rows`` or ``columns``."""
    key = spec["key"]
    return Axis(key, tuple(spec["values"]), spec.get("name", ""), spec.get("published"), spec.get("labels") or {},
                spec.get("sweep") or (key.removesuffix(".name") if key.endswith(".name") else key),
                tuple(spec.get("options") or ()))


@dataclass(frozen=True)
class Layout:
    """A table: rows x columns of cells, each cell the runs sharing those config values."""

    title: str
    rows: tuple[Axis, ...]
    columns: tuple[Axis, ...]
    paper: Optional[str] = None  # published_results.csv ``paper`` and ``table``
    table: Optional[str] = None
    metrics: tuple[str, ...] = ("top1",)
    tune: Optional[str] = None  # a config key chosen per cell
    tune_name: str = "rho"
    tuned_rows: frozenset[Any] = frozenset()  # row values whose cells are tuned (all if empty)
    select: str = "best"  # best | max_stable (the largest value whose runs do not collapse)
    improv: bool = False  # an "Improv." line under every row after the first
    flags: Mapping[str, frozenset[Any]] = field(default_factory=dict)  # extra row columns: rows marked x
    sweeps: tuple[Mapping[str, Sequence[str]], ...] = ()  # each sweep's values per override key
    fixed: Mapping[str, Any] = field(default_factory=dict)  # axis key -> its value where no sweep sets it
    figure: Mapping[str, Any] = field(default_factory=dict)  # how bnexp plot draws it (FIGURE_KEYS)

    @property
    def axes(self) -> tuple[Axis, ...]:
        return (*self.rows, *self.columns)

    def is_tuned(self, cell: Mapping[str, Any]) -> bool:
        """True when the cell reports a tuned value (e.g. the best rho)."""
        if self.tune is None:
            return False
        return not self.tuned_rows or any(same(v, cell[self.rows[0].key]) for v in self.tuned_rows)

    def sweep_of(self, cell: Mapping[str, Any]) -> Optional[Mapping[str, Sequence[str]]]:
        """The first sweep that makes this cell's runs, or None (a cell the paper never ran)."""
        for sweep in self.sweeps:
            if all(any(same(a.option(cell[a.key]), v) for v in sweep[a.sweep]) if a.sweep in sweep
                   else same(self.fixed.get(a.key), cell[a.key]) for a in self.axes):
                return sweep
        return None


def layout_from(report: Mapping[str, Any], sweeps: Sequence[Mapping[str, Sequence[str]]] = (),
                fixed: Optional[Mapping[str, Any]] = None) -> Layout:
    """A :class:`Layout` from a preset's report block and its sweeps."""
    tune = report.get("tune") or {}
    select = tune.get("select", "best")
    if select not in SELECTIONS:
        raise ConfigError(f"report.tune.select={select!r} is not valid; valid choices: {', '.join(SELECTIONS)}")
    figure = dict(report.get("figure") or {})
    unknown = sorted(set(figure) - set(FIGURE_KEYS))
    if unknown:
        raise ConfigError(f"report.figure.{unknown[0]} is not a figure setting; valid: {', '.join(FIGURE_KEYS)}")
    return Layout(
        title=report["title"], rows=tuple(map(axis_from, report["rows"])),
        columns=tuple(map(axis_from, report["columns"])), paper=report.get("paper"),
        table=None if report.get("table") is None else str(report["table"]),
        metrics=tuple(report.get("metrics") or ("top1",)), tune=tune.get("key"), tune_name=tune.get("name", "rho"),
        tuned_rows=frozenset(tune.get("rows") or ()), select=select, improv=bool(report.get("improv", False)),
        flags={flag: frozenset(rows) for flag, rows in (report.get("flags") or {}).items()},
        sweeps=tuple(sweeps), fixed=dict(fixed or {}), figure=figure,
    )
