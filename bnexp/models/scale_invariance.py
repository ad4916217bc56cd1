"""Scale-invariant weights (Arora, Li, Lyu; METHODS.md section 5).

A weight is scale-invariant when its op feeds a normalization that cancels a positive
rescaling of it (``after_op`` BN and its coupled relatives, ``bn_si``; see
:func:`bnexp.nn.is_scale_invariant`). Optimizer parameter groups, the ``weights.csv`` log
and the ``weights`` probe all take the list from :func:`scale_invariant_weights`.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import nn
from torch.optim import Optimizer

from bnexp.models.layers import normalized_ops
from bnexp.nn import is_scale_invariant


def scale_invariant_weights(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """``(qualified name, weight)`` of every op whose output normalization is scale-invariant."""
    return [
        (f"{name}.op.weight", unit.op.weight)
        for name, unit in normalized_ops(model)
        if not isinstance(unit.post, nn.Identity)
        and is_scale_invariant(unit.post, op_bias=getattr(unit.op, "bias", None) is not None)
    ]


def parameter_groups(model: nn.Module, lr_g: float, lr_w: float, wd_g: float, wd_w: float) -> list[dict]:
    """Two optimizer groups: every other parameter (scale-variant) at ``lr_g`` with weight
    decay ``wd_g`` first, scale-invariant weights at ``lr_w`` with ``wd_w``."""
    invariant = {id(p) for _, p in scale_invariant_weights(model)}
    rest = [p for p in model.parameters() if id(p) not in invariant]
    chosen = [p for p in model.parameters() if id(p) in invariant]
    return [{"params": rest, "lr": lr_g, "weight_decay": wd_g, "name": "lr_g"},
            {"params": chosen, "lr": lr_w, "weight_decay": wd_w, "name": "lr_w"}]


def filter_squares(weight: torch.Tensor) -> torch.Tensor:
    """``||w_k||^2`` of each filter (output row) of a weight, in float64."""
    return weight.detach().double().flatten(1).square().sum(1)


def weight_norms(weights: list[tuple[str, nn.Parameter]], optimizer: Optimizer, run: int = 0, runs: int = 1,
                 rates: Optional[Sequence[float]] = None) -> list[tuple[str, float, float, tuple[float, float, float]]]:
    """``(name, ||w||, lr, (min, median, max) of lr / ||w_k||^2 over the filters))`` for each
    weight, ``lr`` being that of the optimizer group holding it. ``lr / ||w||^2`` is a
    layer's effective learning rate; BN makes each filter ``w_k`` scale-invariant on its
    own, so ``lr / ||w_k||^2`` is the effective rate of Arora et al.'s analysis. In a packed
    model of ``runs`` runs, the weights are those of run ``run`` (its block of filters), at its
    ``rates`` (each group's lr; default the optimizer's)."""
    if rates is None:
        rates = [float(group["lr"]) for group in optimizer.param_groups]
    lrs = {id(p): rate for group, rate in zip(optimizer.param_groups, rates) for p in group["params"]}
    rows = []
    for name, w in weights:
        squares = filter_squares(w.chunk(runs)[run])
        per_filter = lrs[id(w)] / squares
        quantiles = torch.stack([per_filter.min(), per_filter.median(), per_filter.max()]).tolist()
        rows.append((name, squares.sum().sqrt().item(), lrs[id(w)], tuple(quantiles)))
    return rows
