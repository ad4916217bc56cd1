"""Run identity: which settings decide a run's result, its directory name and its fingerprint.

A run directory is named after the command-line overrides that change the result
(:func:`run_name`), and its ``summary.json`` records the fingerprint of the resolved config
without the settings that do not (:func:`fingerprint`), beside what its data files and its
starting weights hold (``data_files``, ``init_weights``). Re-running a command finds the
directory again; "completed" means completed with the same fingerprint and the same files,
and a finished run with other ones is an error naming what differs (:func:`run_differences`).
"""

from __future__ import annotations

import functools
import hashlib
import json
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

# Settings that do not change what a run computes: where it logs, how often it saves or
# prints, which checkpoints it keeps, how long its processes wait for each other, which device it runs on, whether it
# trains packed with other runs and how a pack's convolutions are computed (the same
# computation, rounded differently), whether data is downloaded and checked, where
# ImageNet's JPEGs are decoded (the same crops and flips, pixels rounded differently by the
# decoder and resizer), whether the step is replayed as a CUDA graph (the same bits). A key
# covers its whole subtree.
# (data.num_workers is not one: each DataLoader worker draws its own augmentation.)
NON_RESULT_KEYS = (
    "logger",
    "tags",
    "trainer.resume",
    "trainer.pack",
    "trainer.cuda_graph",
    "trainer.pack_conv",
    "trainer.device",
    "trainer.log_every",
    "trainer.checkpoint_every",
    "trainer.checkpoint_unit",
    "trainer.keep_checkpoints",
    "trainer.keep_best",
    "trainer.dist_timeout",
    "data.download",
    "data.verify",
    "data.decode",
)
# Settings added after runs were recorded, each at the value that computes what runs did
# before it existed. At that value a setting is left out of the fingerprint, so a run
# recorded earlier is still found as "completed" (or resumed); any other value is in it.
NEUTRAL_SINCE_ADDED: dict[str, Any] = {
    "norm.input": True,            # before_op nets normalize their input (2026-11-24)
    "model.init_scale": 1,         # the model's own initialization, unscaled (2026-11-24)
    "schedule.warmup_unit": None,  # the warmup counted in schedule.unit (2026-11-24)
    "data.standardize": True,      # images minus the mean, over the std (2026-11-28)
    "norm.gamma": True,            # the normalization family's learnable gamma (2026-11-28)
}
# Tables that a preset's interpolations read (``${oc.select:lookup.warmup.${norm.name}...}``):
# what a run takes from them is in the keys that read them, so the tables themselves are
# left out of the fingerprint (a run that uses none of their entries computes what it did
# before they existed). They stay in run names: an override of one is a choice on the
# command line.
LOOKUP_KEYS = ("lookup",)
# The settings in which the runs of a pack may differ (bnexp.engine.pack): the seed; rho,
# which the normalization family reads from a per-channel buffer (NormFamily.rho_channels);
# and the learning rates (RATE_KEYS) under one schedule shape, which SGD's device step takes
# per run (bnexp.engine.optim.RunSchedules; other optimizers pack runs of one lr only).
RATE_KEYS = ("optim.lr", "optim.lr_g", "optim.lr_w")
PER_RUN_KEYS = ("trainer.seed", "norm.rho", *RATE_KEYS)
# Group choices left out of the names of a sweep's cells (:func:`cell_name`) only: a preset
# names its own sweep folder, and what either sets is in the config (so in the fingerprint).
PRESET_KEYS = ("experiment", "scale")
# Where a data set lies is not what it holds (the digests of data_files say that): data.root is
# left out of run names, and fingerprints hold it at the root its data set's config gives, the
# value every fingerprint recorded before 2026-11-28 holds, so those stay as they were.
LOCATION_KEYS = ("data.root",)
RECORDED_ROOTS = {"cifar10": "data", "cifar100": "data", "mnist": "data", "imagenet": "data/imagenet"}
MAX_NAME_BYTES = 255  # a file name's limit (ext4, XFS, NFS)
FINGERPRINT_CHARS = 16


def _covered(key: str, prefixes: Iterable[str]) -> bool:
    return any(key == p or key.startswith(p + ".") for p in prefixes)


@functools.cache
def _left_out(key: str) -> bool:
    """Whether :func:`result_config` leaves ``key`` out (a non-result or lookup key), once per
    key: a table reads the same few hundred keys in every one of its runs."""
    return _covered(key, NON_RESULT_KEYS + LOOKUP_KEYS)


def shared_settings(cfg: DictConfig) -> dict[str, Any]:
    """``cfg`` resolved, without its :data:`PER_RUN_KEYS`: what every run of its pack shares."""
    tree = OmegaConf.to_container(cfg, resolve=True)
    for key in PER_RUN_KEYS:
        section, _, name = key.rpartition(".")
        tree.get(section, {}).pop(name, None)
    return tree


def run_labels(cfgs: Sequence[DictConfig]) -> list[str]:
    """The console's label of each run of a pack: the per-run settings in which its runs
    differ (``seed 3: ``, ``lr 0.05: ``, ``seed 0 rho 2.0: ``); empty for a run alone."""
    if len(cfgs) < 2:
        return [""] * len(cfgs)
    keys = [k for k in PER_RUN_KEYS if len({str(OmegaConf.select(c, k)) for c in cfgs}) > 1] or [PER_RUN_KEYS[0]]
    return [" ".join(f"{key.rpartition('.')[2]} {OmegaConf.select(c, key)}" for key in keys) + ": " for c in cfgs]


def is_non_result(key: str) -> bool:
    """Whether a config key is one of :data:`NON_RESULT_KEYS` (or under one)."""
    return _covered(key, NON_RESULT_KEYS)


def override_key(line: str) -> str:
    """The config key an override sets: ``+trainer.epoch=3`` -> ``trainer.epoch``."""
    return line.split("=", 1)[0].lstrip("+~").split("@", 1)[0]


def short_hash(text: str, chars: int = 12) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:chars]


def run_name(overrides: Iterable[str], folder: str | None = None, leave_out: tuple[str, ...] = ()) -> str:
    """A directory name from a command line's overrides: those that change the result but
    ``data.root``, sorted and joined by commas (``model=vgg16,norm=cbn``); ``defaults`` for
    none. Stable, so re-running a command finds its directory; ``/`` written as ``%2F`` (and
    ``%`` as ``%25``), so two values never share a name; cut to 255 bytes with a short hash
    of the whole. Given the ``folder`` it goes in, the name an older bnexp gave the same
    command when only that directory is there (:func:`found_name`)."""
    lines = sorted(str(o) for o in overrides
                   if not _covered(override_key(str(o)), NON_RESULT_KEYS + LOCATION_KEYS + leave_out))
    name = ",".join(lines).replace("%", "%25").replace("/", "%2F") or "defaults"
    if len(name.encode()) > MAX_NAME_BYTES:
        head = name.encode()[: MAX_NAME_BYTES - 13].decode(errors="ignore")  # never half a character
        name = f"{head}-{short_hash(name)}"
    return name if folder is None else found_name(Path(folder), name, list(overrides), leave_out)


def legacy_run_name(overrides: Iterable[str], leave_out: tuple[str, ...] = ()) -> str:
    """The name bnexp gave a run directory before 2026-11-28: ``data.root`` included, ``/`` as
    ``_``, cut at 200 characters."""
    lines = sorted(str(o) for o in overrides if not _covered(override_key(str(o)), NON_RESULT_KEYS + leave_out))
    name = ",".join(lines).replace("/", "_") or "defaults"
    return name if len(name) <= 200 else f"{name[:187]}-{short_hash(name)}"


def found_name(folder: Path, name: str, overrides: list[str], leave_out: tuple[str, ...] = ()) -> str:
    """``name``, unless ``folder`` holds no directory of it but one an older bnexp named
    (:func:`legacy_run_name`) for the same command, with its ``data.root`` or another (the
    data set may have moved since; the data files' digests tell whether it is the same data)."""
    if (folder / name).exists() or not folder.is_dir():
        return name
    legacy = legacy_run_name(overrides, leave_out)
    if (folder / legacy).is_dir():
        return legacy
    elsewhere = legacy_run_name([o for o in overrides if not _covered(override_key(str(o)), LOCATION_KEYS)], leave_out)
    moved = [d for d in folder.iterdir() if _without_location(d.name) == elsewhere and d.is_dir()]
    return moved[0].name if len(moved) == 1 else name


def _without_location(name: str) -> str:
    """A name of :func:`legacy_run_name` without its ``data.root=...`` part (:data:`LOCATION_KEYS`)."""
    return ",".join(part for part in name.split(",") if part.partition("=")[0] not in LOCATION_KEYS) or "defaults"


def cell_name(overrides: Iterable[str], folder: str | None = None) -> str:
    """The folder of one cell inside its sweep's folder: :func:`run_name` without the preset
    choices, which the sweep folder already says."""
    return run_name(overrides, folder, PRESET_KEYS)


def flatten(node: Any, prefix: str = "") -> dict[str, Any]:
    """A nested dict as dotted keys: ``{"a": {"b": 1}}`` -> ``{"a.b": 1}``."""
    if not isinstance(node, Mapping):
        return {prefix: node}
    out: dict[str, Any] = {}
    for key, value in node.items():
        name = f"{prefix}.{key}" if prefix else str(key)
        if isinstance(value, Mapping):
            out.update(flatten(value, name))
        else:
            out[name] = value
    return out


def result_config(cfg: DictConfig | Mapping[str, Any]) -> dict[str, Any]:
    """The resolved config as dotted keys, without the settings that do not change the result."""
    tree = OmegaConf.to_container(cfg, resolve=True) if isinstance(cfg, DictConfig) else dict(cfg)
    tree.pop("hydra", None)
    flat = {k: _canonical(v) for k, v in flatten(tree).items() if not _left_out(k)}
    if "data.root" in flat:  # the root recorded fingerprints hold (LOCATION_KEYS)
        flat["data.root"] = RECORDED_ROOTS.get(str(flat.get("data.name")))
    return {k: v for k, v in flat.items() if k not in NEUTRAL_SINCE_ADDED or v != NEUTRAL_SINCE_ADDED[k]}


def _canonical(value: Any) -> Any:
    """``1.0`` as ``1``: ``optim.lr=1`` and ``optim.lr=1.0`` are the same setting."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


def fingerprint(cfg: DictConfig | Mapping[str, Any]) -> str:
    """A short hash of :func:`result_config`: equal for runs that compute the same thing."""
    return result_fingerprint(result_config(cfg))


def result_fingerprint(result: Mapping[str, Any]) -> str:
    """:func:`fingerprint` of a config given as its result config (which :func:`result_config`
    leaves as it is), without deriving that again."""
    return short_hash(json.dumps(result, sort_keys=True, default=str), FINGERPRINT_CHARS)


def run_differences(there: Mapping[str, Any], here: DictConfig, recorded: Mapping[str, Any] | None = None) -> str:
    """What makes a recorded run (its config ``there``; ``recorded``, its summary or checkpoint,
    holds what its data files and starting weights held) another run than ``here``: the
    settings that differ (:func:`differences`), then the data files and starting weights whose
    content differs from the files ``here`` reads; empty for the same run."""
    from bnexp.data import data_files  # here: bnexp.data imports torch, which naming runs does not need
    from bnexp.data.files import changed_files

    recorded = recorded or {}
    settings = [differences(there, here)] if fingerprint(there) != fingerprint(here) else []
    now = [f.path for f in data_files(here.data)]
    return "; ".join(settings + changed_files(recorded.get("data_files"), now)
                     + changed_files(recorded.get("init_weights"), key="init_weights"))


def differences(there: Mapping[str, Any], here: Mapping[str, Any], limit: int = 6) -> str:
    """The keys whose values differ between two configs, as ``key: A there, B here``."""
    a, b = result_config(there), result_config(here)
    keys = sorted(k for k in a.keys() | b.keys() if a.get(k, "<unset>") != b.get(k, "<unset>"))
    text = "; ".join(f"{k}: {a.get(k, '<unset>')!r} there, {b.get(k, '<unset>')!r} here" for k in keys[:limit])
    return text + (f"; and {len(keys) - limit} more" if len(keys) > limit else "")
