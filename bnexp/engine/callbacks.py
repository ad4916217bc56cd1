"""Extension points of the training loop.

Methods (AMAT, BNP), probes and loggers plug into :func:`bnexp.engine.trainer.train` through these
hooks instead of editing the loop; :func:`bnexp.engine.trainer.build_callbacks` lists which run, in
which order. Each hook receives the live :class:`TrainState`; a hook that does nothing costs
nothing.
"""

from __future__ import annotations

import logging
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Optional

import torch
from omegaconf import DictConfig
from torch import nn
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler
from torch.utils.data import Dataset

from bnexp.engine.optim import RunSchedules
from bnexp.support.distributed import Dist

log = logging.getLogger(__name__)


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
    # Each parameter group's lr of the coming step, float64 on the device, updated in place
    # inside the engine's step (bnexp.engine.step.TrainStep); None outside it. (groups, runs)
    # in a pack whose runs differ in their lr (run_rates).
    device_lr: Optional[torch.Tensor] = None
    # A pack whose runs differ in their learning rates: each run's schedule (None otherwise)
    run_rates: Optional[RunSchedules] = None

    @property
    def epoch(self) -> float:
        return self.step / self.steps_per_epoch

    @property
    def lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])  # a 0-d tensor under trainer.compile

    def group_lrs(self, run: int = 0) -> list[float]:
        """Each parameter group's lr now, run ``run``'s in a pack whose runs differ in it."""
        if self.run_rates is not None:
            return self.run_rates.group_lrs(run)
        return [float(group["lr"]) for group in self.optimizer.param_groups]


class Callback:
    """Base class: override the hooks you need.

    ``capturable`` hooks do only device work in ``before_step`` and ``after_backward``
    (tensors at fixed addresses, no host read, no value that changes between steps), which
    therefore run inside the engine's step and may be captured in its CUDA graph
    (``trainer.cuda_graph``); the ``before_step`` of the others runs on the host just before
    the step, and a graph is not used when one of them has an ``after_backward``."""

    capturable = False

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
        """Once, with the final status of what the hook serves (completed or diverged): its
        run's, as the run ends; for a hook the runs of a pack share, the pack's, at its end
        (completed when some run completed)."""

    def on_train_stop(self, state: TrainState, status: str) -> None:
        """Instead of :meth:`on_train_end` when training stops on an exception
        (:func:`ended_on_stop`): ``preempted`` or ``interrupted`` (a signal, after a
        checkpoint) or ``failed``. Nothing may be measured or written here: the run resumes
        from its checkpoint."""

    def captured_with(self) -> Any:
        """What the device work of a capturable hook depends on besides tensors (e.g. which
        runs are frozen): when it changes, the step is captured again."""
        return None

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint must hold for the callback to resume exactly."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned."""


def stop_status(err: BaseException) -> str:
    """The status a run stopped by ``err`` ends with: a signal's (``preempted``,
    ``interrupted``, set by :class:`bnexp.engine.preemption.Preempted`), Ctrl-C's, or ``failed``."""
    return getattr(err, "status", "interrupted" if isinstance(err, KeyboardInterrupt) else "failed")


@contextmanager
def ended_on_stop(callbacks: list[Callback], state: TrainState) -> Iterator[None]:
    """Training inside: when it stops on an exception (a signal, Ctrl-C, an error), every
    callback's ``on_train_stop`` runs with :func:`stop_status` before the exception goes on,
    so a tracker closes its run as preempted or failed. A callback that fails to stop is
    logged, never allowed to hide the exception that stopped the run."""
    try:
        yield
    except BaseException as err:
        status = stop_status(err)
        for cb in callbacks:
            try:
                cb.on_train_stop(state, status)
            except Exception as end_err:
                log.warning("%s could not end the run as %s (%s: %s)", type(cb).__name__, status,
                            type(end_err).__name__, end_err)
        raise
