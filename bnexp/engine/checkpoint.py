"""Atomic, checksummed checkpoints, RNG capture and the search for the newest valid one.

Checkpoints go through :func:`bnexp.support.runinfo.atomic_write`, so a crash or a full disk can
never leave a half-written file under a checkpoint's name. Beside each one, a
``<name>.sha256`` file (``sha256sum`` format, so ``sha256sum -c`` checks it too) holds the
digest of its bytes; loading verifies it, so a flipped bit is an error, not a silent drift.
The digest proves integrity, not origin, so a checkpoint is unpickled only by
``torch.load(weights_only=True)``, which builds tensors and plain containers and calls no
code named in the file; a file that needs more is refused (:class:`UnsafeCheckpoint`).
Periodic checkpoints live in ``<run>/checkpoints/step-<step>.pt``; the newest ``keep`` of
them are kept. ``trainer.keep_best`` keeps the state of the best evaluation in ``<run>/best.pt``.
"""

from __future__ import annotations

import hashlib
import io
import logging
import pickle
import random
import re
from pathlib import Path
from typing import Any

import numpy as np
import torch
import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from bnexp.engine.identity import differences, fingerprint
from bnexp.support.errors import ConfigError
from bnexp.support.runinfo import atomic_write
from bnexp.support.untrusted import CHECKPOINT_FILE, RECORD_FILE, SMALL_FILE, UnsafeFile, read_regular, text_stream

log = logging.getLogger("bnexp.engine.checkpoint")

CHECKPOINT_DIR = "checkpoints"
FINAL = "checkpoint.pt"  # a completed run's final state, in its directory
BEST = "best.pt"  # trainer.keep_best: the state at the run's best evaluation (test top-1) so far
REQUIRED_KEYS = ("model", "optimizer", "scheduler", "step", "rng")
RUN_SECTIONS = ("model", "norm", "act", "data")  # what eval and export rebuild a run from
# torch's message when weights_only=True meets a global it does not allow (or blocks)
_REFUSED_GLOBAL = re.compile(r"GLOBAL (\S+) (?:was not an allowed global|whose module)")
_STEP_FILE = re.compile(r"step-(\d+)\.pt$")


class UnsafeCheckpoint(ConfigError):
    """A checkpoint that ``torch.load(weights_only=True)`` refuses: it holds more than
    tensors and plain containers, so unpickling it in full could run code from the file."""

    def __init__(self, path: Path, needs: str) -> None:
        super().__init__(f"refused checkpoint {path}: unpickling it needs {needs}, not only the tensors and plain "
                         "containers bnexp loads (torch.load(weights_only=True), never code from a file); if it is "
                         "a checkpoint of an older bnexp, convert it once with scripts/convert_checkpoints.py as "
                         "docs/resilience.md (\"Checkpoints of older versions\") says")


def checksum_path(path: Path) -> Path:
    return path.with_name(path.name + ".sha256")


def save_with_checksum(payload: dict[str, Any], path: Path) -> None:
    """``torch.save`` through :func:`atomic_write`, then the digest file beside it. A failure
    between the two leaves a checkpoint whose digest does not match: it counts as damaged.
    A folder made for it and left empty by a failure is removed."""
    made = not path.parent.exists()
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        buffer = io.BytesIO()
        torch.save(payload, buffer)
        data = buffer.getvalue()
        checksum_path(path).unlink(missing_ok=True)
        atomic_write(path, lambda f: f.write(data))
        line = f"{hashlib.sha256(data).hexdigest()}  {path.name}\n"
        atomic_write(checksum_path(path), lambda f: f.write(line.encode()))
    except BaseException:
        if made and not any(path.parent.iterdir()):
            path.parent.rmdir()
        raise


def remove_partial_files(run_dir: Path) -> None:
    """Delete what writes cut short by a killed process left in a run directory and its
    checkpoint folder: the temporary files of :func:`atomic_write` (``.<name>.tmp``). Only the
    process that holds the directory's lock calls this."""
    for folder in (run_dir, run_dir / CHECKPOINT_DIR):
        for tmp in folder.glob(".*.tmp"):
            log.info("removing %s, left by a write that did not finish", tmp)
            tmp.unlink(missing_ok=True)


def capture_rng() -> dict[str, Any]:
    """The state of every random generator a training step may draw from, in types that
    ``torch.load(weights_only=True)`` accepts (numpy's key array as a tensor)."""
    name, keys, pos, has_gauss, cached = np.random.get_state()
    numpy_state = {"name": name, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                   "has_gauss": int(has_gauss), "cached_gaussian": float(cached)}
    state = {"python": random.getstate(), "numpy": numpy_state, "torch": torch.get_rng_state()}
    if torch.cuda.is_available():  # the current device's only: another machine may show fewer GPUs
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def restore_rng(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    saved = state["numpy"]
    np.random.set_state((saved["name"], saved["keys"].numpy().astype(np.uint32), saved["pos"], saved["has_gauss"],
                         saved["cached_gaussian"]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        cuda = state["cuda"]
        if isinstance(cuda, (list, tuple)):  # written before 2026-11-23: one state per visible GPU
            cuda = cuda[torch.cuda.current_device()] if torch.cuda.current_device() < len(cuda) else cuda[0]
        torch.cuda.set_rng_state(cuda)


def periodic_path(run_dir: Path, step: int) -> Path:
    return run_dir / CHECKPOINT_DIR / f"step-{step:09d}.pt"


def periodic_step(path: Path) -> int | None:
    """The step a periodic checkpoint's name says (``step-000000300.pt``: 300); None for another file."""
    found = _STEP_FILE.search(path.name)
    return int(found.group(1)) if found else None


def periodic_checkpoints(run_dir: Path) -> list[Path]:
    """Periodic checkpoints of a run, newest (highest step) first."""
    found = [(step, p) for p in (run_dir / CHECKPOINT_DIR).glob("step-*.pt") if (step := periodic_step(p)) is not None]
    return [p for _, p in sorted(found, reverse=True)]


def prune(run_dir: Path, keep: int) -> None:
    """Delete all but the newest ``keep`` periodic checkpoints."""
    for old in periodic_checkpoints(run_dir)[keep:]:
        old.unlink(missing_ok=True)
        checksum_path(old).unlink(missing_ok=True)
    folder = run_dir / CHECKPOINT_DIR
    if keep == 0 and folder.is_dir() and not any(folder.iterdir()):
        folder.rmdir()


def verified_bytes(path: Path, require_checksum: bool = True) -> bytes:
    """A checkpoint's bytes, checked against its digest file; ValueError if they differ, or
    if the digest file is missing and ``require_checksum`` (else a warning)."""
    try:
        data = read_regular(path, CHECKPOINT_FILE)
    except OSError as err:
        raise ValueError(f"unreadable checkpoint {path}: {err}") from err
    try:
        expected = read_regular(checksum_path(path), SMALL_FILE).split()[0].decode("ascii", "backslashreplace")
    except UnsafeFile as err:
        raise ValueError(f"damaged checkpoint {path}: its checksum file: {err}") from None
    except (OSError, IndexError):
        if require_checksum:
            raise ValueError(f"damaged checkpoint {path}: its checksum file {checksum_path(path).name} is missing")
        log.warning("%s has no checksum file: loading it unverified", path)
        return data
    actual = hashlib.sha256(data).hexdigest()
    if actual != expected:
        raise ValueError(f"damaged checkpoint {path}: its sha256 is {actual[:12]}..., its checksum file says "
                         f"{expected[:12]}...")
    return data


def load(path: Path, require_checksum: bool = True) -> dict[str, Any]:
    """Read a checkpoint with ``torch.load(weights_only=True)``, the only way bnexp unpickles
    one; ValueError if it is damaged, unreadable or lacks a required entry, UnsafeCheckpoint
    if it holds more than tensors and plain containers."""
    data = verified_bytes(path, require_checksum)
    try:
        payload = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        reason = " ".join(str(err).rpartition("WeightsUnpickler error:")[2].partition("Check the documentation")[0]
                          .split())  # the unpickler's own words in torch's long message
        refused = _REFUSED_GLOBAL.search(reason)
        if refused:
            raise UnsafeCheckpoint(path, refused.group(1)) from None
        raise ValueError(f"unreadable checkpoint {path}: {reason}") from err
    except Exception as err:
        raise ValueError(f"unreadable checkpoint {path}: {type(err).__name__}: {err}") from err
    missing = [k for k in REQUIRED_KEYS if not isinstance(payload, dict) or k not in payload]
    if missing:
        raise ValueError(f"incomplete checkpoint {path}: missing {', '.join(missing)}")
    return payload


def load_given(path: Path) -> dict[str, Any]:
    """A checkpoint named on the command line (``trainer.init_from``, ``bnexp eval`` and
    ``export``): :func:`load`, a missing checksum file only warned about, with any problem a
    ConfigError."""
    try:
        return load(path, require_checksum=False)
    except ValueError as err:
        raise ConfigError(str(err)) from err


def read_config(path: Path) -> DictConfig:
    """A run's ``config.yaml``, resolved; a ConfigError naming the file if it cannot be read,
    does not parse, or is not a mapping of settings."""
    try:
        cfg = OmegaConf.create(OmegaConf.to_container(OmegaConf.load(text_stream(path, RECORD_FILE)), resolve=True))
    except (OSError, ValueError, yaml.YAMLError, OmegaConfBaseException) as err:
        raise ConfigError(f"damaged run config {path}: {type(err).__name__}: {' '.join(str(err).split())}") from None
    if not isinstance(cfg, DictConfig) or not all(key in cfg for key in RUN_SECTIONS):
        raise ConfigError(f"damaged run config {path}: not a mapping with the sections {', '.join(RUN_SECTIONS)}")
    return cfg


def finished_run(run_dir: Path, command: str) -> tuple[DictConfig, dict[str, Any]]:
    """The config (its config.yaml) and final checkpoint of the finished run in ``run_dir``;
    a ConfigError naming ``command`` if either is missing, damaged or refused, or if the
    config no longer holds the settings the checkpoint was trained with."""
    if not (run_dir / "config.yaml").is_file() or not (run_dir / FINAL).is_file():
        raise ConfigError(f"bnexp {command}: {run_dir} is not a finished run (it needs config.yaml and {FINAL}; "
                          "unfinished runs have only periodic checkpoints)")
    cfg = read_config(run_dir / "config.yaml")
    payload = load_given(run_dir / FINAL)
    trained_with = payload.get("config")
    if trained_with is not None and fingerprint(trained_with) != fingerprint(cfg):
        raise ConfigError(f"bnexp {command}: {run_dir / 'config.yaml'} no longer holds the settings {FINAL} was "
                          f"trained with ({differences(trained_with, cfg)}; 'there' is the checkpoint): put back the "
                          "run's config (summary.json holds it under \"config\")")
    return cfg, payload


def weights_file(path: Path) -> Path:
    """The checkpoint file ``path`` names: itself, or a run directory's final checkpoint."""
    return path / FINAL if path.is_dir() else path


def load_weights(path: Path) -> dict[str, torch.Tensor]:
    """The model weights of a checkpoint file or of a run directory's final checkpoint."""
    file = weights_file(path)
    if not file.is_file():
        raise ConfigError(f"{path}: no checkpoint there (a checkpoint file, or a run directory holding {FINAL})")
    return load_given(file)["model"]


def drop_stale_best(run_dir: Path, step: int) -> None:
    """Remove a run's :data:`BEST` checkpoint when it was written after ``step``, where
    training starts again (the evaluations after it are trained again, and from step 0 they
    are another run's), or when it is damaged."""
    path = run_dir / BEST
    if not path.is_file():
        return
    try:
        written = int(load(path)["step"])
    except (ValueError, TypeError) as err:
        log.warning("%s; removing it (a later best evaluation writes it again)", err)
    else:
        if written <= step:
            return
        log.info("removing %s of step %d: training starts again at step %d", path, written, step)
    path.unlink(missing_ok=True)
    checksum_path(path).unlink(missing_ok=True)


def resume_candidates(run_dir: Path) -> list[Path]:
    """The checkpoints a run may resume from, newest first: its final checkpoint (there when
    the process was killed after writing it, before its summary said ``completed``), then its
    periodic ones."""
    final = run_dir / FINAL
    return ([final] if final.is_file() else []) + periodic_checkpoints(run_dir)


def newest_valid(run_dir: Path) -> tuple[Path, dict[str, Any]] | None:
    """The newest of :func:`resume_candidates` that loads, warning about each damaged one
    skipped. One that needs more than ``weights_only=True`` raises UnsafeCheckpoint instead of
    being skipped: the run stops rather than train past (and prune) it."""
    for path in resume_candidates(run_dir):
        try:
            return path, load(path)
        except ValueError as err:
            log.warning("%s; trying the previous checkpoint", err)
    return None
