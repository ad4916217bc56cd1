"""Run outputs into pandas: one row per summary.json, one frame per metrics.csv."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pandas as pd

STATUSES = ("completed", "diverged", "failed")


def _flatten(prefix: str, node: Any, out: dict[str, Any]) -> None:
    if isinstance(node, dict):
        for key, value in node.items():
            _flatten(f"{prefix}.{key}" if prefix else str(key), value, out)
    else:
        out[prefix] = node


def summary_row(path: Path) -> dict[str, Any]:
    """One run: status, metrics, and the config flattened to dotted keys (``act.name``)."""
    try:
        summary = json.loads(path.read_text())
    except (OSError, ValueError) as err:  # a half-written or corrupt file counts as failed
        return {"status": "failed", "error": f"unreadable summary: {err}", "run_dir": str(path.parent)}
    row: dict[str, Any] = {}
    _flatten("", summary.pop("config", {}), row)
    row.update({k: v for k, v in summary.items() if not isinstance(v, (dict, list))})
    row["run_dir"] = str(path.parent)
    return row


def load_summaries(results: Path) -> pd.DataFrame:
    """Every summary.json under ``results`` (recursively), one row each."""
    rows = [summary_row(p) for p in sorted(Path(results).rglob("summary.json"))]
    return pd.DataFrame(rows)


def load_metrics(run_dir: str | Path) -> pd.DataFrame:
    """A run's metrics.csv (empty frame when missing)."""
    path = Path(run_dir) / "metrics.csv"
    return pd.read_csv(path) if path.is_file() else pd.DataFrame()


def seconds_per_epoch(run_dir: str | Path) -> float:
    """Mean wall-clock seconds per epoch, from metrics.csv's last row."""
    metrics = load_metrics(run_dir)
    if metrics.empty or not metrics["epoch"].iloc[-1]:
        return math.nan
    return float(metrics["seconds"].iloc[-1] / metrics["epoch"].iloc[-1])


def first_train_loss(run_dir: str | Path) -> float:
    """The first training loss metrics.csv recorded (the loss before learning settles)."""
    metrics = load_metrics(run_dir)
    return float(metrics["train_loss"].iloc[0]) if not metrics.empty else math.nan
