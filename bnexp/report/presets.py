"""Paper presets (``configs/experiment/<paper>/<name>.yaml``): their runs and their cost.

A preset is a Hydra overlay holding a protocol and a sweep (``hydra.sweeper.params``).
:func:`plan` expands the sweep exactly as Hydra's basic sweeper does (a Cartesian
product, command-line values replacing the preset's), so ``bnexp reproduce`` can count,
cost and stage the runs that ``bnexp train -m experiment=<preset>`` would start.
"""

from __future__ import annotations

import json
import math
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

import yaml
from hydra import compose, initialize_config_dir
from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
from hydra.core.global_hydra import GlobalHydra
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import Override
from omegaconf import DictConfig, OmegaConf

from bnexp.config import config_dir, lr_not_applicable, register_resolvers, uses_bnp_lr
from bnexp.commands import split_options
from bnexp.errors import ConfigError, unknown_choice

SEED = "trainer.seed"
SCALES = ("full", "quick")
# Training-set sizes, for step counts when a preset sets epochs.
TRAIN_SIZES = {"cifar10": 50_000, "cifar100": 50_000, "mnist": 60_000, "imagenet": 1_281_167}
# Rough seconds per training step on one current data-centre GPU at the protocol's batch
# size: an order-of-magnitude guide for planning, not a benchmark.
GPU_SECONDS_PER_STEP = {
    "resnet20": 0.012, "resnet32": 0.018, "resnet44": 0.024, "resnet56": 0.03, "resnet110": 0.06,
    "preact_resnet110": 0.06, "vgg16": 0.015, "resnet18": 0.25, "resnet50": 0.6, "efficientnet_b0": 0.5,
    "mlp3x100": 0.001, "mlp2x100": 0.001, "cnn5": 0.002,
}
QUICK_SECONDS_PER_RUN = 3.0  # measured on a busy 2-core CPU, runs in one process


def preset_names() -> list[str]:
    """Every ``<paper>/<name>`` under configs/experiment, sorted."""
    root = config_dir() / "experiment"
    return sorted(str(p.relative_to(root).with_suffix("")) for p in root.glob("*/*.yaml"))


def check_preset(name: str) -> None:
    """Raise a ConfigError naming the valid presets unless ``name`` is one."""
    if name not in preset_names():
        raise unknown_choice("preset", name, preset_names())


def check_scale(scale: str) -> None:
    """Raise a ConfigError unless ``scale`` is full or quick."""
    if scale not in SCALES:
        raise unknown_choice("scale", scale, SCALES)


def preset_overrides(name: str, scale: str = "full") -> list[str]:
    """The command-line overrides selecting a preset at a scale."""
    return [f"experiment={name}", *([f"scale={scale}"] if scale != "full" else [])]


@contextmanager
def hydra_session() -> Iterator[None]:
    """A Hydra context on bnexp's config tree (outside any running Hydra app)."""
    register_resolvers()
    with initialize_config_dir(config_dir=str(config_dir()), version_base="1.3"):
        yield


def compose_preset(name: str, scale: str = "full", overrides: Sequence[str] = ()) -> DictConfig:
    """The preset's config, Hydra node included (call inside :func:`hydra_session`)."""
    check_preset(name)
    check_scale(scale)
    return compose("train", [*preset_overrides(name, scale), *overrides], return_hydra_config=True)


def sweep_arguments(cfg: DictConfig) -> list[str]:
    """``hydra.sweeper.params`` as override strings."""
    return [f"{key}={value}" for key, value in cfg.hydra.sweeper.params.items()]


def parse(arguments: Sequence[str]) -> list[Override]:
    """Hydra's parse of override strings (``glob`` reads the config tree)."""
    loader = GlobalHydra.instance().config_loader()
    return OverridesParser.create(config_loader=loader).parse_overrides(list(arguments))


def expand(arguments: Sequence[str]) -> list[tuple[str, ...]]:
    """The jobs Hydra's basic sweeper makes of these sweep arguments (later keys win)."""
    return [tuple(job) for job in BasicSweeper.split_arguments(parse(arguments), None)[0]]


def job_value(job: Sequence[str], key: str) -> str | None:
    """The value a job's overrides give ``key``, if any."""
    for item in job:
        k, _, v = item.partition("=")
        if k == key:
            return v
    return None


def without(job: Sequence[str], key: str) -> tuple[str, ...]:
    """The job's overrides less the one for ``key``."""
    return tuple(item for item in job if item.partition("=")[0] != key)


def fixed_overrides(overrides: Sequence[str]) -> list[str]:
    """The overrides that are not sweeps (those a single config can take)."""
    return [o.input_line for o in parse(overrides) if not o.is_sweep_override()]


@dataclass
class Plan:
    """The runs of a preset at a scale: Hydra override tuples, one per run."""

    name: str
    scale: str
    cfg: DictConfig
    jobs: list[tuple[str, ...]]
    overrides: tuple[str, ...] = ()

    @property
    def results_dir(self) -> Path:
        """Where the sweep writes its runs (the preset's ``hydra.sweep.dir``)."""
        return Path(self.cfg.hydra.sweep.dir)

    @property
    def seeds(self) -> list[int]:
        """The seeds of the sweep, in order."""
        return sorted({int(job_value(job, SEED) or self.cfg.trainer.seed) for job in self.jobs})


# Sweep keys that pick a config group, and the config key that records the choice.
CHOICE_KEYS = {"dataset": "tags.data", "model": "model.name", "norm": "norm.name", "act": "act.name"}


def cell_view(base: DictConfig, job: Sequence[str]) -> DictConfig:
    """The base config with a job's overrides written into the keys they decide.

    A group choice (``norm=bnp``) sets the key naming it (``norm.name``), not the whole
    group: enough to resolve ``${bnp_lr:...}`` without composing every job (slow).
    """
    view = OmegaConf.create(OmegaConf.to_container(base, resolve=False))
    for item in job:
        key, _, value = item.partition("=")
        OmegaConf.update(view, CHOICE_KEYS.get(key, key), yaml.safe_load(value), force_add=True)
    return view


def applicable(jobs: list[tuple[str, ...]], cfg: DictConfig) -> list[tuple[str, ...]]:
    """Drop the jobs whose learning rate the BNP table marks N/A (checked once per cell)."""
    base = OmegaConf.masked_copy(cfg, [key for key in cfg if key != "hydra"])
    keep: dict[tuple[str, ...], bool] = {}
    for job in jobs:
        cell = without(job, SEED)
        if cell not in keep:
            keep[cell] = not lr_not_applicable(cell_view(base, cell))
    return [job for job in jobs if keep[without(job, SEED)]]


def plan(name: str, scale: str = "full", overrides: Sequence[str] = ()) -> Plan:
    """Expand a preset's sweep (plus extra overrides) into its runs."""
    with hydra_session():
        cfg = compose_preset(name, scale, fixed_overrides(overrides))
        jobs = expand([*sweep_arguments(cfg), *overrides])
        if uses_bnp_lr(cfg):
            jobs = applicable(jobs, cfg)
    return Plan(name, scale, cfg, jobs, tuple(overrides))


def steps_per_run(cfg: DictConfig, job: Sequence[str]) -> int:
    """Optimizer steps of one run (its batch size and data set may be swept)."""
    if cfg.trainer.max_steps is not None:
        return int(cfg.trainer.max_steps)
    batch = int(job_value(job, "trainer.batch_size") or cfg.trainer.batch_size)
    data = job_value(job, "dataset") or cfg.tags.get("data", cfg.data.name)
    size = int(cfg.data.train_size) if cfg.data.name == "synthetic" else TRAIN_SIZES.get(data, 50_000)
    return int(round(float(cfg.trainer.epochs) * math.ceil(size / batch)))


def estimate(p: Plan) -> str:
    """One line: how many runs and roughly how much compute they take."""
    if p.scale == "quick":
        return f"{len(p.jobs)} runs, about {len(p.jobs) * QUICK_SECONDS_PER_RUN / 60:.1f} CPU minutes"
    seconds = 0.0
    for job in p.jobs:
        model = job_value(job, "model") or p.cfg.model.name
        seconds += steps_per_run(p.cfg, job) * GPU_SECONDS_PER_STEP.get(model, 0.05)
    return f"{len(p.jobs)} runs, about {seconds / 3600:,.0f} GPU-hours (rough: one current GPU per run)"


# A run that ended with one of these is a result: re-running its command skips it. Failed,
# preempted and interrupted runs run again (resuming from their checkpoints).
FINISHED = ("completed", "diverged")


def skip_reason(cfg: DictConfig, run_dir: Path) -> str | None:
    """Why a job should not train: N/A in the paper, or already completed or diverged."""
    if lr_not_applicable(cfg):
        return "the paper lists no learning rate for this cell (N/A)"
    summary = run_dir / "summary.json"
    if str(cfg.trainer.get("resume", "auto")) == "never" or not summary.is_file():
        return None
    try:
        status = json.loads(summary.read_text()).get("status")
    except (OSError, ValueError):
        return None
    if status in FINISHED:
        return f"already {status} (trainer.resume=never runs it again)"
    return None


def parse_command(args: Sequence[str], usage: str, defaults: dict[str, str]) -> tuple[str, dict[str, str], list[str]]:
    """``<paper>/<name> key=value ...`` -> (preset, this command's options, Hydra overrides)."""
    if not args or "=" in args[0]:
        raise ConfigError(f"usage: {usage}; presets: {', '.join(preset_names())}")
    given, overrides = split_options(args[1:], defaults)
    return args[0], {**defaults, **given}, overrides


def spread_over_gpus(job_num: int) -> None:
    """Sweep job ``n`` trains on GPU ``n mod count`` when several GPUs are visible."""
    import torch

    count = torch.cuda.device_count()
    if count > 1:
        torch.cuda.set_device(job_num % count)
