"""Atomic checkpoints, RNG capture and the search for the newest readable checkpoint.

Checkpoints go through :func:`bnexp.runinfo.atomic_write`, so a crash or a full disk can
never leave a half-written file under a checkpoint's name. Periodic checkpoints live in
``<run>/checkpoints/step-<step>.pt``; the newest ``keep`` of them are kept.
"""

from __future__ import annotations

import logging
import random
import re
from pathlib import Path
from typing import Any

import numpy as np
import torch

from bnexp.runinfo import atomic_write

log = logging.getLogger("bnexp.checkpoint")

CHECKPOINT_DIR = "checkpoints"
REQUIRED_KEYS = ("model", "optimizer", "scheduler", "step", "rng")
_STEP_FILE = re.compile(r"step-(\d+)\.pt$")


def save(payload: dict[str, Any], path: Path) -> None:
    """``torch.save`` through :func:`atomic_write`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, lambda f: torch.save(payload, f))


def capture_rng() -> dict[str, Any]:
    """The state of every random generator a training step may draw from."""
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


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


def load(path: Path) -> dict[str, Any]:
    """Read a checkpoint; ValueError if it is unreadable or lacks a required entry."""
    try:
        payload = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as err:
        raise ValueError(f"unreadable checkpoint {path}: {type(err).__name__}: {err}") from err
    missing = [k for k in REQUIRED_KEYS if not isinstance(payload, dict) or k not in payload]
    if missing:
        raise ValueError(f"incomplete checkpoint {path}: missing {', '.join(missing)}")
    return payload


def newest_valid(run_dir: Path) -> tuple[Path, dict[str, Any]] | None:
    """The newest periodic checkpoint that loads, warning about each one skipped."""
    for path in periodic_checkpoints(run_dir):
        try:
            return path, load(path)
        except ValueError as err:
            log.warning("%s; trying the previous checkpoint", err)
    return None
