"""Locating the Hydra config tree and checking a composed config before a run starts."""

from __future__ import annotations

import math
from contextlib import contextmanager
from importlib import resources
from pathlib import Path
from typing import Callable, Iterable, Iterator

from hydra import initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import Override
from omegaconf import DictConfig, OmegaConf

from bnexp.distributed import Dist, split_batch
from bnexp.errors import ConfigError, unknown_choice
from bnexp.identity import override_key
from bnexp.norms import NORM_LAYERS, uses_batch_statistics
from bnexp.optim import UNITS

DEVICES = ("auto", "cpu", "cuda")
CHECKPOINT_UNITS = (*UNITS, "minute")  # minutes of wall time: bnexp/trainer.py CheckpointClock
RESUME_MODES = ("auto", "never")  # or the path of a checkpoint file


def config_dir() -> Path:
    """``configs/`` of a source checkout, else the copy installed as ``bnexp.configs``."""
    checkout = Path(__file__).resolve().parent.parent / "configs"
    if (checkout / "train.yaml").is_file():
        return checkout
    return Path(str(resources.files("bnexp.configs")))


@contextmanager
def hydra_session() -> Iterator[None]:
    """A Hydra context on bnexp's config tree (outside any running Hydra app), for ``compose``."""
    register_resolvers()
    with initialize_config_dir(config_dir=str(config_dir()), version_base="1.3"):
        yield


def parser() -> OverridesParser:
    """Hydra's override parser on bnexp's config tree (call inside :func:`hydra_session`)."""
    return OverridesParser.create(config_loader=GlobalHydra.instance().config_loader())


def is_group(o: Override) -> bool:
    """Whether an override chooses a config group option (``norm=cbn``, ``hydra/launcher=joblib``)."""
    key = o.key_or_group
    return key.startswith("hydra/") or ("." not in key and (config_dir() / key).is_dir())


def register_resolvers() -> None:
    """OmegaConf resolvers the config tree uses (``${run_name:...}``, ``${cell_name:...}``,
    ``${sweep_name:...}``, ``${bnp_lr:...}``)."""
    from bnexp.identity import cell_name, run_name
    from bnexp.reference import bnp_lr

    for name, resolver in (("run_name", run_name), ("cell_name", cell_name), ("bnp_lr", bnp_lr)):
        if not OmegaConf.has_resolver(name):
            OmegaConf.register_new_resolver(name, resolver)
    # A sweep's folder is named once, from the sweep's command line: Hydra copies a cached
    # value into every job's config (as it does for ${now:...}), where hydra.overrides.task
    # holds the job's overrides instead.
    if not OmegaConf.has_resolver("sweep_name"):
        OmegaConf.register_new_resolver("sweep_name", run_name, use_cache=True)


def uses_bnp_lr(cfg: DictConfig) -> bool:
    """True when the config's lr comes from the BNP paper's table (``${bnp_lr:...}``)."""
    raw = OmegaConf.to_container(cfg.optim, resolve=False).get("lr")
    return isinstance(raw, str) and raw.startswith("${bnp_lr:")


def lr_not_applicable(cfg: DictConfig) -> bool:
    """True when the run's lr comes from the BNP table and the paper marks it N/A."""
    return uses_bnp_lr(cfg) and cfg.optim.lr is None


def check_published_lr(cfg: DictConfig) -> None:
    """A preset reads its lr from the BNP paper's table for its own data set (``tags.data``);
    trained on another data set (say ``data=digits``) it would use a learning rate tuned for
    other data without a word, so the lr must then be given."""
    data, tagged = cfg.data.name, OmegaConf.select(cfg, "tags.data")
    if uses_bnp_lr(cfg) and data not in (tagged, "synthetic"):  # synthetic: scale=quick's stand-in
        raise ConfigError(f"optim.lr of this preset comes from the BNP paper's table for {tagged}, which has no "
                          f"learning rate for data={data}: set optim.lr=VALUE")


def _number(cfg: DictConfig, key: str, ok: Callable[[float], bool], rule: str, integer: bool = False) -> None:
    """``key`` holds a finite number (an integer if ``integer``) for which ``ok`` holds."""
    value = OmegaConf.select(cfg, key)
    kinds = (int,) if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds) or not math.isfinite(value) or not ok(value):
        raise ConfigError(f"{key}={value!r} is not valid: {key} must be {rule}")


def _optional(cfg: DictConfig, key: str, ok: Callable[[float], bool], rule: str, integer: bool = False) -> None:
    """:func:`_number` for a key that may be absent or null."""
    if OmegaConf.select(cfg, key) is not None:
        _number(cfg, key, ok, f"{rule} (or null)", integer)


def _milestones(cfg: DictConfig) -> None:
    """``schedule.milestones``: a list of numbers >= 0 in increasing order."""
    value = cfg.schedule.get("milestones")
    if value is None:
        return
    items = list(value) if OmegaConf.is_list(value) else None
    numbers = items is not None and all(isinstance(v, (int, float)) and not isinstance(v, bool) and
                                        math.isfinite(v) and v >= 0 for v in items)
    if not numbers or items != sorted(items):
        raise ConfigError(f"schedule.milestones={OmegaConf.to_container(value) if items is not None else value!r} is "
                          "not valid: schedule.milestones must be a list of numbers >= 0 in increasing order, e.g. "
                          "[60,100]")


def _resume(cfg: DictConfig) -> None:
    """``trainer.resume``: auto, never, or a checkpoint file that exists."""
    mode = str(cfg.trainer.resume)
    if mode not in RESUME_MODES and not Path(mode).is_file():
        raise ConfigError(f"trainer.resume={mode!r} is not valid: use auto (continue from the newest checkpoint in "
                          "the run directory), never (start over), or the path of a checkpoint file")


def _init_from(cfg: DictConfig) -> None:
    """``trainer.init_from``: null, or a checkpoint file or run directory that exists."""
    source = cfg.trainer.get("init_from")
    if source is not None and not Path(str(source)).exists():
        raise ConfigError(f"trainer.init_from={source!r} is not valid: use a checkpoint file or a run directory "
                          "holding checkpoint.pt (or null)")


def meaningless(cfg: DictConfig, given: Iterable[str]) -> None:
    """A ``norm.*`` setting on the command line that the chosen norm ignores is an error,
    not a silently dropped value."""
    norm = cfg.norm
    for key in sorted({override_key(line) for line in given}):
        name = key.removeprefix("norm.")
        if not key.startswith("norm.") or name in ("name", "layer", "op_bias") or name.startswith("bnp"):
            continue
        reason = None
        if norm.get("layer") is None:
            reason = f"norm={norm.name} has no normalization layers"
        elif name in ("join", "classifier", "input") and norm.get("placement") != "before_op":
            reason = "it applies to norm.placement=before_op only"
        elif name == "sync" and not NORM_LAYERS.get(norm.layer).batch_statistics:
            reason = f"norm={norm.name} uses no batch statistics to synchronize"
        elif name.startswith("amat_") and not norm.get("amat"):
            reason = "it applies with norm.amat=true only"
        if reason:
            raise ConfigError(f"{key}={OmegaConf.select(cfg, key)} means nothing here: {reason}; leave it out")


def validate(cfg: DictConfig) -> None:
    """Reject impossible values with one message naming the key, the value and the rule."""
    check_published_lr(cfg)
    _number(cfg, "optim.lr", lambda v: v > 0, "a number > 0")
    for key in ("optim.wd_w", "optim.wd_g"):
        _optional(cfg, key, lambda v: v >= 0, "a number >= 0")
    _optional(cfg, "model.width", lambda v: v >= 1, "an integer >= 1", integer=True)
    for key in ("model.width_mult", "model.depth_mult", "model.init_scale"):
        _optional(cfg, key, lambda v: v > 0, "a number > 0")
    for key in ("model.dropout", "model.stochastic_depth"):
        _optional(cfg, key, lambda v: 0 <= v < 1, "in [0, 1)")
    _milestones(cfg)
    _optional(cfg, "schedule.gamma", lambda v: v > 0, "a number > 0")
    _resume(cfg)
    _init_from(cfg)
    for key in ("optim.lr_w", "optim.lr_g"):
        _optional(cfg, key, lambda v: v > 0, "a number > 0, null meaning optim.lr")
    _optional(cfg, "optim.momentum", lambda v: 0 <= v < 1, "in [0, 1)")
    if cfg.optim.get("name") == "adam":
        for key in ("optim.beta1", "optim.beta2"):
            _number(cfg, key, lambda v: 0 <= v < 1, "in [0, 1)")
        _number(cfg, "optim.eps", lambda v: v > 0, "a number > 0")
        for key in ("momentum", "nesterov"):  # a preset's protocol may set them for SGD
            if cfg.optim.get(key):
                raise ConfigError(f"optim.{key}={cfg.optim[key]} means nothing with optim=adam (optim.beta1 is its "
                                  f"momentum): set optim.{key}={'false' if key == 'nesterov' else 0}")
    _number(cfg, "optim.weight_decay", lambda v: v >= 0, "a number >= 0")
    _number(cfg, "trainer.batch_size", lambda v: v >= 1, "an integer >= 1", integer=True)
    _number(cfg, "trainer.nproc", lambda v: v >= 1, "an integer >= 1", integer=True)
    _number(cfg, "trainer.dist_timeout", lambda v: v > 0, "a number of seconds > 0")
    _number(cfg, "trainer.pack", lambda v: v >= 1, "an integer >= 1", integer=True)
    per_process = split_batch(cfg.trainer.batch_size, Dist(world_size=cfg.trainer.nproc))
    together = cfg.trainer.batch_size if cfg.norm.get("sync") else per_process
    if together < 2 and uses_batch_statistics(cfg.norm):
        raise ConfigError(
            f"trainer.batch_size={cfg.trainer.batch_size} gives batch statistics over one image, and norm="
            f"{cfg.norm.name} normalizes with batch statistics: use trainer.batch_size >= 2 per process, or a norm "
            "without batch statistics (none, gn, ln, bnp, bnp_gn, or bn_4things with norm.groups set)")
    _number(cfg, "trainer.epochs", lambda v: v >= 0, "a number >= 0")
    _optional(cfg, "trainer.max_steps", lambda v: v >= 1, "an integer >= 1", integer=True)
    _number(cfg, "trainer.eval_every", lambda v: v > 0, "a number > 0")
    _number(cfg, "trainer.log_every", lambda v: v >= 1, "an integer >= 1", integer=True)
    _number(cfg, "trainer.seed", lambda v: v >= 0, "an integer >= 0", integer=True)
    if cfg.trainer.device not in DEVICES:
        raise unknown_choice("trainer.device", cfg.trainer.device, DEVICES)
    if cfg.trainer.eval_unit not in UNITS:
        raise unknown_choice("trainer.eval_unit", cfg.trainer.eval_unit, UNITS)
    _number(cfg, "trainer.checkpoint_every", lambda v: v >= 0, "a number >= 0 (0 disables checkpoints)")
    _number(cfg, "trainer.keep_checkpoints", lambda v: v >= 1, "an integer >= 1", integer=True)
    if cfg.trainer.checkpoint_unit not in CHECKPOINT_UNITS:
        raise unknown_choice("trainer.checkpoint_unit", cfg.trainer.checkpoint_unit, CHECKPOINT_UNITS)
    for key in ("trainer.tf32", "trainer.deterministic"):
        if not isinstance(OmegaConf.select(cfg, key), bool):
            raise ConfigError(f"{key}={OmegaConf.select(cfg, key)!r} is not valid: use true or false")
    if cfg.schedule.get("unit", "epoch") not in UNITS:
        raise unknown_choice("schedule.unit", cfg.schedule.unit, UNITS)
