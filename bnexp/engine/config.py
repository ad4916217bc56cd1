"""Checking a composed config before a run starts: the schema's types and ranges, then the
rules that tie keys together (which flags a norm or optimizer makes meaningless)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterable, Mapping

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from bnexp.data import known_train_size
from bnexp.data.loaders import drop_last
from bnexp.data.sampling import epoch_steps
from bnexp.engine.identity import flatten, override_key
from bnexp.engine.optim import milestone_steps, to_steps
from bnexp.engine.schema import MAX_SEED, MAX_STEPS, RESUME_MODES, STEPS_WHY, check_schema
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
    """``schedule.milestones`` in strictly increasing order (the schema checks that they are
    numbers >= 0): a milestone given twice would decay the lr twice there."""
    milestones = values["schedule"].get("milestones")
    if milestones is not None and any(a >= b for a, b in zip(milestones, milestones[1:])):
        raise ConfigError(f"schedule.milestones={milestones} is not valid: schedule.milestones must be in strictly "
                          "increasing order (each one decays the lr once), e.g. [60,100]")


# Synthetic images are made in memory: (train_size + test_size) x channels x image_size^2 bytes,
# with float32 copies while they are drawn. 2**30 bytes is 5.8 times CIFAR-10.
MAX_SYNTHETIC_BYTES = 2**30


def _synthetic_size(cfg: DictConfig) -> None:
    """``data=synthetic`` fits in memory (each of its sizes is bounded by the schema alone)."""
    data = cfg.data
    if data.get("name") != "synthetic":
        return
    size = (data.train_size + data.test_size) * data.get("channels", 3) * data.image_size**2
    if size > MAX_SYNTHETIC_BYTES:
        raise ConfigError(f"data=synthetic with data.train_size={data.train_size}, data.test_size={data.test_size}, "
                          f"data.channels={data.get('channels', 3)} and data.image_size={data.image_size} holds "
                          f"{size} bytes of images, more than {MAX_SYNTHETIC_BYTES} (it is made in memory, with "
                          "float32 copies): use fewer or smaller images")


def known_steps_per_epoch(cfg: DictConfig) -> int | None:
    """The optimizer steps of an epoch when the config tells the training images
    (:func:`bnexp.data.known_train_size`); None when only the loaded data does."""
    images = known_train_size(cfg.data)
    if images is None:
        return None
    batch = split_batch(cfg.trainer.batch_size, Dist(world_size=cfg.trainer.nproc))
    steps = epoch_steps(images, batch, cfg.trainer.nproc, str(cfg.data.get("sampling", "with_replacement")),
                        drop_last(cfg.data, uses_batch_statistics(cfg.norm)))
    return steps or None  # none: a batch larger than the data, which the run's batch check names


def step_amounts(cfg: DictConfig) -> list[tuple[str, float, str, bool]]:
    """The amounts a run turns into step counts: (key, value, unit, whether 0 turns it off)."""
    trainer, schedule = cfg.trainer, cfg.schedule
    amounts = [("trainer.eval_every", trainer.eval_every, trainer.eval_unit, False),
               ("schedule.warmup", schedule.get("warmup", 0), schedule.get("warmup_unit") or schedule.get("unit", "epoch"), True)]
    if trainer.max_steps is None:
        amounts.append(("trainer.epochs", trainer.epochs, "epoch", False))
    if trainer.checkpoint_unit != "minute":
        amounts.append(("trainer.checkpoint_every", trainer.checkpoint_every, trainer.checkpoint_unit, True))
    return amounts


def check_step_counts(cfg: DictConfig, steps_per_epoch: int | None) -> None:
    """Amounts that round to no step (a run that trains nothing, an interval that never comes)
    name the smallest valid value; milestones must fall on distinct steps, and the run must
    end within :data:`~bnexp.engine.schema.MAX_STEPS` steps. Amounts in epochs are checked
    only when ``steps_per_epoch`` is known (an epoch count of 0 always)."""
    for key, value, unit, zero_is_off in step_amounts(cfg):
        if unit == "epoch" and steps_per_epoch is None:
            if value == 0 and not zero_is_off:
                raise ConfigError(f"{key}=0 is not valid: it trains no step; give a number of epochs > 0 (or set "
                                  "trainer.max_steps)")
            continue
        if to_steps(value, unit, steps_per_epoch or 1) < 1 and not (zero_is_off and value == 0):
            raise ConfigError(f"{key}={value} is not valid: it rounds to no step; the smallest valid value is "
                              f"{smallest_amount(unit, steps_per_epoch)}{', or 0 to turn it off' if zero_is_off else ''}")
    if steps_per_epoch is None:
        return
    total = to_steps(cfg.trainer.epochs, "epoch", steps_per_epoch) if cfg.trainer.max_steps is None else 0
    if total > MAX_STEPS:
        raise ConfigError(f"trainer.epochs={cfg.trainer.epochs} is {total} steps ({steps_per_epoch} per epoch), more "
                          f"than {MAX_STEPS} ({STEPS_WHY}): use fewer epochs")
    if cfg.schedule.name == "multistep":
        milestone_steps(list(cfg.schedule.get("milestones") or []), cfg.schedule.get("unit", "epoch"), steps_per_epoch)


def smallest_amount(unit: str, steps_per_epoch: int | None) -> str:
    """The smallest amount in ``unit`` that makes one step, in words."""
    if unit != "epoch":
        return "1 (step)"
    per_epoch = f"{steps_per_epoch} step{'s' if steps_per_epoch != 1 else ''}"
    return f"{1 / steps_per_epoch:.6g} (epochs of {per_epoch}: one step)"


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
    _synthetic_size(cfg)
    check_step_counts(cfg, known_steps_per_epoch(cfg))
    per_process = split_batch(cfg.trainer.batch_size, Dist(world_size=cfg.trainer.nproc))
    together = cfg.trainer.batch_size if cfg.norm.get("sync") else per_process
    if together < 2 and uses_batch_statistics(cfg.norm):
        raise ConfigError(
            f"trainer.batch_size={cfg.trainer.batch_size} gives batch statistics over one image, and norm="
            f"{cfg.norm.name} normalizes with batch statistics: use trainer.batch_size >= 2 per process, or a norm "
            "without batch statistics (none, gn, ln, bnp, bnp_gn, or bn_4things with norm.groups set)")
