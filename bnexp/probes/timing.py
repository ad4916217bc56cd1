"""The ``time`` probe: seconds per training step and per epoch, data loading apart from compute
(BNP Table 1).

The loop alternates two intervals, read with ``time.perf_counter`` (after a CUDA
synchronize on a GPU, so queued kernels are counted where they run):

- ``compute``: from ``before_step`` to ``after_step`` of a step: forward, backward,
  gradient hooks (BNP), optimizer and schedule step;
- ``data``: from ``after_step`` of one step to ``before_step`` of the next: fetching and
  moving the next batch, plus the loop's own bookkeeping (progress, a periodic
  checkpoint). Evaluation is left out: the interval restarts after it.

The other probes' work in the hooks is left out of both. Rows: ``data_s`` and
``compute_s`` of each scheduled step, and at the end of every epoch (and of a final
partial one) ``epoch_data_s``, ``epoch_compute_s``, ``epoch_s`` and ``epoch_steps``.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any, Iterator

import torch

from bnexp.callbacks import TrainState
from bnexp.probes.callback import ALL, Probe, register_probe

EPOCH_KEYS = ("data", "compute", "steps")


@register_probe
class Time(Probe):
    """Wall-clock seconds of data loading and compute, per step and per epoch."""

    name = "time"
    is_clock = True

    def on_train_start(self, state: TrainState) -> None:
        self.device = state.device
        self.epoch = dict.fromkeys(EPOCH_KEYS, 0.0)
        self.data_s = 0.0
        self.mark = self._now()

    def _now(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def _lap(self) -> float:
        """Seconds since the mark; the mark moves to now."""
        now = self._now()
        elapsed, self.mark = now - self.mark, now
        return elapsed

    @contextlib.contextmanager
    def excluded(self) -> Iterator[None]:
        started = time.perf_counter()
        try:
            yield
        finally:
            self.mark += time.perf_counter() - started

    def before_step(self, state: TrainState) -> None:
        self.data_s = self._lap()

    def after_step(self, state: TrainState) -> None:
        compute_s = self._lap()
        step = state.step - 1
        if self.due(step, state):
            self.emit(step, ALL, "data_s", self.data_s)
            self.emit(step, ALL, "compute_s", compute_s)
        self.epoch["data"] += self.data_s
        self.epoch["compute"] += compute_s
        self.epoch["steps"] += 1
        if state.step % state.steps_per_epoch == 0:
            self._close_epoch(state.step)

    def on_eval(self, state: TrainState, row: dict[str, Any]) -> None:
        self.mark = self._now()

    def on_train_end(self, state: TrainState, status: str) -> None:
        if self.epoch["steps"]:
            self._close_epoch(state.step)

    def _close_epoch(self, step: int) -> None:
        data, compute = self.epoch["data"], self.epoch["compute"]
        for quantity, value in (("epoch_data_s", data), ("epoch_compute_s", compute), ("epoch_s", data + compute),
                                ("epoch_steps", self.epoch["steps"])):
            self.emit(step, ALL, quantity, value)
        self.epoch = dict.fromkeys(EPOCH_KEYS, 0.0)

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": dict(self.epoch)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.epoch.update(state.get("epoch", {}))
