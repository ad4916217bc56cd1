"""The ``time`` probe: seconds per training step and per epoch, data loading apart from compute
(BNP Table 1).

The loop alternates two intervals, marked with ``time.perf_counter`` on the CPU and with
CUDA events on a GPU (recorded on the stream, so queued kernels are counted where they run,
and read when an epoch closes: no step waits for the device):

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
from typing import Any, Iterator, Union

import torch

from bnexp.engine.callbacks import TrainState
from bnexp.probes.callback import ALL, Probe, register_probe

EPOCH_KEYS = ("data", "compute", "steps")
Mark = Union[float, "torch.cuda.Event"]


class Interval:
    """From one mark to another, less the marked spans excluded in between."""

    def __init__(self, start: Mark) -> None:
        self.start = start
        self.end: Mark | None = None
        self.excluded: list[tuple[Mark, Mark]] = []

    def seconds(self) -> float:
        return span(self.start, self.end) - sum(span(a, b) for a, b in self.excluded)


def span(a: Mark, b: Mark) -> float:
    """Seconds between two marks (CUDA events: ``b`` must have completed)."""
    return b - a if isinstance(a, float) else a.elapsed_time(b) / 1000.0


@register_probe
class Time(Probe):
    """Wall-clock seconds of data loading and compute, per step and per epoch."""

    name = "time"
    is_clock = True

    def on_train_start(self, state: TrainState) -> None:
        self.cuda = state.device.type == "cuda"
        self.epoch = dict.fromkeys(EPOCH_KEYS, 0.0)
        self.steps: list[tuple[int, bool, Interval, Interval]] = []  # (step, emitted, data, compute), unread
        self.open = Interval(self._mark())

    def _mark(self) -> Mark:
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def _turn(self) -> Interval:
        """Close the open interval here and open the next one; the closed one."""
        closed, self.open = self.open, Interval(self._mark())
        closed.end = self.open.start
        return closed

    @contextlib.contextmanager
    def excluded(self) -> Iterator[None]:
        start = self._mark()
        try:
            yield
        finally:
            self.open.excluded.append((start, self._mark()))

    def before_step(self, state: TrainState) -> None:
        self.data = self._turn()

    def after_step(self, state: TrainState) -> None:
        step = state.step - 1
        self.steps.append((step, self.due(step, state), self.data, self._turn()))
        self.epoch["steps"] += 1
        if state.step % state.steps_per_epoch == 0:
            self._close_epoch(state.step)

    def _read(self) -> None:
        """Turn the unread steps' marks into seconds (on a GPU, once their events have run)."""
        if self.steps and self.cuda:
            self.steps[-1][3].end.synchronize()
        for step, emitted, data, compute in self.steps:
            data_s, compute_s = data.seconds(), compute.seconds()
            if emitted:
                self.emit(step, ALL, "data_s", data_s)
                self.emit(step, ALL, "compute_s", compute_s)
            self.epoch["data"] += data_s
            self.epoch["compute"] += compute_s
        self.steps = []

    def on_eval(self, state: TrainState, row: dict[str, Any]) -> None:
        self.open = Interval(self._mark())  # evaluation is in no interval

    def on_train_end(self, state: TrainState, status: str) -> None:
        if self.epoch["steps"]:
            self._close_epoch(state.step)

    def _close_epoch(self, step: int) -> None:
        self._read()
        data, compute = self.epoch["data"], self.epoch["compute"]
        for quantity, value in (("epoch_data_s", data), ("epoch_compute_s", compute), ("epoch_s", data + compute),
                                ("epoch_steps", self.epoch["steps"])):
            self.emit(step, ALL, quantity, value)
        self.epoch = dict.fromkeys(EPOCH_KEYS, 0.0)

    def state_dict(self) -> dict[str, Any]:
        self._read()
        return {"epoch": dict(self.epoch)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.epoch.update(state.get("epoch", {}))
