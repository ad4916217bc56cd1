"""Gradient probes: the stochastic gradient's norm (CBN Fig. 7) and variance (CBN Fig. 10).

Both report the raw gradient of the mini-batch cross-entropy, before weight decay and
before any method rewrites it (BNP): ``grad_norm`` reads the gradients in
``after_backward`` ahead of the method callbacks, ``grad_var`` computes its own.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Callable, Mapping

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from bnexp.engine.callbacks import TrainState
from bnexp.probes.callback import ALL, Probe, register_probe
from bnexp.probes.sampling import Batch, SampledProbe

LossFn = Callable[[Tensor, Tensor], Tensor]  # (model output, targets) -> scalar


def owner(param_name: str) -> str:
    """The qualified name of the module holding a parameter (``layer1.0.conv1.op``)."""
    return param_name.rpartition(".")[0] or param_name


def trainable(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    return [(name, p) for name, p in model.named_parameters() if p.requires_grad]


def per_layer_sums(values: Mapping[str, float]) -> dict[str, float]:
    """Per-parameter values summed per owning module, plus their total under ``all``."""
    sums: dict[str, float] = defaultdict(float)
    for name, value in values.items():
        sums[owner(name)] += value
    return {**sums, ALL: sum(values.values())}


def gradient_variance(
    model: nn.Module, batches: list[Batch], loss_fn: LossFn, params: list[tuple[str, nn.Parameter]]
) -> dict[str, float]:
    """``mean_i ||g_i - mean_j g_j||^2`` over the batches' gradients ``g_i`` of ``params``,
    per parameter. Accumulated element-wise in float64 with Welford's update, so no stack of
    gradients is kept and no large sums cancel."""
    mean = [torch.zeros_like(p, dtype=torch.float64) for _, p in params]
    m2 = [torch.zeros_like(p, dtype=torch.float64) for _, p in params]
    for i, (x, y) in enumerate(batches, start=1):
        grads = torch.autograd.grad(loss_fn(model(x), y), [p for _, p in params], allow_unused=True)
        for g, mu, acc in zip(grads, mean, m2):
            g = torch.zeros_like(mu) if g is None else g.double()
            delta = g - mu
            mu.add_(delta / i)
            acc.add_(delta * (g - mu))
    return {name: acc.sum().item() / len(batches) for (name, _), acc in zip(params, m2)}


@register_probe
class GradNorm(Probe):
    """``||g||`` of the step's gradient, per module and for the whole model (``norm``)."""

    name = "grad_norm"

    def after_backward(self, state: TrainState) -> None:
        if not self.due(state.step, state):
            return
        squares = {name: p.grad.detach().double().square().sum() for name, p in trainable(state.model)
                   if p.grad is not None}
        values = dict(zip(squares, torch.stack(list(squares.values())).tolist())) if squares else {}
        for layer, square in per_layer_sums(values).items():
            self.emit(state.step, layer, "norm", square**0.5)


@register_probe
class GradVar(SampledProbe):
    """``mean_i ||g_i - mean(g)||^2`` over ``k`` fresh mini-batches at fixed weights (``variance``)."""

    name = "grad_var"

    def measure_batches(self, state: TrainState, step: int, batches: list[Batch]) -> None:
        variances = gradient_variance(state.model, batches, F.cross_entropy, trainable(state.model))
        for layer, value in per_layer_sums(variances).items():
            self.emit(step, layer, "variance", value)
