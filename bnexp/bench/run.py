"""``bnexp bench run``: the wall time of a short training run, extrapolated to a full one.

Trains ``trainer.epochs`` epochs (2 unless overridden) with an evaluation after each,
``reps`` times, each in a fresh temporary directory. The first epoch pays for start-up
(compilation, autotuning); the later ones give the steady seconds per epoch, evaluation
included, so ``target_epochs`` take about ``wall + (target_epochs - epochs) * steady``. The
ratio is that estimate over ``target_seconds``. With ``jobs=K`` the command also trains K
copies at once with joblib (separate processes) and compares their wall time with K runs
one after another. With ``trainer.pack=K`` the run is a pack of K seeds trained as one
model (:mod:`bnexp.engine.pack`), timed as a whole (the K runs finish together). Every other
``key=value`` is a Hydra override of the run (``trainer.amp=bf16 trainer.compile=true``).
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path
from typing import Any, Mapping, Sequence

import pandas as pd
from joblib import Parallel, delayed
from omegaconf import DictConfig

from bnexp.app.jobs import with_value
from bnexp.bench.common import Record, compose_train, device_of, record
from bnexp.engine.pack import train_pack
from bnexp.engine.trainer import train
from bnexp.support.errors import BnexpError, ConfigError
from bnexp.support.workers import ends_with_parent

DEFAULTS: dict[str, Any] = {"reps": 3, "device": "auto", "threads": 0, "target_epochs": 120, "target_seconds": 120.0,
                            "jobs": 1, "out": "results/bench/run.json"}
COLUMNS = ("name", "mode", "seconds_median", "seconds_iqr", "epoch_seconds", "extrapolated_seconds", "baseline",
           "ratio")
RUN_OVERRIDES = ("trainer.epochs=2", "trainer.max_steps=null", "trainer.eval_every=1", "trainer.eval_unit=epoch",
                 "trainer.resume=never")


def short_run(cfg: DictConfig, run_dir: Path) -> tuple[dict[str, Any], float]:
    """Train once (a pack of ``trainer.pack`` seeds when above 1): (the first run's summary,
    median seconds per epoch after the first)."""
    runs = int(cfg.trainer.pack)
    if runs > 1:
        seeds = range(cfg.trainer.seed, cfg.trainer.seed + runs)
        summary = train_pack([with_value(cfg, "trainer.seed", s) for s in seeds], [run_dir / f"seed{s}" for s in seeds])[0]
        run_dir = run_dir / f"seed{seeds[0]}"
    else:
        summary = train(cfg, run_dir)
    if summary["status"] != "completed":
        raise BnexpError(f"the benchmark run ended with status {summary['status']} (see {run_dir})")
    seconds = pd.read_csv(run_dir / "metrics.csv")["seconds"].tolist()
    return summary, statistics.median(b - a for a, b in zip(seconds, seconds[1:]))


def packed_seconds(cfg: DictConfig, root: Path, jobs: int) -> float:
    """Wall seconds of ``jobs`` copies of the run trained at once in joblib worker processes."""
    start = time.perf_counter()
    Parallel(n_jobs=jobs)(delayed(ends_with_parent(train))(cfg, root / f"packed-{i}") for i in range(jobs))
    return time.perf_counter() - start


def bench(options: Mapping[str, Any], overrides: Sequence[str]) -> list[Record]:
    device = device_of(options)
    cfg = compose_train([*RUN_OVERRIDES, f"trainer.device={options['device']}", *overrides])
    epochs = cfg.trainer.epochs
    if not isinstance(epochs, int) or epochs < 2:
        raise ConfigError(f"bench run needs trainer.epochs >= 2 (a whole number) to time a steady epoch, got {epochs}")
    mode = "compiled" if cfg.trainer.compile else "eager"
    target = f"{options['target_epochs']} epochs in {options['target_seconds']:g} s"
    with tempfile.TemporaryDirectory() as tmp:
        runs = [short_run(cfg, Path(tmp) / f"run-{i}") for i in range(options["reps"])]
        walls = [summary["wall_seconds"] for summary, _ in runs]
        estimates = [wall + (options["target_epochs"] - epochs) * steady for wall, (_, steady) in zip(walls, runs)]
        estimate = statistics.median(estimates)
        name = f"run x{cfg.trainer.pack} (packed)" if cfg.trainer.pack > 1 else "run"
        single = record(name, mode, device, walls, target, ratio=estimate / options["target_seconds"],
                        epochs=epochs, model=cfg.model.name, norm=cfg.norm.name, data=cfg.data.name,
                        amp=cfg.trainer.amp, channels_last=cfg.trainer.channels_last,
                        loader=runs[0][0]["loader"], extrapolated_seconds=estimate,
                        epoch_seconds=statistics.median(steady for _, steady in runs))
        records = [single]
        jobs = options["jobs"]
        if jobs > 1:
            pack = packed_seconds(cfg, Path(tmp), jobs)
            records.append(record(f"run x{jobs} (joblib)", mode, device, [pack], f"run x{jobs} in sequence",
                                  ratio=pack / (jobs * single["seconds_median"]), jobs=jobs))
    return records
