"""The probe framework: the :class:`Probe` base classes, their registry, and the one callback
that runs the probes a config asks for and writes their rows to ``probes.csv``.

Config: ``probes=[grad_norm,eta_tau]`` names the probes; ``probe.<name>`` holds each one's
settings (``configs/probe/default.yaml``). ``every`` is common to all: a probe measures at
steps 0, every, 2*every, ... (only at step 0 when ``every=0``) and once more at the end.

``probes.csv`` is long (tidy): one value per row, columns ``step, probe, layer, quantity,
value``. ``step`` is the number of optimizer updates applied to the weights that were
measured (metrics.csv counts the same way); ``layer`` is a module or parameter name, or
``all`` for the whole model. ``read_probes(run).pivot_table(index="step",
columns=["probe", "layer", "quantity"], values="value")`` gives one column per series.
"""

from __future__ import annotations

import contextlib
import csv
from pathlib import Path
from typing import TYPE_CHECKING, Any, ContextManager, Mapping, Optional

from omegaconf import DictConfig, ListConfig

from bnexp.engine.callbacks import Callback, TrainState
from bnexp.support.errors import ConfigError
from bnexp.support.registry import Registry
from bnexp.support.untrusted import TABLE_FILE, open_regular

if TYPE_CHECKING:
    import pandas as pd

PROBES_FILE = "probes.csv"
COLUMNS = ("step", "probe", "layer", "quantity", "value")
ALL = "all"  # the layer name of a whole-model value

Row = tuple[int, str, str, str, float]


class Probe(Callback):
    """One instrument: a callback with a schedule that buffers the rows it measures.

    Subclasses set ``name`` and call :meth:`emit`; the :class:`ProbesCallback` collects the
    rows after every hook. A probe must leave the training trajectory untouched.
    """

    name = ""
    is_clock = False  # the time probe: the callback keeps the other probes' work out of its intervals

    def __init__(self, settings: Mapping[str, Any], cfg: DictConfig) -> None:
        every = settings.get("every", 1)
        if isinstance(every, bool) or not isinstance(every, int) or every < 0:
            raise ConfigError(f"probe.{self.name}.every must be an integer >= 0, got {every!r}")
        self.every = every
        self.rows: list[Row] = []

    def periodic(self, step: int) -> bool:
        """Whether ``step`` is on the schedule: a multiple of ``every`` (only 0 when every=0)."""
        return step % self.every == 0 if self.every else step == 0

    def due(self, step: int, state: TrainState) -> bool:
        """Whether training step ``step`` (0-based) is measured: on the schedule, or the last."""
        return self.periodic(step) or step == state.total_steps - 1

    def emit(self, step: int, layer: str, quantity: str, value: float) -> None:
        self.rows.append((step, self.name, layer, quantity, float(value)))

    def drain(self) -> list[Row]:
        rows, self.rows = self.rows, []
        return rows

    def excluded(self) -> ContextManager[None]:
        """A context whose duration the probe leaves out of its own measurements (the clock)."""
        return contextlib.nullcontext()


class FixedWeightProbe(Probe):
    """A probe that measures the model as it stands between two steps: before step ``s`` on
    the schedule (weights after ``s`` updates), and on the final weights at the end."""

    def measure(self, state: TrainState, step: int) -> None:
        raise NotImplementedError

    def before_step(self, state: TrainState) -> None:
        if self.periodic(state.step):
            self.measure(state, state.step)

    def on_train_end(self, state: TrainState, status: str) -> None:
        self.measure(state, state.step)


PROBES: Registry[type[Probe]] = Registry("probe")


def register_probe(cls: type[Probe]) -> type[Probe]:
    """Class decorator: make ``cls`` available as ``probes=[<cls.name>]``."""
    PROBES.register(cls.name)(cls)
    return cls


class ProbeWriter:
    """Appends rows to ``probes.csv``; a resumed run first cuts the file back to the length
    it had at the checkpoint, so rows written after it are not repeated."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.started = False

    def cut(self, length: int) -> None:
        if self.path.is_file():
            with open(self.path, "r+b") as f:
                f.truncate(length)
            self.started = True

    def append(self, rows: list[Row]) -> None:
        if not rows:
            return
        with open(self.path, "a" if self.started else "w", newline="") as f:
            writer = csv.writer(f)
            if not self.started:
                writer.writerow(COLUMNS)
            writer.writerows(rows)
        self.started = True

    def length(self) -> int:
        return self.path.stat().st_size if self.path.is_file() else 0


class ProbesCallback(Callback):
    """Runs the enabled probes in every hook and flushes their rows (rank 0 writes).

    When the ``time`` probe is on, it runs first and the other probes' work in a hook is
    excluded from its intervals.
    """

    def __init__(self, probes: list[Probe]) -> None:
        self.clock: Optional[Probe] = next((p for p in probes if p.is_clock), None)
        self.others = [p for p in probes if not p.is_clock]
        self.probes = ([self.clock] if self.clock is not None else []) + self.others
        self.writer: Optional[ProbeWriter] = None

    def _dispatch(self, hook: str, state: TrainState, *args: Any) -> None:
        if self.clock is not None:
            getattr(self.clock, hook)(state, *args)
        with self.clock.excluded() if self.clock is not None else contextlib.nullcontext():
            for probe in self.others:
                getattr(probe, hook)(state, *args)
            for probe in self.probes:
                rows = probe.drain()
                if self.writer is not None:
                    self.writer.append(rows)

    def on_train_start(self, state: TrainState) -> None:
        self.writer = ProbeWriter(Path(state.run_dir) / PROBES_FILE) if state.dist.is_main else None
        self._dispatch("on_train_start", state)

    def before_step(self, state: TrainState) -> None:
        self._dispatch("before_step", state)

    def after_backward(self, state: TrainState) -> None:
        self._dispatch("after_backward", state)

    def after_step(self, state: TrainState) -> None:
        self._dispatch("after_step", state)

    def on_eval(self, state: TrainState, row: dict[str, Any]) -> None:
        self._dispatch("on_eval", state, row)

    def on_train_end(self, state: TrainState, status: str) -> None:
        self._dispatch("on_train_end", state, status)

    def state_dict(self) -> dict[str, Any]:
        states = {p.name: p.state_dict() for p in self.probes}  # the clock reads its pending steps here
        for probe in self.probes:  # ... so their rows go to the file before its length is taken
            rows = probe.drain()
            if self.writer is not None:
                self.writer.append(rows)
        length = self.writer.length() if self.writer is not None else 0
        return {"csv_length": length, "probes": states}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.writer is not None and "csv_length" in state:
            self.writer.cut(state["csv_length"])
        for probe in self.probes:
            probe.load_state_dict(state.get("probes", {}).get(probe.name, {}))


def probe_names(cfg: DictConfig) -> list[str]:
    """The probes ``cfg`` enables, without repeats, in the order given."""
    names = cfg.get("probes") or []
    if not isinstance(names, (list, ListConfig)):
        raise ConfigError(f"probes must be a list of probe names such as [grad_norm,time], got {names!r}")
    return list(dict.fromkeys(str(n) for n in names))


def enable_probe(cfg: DictConfig, name: str) -> None:
    """Add probe ``name`` to ``cfg.probes`` unless it is there already."""
    if name not in probe_names(cfg):
        cfg.probes = [*probe_names(cfg), name]


def probes_callback(cfg: DictConfig) -> Optional[ProbesCallback]:
    """The probes of ``cfg.probes`` with their ``cfg.probe.<name>`` settings, or None."""
    names = probe_names(cfg)
    if not names:
        return None
    settings = cfg.get("probe") or {}
    return ProbesCallback([PROBES.get(name)(settings.get(name) or {}, cfg) for name in names])


def read_probes(run_dir: str | Path) -> pd.DataFrame:
    """A run's probes.csv (an empty frame with the columns when there is none); a ConfigError
    naming the file if it does not parse as rows of whole steps and numeric values."""
    import pandas as pd

    path = Path(run_dir) / PROBES_FILE
    if not path.is_file():
        return pd.DataFrame(columns=list(COLUMNS))
    try:
        with open_regular(path, TABLE_FILE) as f:
            rows = pd.read_csv(f, dtype={"step": int, "probe": str, "layer": str, "quantity": str, "value": float})
    except (OSError, ValueError) as err:  # pandas' ParserError and a UnicodeDecodeError are ValueErrors
        raise ConfigError(f"damaged {PROBES_FILE} {path}: {type(err).__name__}: {' '.join(str(err).split())}") \
            from None
    missing = [c for c in COLUMNS if c not in rows]
    if missing:
        raise ConfigError(f"damaged {PROBES_FILE} {path}: no column {', '.join(missing)}")
    return rows
