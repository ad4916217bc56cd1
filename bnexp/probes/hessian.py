"""The ``hessian`` probe: BNP Fig. 8's condition numbers for one output neuron of the last layer.

At every scheduled step, with ``h`` the input of the model's last Linear layer in that
step's training forward (batch statistics of earlier normalizations included), the probe
takes the exact Hessian ``H`` of the mini-batch cross-entropy with respect to
``[b_n, w_n]``, the bias and weight row of output neuron ``n`` (``neuron``, default 0),
and reports

- ``kappa_hessian``: kappa(H) = largest |eigenvalue| / smallest nonzero |eigenvalue|;
- ``kappa_preconditioned``: the same for ``P^T H P``, with BNP's
  ``P = [[1, -mu^T], [0, I]] @ D`` for this layer;
- ``kappa_d``: kappa(D) = max / min of the diagonal of ``D = diag(1, 1/sqrt(s2))``;
- ``rank_hessian``: how many eigenvalues of H count as nonzero.

``mu`` and ``s2`` are BNP's running statistics of the layer input (``rho``, ``eps1``,
``eps2`` from ``norm.bnp``, else ``probe.hessian.stats``), kept by the probe itself with
:class:`bnexp.nn.BNPLayer`, so they exist in a plain run too. In a single-process BNP run
they equal BNP's; under torchrun BNP averages the batch statistics over the processes
and the probe keeps this process's own.
An eigenvalue is nonzero when its magnitude exceeds ``rtol`` times the largest one;
``rtol: null`` takes ``n * float64 eps`` (numpy's ``matrix_rank`` rule), n = matrix size.
With a batch of N < n + 1 samples H has rank at most N, so the rule matters.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Optional

import torch
from omegaconf import DictConfig, OmegaConf
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from bnexp.engine.callbacks import TrainState
from bnexp.nn import BNPLayer
from bnexp.probes.callback import Probe, register_probe
from bnexp.support.errors import ConfigError


def mean_logsumexp(logits: Tensor) -> Tensor:
    """The mini-batch cross-entropy without its label term ``-logit[label]``: that term is
    linear in the logits, so both have the same Hessian whatever the labels are."""
    return torch.logsumexp(logits, dim=1).mean()


def output_neuron_hessian(
    h: Tensor, weight: Tensor, bias: Tensor, neuron: int, loss: Callable[[Tensor], Tensor] = mean_logsumexp
) -> Tensor:
    """Exact Hessian, in float64, of ``loss(h @ weight.T + bias)`` with respect to
    ``[bias[neuron], weight[neuron]]``, the other rows held fixed."""
    h, weight, bias = (t.detach().double() for t in (h.reshape(-1, weight.shape[1]), weight, bias))
    fixed = h @ weight.T + bias
    column = torch.zeros(weight.shape[0], dtype=torch.bool, device=h.device)
    column[neuron] = True

    def of_slice(theta: Tensor) -> Tensor:
        return loss(torch.where(column, (theta[0] + h @ theta[1:])[:, None], fixed))

    return torch.autograd.functional.hessian(of_slice, torch.cat([bias[neuron : neuron + 1], weight[neuron]]))


def nonzero_spectrum(matrix: Tensor, rtol: Optional[float] = None) -> Tensor:
    """|eigenvalues| of the symmetric part of ``matrix`` above ``rtol`` times the largest
    (default ``n * eps`` of float64), in float64."""
    m = matrix.double()
    magnitudes = torch.linalg.eigvalsh((m + m.T) / 2).abs()
    if rtol is None:
        rtol = m.shape[0] * torch.finfo(torch.float64).eps
    return magnitudes[magnitudes > rtol * magnitudes.max()]


def condition_number(matrix: Tensor, rtol: Optional[float] = None) -> float:
    """Largest over smallest nonzero |eigenvalue| of a symmetric matrix (see :func:`nonzero_spectrum`)."""
    spectrum = nonzero_spectrum(matrix, rtol)
    return (spectrum.max() / spectrum.min()).item()


def last_linear(model: nn.Module) -> tuple[str, nn.Linear]:
    """The last ``nn.Linear`` in module order, with its qualified name."""
    found = [(name, m) for name, m in model.named_modules() if isinstance(m, nn.Linear)]
    if not found:
        raise ConfigError("probe hessian needs a model with a Linear output layer")
    return found[-1]


@register_probe
class Hessian(Probe):
    """BNP Fig. 8's condition numbers for output neuron ``neuron`` of the last Linear layer."""

    name = "hessian"

    def __init__(self, settings: Mapping[str, Any], cfg: DictConfig) -> None:
        super().__init__(settings, cfg)
        self.neuron = int(settings.get("neuron", 0))
        self.rtol = settings.get("rtol")
        bnp = cfg.norm.get("bnp") or settings.get("stats")
        if bnp is None:
            raise ConfigError("probe.hessian.stats (rho, eps1, eps2) must be set when the run has no norm.bnp")
        self.stats_settings = OmegaConf.to_container(bnp) if isinstance(bnp, DictConfig) else dict(bnp)

    def on_train_start(self, state: TrainState) -> None:
        self.layer_name, self.layer = last_linear(state.model)
        if self.layer.bias is None or not 0 <= self.neuron < self.layer.out_features:
            raise ConfigError(f"probe hessian: {self.layer_name} needs a bias and an output neuron {self.neuron}")
        self.stats = BNPLayer(self.layer_name, self.layer, **self.stats_settings)
        self.captured: Optional[tuple[Tensor, Tensor]] = None  # (layer input, layer output) of a measured step
        self.model_output: Optional[Tensor] = None
        self.measuring = False
        self.handles: list[RemovableHandle] = [
            self.layer.register_forward_hook(self._observe_layer),
            state.model.register_forward_hook(self._observe_model),
        ]

    def _observe_layer(self, module: nn.Module, args: tuple[Tensor, ...], output: Tensor) -> None:
        if not module.training:
            return
        self.stats.observe(args[0])  # BNP's statistics, updated as BNP does
        if self.measuring:
            self.captured = (args[0].detach(), output)

    def _observe_model(self, module: nn.Module, args: tuple[Tensor, ...], output: Tensor) -> None:
        if self.measuring:
            self.model_output = output

    def before_step(self, state: TrainState) -> None:
        self.measuring = self.due(state.step, state)

    def after_backward(self, state: TrainState) -> None:
        if not self.measuring or self.captured is None:
            return
        h, layer_output = self.captured
        self.captured, self.model_output, model_output = None, None, self.model_output
        if model_output is not layer_output:
            raise ConfigError(f"probe hessian: {self.layer_name} is not the layer that outputs the logits")
        hessian = output_neuron_hessian(h, self.layer.weight, self.layer.bias, self.neuron)
        p = self.stats.matrix().double()
        diagonal = torch.cat([p.new_ones(1), self.stats.s2().double().rsqrt()])
        self.emit(state.step, self.layer_name, "kappa_hessian", condition_number(hessian, self.rtol))
        self.emit(state.step, self.layer_name, "kappa_preconditioned", condition_number(p.T @ hessian @ p, self.rtol))
        self.emit(state.step, self.layer_name, "kappa_d", (diagonal.max() / diagonal.min()).item())
        self.emit(state.step, self.layer_name, "rank_hessian", nonzero_spectrum(hessian, self.rtol).numel())

    def after_step(self, state: TrainState) -> None:
        self.measuring = False

    def on_train_end(self, state: TrainState, status: str) -> None:
        for handle in self.handles:
            handle.remove()

    def state_dict(self) -> dict[str, Any]:
        return {name: t.clone() for name, t in self.stats.state_dict().items()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state:
            self.stats.load_state_dict(state)
