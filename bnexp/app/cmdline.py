"""Checking a ``bnexp train`` command line before Hydra runs it.

Hydra answers an unknown group option, group or key with a page of text and exit code 1;
it accepts ``+key=value`` for any key, a typo of an existing one included, and the run then
ignores it; an unwritable output folder fails inside its logging set-up with a traceback; a
value the run cannot use would fail it after its folder and lock were made.
:func:`check_command_line` composes the configs the command asks for first (each group
choice of a sweep once, each other swept value in its place) and turns each of these into
one :class:`ConfigError` (exit code 2) that names the value and the valid choices, before
anything is written.
"""

from __future__ import annotations

import copy
import difflib
import math
import os
import tempfile
from pathlib import Path
from typing import Any, Optional, Sequence

from hydra import compose
from hydra.core.hydra_config import HydraConfig
from hydra.core.override_parser.types import Override, RangeSweep
from hydra.errors import HydraException, MissingConfigException, OverrideParseException
from omegaconf import DictConfig, OmegaConf, open_dict, read_write
from omegaconf.errors import OmegaConfBaseException

from bnexp.app.compose import config_dir, hydra_session, is_group, parser
from bnexp.app.config_tree import group_options
from bnexp.app.sweep import interval_refused
from bnexp.support.errors import ConfigError
from bnexp.support.registry import plugin_config_dirs

# Hydra flags followed by a value, and flags after which Hydra does not compose train.yaml
# (help, another config, shell completion): the latter are left to Hydra.
VALUE_FLAGS = ("--cfg", "-c", "--package", "-p")
HYDRA_ONLY_FLAGS = ("-h", "--help", "--hydra-help", "--version", "--info", "-i", "--shell-completion", "-sc",
                    "--config-path", "-cp", "--config-name", "-cn", "--config-dir", "-cd", "--experimental-rerun")
ADDABLE = ("tags.", "hydra.")  # keys a command line may add with +key=value
DRY_RUN = "hydra.sweeper.dry_run=true"  # what `bnexp train -m --dry-run` passes to bnexp's sweeper
# Every flag of Hydra's command line (hydra._internal.utils.get_args_parser) and bnexp's own.
FLAGS = (*VALUE_FLAGS, *HYDRA_ONLY_FLAGS, "-m", "--multirun", "-r", "--run", "--resolve", "--dry-run")
# Jobs one command line may sweep: 70 times CBN Table 1's 1,350 runs; each job is a run folder,
# and every value is checked before the first one starts.
MAX_JOBS = 100_000
BNEXP_SWEEPER = "hydra_plugins.bnexp_sweeper.BnexpSweeper"


def overrides_of(args: Sequence[str]) -> Optional[list[str]]:
    """The override arguments of a command line; None when a flag hands it to Hydra alone."""
    found: list[str] = []
    skip = False
    for arg in args:
        if skip:
            skip = False
        elif arg.split("=", 1)[0] in HYDRA_ONLY_FLAGS:
            return None
        elif arg in VALUE_FLAGS:
            skip = True
        elif not arg.startswith("-"):
            found.append(arg)
    return found


def check_flags(args: Sequence[str]) -> None:
    """A flag that neither Hydra nor bnexp knows is one line (Hydra's own answer is its usage
    page), before anything is written."""
    for arg in args:
        if arg.startswith("-") and arg.split("=", 1)[0] not in FLAGS:
            raise ConfigError(f"unknown option {arg!r}; bnexp train takes -m (--multirun), --dry-run (with -m), "
                              "--cfg job, --info, --help and Hydra's other flags (bnexp train --help), then "
                              "key=value overrides")


def one_value(o: Override, value: str) -> str:
    return f"{o.get_key_element()}={value}"


def sweep_length(o: Override) -> int:
    """How many values a discrete sweep gives, without listing them (a range of 10**8 seeds)."""
    sweep = o.value()
    if isinstance(sweep, RangeSweep):
        return max(0, math.ceil((sweep.stop - sweep.start) / sweep.step))
    return len(sweep.list)


def check_sweep_sizes(parsed: Sequence[Override]) -> None:
    """Each discrete sweep gives at least one value, and all of them together at most
    :data:`MAX_JOBS` jobs."""
    jobs = 1
    for o in parsed:
        if not (o.is_sweep_override() and o.is_discrete_sweep()):
            continue
        length = sweep_length(o)
        if length == 0:
            raise ConfigError(f"{o.input_line} gives no value: a sweep needs at least one (range(a,b) counts from a "
                              "up to b-1)")
        jobs *= length
    if jobs > MAX_JOBS:
        raise ConfigError(f"the sweeps {' '.join(o.input_line for o in parsed if o.is_sweep_override())} make {jobs} "
                          f"jobs, more than {MAX_JOBS} (each one a run folder, its values checked first): sweep fewer "
                          "values, or split the sweep")


def check_deletions(parsed: Sequence[Override]) -> None:
    """``~key`` of a setting (not a group choice, a tag or a Hydra key): every run reads its
    settings, so removing one fails the run (a traceback, or a run folder made first)."""
    for o in parsed:
        key = o.key_or_group
        if o.is_delete() and not is_group(o) and key != "tags" and not key.startswith(ADDABLE):
            raise ConfigError(f"{o.input_line} removes a setting every run reads: give it a value instead "
                              f"({key}=VALUE)")


def check_search(parsed: Sequence[Override], cfg: DictConfig) -> None:
    """An interval sweep needs a search sweeper: bnexp's own (the default) names it in one line."""
    if OmegaConf.select(cfg, "hydra.sweeper._target_") != BNEXP_SWEEPER:
        return
    for o in parsed:
        if o.is_sweep_override() and not o.is_discrete_sweep():
            raise interval_refused(o)


def variants(parsed: Sequence[Override]) -> list[list[str]]:
    """Override lists to compose: each sweep at its first value, then each other value of a
    swept group once. Interval sweeps (a search sweeper's) are left out."""
    def base_line(o: Override) -> Optional[str]:
        if not o.is_sweep_override():
            return o.input_line
        return one_value(o, next(iter(o.sweep_string_iterator()))) if o.is_discrete_sweep() else None

    base = [base_line(o) for o in parsed]
    out = [[line for line in base if line is not None]]
    for i, o in enumerate(parsed):
        if o.is_sweep_override() and o.is_discrete_sweep() and is_group(o):
            for value in list(o.sweep_string_iterator())[1:]:
                out.append([line for j, line in enumerate(base) if line is not None and j != i] + [one_value(o, value)])
    return out


def missing_option(err: MissingConfigException, parsed: Sequence[Override]) -> str:
    """``norm=cbnn`` -> "unknown norm 'cbnn'; valid choices: bn, cbn, ..."."""
    missing = err.missing_cfg_file or ""
    for o in parsed:
        group = o.key_or_group
        if is_group(o) and missing.startswith(group + "/"):
            options = list(err.options or []) or group_options(group)
            return f"unknown {group} {missing[len(group) + 1:]!r}; valid choices: {', '.join(options)}"
    return str(err).split("\n")[0]


def keys_under(cfg: DictConfig, parent: str) -> list[str]:
    """The keys of the node at ``parent`` (the root for ''), config groups of the root included."""
    node = OmegaConf.select(cfg, parent) if parent else cfg
    keys = [str(k) for k in node.keys()] if isinstance(node, DictConfig) else []
    if not parent:
        keys += [p.name for p in config_dir().iterdir() if p.is_dir() and not p.name.startswith("_")]
    return sorted(set(keys) - {"hydra"})


def unknown_key(key: str, cfg: Optional[DictConfig], added: bool = False) -> str:
    """``trainer.epoch`` -> "unknown key 'trainer.epoch'; did you mean trainer.epochs? ..."."""
    parent, _, leaf = key.rpartition(".")
    if not parent and not added and any((d / key).is_dir() for d in (config_dir(), *plugin_config_dirs())):
        # a group that no default of the config chooses
        return (f"config group {key!r} is not in this config's defaults, so {key}=... has nothing to replace: "
                f"+{key}=OPTION adds it (options: {', '.join(group_options(key))})")
    valid = keys_under(cfg, parent) if cfg is not None else []
    close = difflib.get_close_matches(leaf, valid, n=3, cutoff=0.7)
    what = "key" if parent else "config group or key"
    text = f"unknown {what} {key!r}"
    if added:
        text += " (bnexp would ignore it; only tags.* may be added with +)"
    if close:
        text += f"; did you mean {' or '.join(f'{parent}.{c}' if parent else c for c in close)}?"
    if key == "tune_seeds":
        text += ("; tune_seeds is an option of bnexp reproduce and bnexp table: bnexp reproduce <paper>/<name> "
                 "tune_seeds=N dry_run=true lists which seeds select and which test.")
    if valid:
        text += f" Valid {'keys under ' + parent if parent else 'groups and keys'}: {', '.join(valid)}"
    return text


def compose_or_explain(overrides: list[str], parsed: Sequence[Override]) -> DictConfig:
    """The composed config (its hydra node included), or a ConfigError saying what is wrong."""
    try:
        return compose("train", overrides, return_hydra_config=True)
    except MissingConfigException as err:
        raise ConfigError(missing_option(err, parsed)) from None
    except (HydraException, OmegaConfBaseException) as err:
        message = str(err).split("\n")[0]
        if message.startswith("Could not override '"):
            key = message.split("'")[1]
            rest = [o for o in overrides if o.lstrip("+~").split("=", 1)[0] != key]
            raise ConfigError(unknown_key(key, quiet_compose(rest))) from None
        if message.startswith("Could not append to config. An item is already at '"):
            key = message.split("'")[1]
            raise ConfigError(f"+{key}=... adds a key that exists already: write {key}=VALUE") from None
        raise ConfigError(f"the overrides {' '.join(overrides)} do not compose: {message}") from None


def quiet_compose(overrides: list[str]) -> Optional[DictConfig]:
    try:
        return compose("train", overrides, return_hydra_config=True)
    except (HydraException, OmegaConfBaseException):
        return None


def check_additions(parsed: Sequence[Override], base: list[str]) -> None:
    """``+key=value`` for a key bnexp does not have is an error (Hydra adds it, nothing reads it)."""
    added = [o for o in parsed if (o.is_add() or o.is_force_add()) and not is_group(o)
             and not o.key_or_group.startswith(ADDABLE)]
    if not added:
        return
    without = quiet_compose([line for line in base if not line.startswith("+")])
    for o in added:
        if without is None or OmegaConf.select(without, o.key_or_group, default=_ABSENT) is _ABSENT:
            raise ConfigError(unknown_key(o.key_or_group, without, added=True))


_ABSENT: Any = object()


def ensure_writable(folder: Path, key: str) -> None:
    """Create ``folder`` and a file in it, or raise a ConfigError naming it and ``key``; the
    folders made for the test are removed again (the run makes them when it starts), so a
    command that stops before then leaves nothing."""
    made = [p for p in (folder, *folder.parents) if not p.exists()]
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as err:
        raise ConfigError(f"cannot write to the output folder {folder} ({type(err).__name__}: {err.strerror or err}): "
                          f"choose another with {key}=PATH") from None
    finally:
        for path in made:  # deepest first
            try:
                path.rmdir()
            except OSError:  # another process has put something there meanwhile
                break


def bind(cfg: DictConfig, task: list[str]) -> None:
    """Make ``cfg`` (composed with its hydra node) this process's Hydra config, with the command
    line's task overrides: the run and sweep folders are named after them, and ``${hydra:...}``
    reads it."""
    with read_write(cfg.hydra), open_dict(cfg):
        cfg.hydra.overrides.task = task
    HydraConfig.instance().set_config(cfg)


def check_output(cfg: DictConfig, task: list[str], multirun: bool) -> None:
    """The run's (or the sweep's) output folder can be written."""
    bind(cfg, task)
    key = "hydra.sweep.dir" if multirun else "hydra.run.dir"
    try:
        folder = OmegaConf.select(cfg, key)
    except OmegaConfBaseException as err:  # ${nope.nope}, or the key naming itself
        raise ConfigError(f"{key} cannot be resolved: {str(err).splitlines()[0]}") from None
    if "${" in str(folder):  # Hydra stores the folder as a config value, which resolves it again
        raise ConfigError(f"{key} names the folder {folder}, which holds '${{': Hydra would read it as an "
                          f"interpolation again and run elsewhere: choose a folder without '${{' ({key}=PATH)")
    ensure_writable(Path(os.path.expanduser(str(folder))), key)


def check_names(cfg: DictConfig) -> None:
    """A group's ``name`` is the name of its chosen option: ``norm.name=cbn`` with ``norm=bn``
    would train BN and record it as CBN."""
    for group, option in cfg.hydra.runtime.choices.items():
        node = cfg.get(group)
        if isinstance(node, DictConfig) and node.get("name", option) != option:
            raise ConfigError(f"{group}.name={node.name} does not match {group}={option}: {group}.name names the "
                              f"chosen config; choose another with {group}=NAME and leave {group}.name out")


def swept_values(parsed: Sequence[Override]) -> list[tuple[str, Any]]:
    """(key, value) for each value but the first of the command line's value sweeps
    (``optim.lr=0.1,-1``: ``-1``); each composed config holds the first. Interval sweeps (a
    search sweeper's) are left out: their values are drawn as the search goes."""
    return [(o.key_or_group, Override._convert_value(value)) for o in parsed  # a quoted string as its text
            if o.is_sweep_override() and o.is_discrete_sweep() and not is_group(o)
            and not o.key_or_group.startswith("hydra.") for value in list(o.sweep_iterator())[1:]]


def with_value(cfg: DictConfig, key: str, value: Any) -> DictConfig:
    """A copy of ``cfg`` with ``key`` set to ``value`` as Hydra sets an override's value."""
    job = copy.deepcopy(cfg)
    OmegaConf.update(job, key, value, merge=True)
    return job


def check_values(cfg: DictConfig, task: list[str], swept: Sequence[tuple[str, Any]]) -> None:
    """The values of a composed config, and each swept value in its place: valid
    (:func:`bnexp.engine.config.validate`), group names that match the choices, no norm setting
    that the chosen norm ignores."""
    from bnexp.engine.config import meaningless, validate  # here: its schema imports torch, which composing does not need

    bind(cfg, task)
    for job in [cfg, *(with_value(cfg, key, value) for key, value in swept)]:
        validate(job)
        check_names(job)
        meaningless(job, task)


def check_command_line(args: Sequence[str]) -> None:
    """Compose what ``bnexp train ARGS`` would run; raise ConfigError for an unknown group
    option, group or key, an unknown ``+key``, a sweep without ``-m``, an unparsable override,
    a value that is not valid (in each job of a sweep) or an output folder that cannot be
    written."""
    check_flags(args)
    multirun = any(a in ("-m", "--multirun") for a in args)
    shown = [a for a in args if a.split("=", 1)[0] in ("--cfg", "-c", "--info", "-i")]
    if multirun and shown:
        raise ConfigError(f"{shown[0]} shows the config of one job and cannot be used with -m: leave out -m (and "
                          "give one value per key) to see a job's config, or use -m --dry-run to list a sweep's jobs")
    overrides = overrides_of(args)
    if overrides is None:
        return
    with hydra_session():
        try:
            parsed = parser().parse_overrides(overrides)
        except OverrideParseException as err:
            raise ConfigError(f"cannot parse the overrides {' '.join(overrides)}: {str(err).splitlines()[0]}") from None
        sweeps = [o for o in parsed if o.is_sweep_override()]
        if sweeps and not multirun:
            raise ConfigError(f"{sweeps[0].input_line} gives several values: add -m to run one job per value, "
                              "or write key=[a,b] for a list value")
        check_sweep_sizes(parsed)
        check_deletions(parsed)
        lists = variants(parsed)
        composed = [compose_or_explain(overrides_, parsed) for overrides_ in lists]
        check_additions(parsed, lists[0])
        check_search(parsed, composed[0])
        if any(a in VALUE_FLAGS[:2] for a in args):  # --cfg / -c print a config and write nothing
            return
        task = [o.input_line for o in parsed if not o.key_or_group.startswith(("hydra.", "hydra/"))]
        swept = swept_values(parsed)
        for cfg in composed:
            check_values(cfg, task, swept)
        problem = pack_misplaced(composed[0].trainer.get("pack"), multirun,
                                 str(composed[0].hydra.launcher.get("_target_", "")))
        if problem:
            raise ConfigError(problem)
        if DRY_RUN not in args:  # a dry run writes nothing
            check_output(composed[0], task, multirun)


def pack_misplaced(pack: Any, sweeping: bool, launcher: str) -> str | None:
    """Why ``trainer.pack`` cannot apply where it is given (``launcher``: the ``_target_`` of
    the command's Hydra launcher), None when it can: ``auto`` sizes the packs of a sweep, and
    a sweep packs only under bnexp's packing launchers (``pack``, ``pack_slurm``)."""
    packs = pack == "auto" or isinstance(pack, int) and not isinstance(pack, bool) and pack > 1
    if sweeping and packs and not launcher.startswith("hydra_plugins.bnexp_launcher."):
        return (f"trainer.pack={pack} sizes the packs of a sweep, which hydra/launcher=pack (or pack_slurm) "
                "trains; add it, or leave trainer.pack out")
    if not sweeping and pack == "auto":
        return ("trainer.pack=auto sizes the packs of a sweep (bnexp train -m ... hydra/launcher=pack); on one "
                "command line give the number of seeds to pack (trainer.pack=10)")
    return None
