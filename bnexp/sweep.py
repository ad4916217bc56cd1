"""Sweeps: which jobs a multirun makes, which of them run, and what they ended with.

- :func:`expand`: the jobs of a multirun are the union of a preset's sweeps
  (``hydra.sweeper.sweeps``), each one Hydra's cartesian product, with
  ``hydra.sweeper.params`` and the command line applied to every sweep; the sweeper that
  runs them (``hydra/sweeper=bnexp``, the default of ``bnexp train -m``) is the plugin
  ``hydra_plugins.bnexp_sweeper``, where Hydra requires plugins to live;
- :func:`skip_reason`: a job whose run finished already (or whose paper lr is N/A) is not
  trained again; :func:`spread_over_gpus` gives job ``n`` GPU ``n mod count``;
- :class:`SweepReport`: the end-of-sweep report. Each job appends its outcome to a ledger
  file named in the environment at the start of the sweep, which works for in-process,
  joblib and SLURM launchers alike; the end of the sweep reads it back.
"""

from __future__ import annotations

import itertools
import json
import os
import uuid
from collections import Counter
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import Override
from hydra.core.utils import JobReturn
from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from bnexp.config import lr_not_applicable
from bnexp.errors import ConfigError

Sweep = Mapping[str, Any]  # one sweep: config key or group -> value(s) in override syntax
Job = list[str]  # one job's overrides, "key=value"


def sweep_lines(sweep: Optional[Sweep]) -> list[str]:
    """A sweep as override strings (``act: relu,tanh`` -> ``act=relu,tanh``)."""
    return [f"{key}={value}" for key, value in (sweep or {}).items()]


def product(overrides: Sequence[Override]) -> list[Job]:
    """The jobs of one sweep, as Hydra's basic sweeper makes them: each key once (a later
    override replaces an earlier one), a discrete sweep (``a,b``, ``range(n)``) expanded."""
    by_key: dict[str, list[str]] = {}
    for override in overrides:
        key = override.get_key_element()
        if not override.is_sweep_override():
            by_key[key] = [f"{key}={override.get_value_element_as_str()}"]
        elif override.is_discrete_sweep():
            by_key[key] = [f"{key}={value}" for value in override.sweep_string_iterator()]
        else:
            raise ConfigError(f"{override.input_line}: bnexp's sweeper takes value lists and range(); an interval "
                              "search needs a search sweeper (hydra/sweeper=optuna)")
    return [list(job) for job in itertools.product(*by_key.values())]


def expand(sweeps: Sequence[Sweep], params: Optional[Sweep], arguments: Sequence[str],
           parser: OverridesParser) -> list[Job]:
    """The jobs of a multirun: for each sweep (one empty sweep when there are none), the
    product of the sweep, then ``params``, then ``arguments`` (the command line); the union
    over the sweeps, a job that several sweeps make only once, in order."""
    jobs: list[Job] = []
    seen: set[frozenset[str]] = set()
    for sweep in sweeps or [{}]:
        for job in product(parser.parse_overrides([*sweep_lines(sweep), *sweep_lines(params), *arguments])):
            if frozenset(job) not in seen:
                seen.add(frozenset(job))
                jobs.append(job)
    return jobs


# A run that ended with one of these is a result: re-running its command skips it. Failed,
# preempted and interrupted runs run again (resuming from their checkpoints).
FINISHED = ("completed", "diverged")


def skip_reason(cfg: DictConfig, run_dir: Path) -> Optional[str]:
    """Why a job should not train: N/A in the paper, or already completed or diverged."""
    if lr_not_applicable(cfg):
        return "the paper lists no learning rate for this cell (N/A)"
    summary = run_dir / "summary.json"
    if str(cfg.trainer.get("resume", "auto")) == "never" or not summary.is_file():
        return None
    try:
        status = json.loads(summary.read_text()).get("status")
    except (OSError, ValueError):
        return None
    if status in FINISHED:
        return f"already {status} (trainer.resume=never runs it again)"
    return None


def spread_over_gpus(job_num: int) -> None:
    """Sweep job ``n`` trains on GPU ``n mod count`` when several GPUs are visible."""
    import torch

    count = torch.cuda.device_count()
    if count > 1:
        torch.cuda.set_device(job_num % count)

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
