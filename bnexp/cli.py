"""The ``bnexp`` command: ``bnexp <command> [args]``.

``bnexp train [overrides]`` and ``bnexp train -m [sweep overrides]`` are Hydra
applications over ``configs/train.yaml``; the other commands parse their own arguments.
"""

from __future__ import annotations

import importlib
import logging
import sys
from pathlib import Path
from typing import Callable, Sequence

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from bnexp.commands import report
from bnexp.config import config_dir, register_resolvers, validate
from bnexp.errors import EXIT_CONFIG, EXIT_FAILED, EXIT_PREEMPTED, BnexpError
from bnexp.distributed import from_environment
from bnexp.launch import rank_overrides
from bnexp.preemption import Preempted

log = logging.getLogger("bnexp")

USAGE = """usage: bnexp <command> [args]

commands:
  train      train one model, or sweep with -m (Hydra overrides: model=resnet20 norm=bn ...)
  reproduce  run a paper preset's sweep, then print its table: bnexp reproduce cbn/table1 [scale=quick]
  table      a preset's results in the paper's layout: bnexp table cbn/table1 [results=DIR] [format=latex]
  plot       a preset's loss / accuracy curves: bnexp plot cbn/table1 [results=DIR] [out=DIR]
  bench      speed: bnexp bench norms|step|data|run [reps=5] [out=FILE.json] (docs/benchmarks.md)
  lrsearch   largest stable lr per method (CBN Table 6): bnexp lrsearch [methods=[none,cbn]] [acts=[relu]] [lrs=[...]] [out=DIR]
  hessian    Hessian condition numbers in training (BNP Fig. 8): bnexp hessian [norms=[none,bnp]] [out=DIR]
  claims     the papers' claims checked on real digits, with verdicts: bnexp claims [all | NAME ...] [scale=quick]

Run `bnexp train --help` for the config groups and their options."""


def _train_task(cfg: DictConfig) -> float | str | None:
    """One Hydra job. A failed run ends a single run with its exit code; in a sweep the
    failure is recorded in the run's summary.json and the sweep goes on."""
    from bnexp.report.presets import skip_reason, spread_over_gpus
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
        report(f"{err}; re-run the same command to resume {run_dir}")
        sys.exit(err.exit_code)
    except BnexpError as err:
        report(str(err))
        if not sweeping:
            sys.exit(err.exit_code)
        return None
    except Exception as err:  # recorded in summary.json with its traceback
        report(f"run failed with {type(err).__name__}: {err} (traceback in {run_dir / 'summary.json'})")
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


def train_command(args: list[str]) -> None:
    """``bnexp train``: hand the arguments to Hydra."""
    register_resolvers()
    app = hydra.main(config_path=str(config_dir()), config_name="train", version_base="1.3")(_train_task)
    sys.argv = ["bnexp train", *args, *rank_overrides()]
    app()


def multirun(overrides: Sequence[str]) -> None:
    """``bnexp train -m OVERRIDES`` in this process; a non-zero exit is raised as SystemExit."""
    try:
        main(["train", "-m", *overrides])
    except SystemExit as exit_:
        if exit_.code:
            raise


def _report_command(name: str) -> Callable[[list[str]], None]:
    """``bnexp <name>``: :func:`bnexp.report.<name>.command`, imported when called."""
    return lambda args: importlib.import_module(f"bnexp.report.{name}").command(args)


COMMANDS: dict[str, Callable[[list[str]], None]] = {
    "train": train_command,
    **{name: _report_command(name) for name in ("reproduce", "table", "plot")},
    "bench": lambda args: importlib.import_module("bnexp.bench").command(args),
    "lrsearch": lambda args: importlib.import_module("bnexp.probes.lrsearch").command(args),
    "hessian": lambda args: importlib.import_module("bnexp.probes.hessian_study").command(args),
    "claims": lambda args: importlib.import_module("bnexp.studies.claims").command(args),
}


def main(argv: list[str] | None = None) -> None:
    """Entry point of the ``bnexp`` console script."""
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(USAGE)
        return
    command, args = argv[0], argv[1:]
    if command not in COMMANDS:
        report(f"unknown command {command!r}; valid commands: {', '.join(sorted(COMMANDS))}")
        sys.exit(EXIT_CONFIG)
    COMMANDS[command](args)
