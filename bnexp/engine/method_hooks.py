"""Training hooks that the normalization methods need beyond their modules.

- AMAT layers get the current learning rate before every step (CBN Algorithm 1);
- BNP rewrites the gradients of every conv/linear between backward and the optimizer step;
- ``weights.csv`` logs the norm and effective learning rate of each scale-invariant weight.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import torch
from omegaconf import DictConfig, OmegaConf
from torch import Tensor

from bnexp.engine.callbacks import Callback, TrainState
from bnexp.models.scale_invariance import scale_invariant_weights, weight_norms
from bnexp.nn import BNP, NormFamily
from bnexp.nn.family import set_adaptive_eta
from bnexp.support.distributed import bnp_reducer
from bnexp.support.runinfo import MetricsWriter


class AmatLearningRate(Callback):
    """Hand the lr of the coming step to every AMAT layer: inside the engine's step, as
    adaptive AMAT's eta computed on the device from the step's lr (one tensor all layers read,
    :func:`bnexp.nn.family.set_adaptive_eta`); elsewhere (a step without a device lr) as a
    float, when it changed."""

    capturable = True

    def on_train_start(self, state: TrainState) -> None:
        self.layers = [m for m in state.model.modules() if isinstance(m, NormFamily) and m.amat]
        self.lr: Optional[float] = None
        self.eta: Optional[Tensor] = None  # the adaptive layers' eta under a device lr

    def before_step(self, state: TrainState) -> None:
        if state.device_lr is not None:
            adaptive = [m for m in self.layers if m.amat_eta is None]
            if adaptive and self.eta is None:
                # one eta per run in a pack whose runs differ in their lr (device_lr: groups x runs)
                self.eta = torch.zeros(state.device_lr[0].shape, dtype=adaptive[0].amat_mean.dtype,
                                       device=state.device_lr.device)
                for m in adaptive:
                    m.read_eta_from(self.eta)
            if self.eta is not None:
                set_adaptive_eta(self.eta, state.device_lr[0])
            return
        lr = state.lr
        if lr != self.lr:
            for m in self.layers:
                m.set_learning_rate(lr)
            self.lr = lr


class BnpPreconditioner(Callback):
    """BNP over the whole model: statistics from forward hooks, gradients rewritten after backward."""

    capturable = True

    def __init__(self, settings: dict[str, Any]) -> None:
        self.settings = settings

    def on_train_start(self, state: TrainState) -> None:
        # Under torchrun the batch statistics are combined over processes before each update.
        reduce_fn = bnp_reducer if state.dist.enabled else None
        self.bnp = BNP(state.model, **self.settings, reduce_fn=reduce_fn, processes=state.dist.world_size)

    def after_backward(self, state: TrainState) -> None:
        self.bnp.step()

    def on_train_end(self, state: TrainState, status: str) -> None:
        self.bnp.remove()

    def state_dict(self) -> dict[str, Any]:
        return self.bnp.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.bnp.load_state_dict(state)


class WeightNormLog(Callback):
    """At every evaluation: ``||w||`` and ``lr_w / ||w||^2`` of each scale-invariant weight, and
    the min / median / max over its filters of ``lr_w / ||w_k||^2``. In a packed model, one
    log per run: ``run`` of ``runs``, written to that run's ``run_dir``."""

    def __init__(self, run_dir: Optional[Path] = None, run: int = 0, runs: int = 1) -> None:
        self.run_dir, self.run, self.runs = run_dir, run, runs

    def on_train_start(self, state: TrainState) -> None:
        self.weights = scale_invariant_weights(state.model)
        run_dir = self.run_dir or Path(state.run_dir)
        self.writer = MetricsWriter(run_dir / "weights.csv", enabled=state.dist.is_main)

    def on_eval(self, state: TrainState, row: dict[str, Any]) -> None:
        for name, norm, lr_w, (low, median, high) in weight_norms(self.weights, state.optimizer, self.run, self.runs,
                                                                     state.group_lrs(self.run)):
            self.writer.write({"step": state.step, "epoch": row["epoch"], "layer": name, "weight_norm": norm,
                               "lr_w": lr_w, "effective_lr": lr_w / norm**2, "filter_effective_lr_min": low,
                               "filter_effective_lr_median": median, "filter_effective_lr_max": high})

    def state_dict(self) -> dict[str, Any]:
        return {"rows": self.writer.rows}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.writer.restore(state.get("rows", []))


def method_callbacks(cfg: DictConfig) -> list[Callback]:
    """The hooks ``cfg``'s normalization needs, then the scale-invariant weights' log."""
    settings = cfg.norm.get("bnp")
    hooks: list[Optional[Callback]] = [
        AmatLearningRate() if cfg.norm.get("amat") else None,
        BnpPreconditioner(OmegaConf.to_container(settings)) if settings is not None else None,
        WeightNormLog(),
    ]
    return [hook for hook in hooks if hook is not None]
