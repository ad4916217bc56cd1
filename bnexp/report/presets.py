"""Paper presets (``configs/experiment/<paper>/<name>.yaml``): their sweeps, table and cost.

A preset is a Hydra overlay holding a protocol, its sweeps (``hydra.sweeper.sweeps``, run as
their union by :class:`bnexp.app.sweep.BnexpSweeper`) and the description of its table
(``hydra.sweeper.report``). :class:`Preset` reads both from the composed config: the table
commands use the sweeps' values without expanding them; ``bnexp reproduce`` expands them
(:func:`bnexp.app.sweep.expand`) to count and cost the runs.

Matching runs to a preset's cells composes the config of every job (:func:`job_configs`:
CBN Table 1 is 1,350 of them, seconds to minutes of Hydra); the result is kept in bnexp's
cache folder (:func:`cache_dir`) under a key that changes with anything that could change
it, so the table commands compose once per preset and config tree. They read the preset
itself from there too (:func:`read_preset`): a table after the first imports no Hydra.
"""

from __future__ import annotations

import difflib
import fcntl
import json
import math
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any, Iterator, Mapping, Optional, Sequence

import yaml
from omegaconf import DictConfig, OmegaConf, open_dict

from bnexp.app.config_tree import config_digest, config_dir, read_config, register_resolvers
from bnexp.app.sweep_values import Job, Values, select, sweep_lines, union
from bnexp.engine.identity import override_key, result_config, result_fingerprint
from bnexp.report.layouts import Layout, layout_from
from bnexp.support.cache import cache_dir, prune, write_cache
from bnexp.support.errors import ConfigError, unknown_choice
from bnexp.support.options import split_options
from bnexp.support.runinfo import atomic_write

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
# PyYAML's safe loader and dumper on libyaml where PyYAML was built with it, plain PyYAML's
# otherwise (the same values, several times faster): a preset's config kept in the cache
# folder (read_preset), a run's overrides.yaml (a table reads one per run).
YAML_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
YAML_DUMPER = getattr(yaml, "CSafeDumper", yaml.SafeDumper)


def sweep_folder(args: Sequence[str], defaults: Mapping[str, str]) -> tuple[Path, dict[str, str]] | None:
    """``DIR key=value ...`` (a folder of runs, not a preset): the folder and its options over
    ``defaults``; None when the first argument names a preset or is no folder."""
    if not args or args[0] in preset_names() or not Path(args[0]).is_dir():
        return None
    given, extra = split_options(args[1:], defaults)
    if extra:
        raise ConfigError(f"unknown option {extra[0].partition('=')[0]!r} for a sweep folder; options: "
                          f"{', '.join(defaults)}")
    return Path(args[0]), {**defaults, **given}


def preset_names() -> list[str]:
    """Every ``<paper>/<name>`` under configs/experiment, sorted."""
    root = config_dir() / "experiment"
    return sorted(str(p.relative_to(root).with_suffix("")) for p in root.glob("*/*.yaml"))


def preset_overrides(name: str, scale: str = "full") -> list[str]:
    """The command-line overrides selecting a preset at a scale."""
    return [f"experiment={name}", *([f"scale={scale}"] if scale != "full" else [])]


@dataclass
class Preset:
    """A preset at a scale, with the command line's extra overrides, composed once."""

    name: str
    scale: str
    cfg: DictConfig  # with its hydra node
    overrides: tuple[str, ...] = ()  # the command line's, hydra.* included
    task: tuple[str, ...] = ()  # the command line's that a job's overrides hold (no hydra.*)
    params: tuple[str, ...] = ()  # hydra.sweeper.params (scale=quick's seeds) as override lines
    sweeps: tuple[Values, ...] = ()  # each sweep's values per key, params and overrides applied

    @cached_property
    def jobs(self) -> list[Job]:
        """The expanded union of the sweeps (``bnexp reproduce``'s count and cost)."""
        return union(self.sweeps)

    @property
    def results_dir(self) -> Path:
        """Where the sweep writes its runs (the preset's ``hydra.sweep.dir``)."""
        return Path(self.cfg.hydra.sweep.dir)

    @cached_property
    def layout(self) -> Layout:
        """The preset's table (``hydra.sweeper.report``), its cells tied to the sweeps."""
        report = self.cfg.hydra.sweeper.get("report")
        if report is None:
            raise ConfigError(f"preset {self.name} has no report block (hydra.sweeper.report): it has no table")
        fixed = {a["key"]: OmegaConf.select(self.cfg, a["key"]) for a in [*report.rows, *report.columns]}
        return layout_from(OmegaConf.to_container(report, resolve=True), self.sweeps, fixed)

    @cached_property
    def expected(self) -> dict[str, dict[str, Any]]:
        """The result config (dotted keys, :func:`bnexp.engine.identity.result_config`) of every run
        the sweeps make, by fingerprint."""
        return {result_fingerprint(c): c for c in job_configs(self.name, self.scale, self.jobs)}

    @cached_property
    def fingerprints(self) -> frozenset[str]:
        """The fingerprints of the runs the sweeps make: a run belongs to the preset's table
        when its fingerprint is one of these."""
        return frozenset(job_fingerprints(self.name, self.scale, self.jobs))

    @property
    def seeds(self) -> list[int]:
        """The seeds any sweep runs, in order."""
        return sorted({int(s) for sweep in self.sweeps for s in sweep.get(SEED, [self.cfg.trainer.seed])})


def load_preset(name: str, scale: str = "full", overrides: Sequence[str] = ()) -> Preset:
    """Compose preset ``name`` at ``scale`` (plus command-line overrides), with its sweeps."""
    from bnexp.app.cmdline import compose_or_explain  # here: a preset read from the cache needs no Hydra
    from bnexp.app.compose import hydra_session, parser
    from bnexp.app.sweep import parse_values

    check_preset(name, scale)
    with hydra_session():
        sweep_overrides = [o.input_line for o in parser().parse_overrides(list(overrides)) if o.is_sweep_override()]
        fixed = [o for o in overrides if o not in sweep_overrides]
        chosen = [*preset_overrides(name, scale), *fixed]
        cfg = compose_or_explain(chosen, parser().parse_overrides(chosen))
        preset_sweeps = OmegaConf.to_container(cfg.hydra.sweeper.sweeps) or [{}]
        params = OmegaConf.to_container(cfg.hydra.sweeper.params) if cfg.hydra.sweeper.params else {}
        given = parse_values([*sweep_lines(params), *job_overrides(overrides)], parser())
        sweeps = tuple(select([parse_values(sweep_lines(s), parser()) for s in preset_sweeps], given))
    return Preset(name, scale, cfg, tuple(overrides), tuple(job_overrides(overrides)), tuple(sweep_lines(params)),
                  sweeps)


def check_preset(name: str, scale: str) -> None:
    """A ConfigError naming the valid choices when ``name`` is no preset or ``scale`` no scale."""
    if name not in preset_names():
        raise unknown_choice("preset", name, preset_names())
    if scale not in SCALES:
        raise unknown_choice("scale", scale, SCALES)


def job_overrides(overrides: Sequence[str]) -> list[str]:
    """The command line's overrides that a job's overrides hold (Hydra's own left out)."""
    return [o for o in overrides if not o.startswith(("hydra.", "hydra/"))]


def read_preset(name: str, scale: str = "full", overrides: Sequence[str] = ()) -> Preset:
    """:func:`load_preset`'s preset for the commands that only read it (``bnexp table``,
    ``bnexp plot``), from bnexp's cache folder when it was composed before from the same
    preset, scale, overrides and config tree (:func:`~bnexp.app.config_tree.config_digest`),
    without Hydra; else composed and kept there. Its config is the composed one as OmegaConf
    reads it back from plain values: the same keys and values, interpolations resolved as
    they are read (with bnexp's resolvers), Hydra's typed nodes plain."""
    check_preset(name, scale)
    try:
        path: Optional[Path] = cache_dir() / "presets" / f"{config_digest('preset', name, scale, list(overrides))}.json"
    except OSError:  # no home folder to keep a cache in
        path = None
    kept = preset_from(read_config(path), name, scale, overrides) if path is not None else None
    if kept is not None:
        return kept
    p = load_preset(name, scale, overrides)
    plain = OmegaConf.to_container(p.cfg, resolve=False, enum_to_str=True)
    try:
        record = {"cfg": yaml_text(plain), "params": list(p.params), "sweeps": [dict(sweep) for sweep in p.sweeps]}
        back = yaml.load(record["cfg"], YAML_LOADER)
        # plain values only, read back as composed, keys in their order (YAML keeps the number
        # keys of a table's labels; the text of what is read back shows an order or type changed)
        if path is not None and back == plain and yaml_text(back) == record["cfg"]:
            write_cache(path, json.dumps(record).encode())
    except (OSError, TypeError, ValueError, yaml.YAMLError):
        pass
    return p


def yaml_text(plain: Any) -> str:
    """``plain`` as YAML, its keys in their order."""
    return yaml.dump(plain, Dumper=YAML_DUMPER, sort_keys=False)


def preset_from(record: Optional[dict[str, Any]], name: str, scale: str, overrides: Sequence[str]) -> Optional[Preset]:
    """The preset a cache record holds (:func:`read_preset`); None when it has another shape."""
    if record is None or not isinstance(record.get("cfg"), str) or not is_text_list(record.get("params")):
        return None
    sweeps = record.get("sweeps")
    if not isinstance(sweeps, list) or not all(isinstance(sweep, dict) and all(map(is_text_list, sweep.values()))
                                               for sweep in sweeps):
        return None
    try:
        plain = yaml.load(record["cfg"], YAML_LOADER)
    except (yaml.YAMLError, RecursionError):
        return None
    if not isinstance(plain, dict) or not is_tree(plain):
        return None
    register_resolvers()
    try:
        cfg = OmegaConf.create(plain)
        OmegaConf.set_struct(cfg, True)  # as composed: a key it lacks is an error, not None
        p = Preset(name, scale, cfg, tuple(overrides), tuple(job_overrides(overrides)), tuple(record["params"]),
                   tuple(sweeps))
        # what the commands that read a preset read of it, interpolations resolved: a record of
        # another shape, or one that resolves with Hydra's own resolvers (${now:...}), is composed
        p.results_dir, p.layout, p.seeds, int(cfg.trainer.seed), cfg.data.name, cfg.tags.get("data")
    except Exception:  # noqa: BLE001 (whatever the record makes OmegaConf or the layout raise: composed again)
        return None
    return p


def is_tree(value: Any, depth: int = 64) -> bool:
    """Whether ``value`` nests dicts and lists at most ``depth`` deep and holds no container
    twice (what YAML's aliases make, which bnexp never writes: OmegaConf would copy each)."""
    seen: set[int] = set()
    stack = [(value, 0)]
    while stack:
        node, level = stack.pop()
        if isinstance(node, (dict, list)):
            if level > depth or id(node) in seen:
                return False
            seen.add(id(node))
            stack += [(child, level + 1) for child in (node.values() if isinstance(node, dict) else node)]
    return True


def is_text_list(value: Any) -> bool:
    """Whether ``value`` is a list of strings."""
    return isinstance(value, list) and all(isinstance(item, str) for item in value)


def job_configs(name: str, scale: str, jobs: Sequence[Job]) -> list[dict[str, Any]]:
    """The result config of each job of a preset, as its run would record it
    (:func:`compose_job_configs`), from the cache when this preset, scale and job list were
    composed before with the same config files, bnexp code and Hydra (:func:`cache_key`).
    Callers at the same time wait for the first to compose; where the cache cannot be read
    or written, the configs are composed without it."""
    with job_cache(name, scale, jobs) as path:
        return kept_configs(path, name, scale, jobs)


def job_fingerprints(name: str, scale: str, jobs: Sequence[Job]) -> list[str]:
    """The fingerprint of each job's result config (:func:`job_configs`), kept in a file of
    their own beside the configs: matching runs to a preset needs them alone, and reading
    CBN Table 1's 1,350 configs took a tenth of its table's time."""
    with job_cache(name, scale, jobs) as path:
        kept = None if path is None else cached_list(path.with_suffix(".fingerprints.json"), len(jobs), str)
        if kept is None:
            kept = [result_fingerprint(c) for c in kept_configs(path, name, scale, jobs)]
            if path is not None:
                keep_list(path.with_suffix(".fingerprints.json"), kept)
        return kept


@contextmanager
def job_cache(name: str, scale: str, jobs: Sequence[Job]) -> Iterator[Optional[Path]]:
    """The cache file of a preset's job configs (:func:`cache_key`), locked for the block
    (callers at the same time wait for the first); None where no cache folder can be made."""
    try:
        path = cache_dir() / "job_configs" / f"{cache_key(name, scale, jobs)}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        lock = open(path.with_suffix(".lock"), "w")
    except OSError:
        yield None
        return
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released as the file closes
        yield path


def kept_configs(path: Optional[Path], name: str, scale: str, jobs: Sequence[Job]) -> list[dict[str, Any]]:
    """The job configs the cache file at ``path`` holds, else composed (and kept there)."""
    configs = None if path is None else cached_list(path, len(jobs), dict)
    if configs is None:
        configs = compose_job_configs(name, scale, jobs)
        if path is not None:
            keep_list(path, configs)
    return configs


def cached_list(path: Path, count: int, kind: type) -> Optional[list[Any]]:
    """The ``count`` items of type ``kind`` a cache file holds as a JSON list; None when it
    is missing or holds anything else."""
    try:
        items = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return items if isinstance(items, list) and len(items) == count and all(isinstance(i, kind) for i in items) else None


def keep_list(path: Path, items: list[Any]) -> None:
    """Write ``items`` to a cache file when they are plain values (what is read back is what
    was computed), then prune its folder; a file that cannot be written is passed over."""
    text = json.dumps(items)
    if json.loads(text) == items:
        try:
            atomic_write(path, lambda f: f.write(text.encode()))
        except OSError:
            return
        prune(path.parent)


def cache_key(name: str, scale: str, jobs: Sequence[Job]) -> str:
    """A digest of everything :func:`compose_job_configs` computes from: the preset, scale
    and jobs, and what any composition reads (:func:`bnexp.app.config_tree.config_digest`)."""
    return config_digest(name, scale, [list(job) for job in jobs])


def compose_job_configs(name: str, scale: str, jobs: Sequence[Job]) -> list[dict[str, Any]]:
    """The result config of each job of a preset, as its run would record it. Each
    combination of group choices is composed once; a job's values are set on it, the config
    resolved (so interpolations such as the BNP learning rates follow them), and the
    values set back. Each distinct override is parsed once."""
    from hydra import compose  # here: a preset read from the cache needs no Hydra

    from bnexp.app.compose import hydra_session, is_group, parser

    configs, bases = [], {}
    with hydra_session():
        read = parser()
        overrides: dict[str, Any] = {}
        for job in jobs:
            for line in job:
                if line not in overrides:
                    overrides[line] = read.parse_overrides([line])[0]
            parsed = [overrides[line] for line in job]
            groups = tuple(o.input_line for o in parsed if is_group(o))
            if groups not in bases:
                cfg = compose("train", [*preset_overrides(name, scale), *groups])
                bases[groups] = (cfg, OmegaConf.to_container(cfg, resolve=False))
            cfg, raw = bases[groups]
            values = [(o.key_or_group, o.value()) for o in parsed if not is_group(o)]
            with open_dict(cfg):
                for key, value in values:
                    OmegaConf.update(cfg, key, value, merge=False)
                configs.append(result_config(cfg))
                for key, _ in values:
                    _restore(cfg, raw, key)
    return configs


def _restore(cfg: DictConfig, raw: Mapping[str, Any], key: str) -> None:
    """Set ``key`` of ``cfg`` back to its value (an interpolation kept as one) in ``raw``,
    or delete it if ``raw`` has none."""
    node: Any = raw
    for part in key.split("."):
        if not isinstance(node, Mapping) or part not in node:
            parent, _, leaf = key.rpartition(".")
            del (OmegaConf.select(cfg, parent) if parent else cfg)[leaf]
            return
        node = node[part]
    OmegaConf.update(cfg, key, node, merge=False)


def count(p: Preset, sweeps: Sequence[Sequence[str]]) -> int:
    """How many runs these command-line sweeps of the preset make (with its params)."""
    from bnexp.app.compose import hydra_session, parser
    from bnexp.app.sweep import expand

    with hydra_session():
        return sum(len(expand([{}], None, [*p.params, *p.task, *sweep], parser())) for sweep in sweeps)


def job_value(job: Sequence[str], key: str) -> str | None:
    """The value a job's overrides give ``key``, if any."""
    for item in job:
        k, _, v = item.partition("=")
        if k == key:
            return v
    return None


def steps_per_run(cfg: DictConfig, job: Sequence[str]) -> int:
    """Optimizer steps of one run (its batch size and data set may be swept)."""
    if cfg.trainer.max_steps is not None:
        return int(cfg.trainer.max_steps)
    batch = int(job_value(job, "trainer.batch_size") or cfg.trainer.batch_size)
    data = job_value(job, "paper_data") or cfg.tags.get("data", cfg.data.name)
    size = int(cfg.data.train_size) if cfg.data.name == "synthetic" else TRAIN_SIZES.get(data, 50_000)
    return int(round(float(cfg.trainer.epochs) * math.ceil(size / batch)))


def estimate(p: Preset) -> str:
    """One line: how many runs and roughly how much compute they take."""
    if p.scale == "quick":
        return f"{len(p.jobs)} runs, about {len(p.jobs) * QUICK_SECONDS_PER_RUN / 60:.1f} CPU minutes"
    seconds = 0.0
    for job in p.jobs:
        model = job_value(job, "model") or p.cfg.model.name
        seconds += steps_per_run(p.cfg, job) * GPU_SECONDS_PER_STEP.get(model, 0.05)
    return f"{len(p.jobs)} runs, about {seconds / 3600:,.0f} GPU-hours (rough: one current GPU per run)"


def parse_command(args: Sequence[str], usage: str, defaults: dict[str, str]) -> tuple[str, dict[str, str], list[str]]:
    """``<paper>/<name> key=value ...`` -> (preset, this command's options, Hydra overrides)."""
    if not args or "=" in args[0]:
        raise ConfigError(f"usage: {usage}; presets: {', '.join(preset_names())}")
    given, overrides = split_options(args[1:], defaults)
    roots = {p.name for p in config_dir().iterdir() if p.is_dir()} | {"tags", "probes", "hydra"}
    for line in overrides:
        root = override_key(line).split(".")[0].split("/")[0]
        if root not in roots:
            close = difflib.get_close_matches(root, [*defaults, *roots], n=2, cutoff=0.7)
            raise ConfigError(f"unknown option {root!r}{'; did you mean ' + ' or '.join(close) + '?' if close else ''} "
                              f"options: {', '.join(defaults)}, and Hydra overrides of the preset (e.g. "
                              "data.root=PATH)")
    return args[0], {**defaults, **given}, overrides
