"""``bnexp train``: the Hydra application over ``configs/train.yaml``, one job or a multirun.

Each job (:func:`train_job`) skips a run that finished already, spreads sweep jobs over the
visible GPUs, starts ``trainer.nproc`` processes through torchrun when asked, and trains;
a failure ends a single run with its exit code and is recorded in a sweep.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Sequence

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from bnexp.commands import print_error
from bnexp.config import config_dir, register_resolvers, validate
from bnexp.distributed import from_environment
from bnexp.errors import EXIT_FAILED, EXIT_PREEMPTED, BnexpError
from bnexp.launch import rank_overrides
from bnexp.preemption import Preempted

log = logging.getLogger("bnexp")


def train_job(cfg: DictConfig) -> float | str | None:
    """One Hydra job. A failed run ends a single run with its exit code; in a sweep the
    failure is recorded in the run's summary.json and the sweep goes on."""
    from bnexp.sweep import skip_reason, spread_over_gpus
    from bnexp.trainer import train

    hydra_cfg = HydraConfig.get()
    sweeping = hydra_cfg.mode == RunMode.MULTIRUN
    run_dir = Path(hydra_cfg.runtime.output_dir)
    register_resolvers()  # a launcher's worker process starts without them
    reason = skip_reason(cfg, run_dir)
    if reason:
        log.info("%s: skipped: %s", run_dir, reason)
        return "skipped"  # counted as such by the end-of-sweep report
    if sweeping:
        spread_over_gpus(hydra_cfg.job.num)
    try:
        if int(cfg.trainer.nproc) > 1 and not from_environment().enabled:
            validate(cfg)  # before starting processes that would all fail the same way
            return _launch_processes(int(cfg.trainer.nproc), list(hydra_cfg.overrides.task), run_dir, sweeping)
        summary = train(cfg, run_dir)
    except Preempted as err:  # stops a sweep too: the whole job is being preempted
        print_error(f"{err}; re-run the same command to resume {run_dir}")
        sys.exit(err.exit_code)
    except BnexpError as err:
        print_error(str(err))
        if not sweeping:
            sys.exit(err.exit_code)
        return None
    except Exception as err:  # recorded in summary.json with its traceback
        print_error(f"run failed with {type(err).__name__}: {err} (traceback in {run_dir / 'summary.json'})")
        if not sweeping:
            sys.exit(EXIT_FAILED)
        return None
    log.info("%s: status %s, final top-1 %s", run_dir, summary["status"], summary.get("final_top1"))
    return summary.get("final_top1")


def _launch_processes(nproc: int, overrides: list[str], run_dir: Path, sweeping: bool) -> float | None:
    """Run this job as ``nproc`` torchrun processes; a failure ends a single run."""
    from bnexp.launch import run_under_torchrun
    from bnexp.sweep import job_status

    code = run_under_torchrun(nproc, overrides, run_dir)
    status = job_status(run_dir)[0]
    log.info("%s: %d processes exited with %d, status %s", run_dir, nproc, code, status)
    if code != 0 and not sweeping:
        sys.exit(EXIT_PREEMPTED if status == "preempted" else code)  # as a one-process run exits
    return None


def register_sweeper() -> None:
    """Make bnexp's sweeper (``hydra/sweeper=bnexp``) known to Hydra. A wheel install puts it
    where Hydra's plugin scan finds it; an editable install's import hook hides it from that
    scan, so it is registered by hand, as Hydra's ``Plugins.register`` allows."""
    from hydra.core.plugins import Plugins
    from hydra_plugins.bnexp_sweeper import BnexpSweeper

    Plugins.instance().register(BnexpSweeper)


def train_command(args: list[str]) -> None:
    """``bnexp train``: hand the arguments to Hydra."""
    register_resolvers()
    register_sweeper()
    app = hydra.main(config_path=str(config_dir()), config_name="train", version_base="1.3")(train_job)
    sys.argv = ["bnexp train", *args, *rank_overrides()]
    app()


def multirun(overrides: Sequence[str]) -> None:
    """``bnexp train -m OVERRIDES`` in this process; a non-zero exit is raised as SystemExit."""
    try:
        train_command(["-m", *overrides])
    except SystemExit as exit_:
        if exit_.code:
            raise
