"""A ``bnexp train`` job: what Hydra runs for each run of a single run or a multirun.

Each job (:func:`train_job`) takes the run directory's lock, skips a run that finished
already with the same settings (and refuses one that finished with other settings), records
its overrides in ``.hydra/``, spreads sweep jobs over the visible GPUs, starts
``trainer.nproc`` processes through torchrun when asked, and trains. A failure ends a
single run with its exit code; in a sweep it is recorded and the sweep goes on. Ctrl-C and
preemption stop a sweep too, after its report.
"""

from __future__ import annotations

import logging
import math
import os
import sys
import traceback
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, Sequence

from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf, open_dict, read_write

from bnexp.app.cells import note_cell
from bnexp.app.cmdline import pack_misplaced
from bnexp.app.compose import prepare_config_tree
from bnexp.app.sweep import job_status, record, skip_or_home, spread_over_gpus
from bnexp.app.torchrun import check_gpus, follow_launcher, run_under_torchrun
from bnexp.engine.config import meaningless, validate
from bnexp.engine.identity import override_key, run_name
from bnexp.engine.pack import train_pack
from bnexp.engine.preemption import STOP_EXIT_CODES, Preempted
from bnexp.engine.trainer import train
from bnexp.support.distributed import from_environment
from bnexp.support.errors import EXIT_FAILED, EXIT_INTERRUPTED, BnexpError, ConfigError
from bnexp.support.options import print_error, print_warning
from bnexp.support.runinfo import read_run_json, storage_error
from bnexp.support.runlock import HELD_ENV, RunLock, RunLocked
from bnexp.support.workers import ends_with_parent

log = logging.getLogger("bnexp")


def report_error(message: str, details: str = "", to_log: bool = True) -> None:
    """One error paragraph on stderr; it and ``details`` (a traceback) also go to the run's
    log file (``train.log``), so a failed run's directory says why it failed (not when
    ``to_log`` is false: the directory belongs to another process)."""
    print_error(message)
    if not to_log:
        return
    record = log.makeRecord(log.name, logging.ERROR, __file__, 0, f"{message}\n{details}".rstrip(), None, None)
    for handler in logging.getLogger().handlers:
        if isinstance(handler, logging.FileHandler):
            handler.handle(record)


def console_log_only_off_rank_0() -> None:
    """Ranks above 0 log to their console only, so that rank 0 alone writes the run's
    ``train.log``. Under torchrun their Hydra logging is off already (:func:`rank_overrides`);
    Hydra's submitit launcher runs the whole Hydra job, file logging included, in every
    SLURM task."""
    if from_environment().is_main:
        return
    root = logging.getLogger()
    for handler in [h for h in root.handlers if isinstance(h, logging.FileHandler)]:
        root.removeHandler(handler)
        handler.close()


@dataclass(frozen=True)
class Job:
    """One run to train: its config, its Hydra config and its directory."""

    cfg: DictConfig
    hydra_cfg: DictConfig
    run_dir: Path


def result_value(status: str, summary: Mapping[str, Any]) -> float:
    """What a job returns to a sweeper (an Optuna search maximizes it): the final top-1 of a
    completed run (also when a re-run skips it), NaN for any other outcome (diverged, failed,
    locked, stopped), which Optuna records as a failed trial."""
    top1 = summary.get("final_top1")
    done = status == "completed" or (status == "skipped" and summary.get("status") == "completed")
    return float(top1) if done and top1 is not None else math.nan


def stored_summary(run_dir: Path) -> dict[str, Any]:
    """A run directory's summary.json, empty when it has none (or none that reads)."""
    try:
        return read_run_json(run_dir / "summary.json")
    except ConfigError:
        return {}


@ends_with_parent  # in a launcher's worker process (joblib): stop when the sweep's process has ended
def train_job(cfg: DictConfig) -> float:
    """One Hydra job; returns the run's final top-1 (:func:`result_value`: NaN when it did
    not complete).

    The outcome goes to the sweep's ledger (:func:`bnexp.app.sweep.record`). A failure ends a
    single run with its exit code; in a sweep the next cell runs. A preemption or Ctrl-C
    ends the sweep (the whole job is being stopped). ``trainer.pack=K`` trains seeds
    ``trainer.seed`` to ``trainer.seed + K - 1`` as one pack (:func:`pack_jobs`); in a sweep
    it is the size of the packing launcher's packs (:func:`packing_launcher`).
    """
    hydra_cfg = HydraConfig.get()
    sweeping = hydra_cfg.mode == RunMode.MULTIRUN
    run_dir = Path(hydra_cfg.runtime.output_dir)
    prepare_config_tree()  # a launcher's worker process starts without them
    console_log_only_off_rank_0()
    pack = cfg.trainer.get("pack", 1)
    problem = pack_misplaced(pack, sweeping, str(hydra_cfg.get("launcher", {}).get("_target_", "")))
    if problem:  # the command line's check catches it first (bnexp.app.cmdline)
        report_error(problem, to_log=False)
        sys.exit(ConfigError.exit_code)
    # In a sweep under the packing launcher trainer.pack sizes its packs; this job is alone in its own.
    if isinstance(pack, int) and pack > 1 and not sweeping:
        return train_pack_job(pack_jobs(Job(cfg, hydra_cfg, run_dir), pack), sweeping)[0]

    def single() -> list[tuple[str, Any]]:
        follow_launcher()  # a rank started by bnexp's launcher ends with it and shares its lock
        with RunLock(run_dir, enabled=from_environment().is_main):
            return [run_job(cfg, hydra_cfg, run_dir, sweeping)]

    return run_and_record([run_dir], sweeping, single)[0]


ENDED = ("completed", "diverged")  # the statuses of a run that a signal cannot leave unfinished


def run_and_record(run_dirs: list[Path], sweeping: bool, work: Callable[[], list[tuple[str, Any]]]) -> list[Any]:
    """Run ``work`` (the (status, value) of each of ``run_dirs``), recording each outcome in
    the sweep's ledger; returns the values (:func:`result_value`), NaN for a run that failed."""
    where = ", ".join(str(d) for d in run_dirs)
    try:
        outcomes = work()
    except Preempted as err:
        # A run may have diverged before the signal, or completed as it came.
        statuses = [stored_summary(run_dir).get("status") for run_dir in run_dirs]
        for run_dir, status in zip(run_dirs, statuses):
            record(run_dir, status if status in ENDED else err.status, str(err))
        if all(status in ENDED for status in statuses):
            print_warning(f"{where} {' / '.join(dict.fromkeys(statuses))}, nothing to resume; {err.signal_name} "
                          "came as it ended and stopped the command")
        else:
            report_error(f"{err}; re-run the same command to resume {where}")
        sys.exit(err.exit_code)
    except KeyboardInterrupt:
        for run_dir in run_dirs:
            diverged = stored_summary(run_dir).get("status") == "diverged"
            record(run_dir, "diverged" if diverged else "interrupted", "stopped by Ctrl-C")
        report_error(f"stopped by Ctrl-C; re-run the same command to resume {where}")
        sys.exit(EXIT_INTERRUPTED)
    except BnexpError as err:
        for run_dir in run_dirs:
            record(run_dir, "locked" if isinstance(err, RunLocked) else "failed", str(err))
        report_error(str(err), to_log=err.in_run_log)
        if not sweeping:
            sys.exit(err.exit_code)
        return [math.nan] * len(run_dirs)
    except Exception as err:  # recorded in summary.json with its traceback
        for run_dir in run_dirs:
            record(run_dir, "failed", f"{type(err).__name__}: {err}")
        if storage_error(err):  # its log and summary may not be writable either
            report_error(f"cannot write to {where} ({type(err).__name__}: {err}): a full disk, a quota or a file-size "
                         "limit (ulimit -f); what was written before is kept. Make room, then re-run the same command "
                         "to resume", to_log=False)
        else:
            report_error(f"run failed with {type(err).__name__}: {err} (traceback in {run_dirs[0] / 'summary.json'})",
                         traceback.format_exc())
        if not sweeping:
            sys.exit(EXIT_FAILED)
        return [math.nan] * len(run_dirs)
    for run_dir, (status, _) in zip(run_dirs, outcomes):
        record(run_dir, status)
    return [value for _, value in outcomes]


def pack_jobs(job: Job, pack: int) -> list[Job]:
    """The ``pack`` runs of ``trainer.pack`` on one command line: seeds ``trainer.seed`` and up,
    each as its own command (``trainer.seed=S``, without ``trainer.pack``) would run it, in
    the directory that command would use; with a custom ``hydra.run.dir``, the others go
    beside it as ``<dir>-seed<S>``."""
    first = int(job.cfg.trainer.seed)
    given = [o for o in job.hydra_cfg.overrides.task if override_key(o) != "trainer.pack"]
    rest = [o for o in given if override_key(o) != "trainer.seed"]
    named = job.run_dir.name == run_name(given, str(job.run_dir.parent))  # the default hydra.run.dir
    jobs = []
    for seed in range(first, first + pack):
        overrides = [*rest, f"trainer.seed={seed}"] if seed != first or len(rest) < len(given) else rest
        if named:
            run_dir = job.run_dir.parent / run_name(overrides, str(job.run_dir.parent))
        else:
            run_dir = job.run_dir if seed == first else job.run_dir.with_name(f"{job.run_dir.name}-seed{seed}")
        cfg = with_value(with_value(job.cfg, "trainer.seed", seed), "trainer.pack", 1)
        jobs.append(Job(cfg, with_overrides(job.hydra_cfg, overrides, run_dir), run_dir))
    return jobs


def with_value(cfg: DictConfig, key: str, value: Any) -> DictConfig:
    """A copy of ``cfg`` with ``key`` set to ``value``."""
    copy = cfg.copy()
    OmegaConf.update(copy, key, value, merge=False)
    return copy


def with_overrides(hydra_cfg: DictConfig, task: list[str], run_dir: Path) -> DictConfig:
    """A copy of a job's Hydra config with other task overrides and output directory."""
    copy = hydra_cfg.copy()
    with read_write(copy), open_dict(copy):
        copy.overrides.task = task
        copy.runtime.output_dir = str(run_dir.absolute())
    return copy


def train_pack_job(jobs: list[Job], sweeping: bool) -> list[Any]:
    """Train ``jobs`` (runs that differ in their seed only) as one pack: each takes its
    directory's lock and is skipped when finished already; the rest train together
    (:mod:`bnexp.engine.pack`). Returns each run's :func:`result_value`."""
    values: dict[Path, float] = {}
    with ExitStack() as locks:
        todo = []
        for job in jobs:
            try:
                locks.enter_context(RunLock(job.run_dir))
                home = prepare_job(job, write=True)
                if home:
                    record(job.run_dir, "skipped")
                    values[job.run_dir] = result_value("skipped", stored_summary(home))
                else:
                    todo.append(job)
            except BnexpError as err:
                record(job.run_dir, "locked" if isinstance(err, RunLocked) else "failed", str(err))
                report_error(str(err), to_log=err.in_run_log)
                if not sweeping:
                    sys.exit(err.exit_code)
        if todo:
            dirs = [job.run_dir for job in todo]
            frozen = frozen_runs(jobs, todo)
            members = [job for job in jobs if job in todo or job in frozen]
            values.update(zip(dirs, run_and_record(dirs, sweeping, lambda: pack_outcomes(members, frozen))))
    return [values.get(job.run_dir, math.nan) for job in jobs]


def frozen_runs(jobs: list[Job], todo: list[Job]) -> list[Job]:
    """The runs of ``jobs`` that diverged in the pack that ``todo`` resumes (a pack with just
    these runs and ``todo``'s): they go back into the pack, frozen, so that it keeps the
    shapes, and so the rounding, of the pack that was interrupted. None when the pack that
    diverged had other runs."""
    resumed = {str(job.run_dir) for job in todo}
    found = []
    for job in jobs:
        summary = {} if job in todo else stored_summary(job.run_dir)
        if summary.get("status") == "diverged" and resumed <= set(summary.get("packed_with", [])):
            found.append((job, {str(job.run_dir), *summary["packed_with"]}))
    whole = resumed | {str(job.run_dir) for job, _ in found}
    return [job for job, _ in found] if all(pack == whole for _, pack in found) else []


def prepare_job(job: Job, write: bool) -> Optional[Path]:
    """The directory holding a job's finished result when it is to be skipped, else None;
    when ``write`` (the main process), its ``.hydra/`` is written if it trains, and a listing
    sweep's list names where its result is (:mod:`bnexp.app.cells`)."""
    meaningless(job.cfg, job.hydra_cfg.overrides.task)
    sweep_dir = Path(job.hydra_cfg.sweep.dir) if job.hydra_cfg.get("mode") == RunMode.MULTIRUN else None
    reason, home = skip_or_home(job.cfg, job.run_dir, sweep_dir)
    if write and sweep_dir is not None:
        note_cell(sweep_dir, home)
    if reason:
        (log.warning if "WARNING" in reason else log.info)("%s: skipped: %s", job.run_dir, reason)
        return home
    if write:
        save_hydra_files(job.run_dir, job.hydra_cfg, job.cfg)
    return None


def pack_outcomes(jobs: list[Job], frozen: Sequence[Job] = ()) -> list[tuple[str, Any]]:
    """Train ``jobs`` as one pack, those in ``frozen`` (diverged before) frozen in their slots;
    (status, final top-1) of each of the others."""
    summaries = train_pack([job.cfg for job in jobs], [job.run_dir for job in jobs], [job in frozen for job in jobs])
    for job, summary in zip([job for job in jobs if job not in frozen], summaries):
        log.info("%s: status %s, final top-1 %s", job.run_dir, summary["status"], summary.get("final_top1"))
    return [(summary["status"], result_value(summary["status"], summary)) for summary in summaries]


def run_job(cfg: DictConfig, hydra_cfg: DictConfig, run_dir: Path, sweeping: bool) -> tuple[str, Any]:
    """Skip, launch or train one job holding its directory's lock; (status, final top-1)."""
    launched = HELD_ENV in os.environ  # a rank of bnexp's launcher, which has written .hydra/ already
    home = prepare_job(Job(cfg, hydra_cfg, run_dir), write=from_environment().is_main and not launched)
    if home:
        return "skipped", result_value("skipped", stored_summary(home))
    if sweeping:
        spread_over_gpus(hydra_cfg.job.num)
    if int(cfg.trainer.nproc) > 1 and not from_environment().enabled:
        validate(cfg)  # before starting processes that would all fail the same way
        check_gpus(int(cfg.trainer.nproc), str(cfg.trainer.device))
        status = _launch_processes(int(cfg.trainer.nproc), list(hydra_cfg.overrides.task), run_dir, sweeping)
        return status, result_value(status, stored_summary(run_dir))
    summary = train(cfg, run_dir)
    log.info("%s: status %s, final top-1 %s", run_dir, summary["status"], summary.get("final_top1"))
    return summary["status"], result_value(summary["status"], summary)


def save_hydra_files(run_dir: Path, hydra_cfg: DictConfig, cfg: DictConfig) -> None:
    """``.hydra/config.yaml``, ``hydra.yaml`` and ``overrides.yaml``, as Hydra itself writes
    them (``hydra.output_subdir`` is null so that Hydra writes nothing before the lock)."""
    folder = run_dir / ".hydra"
    folder.mkdir(parents=True, exist_ok=True)
    for name, node in (("config", cfg), ("hydra", OmegaConf.create({"hydra": hydra_cfg})),
                       ("overrides", hydra_cfg.overrides.task)):
        (folder / f"{name}.yaml").write_text(OmegaConf.to_yaml(node))


def _launch_processes(nproc: int, overrides: list[str], run_dir: Path, sweeping: bool) -> str:
    """Run this job as ``nproc`` torchrun processes; a failure ends a single run as a
    one-process run ends, with one line saying so. Returns the run's status."""
    code = run_under_torchrun(nproc, overrides, run_dir)
    status, error = job_status(run_dir)
    log.info("%s: %d processes exited with %d, status %s", run_dir, nproc, code, status)
    if status in STOP_EXIT_CODES:  # the ranks checkpointed on a signal: stop a sweep too
        record(run_dir, status, error)
        sys.exit(STOP_EXIT_CODES[status])
    if code != 0 and not sweeping:
        report_error(f"the {nproc} processes of {run_dir} stopped with exit code {code} (the first error above says "
                     "why); re-run the same command to resume from its last checkpoint")
        sys.exit(code)
    return status
