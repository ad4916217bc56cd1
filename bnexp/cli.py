"""The ``bnexp`` command: ``bnexp <command> [args]``.

``bnexp train [overrides]`` and ``bnexp train -m [sweep overrides]`` are Hydra
applications over ``configs/train.yaml``; the other commands parse their own arguments.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Callable

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from bnexp.config import config_dir
from bnexp.errors import EXIT_CONFIG, EXIT_FAILED, BnexpError

log = logging.getLogger("bnexp")

USAGE = """usage: bnexp <command> [args]

commands:
  train   train one model, or sweep with -m (Hydra overrides: model=resnet20 norm=bn ...)

Run `bnexp train --help` for the config groups and their options."""


def report(message: str) -> None:
    """Print one error paragraph to stderr."""
    print(f"bnexp: error: {message}", file=sys.stderr, flush=True)


def _train_task(cfg: DictConfig) -> float | None:
    """One Hydra job. A failed run ends a single run with its exit code; in a sweep the
    failure is recorded in the run's summary.json and the sweep goes on."""
    from bnexp.trainer import train

    hydra_cfg = HydraConfig.get()
    sweeping = hydra_cfg.mode == RunMode.MULTIRUN
    run_dir = Path(hydra_cfg.runtime.output_dir)
    try:
        summary = train(cfg, run_dir)
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


def train_command(args: list[str]) -> None:
    """``bnexp train``: hand the arguments to Hydra."""
    app = hydra.main(config_path=str(config_dir()), config_name="train", version_base="1.3")(_train_task)
    sys.argv = ["bnexp train", *args]
    app()


COMMANDS: dict[str, Callable[[list[str]], None]] = {"train": train_command}


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
