"""Locating the Hydra config tree and checking a composed config before a run starts."""

from __future__ import annotations

import hashlib
from importlib import resources
from pathlib import Path
from typing import Callable

from omegaconf import DictConfig, OmegaConf

from bnexp.distributed import Dist, split_batch
from bnexp.errors import ConfigError, unknown_choice
from bnexp.norms import uses_batch_statistics

DEVICES = ("auto", "cpu", "cuda")
UNITS = ("epoch", "step")
MAX_NAME = 200  # file names may be 255 bytes; leave room


def config_dir() -> Path:
    """``configs/`` of a source checkout, else the copy installed as ``bnexp.configs``."""
    checkout = Path(__file__).resolve().parent.parent / "configs"
    if (checkout / "train.yaml").is_file():
        return checkout
    return Path(str(resources.files("bnexp.configs")))


def run_name(override_dirname: str) -> str:
    """A run directory name from the run's overrides: stable, so re-running the same
    command finds the same directory (to resume it or skip it); hashed when too long."""
    if not override_dirname:
        return "defaults"
    if len(override_dirname) <= MAX_NAME:
        return override_dirname.replace("/", "_")
    digest = hashlib.sha1(override_dirname.encode()).hexdigest()[:12]
    return f"{override_dirname[: MAX_NAME - 13].replace('/', '_')}-{digest}"


def register_resolvers() -> None:
    """OmegaConf resolvers the config tree uses (``${run_name:...}``, ``${bnp_lr:...}``)."""
    from bnexp.reference import bnp_lr

    for name, resolver in (("run_name", run_name), ("bnp_lr", bnp_lr)):
        if not OmegaConf.has_resolver(name):
            OmegaConf.register_new_resolver(name, resolver)


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
    value = OmegaConf.select(cfg, key)
    kinds = (int,) if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds) or not ok(value):
        raise ConfigError(f"{key}={value!r} is not valid: {key} must be {rule}")


def validate(cfg: DictConfig) -> None:
    """Reject impossible values with one message naming the key, the value and the rule."""
    check_published_lr(cfg)
    _number(cfg, "optim.lr", lambda v: v > 0, "a number > 0")
    for key in ("optim.lr_w", "optim.lr_g"):
        if OmegaConf.select(cfg, key) is not None:
            _number(cfg, key, lambda v: v > 0, "a number > 0 (or null for optim.lr)")
    _number(cfg, "optim.momentum", lambda v: 0 <= v < 1, "in [0, 1)")
    _number(cfg, "optim.weight_decay", lambda v: v >= 0, "a number >= 0")
    _number(cfg, "trainer.batch_size", lambda v: v >= 1, "an integer >= 1", integer=True)
    _number(cfg, "trainer.nproc", lambda v: v >= 1, "an integer >= 1", integer=True)
    per_process = split_batch(cfg.trainer.batch_size, Dist(world_size=cfg.trainer.nproc))
    together = cfg.trainer.batch_size if cfg.norm.get("sync") else per_process
    if together < 2 and uses_batch_statistics(cfg.norm):
        raise ConfigError(
            f"trainer.batch_size={cfg.trainer.batch_size} gives batch statistics over one image, and norm="
            f"{cfg.norm.name} normalizes with batch statistics: use trainer.batch_size >= 2 per process, or a norm "
            "without batch statistics (none, gn, ln, bnp, bnp_gn)")
    _number(cfg, "trainer.epochs", lambda v: v >= 0, "a number >= 0")
    if cfg.trainer.max_steps is not None:
        _number(cfg, "trainer.max_steps", lambda v: v >= 1, "an integer >= 1 (or null)", integer=True)
    _number(cfg, "trainer.eval_every", lambda v: v > 0, "a number > 0")
    _number(cfg, "trainer.log_every", lambda v: v >= 1, "an integer >= 1", integer=True)
    _number(cfg, "trainer.seed", lambda v: v >= 0, "an integer >= 0", integer=True)
    if cfg.trainer.device not in DEVICES:
        raise unknown_choice("trainer.device", cfg.trainer.device, DEVICES)
    if cfg.trainer.eval_unit not in UNITS:
        raise unknown_choice("trainer.eval_unit", cfg.trainer.eval_unit, UNITS)
    _number(cfg, "trainer.checkpoint_every", lambda v: v >= 0, "a number >= 0 (0 disables checkpoints)")
    _number(cfg, "trainer.keep_checkpoints", lambda v: v >= 1, "an integer >= 1", integer=True)
    if cfg.trainer.checkpoint_unit not in UNITS:
        raise unknown_choice("trainer.checkpoint_unit", cfg.trainer.checkpoint_unit, UNITS)
    if cfg.schedule.get("unit", "epoch") not in UNITS:
        raise unknown_choice("schedule.unit", cfg.schedule.unit, UNITS)
