"""``bnexp bench <norms|step|data|run|pack|imagenet|graph|table_cost|cli> [key=value ...]``: speed measurements as tables and JSON.

Each subcommand prints a table and writes ``out=`` (``results/bench/<subcommand>.json``
by default): a list of records with ``name``, ``mode`` (eager | compiled), ``device``,
``seconds_median``, ``seconds_iqr``, ``reps``, ``baseline`` and ``ratio`` (seconds over
the baseline's; below 1 is faster), plus ``env`` (date, machine, versions). Options:
``reps``, ``number`` (calls per timed block), ``warmup`` (untimed calls first), ``device``
(auto | cpu | cuda) and each subcommand's sizes; see docs/benchmarks.md.
"""

from __future__ import annotations

import importlib
from types import ModuleType

import torch

from bnexp.bench.common import RECOMPILE_LIMIT, device_of, finish, parse
from bnexp.support.errors import ConfigError, unknown_choice
from bnexp.support.options import exit_on_error
from bnexp.support.runinfo import configure_backends

SUBCOMMANDS = ("norms", "step", "data", "run", "pack", "imagenet", "graph", "table_cost", "cli")
# subcommands whose other key=value args are Hydra overrides
ACCEPTS_OVERRIDES = ("step", "data", "run", "pack", "graph", "table_cost")


def subcommand(name: str) -> ModuleType:
    """The module implementing ``bnexp bench <name>`` (imported on demand)."""
    if name not in SUBCOMMANDS:
        raise unknown_choice("bench subcommand", name, SUBCOMMANDS)
    return importlib.import_module(f"bnexp.bench.{name}")


def execute(args: list[str]) -> None:
    """Parse, measure, print and write one subcommand's records (not named ``run``: that is a submodule)."""
    if not args or "=" in args[0]:
        raise ConfigError(f"usage: bnexp bench <{'|'.join(SUBCOMMANDS)}> [key=value ...]")
    module = subcommand(args[0])
    options, overrides = parse(args[1:], module.DEFAULTS, args[0] in ACCEPTS_OVERRIDES)
    if options.get("threads"):
        torch.set_num_threads(options["threads"])
    configure_backends(tf32=False, deterministic=False)  # as a run with the trainer's defaults
    with torch._dynamo.config.patch(recompile_limit=RECOMPILE_LIMIT):
        records = module.bench(options, overrides)
    finish(records, options["out"], module.COLUMNS, device_of(options))


def command(args: list[str]) -> None:
    """``bnexp bench <subcommand> [key=value ...]``."""
    exit_on_error(lambda: execute(args))
