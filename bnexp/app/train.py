"""``bnexp train``: the command line checked, then handed to Hydra's app over
``configs/train.yaml`` (one job, or a multirun with bnexp's sweeper and launchers); each
job is :func:`bnexp.app.jobs.train_job`, imported when a job runs: Hydra's help and shell
completion answer without importing torch. A completion query (each TAB press) runs the same
app without the command line's checks, bnexp's sweeper and launchers (:func:`answer_completion`),
which are imported when a command runs."""

from __future__ import annotations

import importlib.util
import sys
from typing import Any, Callable, Sequence

import hydra
from hydra.core.plugins import Plugins
from omegaconf import DictConfig

from bnexp.app.compose import config_dir, prepare_config_tree
from bnexp.app.torchrun import rank_overrides
from bnexp.support.errors import EXIT_FAILED, EXIT_INTERRUPTED, BnexpError, ConfigError
from bnexp.support.options import print_error


def register_plugins() -> None:
    """Make bnexp's sweeper (``hydra/sweeper=bnexp``) and packing launchers
    (``hydra/launcher=pack`` and ``pack_slurm``) known to Hydra. A wheel install puts them where Hydra's plugin
    scan finds them; an editable install's import hook hides them from that scan, so they
    are registered by hand, as Hydra's ``Plugins.register`` allows."""
    from hydra_plugins.bnexp_launcher import PackLauncher, PackSlurmLauncher
    from hydra_plugins.bnexp_sweeper import BnexpSweeper

    Plugins.instance().register(BnexpSweeper)
    Plugins.instance().register(PackLauncher)
    Plugins.instance().register(PackSlurmLauncher)


# Hydra plugins bnexp's extras install: (override prefix, the plugin's module, the extra).
PLUGIN_EXTRAS = (("hydra/sweeper=optuna", "hydra_plugins.hydra_optuna_sweeper", "optuna"),
                 ("hydra/launcher=submitit", "hydra_plugins.hydra_submitit_launcher", "slurm"))


def check_plugins(args: Sequence[str]) -> None:
    """A ConfigError naming the extra to install when a chosen Hydra plugin is missing."""
    for prefix, module, extra in PLUGIN_EXTRAS:
        chosen = [a for a in args if a.lstrip("+~").startswith(prefix)]
        if chosen and importlib.util.find_spec(module) is None:
            raise ConfigError(f"{chosen[0]} needs a Hydra plugin that is not installed: pip install 'bnexp[{extra}]'")


def search_sweeper(args: Sequence[str]) -> list[str]:
    """``hydra/sweeper=<search>`` for ``hparams_search=<search>`` when no sweeper is chosen:
    configs/train.yaml's own choice (bnexp's sweeper) outranks one made in a config it
    loads, so the search config cannot choose its sweeper itself."""
    search = [a.split("=", 1)[1] for a in args if a.startswith("hparams_search=")]
    chosen = any(a.lstrip("+~").startswith("hydra/sweeper=") for a in args)
    return [f"hydra/sweeper={search[-1]}"] if search and not chosen else []


def task(cfg: DictConfig) -> Any:
    """Hydra's task function: one job (:func:`bnexp.app.jobs.train_job`)."""
    from bnexp.app.jobs import train_job

    return train_job(cfg)


def train_app() -> Callable[[], Any]:
    """Hydra's app over configs/train.yaml, its task :func:`task` (reading ``sys.argv``)."""
    return hydra.main(config_path=str(config_dir()), config_name="train", version_base="1.3")(task)


def answer_completion(args: list[str]) -> None:
    """Hydra's answer to a shell-completion query of ``bnexp train`` (``args``: ``-sc
    query=SHELL``; the line typed in ``COMP_LINE``): the app of :func:`train_command` on the
    same config tree, without its checks of a command line, which a query does not have, and
    bnexp's sweeper and launchers, which no query reaches."""
    prepare_config_tree()
    sys.argv = ["bnexp", *args]
    train_app()()


def train_command(args: list[str]) -> None:
    """``bnexp train``: check the command line, then hand it to Hydra. ``--dry-run`` (with
    ``-m``) lists a sweep's jobs and run directories without running them."""
    from bnexp.app.cmdline import DRY_RUN, check_command_line
    from bnexp.app.sweep import print_sweep_report

    prepare_config_tree()
    register_plugins()
    multirun_flags = [a for a in args if a in ("-m", "--multirun")]
    args = multirun_flags + [a for a in args if a not in multirun_flags]  # `train a=1 -m b=2,3` works too
    args += search_sweeper(args)
    try:
        check_plugins(args)
        if "--dry-run" in args:
            if not {"-m", "--multirun"} & set(args):
                raise ConfigError("--dry-run lists the jobs of a sweep: use it with -m")
            if any(a.startswith("hydra/sweeper=") and a != "hydra/sweeper=bnexp" for a in args):
                raise ConfigError("--dry-run lists the cells of bnexp's sweeper; a search (hparams_search=..., "
                                  "another hydra/sweeper) picks its trials as it goes")
            args = [a for a in args if a != "--dry-run"] + [DRY_RUN]
        check_command_line(args)
    except BnexpError as err:
        print_error(str(err))
        sys.exit(err.exit_code)
    app = train_app()
    # Hydra's shell completion registers and queries the program named here (bnexp/cli.py
    # routes `bnexp -sc query=...` to answer_completion, which runs the same app)
    program = "bnexp" if {"-sc", "--shell-completion"} & set(args) else "bnexp train"
    sys.argv = [program, *args, *rank_overrides()]
    try:
        app()
    except SystemExit as exit_:
        if exit_.code:  # a sweep stopped by a signal: its report, then its exit code
            print_sweep_report(stopped=True)
        raise
    except KeyboardInterrupt:  # Ctrl-C outside a run (composing, launching)
        print_sweep_report(stopped=True)
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
