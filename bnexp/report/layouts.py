"""How each preset's results are laid out: the paper's rows, columns and their order.

A :class:`Layout` names the config keys (flattened, as in summary.json's ``config``) that
make the rows and the columns of a table, the values in the paper's order, and how a
cell is matched to ``published_results.csv``. ``bnexp table`` and ``bnexp plot`` share it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from typing import Any, Callable, Mapping

from bnexp.report.reference import bnp_lr

LABELS = {
    "sigmoid": "Sigmoid", "tanh": "Tanh", "relu": "ReLU", "selu": "SELU", "swish": "Swish",
    "cifar10": "CIFAR-10", "cifar100": "CIFAR-100", "mnist": "MNIST", "imagenet": "ImageNet",
    "resnet20": "ResNet-20", "vgg16": "VGG-16", "resnet18": "ResNet-18", "resnet50": "ResNet-50",
    "efficientnet_b0": "EfficientNet-B0", "bn": "BN", "cbn": "CBN", "popnorm": "POP-Norm",
    "bnp": "BNP", "brn": "BN renorm", "ln": "LN", "gn": "GN", "bnp_gn": "BNP+GN",
    "mean_removal": "mean removal", "l2_division": "l2 division", "mean_only": "mean removal only",
    "division_only": "division only", "amat": "AMAT", "fixed_eta": "fixed eta 0.9", "no_amat": "no AMAT",
    "resnet110": "ResNet-110", "preact_resnet110": "pre-act ResNet-110", "mlp2x100": "2x100 MLP",
}
METRICS = {"top1": "final_top1", "top5": "final_top5", "seconds_per_epoch": "seconds_per_epoch"}
METRIC_LABELS = {"top1": "top-1", "top5": "top-5", "seconds_per_epoch": "s/epoch"}

ACTS5 = ("sigmoid", "tanh", "relu", "selu", "swish")
ACTS3 = ("sigmoid", "tanh", "relu")
RHO_GRID = (0.25, 0.5, 1.0, 2.0, 4.0, 8.0)


@dataclass(frozen=True)
class Axis:
    """One table dimension: a config key, its values in order, their labels."""

    key: str
    values: tuple[Any, ...]
    name: str = ""
    published: str | None = None  # the published_results.csv column it matches
    labels: Mapping[Any, str] = field(default_factory=dict)

    def label(self, value: Any) -> str:
        """How ``value`` is printed in headers and row names."""
        return self.labels.get(value, LABELS.get(value, str(value)))


@dataclass(frozen=True)
class Layout:
    """A table: rows x columns of cells, each cell the runs sharing those config values."""

    title: str
    rows: tuple[Axis, ...]
    columns: tuple[Axis, ...]
    paper: str | None = None  # published_results.csv ``paper`` and ``table``
    table: str | None = None
    metrics: tuple[str, ...] = ("top1",)
    tune: str | None = None  # a config key chosen per cell: the best mean wins
    tune_name: str = "rho"
    tuned_rows: frozenset[Any] = frozenset()  # row values whose cells are tuned (all if empty)
    select: str = "best"  # best | max_stable (the largest value whose runs do not collapse)
    improv: bool = False  # an "Improv." line under every row after the first
    flags: Mapping[str, Mapping[Any, bool]] = field(default_factory=dict)  # extra row columns
    not_run: Callable[[Mapping[str, Any]], bool] | None = None  # cells the paper never ran

    def is_tuned(self, row: Mapping[str, Any]) -> bool:
        """True when the cell at ``row`` reports a tuned value (e.g. the best rho)."""
        if self.tune is None:
            return False
        return not self.tuned_rows or row[self.rows[0].key] in self.tuned_rows


def _bnp_not_run(model: str, cell: Mapping[str, Any]) -> bool:
    """True where the BNP paper's learning-rate tables say N/A for this cell."""
    return bnp_lr(model, cell["tags.data"], cell["trainer.batch_size"], cell["norm.name"]) is None


CBN_ROW_LABELS = {1: "1 BN (baseline)", 2: "2 CBN"}
CBN_FLAGS = {  # METHODS.md, "CBN ablation rows"
    "Before op": {2: True, 3: True, 4: True, 5: True},
    "Decouple": {2: True, 4: True, 5: True},
    "Tune rho": {2: True, 5: True, 6: True, 7: True},
    "AMAT": {2: True, 7: True},
}


def cbn_ablation(table: str, title: str) -> Layout:
    """CBN Tables 1-4: rows 1-7 x 5 activations, tuned rho in rows 2, 5, 6, 7."""
    return Layout(
        title,
        rows=(Axis("tags.row", tuple(range(1, 8)), "Method", "row", CBN_ROW_LABELS),),
        columns=(Axis("act.name", ACTS5, "Activation", "activation"),),
        paper="cbn", table=table, tune="norm.rho", tuned_rows=frozenset(CBN_FLAGS["Tune rho"]),
        improv=True, flags=CBN_FLAGS,
    )


NORM_BNP = ("none", "bn", "bnp", "brn", "ln")
VANILLA = {"none": "vanilla"}


def batch_axis(sizes: tuple[int, ...], published: str | None = None) -> Axis:
    """A batch-size axis labelled ``batch N``."""
    return Axis("trainer.batch_size", sizes, "Batch", published, {b: f"batch {b}" for b in sizes})


LAYOUTS: dict[str, Layout] = {
    "cbn/table1": cbn_ablation("1", "CBN Table 1: ResNet-20 on CIFAR-10, top-1 %"),
    "cbn/table2": cbn_ablation("2", "CBN Table 2: VGG-16 on CIFAR-10, top-1 %"),
    "cbn/table3": cbn_ablation("3", "CBN Table 3: ResNet-20 on CIFAR-100, top-1 %"),
    "cbn/table4": cbn_ablation("4", "CBN Table 4: VGG-16 on CIFAR-100, top-1 %"),
    "cbn/table5": Layout(
        "CBN Table 5: ILSVRC-2012, top-1 %",
        rows=(Axis("norm.name", ("bn", "cbn"), "Method", "method"),),
        columns=(Axis("model.name", ("resnet18", "resnet50", "efficientnet_b0"), "Model", "model"),
                 Axis("act.name", ACTS5, "Activation", "activation")),
        paper="cbn", table="5", improv=True,
    ),
    "cbn/table6": Layout(
        "CBN Table 6: largest stable lr and its top-1 %, ResNet-20",
        rows=(Axis("tags.method", ("none", "mean_removal", "l2_division", "cbn"), "Method"),),
        columns=(Axis("act.name", ACTS5, "Activation"),),
        tune="optim.lr", tune_name="lr", select="max_stable",
    ),
    "cbn/rho": Layout(
        "CBN Figs. 8-9: CBN in VGG-16 on CIFAR-100 by rho, top-1 %",
        rows=(Axis("norm.rho", RHO_GRID, "rho"),), columns=(Axis("act.name", ACTS5, "Activation"),),
    ),
    "cbn/amat": Layout(
        "CBN Fig. 10: moving-average statistics in ResNet-18 on ILSVRC-2012, top-1 %",
        rows=(Axis("tags.method", ("amat", "fixed_eta", "no_amat"), "Method"),),
        columns=(Axis("act.name", ACTS5, "Activation"),),
    ),
    "popnorm/table1": Layout(
        "POP-Norm Table 1: CIFAR, top-1 %",
        rows=(Axis("model.name", ("vgg16", "resnet20"), "Model", "model"),
              Axis("act.name", ACTS3, "Activation", "activation")),
        columns=(Axis("tags.data", ("cifar10", "cifar100"), "Data", "dataset"),
                 Axis("norm.name", ("bn", "popnorm"), "Method", "method")),
        paper="popnorm", table="1",
    ),
    "popnorm/table2": Layout(
        "POP-Norm Table 2: ResNet-18 on ILSVRC-2012 (ReLU), %",
        rows=(Axis("model.name", ("resnet18",), "Model", "model"),),
        columns=(Axis("norm.name", ("bn", "popnorm"), "Method", "method"),),
        paper="popnorm", table="2", metrics=("top1", "top5"),
    ),
    "popnorm/kappa": Layout(
        "POP-Norm Fig. 2: POP-Norm in VGG-16 on CIFAR-100 by kappa, top-1 %",
        rows=(Axis("norm.rho", (1.0, 4.0, 16.0), "kappa"),), columns=(Axis("act.name", ACTS3, "Activation"),),
    ),
    "popnorm/ablation": Layout(
        "POP-Norm Fig. 3: ablation in VGG-16 on CIFAR-100, top-1 %",
        rows=(Axis("tags.method", ("popnorm", "mean_only", "division_only", "none", "bn"), "Method"),),
        columns=(Axis("act.name", ACTS3, "Activation"),),
    ),
    "bnp/fc": Layout(
        "BNP Figs. 3-4: 3x100 MLP, top-1 %",
        rows=(Axis("norm.name", NORM_BNP, "Method", labels=VANILLA),),
        columns=(Axis("tags.data", ("mnist", "cifar10"), "Data"), batch_axis((60, 6, 1))),
        not_run=partial(_bnp_not_run, "mlp3x100"),
    ),
    "bnp/cnn5": Layout(
        "BNP Figs. 4-5: 5-layer CNN on CIFAR-10, top-1 %",
        rows=(Axis("norm.name", NORM_BNP[:4], "Method", labels=VANILLA),),
        columns=(Axis("tags.data", ("cifar10",), "Data"), batch_axis((128, 2, 1))),
        not_run=partial(_bnp_not_run, "cnn5"),
    ),
    "bnp/resnet110": Layout(
        "BNP Fig. 6 (left): ResNet-110 on CIFAR-10, top-1 %",
        rows=(Axis("norm.name", ("bn", "bnp", "bnp_gn", "gn"), "Method"),),
        columns=(Axis("model.name", ("resnet110",), "Model"),),
    ),
    "bnp/preact110": Layout(
        "BNP Fig. 6 (right): pre-activation ResNet-110 on CIFAR-100, top-1 %",
        rows=(Axis("norm.name", ("bn", "bnp", "bnp_gn", "gn"), "Method"),),
        columns=(Axis("model.name", ("preact_resnet110",), "Model"),),
    ),
    "bnp/hessian": Layout(
        "BNP Fig. 8: 2x100 MLP on CIFAR-10, batch 60, top-1 %",
        rows=(Axis("norm.name", ("none", "bnp"), "Method", labels=VANILLA),),
        columns=(Axis("model.name", ("mlp2x100",), "Model"),),
    ),
    "bnp/timing": Layout(
        "BNP Table 1: seconds per epoch, 2x100 MLP on CIFAR-10",
        rows=(Axis("norm.name", ("bn", "bnp"), "Method", "method"),),
        columns=(batch_axis((16, 256, 512), "row"),),
        paper="bnp", table="1", metrics=("seconds_per_epoch",),
    ),
    "arora/auto_rate": Layout(
        "Arora et al.: ResNet-20 with BN on CIFAR-10 by lr_w (lr_g = 0.1), top-1 %",
        rows=(Axis("optim.lr_w", (0.01, 0.1, 1.0, 10.0, 100.0), "lr_w"),),
        columns=(Axis("model.name", ("resnet20",), "Model"),),
    ),
}
