"""The ``bnexp`` command: ``bnexp <command> [args]``.

``bnexp train [overrides]`` and ``bnexp train -m [sweep overrides]`` are the Hydra
application of :mod:`bnexp.app`; the other commands parse their own arguments.
"""

from __future__ import annotations

import importlib
import sys
from typing import Callable

from bnexp.app import train_command
from bnexp.commands import print_error
from bnexp.errors import EXIT_CONFIG

USAGE = """usage: bnexp <command> [args]

commands:
  train      train one model, or sweep with -m (Hydra overrides: model=resnet20 norm=bn ...); -m --dry-run lists the cells
  reproduce  run a paper preset's sweep, then print its table: bnexp reproduce cbn/table1 [scale=quick] [dry_run=true]
  table      a preset's results in the paper's layout: bnexp table cbn/table1 [results=DIR] [format=latex],
             or any sweep folder: bnexp table DIR [rows=KEY] [cols=KEY] [metric=top1|best_top1|top5]
  plot       loss / accuracy curves: bnexp plot cbn/table1 [results=DIR] [out=DIR], or bnexp plot DIR [out=DIR]
  bench      speed: bnexp bench norms|step|data|run [reps=5] [out=FILE.json] (docs/benchmarks.md)
  lrsearch   largest stable lr per method (CBN Table 6): bnexp lrsearch [methods=[none,cbn]] [acts=[relu]] [lrs=[...]] [out=DIR]
  hessian    Hessian condition numbers in training (BNP Fig. 8): bnexp hessian [norms=[none,bnp]] [out=DIR]
  claims     the papers' claims checked on real digits, with verdicts: bnexp claims [all | NAME ...] [scale=quick]

Run `bnexp train --help` for the config groups and their options."""


def _report_command(name: str) -> Callable[[list[str]], None]:
    """``bnexp <name>``: :func:`bnexp.report.<name>.command`, imported when called."""
    return lambda args: importlib.import_module(f"bnexp.report.{name}").command(args)


def _study_command(name: str) -> Callable[[list[str]], None]:
    """``bnexp <name>``: :func:`bnexp.studies.<name>.command`, imported when called."""
    return lambda args: importlib.import_module(f"bnexp.studies.{name}").command(args)


COMMANDS: dict[str, Callable[[list[str]], None]] = {
    "train": train_command,
    **{name: _report_command(name) for name in ("reproduce", "table", "plot")},
    "bench": lambda args: importlib.import_module("bnexp.bench").command(args),
    **{name: _study_command(name) for name in ("lrsearch", "hessian", "claims")},
}


def main(argv: list[str] | None = None) -> None:
    """Entry point of the ``bnexp`` console script."""
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(USAGE)
        return
    command, args = argv[0], argv[1:]
    if command not in COMMANDS:
        print_error(f"unknown command {command!r}; valid commands: {', '.join(sorted(COMMANDS))}")
        sys.exit(EXIT_CONFIG)
    COMMANDS[command](args)
