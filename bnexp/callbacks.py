"""Extension points of the training loop.

Methods (AMAT, BNP), probes and loggers plug into :func:`bnexp.trainer.train` through these
hooks instead of editing the loop; :func:`bnexp.trainer.build_callbacks` lists which run, in
which order. Each hook receives the live :class:`TrainState`; a hook that does nothing costs
nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch
from omegaconf import DictConfig
from torch import nn
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler
from torch.utils.data import Dataset

from bnexp.distributed import Dist


@dataclass
class TrainState:
    """Everything a hook may read or change during a run."""

    cfg: DictConfig
    run_dir: Path
    device: torch.device
    model: nn.Module
    optimizer: Optimizer
    scheduler: LRScheduler
    steps_per_epoch: int
    total_steps: int
    step: int = 0  # optimizer steps taken so far
    dist: Dist = field(default_factory=Dist)  # rank and world size (rank 0 of 1 unless under torchrun)
    train_data: Optional[Dataset] = None  # the training set (probes draw batches from it); None in benches
    summary: dict = field(default_factory=dict)  # the run's summary.json so far (loggers mirror it at the end)

    @property
    def epoch(self) -> float:
        return self.step / self.steps_per_epoch

    @property
    def lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])  # a 0-d tensor under trainer.compile


class Callback:
    """Base class: override the hooks you need."""

    def on_train_start(self, state: TrainState) -> None:
        """After the model, optimizer and data exist, before a checkpoint (if any) is restored."""

    def before_step(self, state: TrainState) -> None:
        """Before the forward pass of step ``state.step`` (the lr of this step is set)."""

    def after_backward(self, state: TrainState) -> None:
        """Gradients exist; the optimizer has not stepped yet."""

    def after_step(self, state: TrainState) -> None:
        """After the optimizer and schedule stepped; ``state.step`` already counts it."""

    def on_eval(self, state: TrainState, row: dict[str, Any]) -> None:
        """After an evaluation; ``row`` is the metrics.csv row just written."""

    def on_train_end(self, state: TrainState, status: str) -> None:
        """Once, with the final status (completed, diverged or failed)."""

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint must hold for the callback to resume exactly."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned."""

