"""``bnexp train``: the Hydra application over ``configs/train.yaml``, one job or a multirun.

Each job (:func:`train_job`) takes the run directory's lock, skips a run that finished
already with the same settings (and refuses one that finished with other settings), records
its overrides in ``.hydra/``, spreads sweep jobs over the visible GPUs, starts
``trainer.nproc`` processes through torchrun when asked, and trains. A failure ends a
single run with its exit code; in a sweep it is recorded and the sweep goes on. Ctrl-C and
preemption stop a sweep too, after its report.
"""

from __future__ import annotations

import logging
import sys
import traceback
from pathlib import Path
from typing import Any, Sequence

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from bnexp.commands import print_error
from bnexp.config import config_dir, meaningless, register_resolvers, validate
from bnexp.distributed import from_environment
from bnexp.errors import EXIT_FAILED, EXIT_INTERRUPTED, BnexpError, ConfigError
from bnexp.launch import check_gpus, rank_overrides
from bnexp.preemption import STOP_EXIT_CODES, Preempted
from bnexp.runlock import RunLock, RunLocked

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


def train_job(cfg: DictConfig) -> float | None:
    """One Hydra job; returns the run's final top-1 (None when it did not finish).

    The outcome goes to the sweep's ledger (:func:`bnexp.sweep.record`). A failure ends a
    single run with its exit code; in a sweep the next cell runs. A preemption or Ctrl-C
    ends the sweep (the whole job is being stopped).
    """
    from bnexp.sweep import record

    hydra_cfg = HydraConfig.get()
    sweeping = hydra_cfg.mode == RunMode.MULTIRUN
    run_dir = Path(hydra_cfg.runtime.output_dir)
    register_resolvers()  # a launcher's worker process starts without them
    try:
        with RunLock(run_dir, enabled=from_environment().is_main):
            status, value = run_job(cfg, hydra_cfg, run_dir, sweeping)
    except Preempted as err:
        record(run_dir, err.status, str(err))
        report_error(f"{err}; re-run the same command to resume {run_dir}")
        sys.exit(err.exit_code)
    except KeyboardInterrupt:
        record(run_dir, "interrupted", "stopped by Ctrl-C")
        report_error(f"stopped by Ctrl-C; re-run the same command to resume {run_dir}")
        sys.exit(EXIT_INTERRUPTED)
    except BnexpError as err:
        record(run_dir, "locked" if isinstance(err, RunLocked) else "failed", str(err))
        report_error(str(err), to_log=err.in_run_log)
        if not sweeping:
            sys.exit(err.exit_code)
        return None
    except Exception as err:  # recorded in summary.json with its traceback
        record(run_dir, "failed", f"{type(err).__name__}: {err}")
        report_error(f"run failed with {type(err).__name__}: {err} (traceback in {run_dir / 'summary.json'})",
                     traceback.format_exc())
        if not sweeping:
            sys.exit(EXIT_FAILED)
        return None
    record(run_dir, status)
    return value


def run_job(cfg: DictConfig, hydra_cfg: DictConfig, run_dir: Path, sweeping: bool) -> tuple[str, Any]:
    """Skip, launch or train one job holding its directory's lock; (status, final top-1)."""
    from bnexp.sweep import skip_reason, spread_over_gpus
    from bnexp.trainer import train

    meaningless(cfg, hydra_cfg.overrides.task)
    reason = skip_reason(cfg, run_dir)
    if reason:
        (log.warning if "WARNING" in reason else log.info)("%s: skipped: %s", run_dir, reason)
        return "skipped", None
    if from_environment().is_main:
        save_hydra_files(run_dir, hydra_cfg, cfg)
    if sweeping:
        spread_over_gpus(hydra_cfg.job.num)
    if int(cfg.trainer.nproc) > 1 and not from_environment().enabled:
        validate(cfg)  # before starting processes that would all fail the same way
        check_gpus(int(cfg.trainer.nproc), str(cfg.trainer.device))
        return _launch_processes(int(cfg.trainer.nproc), list(hydra_cfg.overrides.task), run_dir, sweeping), None
    summary = train(cfg, run_dir)
    log.info("%s: status %s, final top-1 %s", run_dir, summary["status"], summary.get("final_top1"))
    return summary["status"], summary.get("final_top1")


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
    one-process run ends. Returns the run's status."""
    from bnexp.launch import run_under_torchrun
    from bnexp.sweep import job_status, record

    code = run_under_torchrun(nproc, overrides, run_dir)
    status, error = job_status(run_dir)
    log.info("%s: %d processes exited with %d, status %s", run_dir, nproc, code, status)
    if status in STOP_EXIT_CODES:  # the ranks checkpointed on a signal: stop a sweep too
        record(run_dir, status, error)
        sys.exit(STOP_EXIT_CODES[status])
    if code != 0 and not sweeping:
        sys.exit(code)
    return status


def register_sweeper() -> None:
    """Make bnexp's sweeper (``hydra/sweeper=bnexp``) known to Hydra. A wheel install puts it
    where Hydra's plugin scan finds it; an editable install's import hook hides it from that
    scan, so it is registered by hand, as Hydra's ``Plugins.register`` allows."""
    from hydra.core.plugins import Plugins
    from hydra_plugins.bnexp_sweeper import BnexpSweeper

    Plugins.instance().register(BnexpSweeper)


def train_command(args: list[str]) -> None:
    """``bnexp train``: check the command line, then hand it to Hydra. ``--dry-run`` (with
    ``-m``) lists a sweep's jobs and run directories without running them."""
    from bnexp.cmdline import DRY_RUN, check_command_line
    from bnexp.sweep import finish_report

    register_resolvers()
    register_sweeper()
    multirun_flags = [a for a in args if a in ("-m", "--multirun")]
    args = multirun_flags + [a for a in args if a not in multirun_flags]  # `train a=1 -m b=2,3` works too
    try:
        if "--dry-run" in args:
            if not {"-m", "--multirun"} & set(args):
                raise ConfigError("--dry-run lists the jobs of a sweep: use it with -m")
            args = [a for a in args if a != "--dry-run"] + [DRY_RUN]
        check_command_line(args)
    except BnexpError as err:
        print_error(str(err))
        sys.exit(err.exit_code)
    app = hydra.main(config_path=str(config_dir()), config_name="train", version_base="1.3")(train_job)
    sys.argv = ["bnexp train", *args, *rank_overrides()]
    try:
        app()
    except SystemExit as exit_:
        if exit_.code:  # a sweep stopped by a signal: its report, then its exit code
            finish_report(stopped=True)
        raise
    except KeyboardInterrupt:  # Ctrl-C outside a run (composing, launching)
        finish_report(stopped=True)
        print_error("stopped by Ctrl-C")
        sys.exit(EXIT_INTERRUPTED)


def multirun(overrides: Sequence[str]) -> int:
    """``bnexp train -m OVERRIDES`` in this process. Returns 0, or EXIT_FAILED when some cells
    failed (after the sweep's report); any other non-zero exit (a bad command line, Ctrl-C,
    preemption) is raised as SystemExit."""
    try:
        train_command(["-m", *overrides])
    except SystemExit as exit_:
        if exit_.code == EXIT_FAILED:
            return EXIT_FAILED
        if exit_.code:
            raise
    return 0
