"""Run outputs into pandas: one row per summary.json, one frame per metrics.csv, the time
probe's seconds per epoch."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pandas as pd
import yaml

from bnexp.identity import fingerprint, flatten, result_config
from bnexp.probes.callback import read_probes


def run_overrides(run_dir: Path) -> dict[str, str]:
    """The overrides Hydra recorded for a sweep's job (``.hydra/overrides.yaml``), by key."""
    path = run_dir / ".hydra" / "overrides.yaml"
    lines = yaml.safe_load(path.read_text()) if path.is_file() else None
    return dict(line.split("=", 1) for line in lines or [] if "=" in line)


def summary_row(path: Path) -> dict[str, Any]:
    """One run: status, metrics, the config flattened to dotted keys (``act.name``), the
    job's overrides as ``overrides.<key>`` (``overrides.cbn_row``: the values its sweep gave),
    and its identity: ``fingerprint`` and ``result_config`` (:mod:`bnexp.identity`)."""
    row: dict[str, Any] = {f"overrides.{key}": value for key, value in run_overrides(path.parent).items()}
    row["run_dir"] = str(path.parent)
    try:
        summary = json.loads(path.read_text())
    except (OSError, ValueError) as err:  # a half-written or corrupt file counts as failed
        return {**row, "status": "failed", "error": f"unreadable summary: {err}", "fingerprint": None,
                "result_config": {}}
    config = summary.pop("config", {})
    row.update(flatten(config))
    row.update({k: v for k, v in summary.items() if not isinstance(v, (dict, list))})
    row["result_config"] = result_config(config)
    row["fingerprint"] = fingerprint(row["result_config"])
    return row


def load_summaries(results: Path) -> pd.DataFrame:
    """Every summary.json under ``results`` (recursively), one row each."""
    rows = [summary_row(p) for p in sorted(Path(results).rglob("summary.json"))]
    return pd.DataFrame(rows)


def load_metrics(run_dir: str | Path) -> pd.DataFrame:
    """A run's metrics.csv (empty frame when missing)."""
    path = Path(run_dir) / "metrics.csv"
    return pd.read_csv(path) if path.is_file() else pd.DataFrame()


def seconds_per_epoch(run_dir: str | Path, steps_per_epoch: float) -> float:
    """Training seconds per epoch from the ``time`` probe (data loading and compute, no
    evaluation or checkpoints): ``sum(epoch_s) / sum(epoch_steps) * steps_per_epoch``;
    NaN when the run has no such rows."""
    totals = read_probes(run_dir).query("probe == 'time'").groupby("quantity")["value"].sum()
    steps = totals.get("epoch_steps", 0.0)
    return float(totals["epoch_s"] / steps * steps_per_epoch) if steps else math.nan
