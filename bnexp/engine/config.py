"""Checking a composed config before a run starts: the schema's types and ranges, then the
rules that tie keys together (which flags a norm or optimizer makes meaningless)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterable, Mapping

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from bnexp.engine.identity import flatten, override_key
from bnexp.engine.schema import MAX_SEED, RESUME_MODES, check_schema
from bnexp.nn.create_norm import NORM_LAYERS, uses_batch_statistics
from bnexp.support.distributed import Dist, split_batch
from bnexp.support.errors import ConfigError


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


def resolved(cfg: DictConfig) -> dict[str, Any]:
    """The config's values with every interpolation resolved, as plain dicts and lists
    (Hydra's own node left out); one that cannot be resolved is a ConfigError naming its key."""
    try:
        return {str(key): OmegaConf.to_container(cfg[key], resolve=True) if OmegaConf.is_config(cfg[key]) else cfg[key]
                for key in cfg if key != "hydra"}
    except OmegaConfBaseException as err:
        key = str(getattr(err, "full_key", "") or "")
        raw = flatten(OmegaConf.to_container(cfg, resolve=False)).get(key, "")
        raise ConfigError(f"{key}={raw} cannot be resolved: {str(err).splitlines()[0]}") from None


def _milestones(values: Mapping[str, Any]) -> None:
    """``schedule.milestones`` in increasing order (the schema checks that they are numbers >= 0)."""
    milestones = values["schedule"].get("milestones")
    if milestones is not None and milestones != sorted(milestones):
        raise ConfigError(f"schedule.milestones={milestones} is not valid: schedule.milestones must be in increasing "
                          "order, e.g. [60,100]")


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


def _adam(cfg: DictConfig) -> None:
    """``optim=adam`` takes no SGD momentum or nesterov (a preset's SGD protocol may set them)."""
    if cfg.optim.get("name") != "adam":
        return
    for key in ("momentum", "nesterov"):
        if cfg.optim.get(key):
            raise ConfigError(f"optim.{key}={cfg.optim[key]} means nothing with optim=adam (optim.beta1 is its "
                              f"momentum): set optim.{key}={'false' if key == 'nesterov' else 0}")


def _nesterov(cfg: DictConfig) -> None:
    """``optim.nesterov=true`` needs a momentum (torch's SGD refuses it without one)."""
    momentum = cfg.optim.get("momentum") or 0
    if cfg.optim.get("nesterov") and not momentum > 0:
        raise ConfigError(f"optim.nesterov=true needs optim.momentum > 0 (Nesterov's is a momentum method), got "
                          f"optim.momentum={momentum}: set a momentum, or optim.nesterov=false")


def _warmup(cfg: DictConfig) -> None:
    """A linear warmup starts at ``lr * warmup_factor``: a factor of 0 is refused by torch."""
    if cfg.schedule.get("warmup_mode") == "linear" and cfg.schedule.get("warmup_factor") == 0:
        raise ConfigError("schedule.warmup_factor=0 is not valid with schedule.warmup_mode=linear: a linear warmup "
                          "starts at lr * warmup_factor, which must be > 0; use a factor in (0, 1]")


def _seeds(cfg: DictConfig) -> None:
    """The seeds a run draws (``trainer.seed`` plus the rank, or plus the member of a pack)
    fit numpy's 32 bits."""
    pack = cfg.trainer.pack if isinstance(cfg.trainer.pack, int) else 1  # auto: a sweep's packs, one run each here
    seed, runs = cfg.trainer.seed, max(cfg.trainer.nproc, pack)
    if seed + runs - 1 > MAX_SEED:
        raise ConfigError(f"trainer.seed={seed} is too large for trainer.nproc={cfg.trainer.nproc} and trainer.pack="
                          f"{cfg.trainer.pack}: the seeds {seed} to {seed + runs - 1} must be <= {MAX_SEED}")


def validate(cfg: DictConfig) -> None:
    """Reject impossible values with one message naming the key, the value and the rule: the
    types and ranges of the schema (:mod:`bnexp.engine.schema`), then the rules that tie keys together."""
    values = resolved(cfg)
    check_published_lr(cfg)
    if lr_not_applicable(cfg):  # no run: the sweep skips the cell (bnexp.app.sweep.skip_reason)
        return
    check_schema(values)
    _milestones(values)
    _resume(cfg)
    _init_from(cfg)
    _adam(cfg)
    _nesterov(cfg)
    _warmup(cfg)
    _seeds(cfg)
    per_process = split_batch(cfg.trainer.batch_size, Dist(world_size=cfg.trainer.nproc))
    together = cfg.trainer.batch_size if cfg.norm.get("sync") else per_process
    if together < 2 and uses_batch_statistics(cfg.norm):
        raise ConfigError(
            f"trainer.batch_size={cfg.trainer.batch_size} gives batch statistics over one image, and norm="
            f"{cfg.norm.name} normalizes with batch statistics: use trainer.batch_size >= 2 per process, or a norm "
            "without batch statistics (none, gn, ln, bnp, bnp_gn, or bn_4things with norm.groups set)")
