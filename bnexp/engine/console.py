"""What a run tells its user, on the console and in ``train.log`` alike (a terminal or not:
nohup, SLURM): a banner as training starts (run directory, model and parameter count,
device, data set and size, steps), the projected wall time once the first steps are timed
(with a warning when a long run trains on a CPU), and one line per evaluation with the test
accuracy, which the progress bar shows too (:meth:`RunConsole.postfix`).

:class:`RunConsole` is a hook of the :class:`~bnexp.engine.trainer.Trainer` that keeps no
state in checkpoints: it is not one of the hooks a run's checkpoint lists.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch

from bnexp.engine.callbacks import Callback, TrainState
from bnexp.support.runinfo import duration

log = logging.getLogger("bnexp.run")

TIMED_STEPS = 20  # steps timed for the projection (fewer when the run has fewer left)
TIMED_SECONDS = 30.0  # or as many as this many seconds take, for slow steps
CPU_WARNING_SECONDS = 3600.0  # a projection beyond this on a CPU warns: the protocols are meant for a GPU


def device_text(device: torch.device, asked: str) -> str:
    """The device a run trains on, and why a CPU when ``trainer.device=auto`` chose it."""
    if device.type == "cuda":
        return f"{device} ({torch.cuda.get_device_name(device)})"
    return f"{device} (no CUDA GPU is visible)" if asked == "auto" else str(device)


def banner(state: TrainState, run_dirs: Sequence[Path], params: Any) -> str:
    """The lines that open a run's log: where it writes, what it trains, on what, how long."""
    cfg, runs = state.cfg, len(run_dirs)
    budget = "" if cfg.trainer.max_steps is not None else f" ({cfg.trainer.epochs} epochs)"
    every = f"every {cfg.trainer.eval_unit}" if cfg.trainer.eval_every == 1 else \
        f"every {cfg.trainer.eval_every} {cfg.trainer.eval_unit}s"
    where = [f"run directory {run_dirs[0]}"] if runs == 1 else \
        [f"a pack of {runs} runs trained as one model:", *(f"  {d}" for d in run_dirs)]
    count = f"{params:,}" if isinstance(params, int) else "?"
    size = f"{len(state.train_data):,} training images" if state.train_data is not None else "training images"
    return "\n".join([
        *where,
        f"  model {cfg.model.name} ({count} parameters{' each' if runs > 1 else ''}), norm {cfg.norm.name}, "
        f"act {cfg.act.name}, on {device_text(state.device, str(cfg.trainer.device))}",
        f"  data {cfg.data.name}: {size}, batches of {cfg.trainer.batch_size} ({state.steps_per_epoch:,} steps an epoch)",
        f"  {state.total_steps:,} steps{budget}, an evaluation {every}",
    ])


def eval_line(row: Mapping[str, Any], total: int, best: float, label: str = "") -> str:
    """One evaluation: where training is, the test accuracy (and best so far), the losses."""
    top5 = f", top-5 {row['test_top5']:.2f}%" if "test_top5" in row else ""
    return (f"{label}eval at step {row['step']:,}/{total:,} (epoch {row['epoch']:.2f}): test top-1 "
            f"{row['test_acc']:.2f}%{top5} (best {best:.2f}%), test loss {row['test_loss']:.4f}; "
            f"train loss {row['train_loss']:.4f}, top-1 {row['train_acc']:.2f}%")


class RunConsole(Callback):
    """The banner, the projection and the evaluation lines of one run or pack (rank 0 alone
    speaks under torchrun). ``labels``: how each run of a pack is named in its lines."""

    def __init__(self, run_dirs: Sequence[Path], labels: Sequence[str], params: Any) -> None:
        self.run_dirs, self.labels, self.params = list(run_dirs), list(labels), params
        self.tests: dict[int, float] = {}  # each run's latest test top-1
        self.timing: tuple[int, float] | None = None  # (step, clock) where the timed steps start
        self.timed = False
        self.speaks = True

    def on_train_start(self, state: TrainState) -> None:
        self.speaks = state.dist.is_main
        if self.speaks:
            log.info("%s", banner(state, self.run_dirs, self.params))

    def after_step(self, state: TrainState) -> None:
        """Time the first steps this process trains (the very first, which compiles and warms
        up, excepted), then project the steps left, once."""
        if self.timed or not self.speaks:
            return
        if self.timing is None:
            self.timing = (state.step, self.clock(state))
            return
        start, began = self.timing
        if state.step - start < TIMED_STEPS and time.perf_counter() - began < TIMED_SECONDS:
            return
        self.timed = True
        left = state.total_steps - state.step
        if left > 0:
            self.project(state, start, (self.clock(state) - began) / (state.step - start), left)

    @staticmethod
    def clock(state: TrainState) -> float:
        """Now, once the device has done the work queued so far."""
        if state.device.type == "cuda":
            torch.cuda.synchronize(state.device)
        return time.perf_counter()

    def project(self, state: TrainState, start: int, per_step: float, left: int) -> None:
        """Log the projected wall time of the steps left; warn when it is long on a CPU."""
        rest = per_step * left
        log.info("timed steps %d-%d: %.4g s a step; the %s steps left take about %s (evaluations and checkpoints "
                 "not counted)", start + 1, state.step, per_step, f"{left:,}", duration(rest))
        if state.device.type == "cpu" and rest > CPU_WARNING_SECONDS:
            log.warning("this run trains about %s on the CPU: bnexp's paper protocols are meant for a GPU. For a "
                        "short run here, set trainer.max_steps or trainer.epochs, train on data=digits, or run a "
                        "preset at scale=quick", duration(rest))

    def evaluated(self, index: int, row: Mapping[str, Any], total: int, best: float) -> None:
        """One line for run ``index``'s evaluation ``row`` (a metrics.csv row; ``best``: its best
        test top-1 so far, this one included)."""
        self.tests[index] = float(row["test_acc"])
        if self.speaks:
            log.info("%s", eval_line(row, total, best, self.labels[index]))

    def postfix(self) -> dict[str, str]:
        """The progress bar's test entry: each run's latest test top-1 (none before the first)."""
        return {"test": " ".join(f"{self.tests[i]:.2f}%" for i in sorted(self.tests))} if self.tests else {}
