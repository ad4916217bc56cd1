"""The ``bnexp`` command: ``bnexp <command> [args]``.

``bnexp train [overrides]`` and ``bnexp train -m [sweep overrides]`` are the Hydra
application of :mod:`bnexp.app.train` (``bnexp train --help`` is Hydra's help, with the config
groups); the other commands parse their own ``key=value`` arguments, and ``bnexp <command>
--help`` prints the documentation of the module that implements it. ``bnexp --version``
prints the versions and the source of this install. Hydra's shell completion
(``eval "$(bnexp train -sc install=bash)"``) queries ``bnexp -sc query=bash``, which is
routed to ``bnexp train``.

Each command's module is imported when the command runs: ``bnexp --help``, ``--version``,
shell completion, ``bnexp train --help`` and the table commands never import torch, whose
import takes seconds.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from pathlib import Path
from typing import Callable

from bnexp.support.errors import EXIT_CONFIG
from bnexp.support.options import cycles_uncollected, plain_text, print_error

USAGE = """usage: bnexp <command> [args]

commands:
  train      train one model, or sweep with -m (Hydra overrides: model=resnet20 norm=bn ...); -m --dry-run lists the cells
  reproduce  run a paper preset's sweep, then print its table: bnexp reproduce cbn/table1 [scale=quick] [dry_run=true]
  table      a preset's results in the paper's layout: bnexp table cbn/table1 [results=DIR] [format=latex],
             or any sweep folder: bnexp table DIR [rows=KEY] [cols=KEY] [metric=top1|best_top1|top5]
  plot       loss / accuracy curves: bnexp plot cbn/table1 [results=DIR] [out=DIR], or bnexp plot DIR [out=DIR]
  eval       a finished run's final weights on a data set: bnexp eval RUN_DIR [data=NAME] [split=test|train]
  export     a finished run's weights for other tools: bnexp export RUN_DIR [format=torchvision|safetensors]
  bench      speed: bnexp bench norms|step|data|run|pack|imagenet|graph|table_cost|cli [reps=5] [out=FILE.json] (docs/benchmarks.md)
  lrsearch   largest stable lr per method (CBN Table 6): bnexp lrsearch [methods=[none,cbn]] [acts=[relu]] [lrs=[...]] [out=DIR]
  hessian    Hessian condition numbers in training (BNP Fig. 8): bnexp hessian [norms=[none,bnp]] [out=DIR]
  claims     the papers' claims checked on real digits, with verdicts: bnexp claims [all | NAME ...] [scale=quick]

Run `bnexp train --help` for the config groups and their options, `bnexp <command> --help` for a
command's options, `bnexp --version` for the versions of this install."""


def _command(module: str, function: str = "command") -> Callable[[list[str]], None]:
    """``bnexp <name>``: ``function`` of ``module``, imported when called."""
    return lambda args: getattr(importlib.import_module(module), function)(args)


def table_command(args: list[str]) -> None:
    """``bnexp table``: :func:`bnexp.report.table.command`, its imports included, without
    cyclic garbage collection (:func:`~bnexp.support.options.cycles_uncollected`)."""
    with cycles_uncollected():
        _command("bnexp.report.table")(args)


def train_command(args: list[str]) -> None:
    """``bnexp train``: :func:`bnexp.app.train.train_command`."""
    _command("bnexp.app.train", "train_command")(args)


COMMANDS: dict[str, Callable[[list[str]], None]] = {
    "train": train_command,
    **{name: _command(f"bnexp.report.{name}") for name in ("reproduce", "plot")},
    "table": table_command,
    "eval": _command("bnexp.report.evaluate"),
    "export": _command("bnexp.report.export"),
    "bench": _command("bnexp.bench"),
    **{name: _command(f"bnexp.studies.{name}") for name in ("lrsearch", "hessian", "claims")},
}


# The module whose docstring is each command's --help, and the optional extras it needs.
MODULES = {"reproduce": "bnexp.report.reproduce", "table": "bnexp.report.table", "plot": "bnexp.report.plot",
           "eval": "bnexp.report.evaluate", "export": "bnexp.report.export",
           "bench": "bnexp.bench", "lrsearch": "bnexp.studies.lrsearch", "hessian": "bnexp.studies.hessian",
           "claims": "bnexp.studies.claims"}
EXTRAS = {"plot": ("matplotlib", "plot"), "hessian": ("matplotlib", "plot")}


def version() -> str:
    """``bnexp --version``: bnexp's version and source (a git checkout's commit), torch's."""
    from bnexp.support.runinfo import source_of_bnexp  # here: what it imports, the other commands need not

    source = source_of_bnexp()
    where = f"git {source['git_commit'][:12]}{' (dirty)' if source['git_dirty'] else ''}" if source["git_commit"] \
        else "installed package"
    return f"bnexp {source['bnexp_version']} ({where}), torch {torch_version()}, python {sys.version.split()[0]}"


def torch_version() -> str:
    """``torch.__version__`` (its build included: ``2.14.1+cu130``), read from torch's
    ``version.py`` without importing torch; the installed distribution's version when that
    file is not there."""
    spec = importlib.util.find_spec("torch")
    path = Path(spec.origin).parent / "version.py" if spec is not None and spec.origin else None
    if path is None or not path.is_file():
        from importlib import metadata

        return metadata.version("torch")
    module_spec = importlib.util.spec_from_file_location("_bnexp_torch_version", path)
    assert module_spec is not None and module_spec.loader is not None
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return str(module.__version__)


def command_help(command: str) -> str:
    """``bnexp <command> --help``: the documentation of the module implementing it."""
    doc = importlib.import_module(MODULES[command]).__doc__ or ""
    return f"usage: bnexp {command} [key=value ...]\n\n{plain_text(doc).strip()}"


def completion(argv: list[str]) -> None:
    """Hydra's shell completion of ``bnexp train``: its install script, or the answer to a
    query (command names while the command is being typed; a group's options and a config
    key without Hydra where :mod:`bnexp.app.config_tree` can answer)."""
    query = next((a.partition("=")[2] for a in argv[1:] if a.startswith("query=")), None)
    if query is None:  # install= / uninstall=: the script
        train_command(argv)
        return
    line = os.environ.get("COMP_LINE", "")
    words = line.split(" ", 2)
    if len(words) <= 2:  # still typing the command name
        typed = words[1] if len(words) == 2 else ""
        print(("\n" if query == "fish" else " ").join(name for name in COMMANDS if name.startswith(typed)))
        return
    if words[1] == "train":
        from bnexp.app.config_tree import group_choices, key_choices  # here: the other queries need neither

        answer = group_choices(words[2]) if query == "bash" else None
        if answer is None and query == "bash":  # a key, from the config of the other words (composed on a miss)
            answer = key_choices(words[2], lambda w: importlib.import_module("bnexp.app.compose").completion_config(w))
        if answer is not None:
            print(answer)
            return
        os.environ["COMP_LINE"] = f"{words[0]} {words[2]}"
        _command("bnexp.app.train", "answer_completion")(argv)


def missing_extra(command: str) -> str | None:
    """Why ``command`` cannot run here: an optional dependency it needs is not installed."""
    module, extra = EXTRAS.get(command, (None, None))
    if module is None or importlib.util.find_spec(module) is not None:
        return None
    return f"bnexp {command} needs {module}, which is not installed: pip install 'bnexp[{extra}]'"


def main(argv: list[str] | None = None) -> None:
    """Entry point of the ``bnexp`` console script."""
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(USAGE)
        return
    if argv[0] in ("-V", "--version"):
        print(version())
        return
    if argv[0] in ("-sc", "--shell-completion"):
        completion(argv)
        return
    command, args = argv[0], argv[1:]
    if command not in COMMANDS:
        print_error(f"unknown command {command!r}; valid commands: {', '.join(sorted(COMMANDS))}")
        sys.exit(EXIT_CONFIG)
    missing = missing_extra(command)
    if missing:
        print_error(missing)
        sys.exit(EXIT_CONFIG)
    if command != "train" and {"-h", "--help"} & set(args):
        print(command_help(command))
        return
    COMMANDS[command](args)
