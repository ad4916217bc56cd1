"""The ``weights`` probe: norms and effective learning rates of scale-invariant weights (Arora et al.).

For every weight :func:`bnexp.models.scale_invariance.scale_invariant_weights` lists, ``norm`` is
``||w||`` and ``effective_lr`` is ``lr / ||w||^2`` with the learning rate of the optimizer
group holding ``w`` (``lr_w`` when the run splits the groups). The loss does not change
when such a weight is rescaled, so a step of size lr on it moves its direction as much as
a step of ``lr / ||w||^2`` on a unit-norm weight would. BN normalizes each output channel
on its own, so every filter ``w_k`` is scale-invariant by itself: ``filter_effective_lr_median``
is the median over the layer's filters of ``lr / ||w_k||^2``.
"""

from __future__ import annotations

import logging

from bnexp.engine.callbacks import TrainState
from bnexp.models.scale_invariance import scale_invariant_weights, weight_norms
from bnexp.probes.callback import FixedWeightProbe, register_probe

log = logging.getLogger("bnexp.probes")


@register_probe
class Weights(FixedWeightProbe):
    """Per scale-invariant weight: ``norm`` and ``effective_lr``, between steps."""

    name = "weights"

    def on_train_start(self, state: TrainState) -> None:
        self.weights = scale_invariant_weights(state.model)
        if not self.weights:
            log.warning("probe weights: the model has no scale-invariant weight; nothing to measure")

    def measure(self, state: TrainState, step: int) -> None:
        if not self.weights:
            return
        for name, norm, lr, (_, median, _) in weight_norms(self.weights, state.optimizer):
            self.emit(step, name, "norm", norm)
            self.emit(step, name, "effective_lr", lr / norm**2)
            self.emit(step, name, "filter_effective_lr_median", median)
