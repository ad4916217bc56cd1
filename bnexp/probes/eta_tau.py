"""The ``eta_tau`` probe: CBN's eta_k and tau_k per channel, as quantiles per layer (CBN Figs. 2-3).

For a normalization's input ``x`` in a training forward, per channel:

    mu_B    = mean of x over N (and H, W)
    sigma_B = sqrt(mean((x - mu_B + beta)^2) + eps)   (mu_B only when centering, beta only when decoupled)
    eta     = (mu_B - beta) / mu_A
    tau     = gamma / (rho * sigma_B)

``mu_A`` is the moving average the forward uses: AMAT's ``mu_A`` as this step's forward
sees it (:meth:`~bnexp.nn.NormFamily.amat_forward_mean`: updated with ``mu_B`` under
``amat_update=before_forward``, the stored one under ``after_forward``, ``mu_B`` itself on
the first step), or the running mean before the update for a layer without AMAT. The values come from a forward pre-hook
that reads the input and the layer's state and changes nothing.
"""

from __future__ import annotations

import logging
from functools import partial
from typing import Optional

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from bnexp.callbacks import TrainState
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
    return module.amat_forward_mean(batch_mean.to(module.amat_mean.dtype))


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


@register_probe
class EtaTau(Probe):
    """Quantiles across channels of eta and tau for every CBN-style layer (``eta_q50`` ...)."""

    name = "eta_tau"

    def on_train_start(self, state: TrainState) -> None:
        self.step: Optional[int] = None  # the step being measured, while its forward runs
        layers = cbn_layers(state.model)
        self.handles: list[RemovableHandle] = [m.register_forward_pre_hook(partial(self._capture, name))
                                               for name, m in layers]
        if not layers:
            log.warning("probe eta_tau: the model has no decoupled or AMAT normalization; nothing to measure")

    def before_step(self, state: TrainState) -> None:
        self.step = state.step if self.due(state.step, state) else None

    def after_step(self, state: TrainState) -> None:
        self.step = None

    def on_train_end(self, state: TrainState, status: str) -> None:
        for handle in self.handles:
            handle.remove()

    def _capture(self, name: str, module: NormFamily, args: tuple[Tensor, ...]) -> None:
        if self.step is None or not module.training:
            return
        q = torch.tensor(QUANTILES, dtype=torch.float64, device=args[0].device)
        for prefix, values in zip(("eta", "tau"), eta_tau(module, args[0])):
            if values is not None:
                for level, value in zip(QUANTILES, torch.quantile(values, q).tolist()):
                    self.emit(self.step, name, quantity_name(prefix, level), value)
