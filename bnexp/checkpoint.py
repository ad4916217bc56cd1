"""Atomic, checksummed checkpoints, RNG capture and the search for the newest valid one.

Checkpoints go through :func:`bnexp.runinfo.atomic_write`, so a crash or a full disk can
never leave a half-written file under a checkpoint's name. Beside each one, a
``<name>.sha256`` file (``sha256sum`` format, so ``sha256sum -c`` checks it too) holds the
digest of its bytes; loading verifies it, so a flipped bit is an error, not a silent drift.
Periodic checkpoints live in ``<run>/checkpoints/step-<step>.pt``; the newest ``keep`` of
them are kept.
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
from omegaconf import DictConfig, OmegaConf

from bnexp.errors import ConfigError
from bnexp.runinfo import atomic_write

log = logging.getLogger("bnexp.checkpoint")

CHECKPOINT_DIR = "checkpoints"
FINAL = "checkpoint.pt"  # a completed run's final state, in its directory
REQUIRED_KEYS = ("model", "optimizer", "scheduler", "step", "rng")
_STEP_FILE = re.compile(r"step-(\d+)\.pt$")


def checksum_path(path: Path) -> Path:
    return path.with_name(path.name + ".sha256")


def save(payload: dict[str, Any], path: Path) -> None:
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
    if isinstance(saved, dict):
        saved = (saved["name"], saved["keys"].numpy().astype(np.uint32), saved["pos"], saved["has_gauss"],
                 saved["cached_gaussian"])
    np.random.set_state(saved)  # a tuple in checkpoints written before 2026-11-23
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        cuda = state["cuda"]
        if isinstance(cuda, (list, tuple)):  # written before 2026-11-23: one state per visible GPU
            cuda = cuda[torch.cuda.current_device()] if torch.cuda.current_device() < len(cuda) else cuda[0]
        torch.cuda.set_rng_state(cuda)


def periodic_path(run_dir: Path, step: int) -> Path:
    return run_dir / CHECKPOINT_DIR / f"step-{step:09d}.pt"


def periodic_checkpoints(run_dir: Path) -> list[Path]:
    """Periodic checkpoints of a run, newest (highest step) first."""
    folder = run_dir / CHECKPOINT_DIR
    found = [(int(m.group(1)), p) for p in folder.glob("step-*.pt") if (m := _STEP_FILE.search(p.name))]
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
        data = path.read_bytes()
    except OSError as err:
        raise ValueError(f"unreadable checkpoint {path}: {err}") from err
    try:
        expected = checksum_path(path).read_text().split()[0]
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
    """Read a checkpoint; ValueError if it is damaged, unreadable or lacks a required entry."""
    data = verified_bytes(path, require_checksum)
    try:
        payload = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:  # written before 2026-11-23 (numpy's RNG state as an array)
        if not checksum_path(path).is_file():  # only bnexp's own files, vouched for by their checksum
            raise ValueError(f"unreadable checkpoint {path}: it holds more than tensors and plain containers "
                             "(torch.load(weights_only=True) refuses it) and has no checksum file showing bnexp "
                             "wrote it") from err
        log.warning("%s was written by an older bnexp: loading it with weights_only=False", path)
        payload = _load_any(path, data)
    except Exception as err:
        raise ValueError(f"unreadable checkpoint {path}: {type(err).__name__}: {err}") from err
    missing = [k for k in REQUIRED_KEYS if not isinstance(payload, dict) or k not in payload]
    if missing:
        raise ValueError(f"incomplete checkpoint {path}: missing {', '.join(missing)}")
    return payload


def _load_any(path: Path, data: bytes) -> Any:
    """A checkpoint of an older bnexp, unpickled in full (its bytes matched its checksum file)."""
    try:
        return torch.load(io.BytesIO(data), map_location="cpu", weights_only=False)
    except Exception as err:
        raise ValueError(f"unreadable checkpoint {path}: {type(err).__name__}: {err}") from err


def finished_run_config(run_dir: Path, command: str) -> DictConfig:
    """The config of the finished run in ``run_dir`` (its config.yaml, beside its final
    checkpoint); a ConfigError naming ``command`` otherwise."""
    if not (run_dir / "config.yaml").is_file() or not (run_dir / FINAL).is_file():
        raise ConfigError(f"bnexp {command}: {run_dir} is not a finished run (it needs config.yaml and {FINAL}; "
                          "unfinished runs have only periodic checkpoints)")
    return OmegaConf.load(run_dir / "config.yaml")


def load_weights(path: Path) -> dict[str, torch.Tensor]:
    """The model weights of a checkpoint file or of a run directory's final checkpoint."""
    file = path / FINAL if path.is_dir() else path
    if not file.is_file():
        raise ConfigError(f"{path}: no checkpoint there (a checkpoint file, or a run directory holding {FINAL})")
    try:
        return load(file, require_checksum=False)["model"]
    except ValueError as err:
        raise ConfigError(str(err)) from err


def resume_candidates(run_dir: Path) -> list[Path]:
    """The checkpoints a run may resume from, newest first: its final checkpoint (there when
    the process was killed after writing it, before its summary said ``completed``), then its
    periodic ones."""
    final = run_dir / FINAL
    return ([final] if final.is_file() else []) + periodic_checkpoints(run_dir)


def newest_valid(run_dir: Path) -> tuple[Path, dict[str, Any]] | None:
    """The newest of :func:`resume_candidates` that loads, warning about each one skipped."""
    for path in resume_candidates(run_dir):
        try:
            return path, load(path)
        except ValueError as err:
            log.warning("%s; trying the previous checkpoint", err)
    return None
