"""The ``eta_tau`` probe: CBN's eta_k and tau_k per channel, as quantiles per layer (CBN Figs. 2-3).

For a normalization's input ``x`` in a training forward, per channel:

    mu_B    = mean of x over N (and H, W)
    sigma_B = sqrt(mean((x - mu_B + beta)^2) + eps)   (mu_B only when centering, beta only when decoupled)
    eta     = (mu_B - beta) / mu_A
    tau     = gamma / (rho * sigma_B)

``mu_A`` is the moving average the forward centres with: for AMAT ``r_mu * mu_B``
(:meth:`~bnexp.nn.NormFamily.amat_mean_ratio`: the average updated with ``mu_B`` under
``amat_update=before_forward``, the stored one under ``after_forward``, ``mu_B`` itself on
the first step, and the clip of ``norm.amat_r_max`` where it binds), or the running mean
before the update for a layer without AMAT. The values come from a forward pre-hook
that reads the input and the layer's state and changes nothing.
"""

from __future__ import annotations

import logging
from functools import partial
from typing import Optional

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from bnexp.engine.callbacks import TrainState
from bnexp.nn import NormFamily
from bnexp.probes.callback import Probe, register_probe

log = logging.getLogger("bnexp.probes")

QUANTILES = (0.05, 0.25, 0.5, 0.75, 0.95)


def cbn_layers(model: nn.Module) -> list[tuple[str, NormFamily]]:
    """The CBN-style normalizations of ``model``: family members that decouple beta or use AMAT."""
    return [(name, m) for name, m in model.named_modules() if isinstance(m, NormFamily) and (m.decouple or m.amat)]


def moving_mean(module: NormFamily, batch_mean: Tensor) -> Tensor:
    """``mu_A`` of the coming forward (see the module docstring)."""
    if not module.amat:
        return module.running_mean
    mean = batch_mean.to(module.amat_mean.dtype)
    return module.amat_mean_ratio(mean) * mean


def eta_tau(module: NormFamily, x: Tensor) -> tuple[Optional[Tensor], Optional[Tensor]]:
    """Per-channel eta (None without centering) and tau (None without scaling), in float64,
    for input ``x`` of a training forward of ``module`` that has not run yet."""
    x = x.detach().double()
    dims = [0, *range(2, x.dim())]
    shape = (1, -1, *([1] * (x.dim() - 2)))
    mu_b = x.mean(dims)
    beta = module.bias.detach().double()
    shift = torch.zeros_like(mu_b)
    if module.center:
        shift = shift - mu_b
    if module.decouple:
        shift = shift + beta
    sigma_b = ((x + shift.view(shape)).square().mean(dims) + module.eps).sqrt()
    eta = (mu_b - beta) / moving_mean(module, mu_b).double() if module.center else None
    tau = module.weight.detach().double() / (module.rho * sigma_b) if module.scale else None
    return eta, tau


def quantity_name(prefix: str, q: float) -> str:
    """``eta_q05`` for the 5% quantile of eta."""
    return f"{prefix}_q{round(q * 100):02d}"


class LayerInputProbe(Probe):
    """A probe that reads the inputs of some normalization layers in the training forwards of
    the steps on its schedule (a forward pre-hook per layer that changes nothing).

    Subclasses pick the layers (:meth:`layers`) and measure one input (:meth:`capture`).
    """

    def layers(self, model: nn.Module) -> list[tuple[str, NormFamily]]:
        raise NotImplementedError

    def capture(self, step: int, name: str, module: NormFamily, x: Tensor) -> None:
        raise NotImplementedError

    def on_train_start(self, state: TrainState) -> None:
        self.step: Optional[int] = None  # the step being measured, while its forward runs
        layers = self.layers(state.model)
        self.handles: list[RemovableHandle] = [m.register_forward_pre_hook(partial(self._hook, name))
                                               for name, m in layers]
        if not layers:
            log.warning("probe %s: the model has no layer it measures; nothing to record", self.name)

    def before_step(self, state: TrainState) -> None:
        self.step = state.step if self.due(state.step, state) else None

    def after_step(self, state: TrainState) -> None:
        self.step = None

    def on_train_end(self, state: TrainState, status: str) -> None:
        for handle in self.handles:
            handle.remove()

    def _hook(self, name: str, module: NormFamily, args: tuple[Tensor, ...]) -> None:
        if self.step is not None and module.training:
            self.capture(self.step, name, module, args[0])


@register_probe
class EtaTau(LayerInputProbe):
    """Quantiles across channels of eta and tau for every CBN-style layer (``eta_q50`` ...)."""

    name = "eta_tau"

    def layers(self, model: nn.Module) -> list[tuple[str, NormFamily]]:
        return cbn_layers(model)

    def capture(self, step: int, name: str, module: NormFamily, x: Tensor) -> None:
        q = torch.tensor(QUANTILES, dtype=torch.float64, device=x.device)
        for prefix, values in zip(("eta", "tau"), eta_tau(module, x)):
            if values is not None:
                for level, value in zip(QUANTILES, torch.quantile(values, q).tolist()):
                    self.emit(step, name, quantity_name(prefix, level), value)


@register_probe
class AmatRatio(LayerInputProbe):
    """Per AMAT layer: the largest ``|r_mu|`` over its channels (as the forward uses it: averaged,
    guarded, clipped by ``norm.amat_r_max``) and the smallest ``|mu_B|``. A ratio grows where
    a channel's batch mean nears zero, and it scales the gradient through the batch mean
    (docs/methods/cbn.md shows a collapse it causes)."""

    name = "amat"

    def layers(self, model: nn.Module) -> list[tuple[str, NormFamily]]:
        return [(name, m) for name, m in model.named_modules() if isinstance(m, NormFamily) and m.amat]

    def capture(self, step: int, name: str, module: NormFamily, x: Tensor) -> None:
        mean = x.detach().to(module.amat_mean.dtype).mean([0, *range(2, x.dim())])
        ratio = module.amat_mean_ratio(mean).abs().max()
        self.emit(step, name, "r_mu_max_abs", ratio.item())
        self.emit(step, name, "mu_b_min_abs", mean.abs().min().item())
