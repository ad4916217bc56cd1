"""The end-of-sweep report: how many cells completed, diverged or failed, and where.

A Hydra callback (registered in ``configs/train.yaml``). Each job appends its outcome to
a ledger file named in the environment at the start of the sweep, which works for
in-process, joblib and SLURM launchers alike; the end of the sweep reads it back.
"""

from __future__ import annotations

import json
import os
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

from hydra.core.utils import JobReturn
from hydra.experimental.callback import Callback
from omegaconf import DictConfig

LEDGER_ENV = "BNEXP_SWEEP_LEDGER"
STATUSES = ("completed", "diverged", "failed", "skipped")


def job_status(run_dir: Path) -> tuple[str, str | None]:
    """(status, error) from a run's summary.json; a run that wrote none counts as failed."""
    try:
        summary = json.loads((run_dir / "summary.json").read_text())
    except (OSError, ValueError):
        return "failed", "no readable summary.json"
    return summary.get("status", "failed"), summary.get("error")


def format_report(entries: list[dict[str, Any]]) -> str:
    """Counts per status, then one line per failed cell with its error and directory."""
    counts = Counter(e["status"] for e in entries)
    head = ", ".join(f"{counts.get(s, 0)} {s}" for s in STATUSES if s != "skipped" or counts.get(s))
    others = sorted(set(counts) - set(STATUSES))
    head += "".join(f", {counts[s]} {s}" for s in others)
    lines = [f"sweep finished: {len(entries)} cells: {head}"]
    for e in entries:
        if e["status"] == "failed":
            lines.append(f"  failed: {e['dir']}: {e['error']} (details in {Path(e['dir']) / 'summary.json'})")
    return "\n".join(lines)


class SweepReport(Callback):
    """Collect each job's outcome and print the sweep's totals at its end."""

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        sweep_dir.mkdir(parents=True, exist_ok=True)
        os.environ[LEDGER_ENV] = str(sweep_dir / f".sweep-{uuid.uuid4().hex}.jsonl")

    def on_job_end(self, config: DictConfig, job_return: JobReturn, **kwargs: Any) -> None:
        ledger = os.environ.get(LEDGER_ENV)
        if not ledger:  # a single run: nothing to report
            return
        run_dir = Path(config.hydra.runtime.output_dir)
        status, error = job_status(run_dir)
        if job_return.return_value == "skipped":
            status = "skipped"
        with open(ledger, "a") as f:
            f.write(json.dumps({"dir": str(run_dir), "status": status, "error": error}) + "\n")

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        ledger = Path(os.environ.pop(LEDGER_ENV, ""))
        if not ledger.name or not ledger.is_file():
            return
        # One entry per run directory (a multi-task SLURM job reports once per task).
        by_dir = {e["dir"]: e for e in (json.loads(line) for line in ledger.read_text().splitlines() if line.strip())}
        entries = list(by_dir.values())
        ledger.unlink()
        print(format_report(entries), flush=True)
