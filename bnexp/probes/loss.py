"""The ``loss`` probe: the training loss at fixed weights on a fixed set of training batches.

Unlike metrics.csv's ``train_loss`` (an average over the steps of a logging window, each
at different weights), every measurement uses the same ``k`` batches, so values at two
steps compare the weights alone. ``bnexp lrsearch`` reads its step-0 and final values.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from bnexp.engine.callbacks import TrainState
from bnexp.probes.callback import ALL, register_probe
from bnexp.probes.sampling import Batch, SampledProbe


@register_probe
class Loss(SampledProbe):
    """Mean cross-entropy of the model in training mode over the probe's fixed batches."""

    name = "loss"
    fresh_batches = False

    def measure_batches(self, state: TrainState, step: int, batches: list[Batch]) -> None:
        with torch.no_grad():
            losses = torch.stack([F.cross_entropy(state.model(x), y) for x, y in batches])
        self.emit(step, ALL, "loss", losses.double().mean().item())
