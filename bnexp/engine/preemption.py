"""Turning SIGTERM / SIGUSR1 / SIGUSR2 / SIGINT into "checkpoint at the next step, then stop".

Cluster schedulers warn a job before they preempt it (SLURM sends SIGTERM, or the signal
set with ``--signal``; submitit asks for SIGUSR2), and a user stops a run with Ctrl-C
(SIGINT). While a run trains, these signals only set a flag; the loop checks it after each
step, writes a checkpoint and raises :class:`Preempted` (status ``preempted``, exit 75; after
Ctrl-C: ``interrupted``, exit 130). A second Ctrl-C stops at once (KeyboardInterrupt). A
handler installed before bnexp's (submitit's requeue handler, for one) is called after the
checkpoint is safely on disk.
"""

from __future__ import annotations

import signal
import threading
from types import FrameType
from typing import Any, Callable

from bnexp.support.distributed import max_over_ranks
from bnexp.support.errors import EXIT_INTERRUPTED, EXIT_PREEMPTED

SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2, signal.SIGINT)


STOP_EXIT_CODES = {"preempted": EXIT_PREEMPTED, "interrupted": EXIT_INTERRUPTED}  # the statuses of a stopped run


class Preempted(Exception):
    """The run stopped on a signal after writing a checkpoint (or before training started,
    with nothing to checkpoint); re-run to resume."""

    def __init__(self, signum: int, before_training: bool = False) -> None:
        name = "Ctrl-C (SIGINT)" if signum == signal.SIGINT else signal.Signals(signum).name
        when = "before training started (nothing to checkpoint yet)" if before_training else "after writing a checkpoint"
        super().__init__(f"stopped by {name} {when}")
        self.signum, self.signal_name = signum, name
        self.status = "interrupted" if signum == signal.SIGINT else "preempted"
        self.exit_code = STOP_EXIT_CODES[self.status]


class PreemptionGuard:
    """Context manager recording the first preemption signal received.

    ``on_signal`` (optional) is called with that signal as it arrives; the process that
    launches torchrun uses it to pass the signal on to the ranks.
    """

    def __init__(self, on_signal: Callable[[int], None] | None = None) -> None:
        self.signum: int | None = None
        self.on_signal = on_signal
        self._previous: dict[int, Any] = {}

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if signum == signal.SIGINT and self.signum == signal.SIGINT:
            raise KeyboardInterrupt  # a second Ctrl-C: stop now
        if self.signum is None:
            self.signum = signum
            if self.on_signal is not None:
                self.on_signal(signum)

    def __enter__(self) -> "PreemptionGuard":
        if threading.current_thread() is threading.main_thread():
            for sig in SIGNALS:
                previous = signal.signal(sig, self._handle)
                owner = getattr(previous, "__self__", None)  # the set-up's handler: forward to the one before it
                self._previous[sig] = owner.previous.get(sig) if isinstance(owner, StopAtOnce) else previous
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def agreed(self) -> bool:
        """Whether any process received a signal; under torchrun every process calls this
        each step, so all of them checkpoint and stop at the same step."""
        self.signum = max_over_ranks(self.signum or 0) or None
        return self.signum is not None

    def forward(self) -> None:
        """Call the handler that was installed before ours for the received signal."""
        previous = self._previous.get(self.signum) if self.signum is not None else None
        if callable(previous) and previous is not signal.default_int_handler:  # that one raises KeyboardInterrupt
            previous(self.signum, None)


class StopAtOnce:
    """Context manager for a run's set-up (checking, reading data, building the model): a
    preemption signal stops it at once, as :class:`Preempted` (``before_training``), after the
    handler installed before it (submitit's requeue) has run; there is nothing to checkpoint.
    SIGINT is left alone: Ctrl-C's KeyboardInterrupt already stops a set-up. The training
    loop's :class:`PreemptionGuard` takes over from it."""

    def __init__(self) -> None:
        self.previous: dict[int, Any] = {}

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        previous = self.previous.get(signum)
        if callable(previous):
            previous(signum, frame)
        raise Preempted(signum, before_training=True)

    def __enter__(self) -> "StopAtOnce":
        if threading.current_thread() is threading.main_thread():
            for sig in (s for s in SIGNALS if s != signal.SIGINT):
                self.previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)
        self.previous.clear()
