"""Experiment trackers, chosen with ``logger=<name>`` (``configs/logger/``).

``tensorboard``, ``mlflow`` and ``wandb`` mirror a run to the tracker: the resolved config
as its hyperparameters, every metrics.csv row (losses, accuracies, learning rate, seconds)
under ``metrics/``, the rows the probes and the scale-invariant weights' log add
(``probes.csv`` under ``probes/<probe>/<layer>/<quantity>``, ``weights.csv`` under
``weights/<layer>/<column>``) at each evaluation, and at the end the run's summary (status,
final and best accuracies). A run is named after its directory and grouped by its
directory's parent (a preset's sweep folder, so the seeds of its cells sit together;
``runs`` for a single run and the cells of an ad-hoc sweep, which train where single runs
do). Under torchrun only rank 0 logs (the metrics are already summed over the ranks).
Each tracker is an optional extra (``pip install 'bnexp[mlflow]'``); a missing one is a
ConfigError naming it.

- ``tensorboard``: event files in ``<run dir>/tensorboard`` (or ``logger.dir``), with the
  config and final metrics in the HParams tab (``tensorboard --logdir <sweep folder>``).
- ``mlflow``: MLflow's own tracking store, ``logger.tracking_uri`` (default a SQLite file,
  ``sqlite:///results/mlflow.db``; ``mlflow ui --backend-store-uri <uri>`` shows it), the
  experiment named after the group; the summary and config as JSON artifacts
  (``bnexp_summary.json``, ``config.json``).
- ``wandb``: Weights & Biases, ``logger.project`` (``WANDB_MODE=offline`` keeps everything
  in ``<run dir>/wandb`` for a later ``wandb sync``).

A stopped run (a signal, Ctrl-C, an error) closes its tracker run with its status, and a
resumed run continues the tracker run its checkpoint names (:class:`Tracker`).
"""

from __future__ import annotations

import contextlib
import csv
import fcntl
import importlib
import io
import logging
import math
import time
from pathlib import Path
from typing import Any, Iterator, Mapping

from omegaconf import DictConfig, OmegaConf

from bnexp.engine.callbacks import Callback, TrainState
from bnexp.engine.identity import flatten
from bnexp.engine.preemption import STOP_EXIT_CODES
from bnexp.support.errors import ConfigError

log = logging.getLogger(__name__)

NOT_SCALARS = ("step", "epoch")
SUMMARY_KEYS = ("status", "final_top1", "best_top1", "final_top5", "best_top5", "final_test_loss", "final_train_loss",
                "steps", "params")
MLFLOW_STATUS = {"completed": "FINISHED", "preempted": "KILLED", "interrupted": "KILLED"}  # else FAILED


def scalars(row: Mapping[str, Any], prefix: str) -> dict[str, float]:
    """The finite numbers of a row, keyed ``<prefix>/<column>``."""
    return {f"{prefix}/{k}": float(v) for k, v in row.items()
            if k not in NOT_SCALARS and isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)}


class SideFiles:
    """The rows the probes (``probes.csv``) and the weights' log (``weights.csv``) appended
    since the last read, as scalars per step. Each read starts where the last one ended (a
    byte offset), so a long run's files are not parsed again at every evaluation."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir
        self.seen = {"probes.csv": 0, "weights.csv": 0}  # bytes of each file read so far

    def new(self) -> dict[int, dict[str, float]]:
        out: dict[int, dict[str, float]] = {}
        for name, key in (("probes.csv", self._probe_key), ("weights.csv", self._weight_keys)):
            path = self.run_dir / name
            if not path.is_file():
                continue
            with open(path, "rb") as f:
                header = f.readline()
                start = max(self.seen[name], len(header))
                f.seek(start)
                data = f.read()
            data = data[:data.rfind(b"\n") + 1]  # whole rows only
            fields = next(csv.reader([header.decode()]), [])
            for row in csv.DictReader(io.StringIO(data.decode(), newline=""), fieldnames=fields):
                out.setdefault(int(row["step"]), {}).update(key(row))
            self.seen[name] = start + len(data)
        return out

    @staticmethod
    def _probe_key(row: Mapping[str, str]) -> dict[str, float]:
        value = float(row["value"])
        name = "/".join(p for p in ("probes", row["probe"], row["layer"], row["quantity"]) if p)
        return {name: value} if math.isfinite(value) else {}

    @staticmethod
    def _weight_keys(row: Mapping[str, str]) -> dict[str, float]:
        return {f"weights/{row['layer']}/{k}": float(v) for k, v in row.items()
                if k not in ("step", "epoch", "layer") and v not in ("", None) and math.isfinite(float(v))}


class Tracker(Callback):
    """What every tracker does; subclasses open, log and close in their own API.

    The tracker's run opens at the first step, after a checkpoint (if any) was restored: a
    resumed run continues the tracker run its checkpoint names (``run_id``), and the side
    files' rows sent before the checkpoint are not sent again. A run that stops (a signal,
    Ctrl-C, an error) closes its tracker run with that status."""

    module = ""  # the package it needs
    extra = ""  # bnexp's extra that installs it

    def __init__(self, settings: Mapping[str, Any]) -> None:
        self.settings = dict(settings)
        self.opened = False
        self.side: SideFiles | None = None
        self.run_id: str | None = None  # the tracker's own id of its run, once opened or restored

    def on_train_start(self, state: TrainState) -> None:
        """Check the package is there (every rank, so all stop alike); rank 0 will log."""
        try:
            importlib.import_module(self.module)
        except ImportError as err:
            raise ConfigError(f"logger={self.settings.get('name')} needs the {self.module} package, which is not "
                              f"installed: pip install 'bnexp[{self.extra}]'") from err
        if state.dist.is_main:
            self.side = SideFiles(Path(state.run_dir))

    @contextlib.contextmanager
    def failure_ends_tracking(self, what: str) -> Iterator[None]:
        """A tracker call whose failure (the tracker unreachable, its store locked) costs a
        warning and the rest of this run's tracking, never the run: metrics.csv, probes.csv,
        weights.csv and summary.json still hold everything."""
        try:
            yield
        except Exception as err:
            log.warning("logger=%s: %s failed (%s: %s); the run goes on without the tracker", self.settings.get("name"),
                        what, type(err).__name__, err)
            self.side, self.opened = None, False

    def ensure_open(self, state: TrainState) -> None:
        """Open (or, resumed, reopen) the tracker's run on rank 0, once."""
        if self.side is None or self.opened:
            return
        run_dir = Path(state.run_dir)
        config = OmegaConf.to_container(state.cfg, resolve=True)
        with self.failure_ends_tracking("opening its run"):
            self.run_id = self.open(run_dir, run_dir.name, run_dir.parent.name, config, self.run_id, state.step)
            self.opened = True

    def before_step(self, state: TrainState) -> None:
        self.ensure_open(state)

    def on_eval(self, state: TrainState, row: dict[str, Any]) -> None:
        self.ensure_open(state)
        if self.opened:
            with self.failure_ends_tracking("logging"):
                self.log_side_files()
                self.log(scalars(row, "metrics"), int(row["step"]))

    def on_train_end(self, state: TrainState, status: str) -> None:
        self.ensure_open(state)  # a run resumed at its last step trains no step
        self.finish(state, status)

    def on_train_stop(self, state: TrainState, status: str) -> None:
        self.finish(state, status)

    def finish(self, state: TrainState, status: str) -> None:
        if not self.opened:
            return
        with self.failure_ends_tracking("closing its run"):
            self.log_side_files()
            summary = {k: state.summary[k] for k in SUMMARY_KEYS if k in state.summary} | {"status": status}
            self.close(summary, status)
        self.opened = False

    def log_side_files(self) -> None:
        assert self.side is not None
        for step, values in sorted(self.side.new().items()):
            self.log(values, step)

    def state_dict(self) -> dict[str, Any]:
        """For a checkpoint: the side files' rows so far go to the tracker first, so a run
        resumed from this checkpoint sends none of them again."""
        if self.opened:
            with self.failure_ends_tracking("logging"):
                self.log_side_files()
        if self.side is None:
            return {}
        return {"run_id": self.run_id, "seen": dict(self.side.seen), "run_dir": str(self.side.run_dir)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue the checkpoint's tracker run only when the checkpoint is this run's own
        (``trainer.resume=FILE`` may name another run's)."""
        if self.side is not None and state.get("run_dir") == str(self.side.run_dir):
            self.run_id = state["run_id"]
            self.side.seen.update(state["seen"])

    def open(self, run_dir: Path, name: str, group: str, config: dict[str, Any], resume_id: str | None,
             step: int) -> str | None:
        """Start the tracker's run, or continue run ``resume_id`` from ``step``; its id."""
        raise NotImplementedError

    def log(self, values: Mapping[str, float], step: int) -> None:
        raise NotImplementedError

    def close(self, summary: Mapping[str, Any], status: str) -> None:
        raise NotImplementedError


def hparam(value: Any) -> Any:
    """A config value as TensorBoard's HParams plugin takes it (bool, number or string)."""
    return value if isinstance(value, (bool, int, float, str)) else str(value)


class TensorBoardLogger(Tracker):
    module, extra = "tensorboard", "tensorboard"

    def open(self, run_dir: Path, name: str, group: str, config: dict[str, Any], resume_id: str | None,
             step: int) -> str | None:
        from torch.utils.tensorboard import SummaryWriter

        self.config = {k: hparam(v) for k, v in flatten(config).items()}
        folder = str(Path(self.settings.get("dir") or run_dir / "tensorboard"))
        # Resumed: TensorBoard hides the events a killed process wrote after the checkpoint.
        self.writer = SummaryWriter(log_dir=folder, purge_step=step + 1 if step else None)
        return None

    def log(self, values: Mapping[str, float], step: int) -> None:
        for key, value in values.items():
            self.writer.add_scalar(key, value, global_step=step)
        self.writer.flush()

    def close(self, summary: Mapping[str, Any], status: str) -> None:
        """The HParams entry only for a finished run: TensorBoard keeps the first one a folder
        holds, so a stopped run's would outlive its resumption."""
        if status in ("completed", "diverged"):
            finals = {f"hparams/{k}": float(v) for k, v in summary.items() if isinstance(v, (int, float))}
            self.writer.add_hparams(self.config | {"status": status}, finals, run_name=".")
        self.writer.close()


class MLflowLogger(Tracker):
    module, extra = "mlflow", "mlflow"

    def open(self, run_dir: Path, name: str, group: str, config: dict[str, Any], resume_id: str | None,
             step: int) -> str | None:
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        uri = self.settings.get("tracking_uri") or "sqlite:///results/mlflow.db"
        store = Path(uri.removeprefix("sqlite:///")) if uri.startswith("sqlite:///") else None
        if store is not None:
            store.parent.mkdir(parents=True, exist_ok=True)
        # One process at a time creates the database and the experiment (parallel sweep jobs race otherwise).
        with open(store.with_name(store.name + ".lock"), "a") if store else contextlib.nullcontext() as lock:
            if lock is not None:
                fcntl.flock(lock, fcntl.LOCK_EX)
            self.client = MlflowClient(tracking_uri=uri)
            experiment_name = self.settings.get("experiment") or group
            experiment = self.client.get_experiment_by_name(experiment_name)
            if experiment is None:  # artifacts beside the database, not in the working directory
                artifacts = (store.parent / "mlflow-artifacts").resolve().as_uri() if store else None
                experiment_id = self.client.create_experiment(experiment_name, artifact_location=artifacts)
            else:
                experiment_id = experiment.experiment_id
        if resume_id is not None and self.known(resume_id):  # its parameters and config are logged already
            self.client.update_run(resume_id, status="RUNNING")
            return resume_id
        run_id = self.client.create_run(experiment_id, run_name=name, tags={"run_dir": str(run_dir)}).info.run_id
        params = [Param(k, str(v)[:6000]) for k, v in flatten(config).items()]
        for start in range(0, len(params), 100):  # MLflow takes 100 parameters per batch
            self.client.log_batch(run_id, params=params[start:start + 100])
        self.client.log_dict(run_id, config, "config.json")
        return run_id

    def known(self, run_id: str) -> bool:
        """Whether the store holds run ``run_id`` (a resumed run's store may be another one)."""
        from mlflow.exceptions import MlflowException

        try:
            self.client.get_run(run_id)
        except MlflowException:
            log.warning("MLflow run %s, named in the checkpoint, is not in %s: starting a new MLflow run", run_id,
                        self.client.tracking_uri)
            return False
        return True

    def log(self, values: Mapping[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(k, v, now, step) for k, v in values.items()]
        for start in range(0, len(metrics), 1000):
            self.client.log_batch(self.run_id, metrics=metrics[start:start + 1000])

    def close(self, summary: Mapping[str, Any], status: str) -> None:
        self.client.log_dict(self.run_id, dict(summary), "bnexp_summary.json")  # not summary.json: tables read those
        self.client.set_tag(self.run_id, "status", status)
        self.client.set_terminated(self.run_id, MLFLOW_STATUS.get(status, "FAILED"))


class WandbLogger(Tracker):
    module, extra = "wandb", "wandb"

    def open(self, run_dir: Path, name: str, group: str, config: dict[str, Any], resume_id: str | None,
             step: int) -> str | None:
        import wandb

        self.run = wandb.init(project=self.settings.get("project") or "bnexp", entity=self.settings.get("entity"),
                              group=group, name=name, dir=str(run_dir), config=config, reinit="create_new",
                              id=resume_id, resume="allow" if resume_id else None, allow_val_change=bool(resume_id))
        return self.run.id

    def log(self, values: Mapping[str, float], step: int) -> None:
        self.run.log(dict(values), step=step)

    def close(self, summary: Mapping[str, Any], status: str) -> None:
        self.run.summary.update(dict(summary))
        if status == "preempted":
            self.run.mark_preempting()
        self.run.finish(exit_code=0 if status == "completed" else STOP_EXIT_CODES.get(status, 1))


TRACKERS = {"tensorboard": TensorBoardLogger, "mlflow": MLflowLogger, "wandb": WandbLogger}


def logger_callback(cfg: DictConfig) -> Callback | None:
    """The tracker ``logger=`` names (None for ``logger=none``)."""
    settings = OmegaConf.to_container(cfg.logger, resolve=True) if "logger" in cfg else {"name": "none"}
    tracker = TRACKERS.get(str(settings.get("name")))
    return None if tracker is None else tracker(settings)
