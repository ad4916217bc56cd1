"""Sweeps: which jobs a multirun makes, which of them run, and what they ended with.

- :func:`expand`: the jobs of a multirun are the union of a preset's sweeps
  (``hydra.sweeper.sweeps``), each one Hydra's cartesian product, after
  ``hydra.sweeper.params`` and the command line chose among them
  (:func:`bnexp.app.sweep_values.select`, which needs no Hydra); the sweeper that
  runs them (``hydra/sweeper=bnexp``, the default of ``bnexp train -m``) is the plugin
  ``hydra_plugins.bnexp_sweeper``, where Hydra requires plugins to live;
- :func:`skip_reason`: a job whose run finished already (or whose paper lr is N/A) is not
  trained again; a cell of a listing sweep (:mod:`bnexp.app.cells`) whose settings finished
  in another directory is not either (:func:`skip_or_home`); :func:`describe_jobs`: what
  ``--dry-run`` prints (each cell, how many run, resume and are skipped, the projected time);
  :func:`spread_over_gpus` gives job ``n`` GPU ``n mod count``;
- :class:`SweepReport`: the end-of-sweep report. Each job appends its outcome to the sweep's
  ledger, ``<sweep dir>/.sweep-<id>.jsonl``; the id is drawn at the start of the sweep and
  handed to every job through ``hydra.job.env_set``, which Hydra applies in whichever process
  runs the job (in-process, a joblib worker kept from an earlier sweep, a SLURM task); the
  end of the sweep reads the ledger back and deletes it.
"""

from __future__ import annotations

import csv
import functools
import io
import json
import logging
import os
import statistics
import uuid
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Hashable, Mapping, Optional, Sequence

from hydra.core.hydra_config import HydraConfig
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import Override
from hydra.experimental.callback import Callback
from omegaconf import DictConfig, read_write

from bnexp.app.cells import lists_cells
from bnexp.app.compose import is_group
from bnexp.app.sweep_values import Job, Sweep, Values, select, sweep_lines, union
from bnexp.engine.identity import PER_RUN_KEYS, cell_name, differences, fingerprint, override_key, run_differences
from bnexp.support.errors import EXIT_FAILED, ConfigError, OtherRunThere
from bnexp.support.runinfo import duration, read_run_json
from bnexp.support.runlock import HELD_ENV
from bnexp.support.untrusted import TABLE_FILE, open_regular

# The functions that check finished runs import the engine (checkpoints, config rules, data
# files) in their bodies: those modules load torch, which composing a sweep does without.
log = logging.getLogger("bnexp.app.sweep")


def parse_values(lines: Sequence[str], parser: OverridesParser) -> Values:
    """Each key's values in override lines, a later line for a key replacing an earlier one:
    ``["act=relu,tanh", "trainer.seed=range(2)"]`` -> ``{"act": ["relu", "tanh"], ...}``."""
    found: Values = {}
    for override in parser.parse_overrides(list(lines)):
        key = override.get_key_element()
        if not override.is_sweep_override():
            found[key] = [override.get_value_element_as_str()]
        elif override.is_discrete_sweep():
            found[key] = list(override.sweep_string_iterator())
        else:
            raise interval_refused(override)
    return found


def interval_refused(override: Override) -> ConfigError:
    """The error for an interval sweep given to bnexp's sweeper."""
    return ConfigError(f"{override.input_line}: bnexp's sweeper takes value lists and range(); an interval search "
                       "needs a search sweeper (hydra/sweeper=optuna)")


def expand(sweeps: Sequence[Sweep], params: Optional[Sweep], arguments: Sequence[str],
           parser: OverridesParser) -> list[Job]:
    """The jobs of a multirun: the preset's sweeps (one empty sweep when there are none) with
    ``params`` and then the command line's ``arguments`` applied (:func:`select`), each
    expanded; the union, a job that several sweeps make only once, in order."""
    given = parse_values([*sweep_lines(params), *arguments], parser)
    return union(select([parse_values(sweep_lines(s), parser) for s in sweeps or [{}]], given))


def value_kind(value: Any) -> Any:
    """What of a value decides where it can go in a config: a mapping's keys (and their
    values' kinds), else its type (``0.1`` and ``0.2`` alike, ``0.1``, ``[1]`` and ``null`` not)."""
    if isinstance(value, Mapping):
        return tuple(sorted((str(k), value_kind(v)) for k, v in value.items()))
    return type(value).__name__


def shape(o: Override) -> Any:
    """What of an override decides whether a config composes with it: all of a group choice,
    a deletion or an addition (Hydra checks its value against what is there) or a ``hydra.``
    key (typed by Hydra's schema); for any other key, the key and its value's kind."""
    if is_group(o) or o.is_delete() or o.is_add() or o.is_force_add() or o.key_or_group.startswith("hydra."):
        return o.input_line
    return o.key_or_group, value_kind(o.value())


def shape_representatives(jobs: Sequence[Job], parser: OverridesParser) -> list[Job]:
    """The first job of each shape (:func:`shape` of each override): jobs of one shape compose
    alike, so composing one of them checks whether the others compose. Their values are
    checked as each run starts."""
    chosen: dict[tuple[Any, ...], Job] = {}
    for job in jobs:
        chosen.setdefault(tuple(shape(o) for o in parser.parse_overrides(job)), job)
    return list(chosen.values())


# A run that ended with one of these is a result: re-running its command skips it. Failed,
# preempted and interrupted runs run again (resuming from their checkpoints).
FINISHED = ("completed", "diverged")


def skip_reason(cfg: DictConfig, run_dir: Path) -> Optional[str]:
    """Why a job should not train: N/A in the paper, or already completed or diverged with
    these settings. A finished run with other settings is a ConfigError naming what differs."""
    from bnexp.engine.checkpoint import resume_candidates  # in the function: see the note above `log`
    from bnexp.engine.config import lr_not_applicable

    if lr_not_applicable(cfg):
        return "the paper lists no learning rate for this cell (N/A)"
    if str(cfg.trainer.get("resume", "auto")) == "never":
        return None
    if not (run_dir / "summary.json").is_file():
        return None
    try:
        summary = stored_result(run_dir / "summary.json")
    except ConfigError as err:
        log.warning("%s; not taken as a finished run", err)
        return None
    status = summary.get("status")
    finished = status in FINISHED
    if not finished and (str(cfg.trainer.resume) != "auto" or not resume_candidates(run_dir)):
        return None  # nothing to skip or to resume from
    change = run_differences(summary.get("config") or {}, cfg, summary)
    if change:
        what = f"a run {status}" if finished else f"an unfinished run ({status}) to resume"
        raise OtherRunThere(f"{run_dir} holds {what} with other settings ({change}); "
                            "nothing was changed there. Run with trainer.resume=never to replace it, or choose "
                            "another directory (hydra.run.dir=... / hydra.sweep.dir=...)")
    if not finished:
        return None
    return f"already {status} (trainer.resume=never runs it again){damage_note(run_dir, cfg, summary)}"


# What a re-run and the studies read from a finished run's summary.json: the JSON types
# bnexp writes there, and how to say them (null is also valid: not recorded).
RESULT_TYPES = {"config": ((dict,), "a mapping of settings"), "final_top1": ((int, float), "a number"),
                "num_classes": ((int,), "a whole number")}


def stored_result(path: Path) -> dict[str, Any]:
    """A run's summary.json as :func:`skip_reason` and the studies read it; a ConfigError
    naming the file if it is damaged (:func:`read_run_json`), a value of
    :data:`RESULT_TYPES` is of another type, or its record of the data files is not one
    (:func:`~bnexp.data.files.identity_problem`)."""
    from bnexp.data.files import RECORDS, identity_problem

    summary = read_run_json(path)
    for key, (types, what) in RESULT_TYPES.items():
        value = summary.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, types)):
            raise ConfigError(f"damaged summary.json {path}: its {key} is a JSON {type(value).__name__}, not {what}")
    for key in RECORDS:
        problem = identity_problem(summary.get(key))
        if problem:
            raise ConfigError(f"damaged summary.json {path}: its {key} {problem}")
    return summary


def damage_note(run_dir: Path, cfg: DictConfig, summary: Mapping[str, Any]) -> str:
    """A warning, when a finished run's final checkpoint or config.yaml (which ``bnexp eval``
    and ``export`` rebuild it from) is missing or damaged: its metrics and summary stand."""
    problems = [p for p in (final_checkpoint_problem(run_dir, summary), config_problem(run_dir, cfg)) if p]
    if not problems:
        return ""
    return f"; WARNING: {'; '.join(problems)}. Its metrics and summary stand; trainer.resume=never trains it again"


def final_checkpoint_problem(run_dir: Path, summary: Mapping[str, Any]) -> str:
    """What is wrong with a completed run's final checkpoint, if anything."""
    from bnexp.engine.checkpoint import FINAL, verified_bytes

    if summary.get("status") != "completed":
        return ""
    path = run_dir / FINAL
    try:
        verified_bytes(path)
    except ValueError as err:
        errors = "; ".join(summary.get("checkpoint_errors", [])[-1:])
        why = f"it could not be written ({errors})" if errors and not path.exists() else str(err)
        return f"its final checkpoint is unusable: {why}"
    return ""


def config_problem(run_dir: Path, cfg: DictConfig) -> str:
    """What is wrong with a finished run's config.yaml, if anything: unreadable, or no longer
    the settings ``cfg`` the run was found to have."""
    from bnexp.engine.checkpoint import read_config

    try:
        saved = read_config(run_dir / "config.yaml")
    except ConfigError as err:
        return f"its config.yaml is unusable: {err}"
    if fingerprint(saved) != fingerprint(cfg):
        return f"its config.yaml is unusable: it no longer holds the run's settings ({differences(saved, cfg)})"
    return ""


def pack_groups(job_overrides: Sequence[Sequence[str]], per_run: Sequence[str] = PER_RUN_KEYS,
                apart: Optional[Sequence[Hashable]] = None) -> list[list[int]]:
    """The indices of a sweep's jobs grouped by everything but the ``per_run`` keys (those in
    which the runs of a pack may differ: the seed, rho and the learning rates) and by their
    ``apart`` values (one per job: what its runs must share besides, e.g. the learning rates
    of an optimizer that takes no rate per run), in the order the jobs come. The jobs of a
    group have the same model, shapes, data, schedule and norm; what else their layers hold
    is checked as each pack is built (:func:`bnexp.models.packing.common_layers`)."""
    groups: dict[tuple[Any, ...], list[int]] = {}
    for i, overrides in enumerate(job_overrides):
        key = tuple(sorted(o for o in overrides if override_key(o) not in per_run))
        groups.setdefault((key, None if apart is None else apart[i]), []).append(i)
    return list(groups.values())


def distinct_packs(runs: Sequence[Hashable], max_pack: int) -> list[list[int]]:
    """Positions of ``runs`` (each job's values of the per-run keys, resolved) cut into packs of
    at most ``max_pack`` with no run twice (a job without a seed override and one with
    ``trainer.seed=0`` are the same run twice)."""
    packs: list[list[int]] = []
    for i, run in enumerate(runs):
        home = next((p for p in packs if len(p) < max_pack and all(runs[j] != run for j in p)), None)
        if home is None:
            packs.append([i])
        else:
            home.append(i)
    return packs


def finished_twin(cfg: DictConfig, run_dir: Path, sweep_dir: Path) -> Optional[tuple[Path, str]]:
    """A finished run of ``cfg``'s settings in another directory, for a cell of a listing
    sweep: among the runs beside ``run_dir`` (where single runs live) and the cells held by
    the sweep folders beside ``sweep_dir`` (ad-hoc folders made before cells were listed).
    Its directory and status; None when there is none. The same settings means the same
    fingerprint and unchanged data files, as for a re-run (:func:`skip_reason`)."""
    want = fingerprint(cfg)
    for path in twin_candidates(run_dir, sweep_dir):
        if path.parent == run_dir or recorded_fingerprint(path) != want:
            continue
        try:
            summary = stored_result(path)
        except ConfigError:  # rewritten since it was read
            continue
        if summary.get("status") in FINISHED and not run_differences(summary["config"], cfg, summary.get("data_files")):
            return path.parent, str(summary["status"])
    return None


def twin_candidates(run_dir: Path, sweep_dir: Path) -> list[Path]:
    """The summary.json files :func:`finished_twin` looks at, in a stable order."""
    return sorted(run_dir.parent.glob("*/summary.json")) + sorted(sweep_dir.parent.glob("*/*/summary.json"))


def recorded_fingerprint(path: Path) -> Optional[str]:
    """The fingerprint of the settings a finished run recorded in ``path`` (its summary.json);
    None for an unfinished run or a file that cannot be used."""
    try:
        stat = path.stat()
    except OSError:
        return None
    return _finished_fingerprint(str(path), stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=65536)
def _finished_fingerprint(path: str, size: int, mtime_ns: int) -> Optional[str]:
    """:func:`recorded_fingerprint`, read once per version of the file (its size and time)."""
    try:
        summary = stored_result(Path(path))
    except ConfigError:
        return None
    config = summary.get("config")
    return fingerprint(config) if summary.get("status") in FINISHED and config else None


def skip_or_home(cfg: DictConfig, run_dir: Path, sweep_dir: Optional[Path]) -> tuple[Optional[str], Path]:
    """Why a job should not train (:func:`skip_reason`), and the directory holding its result:
    its own, or, for a cell of a listing sweep (``sweep_dir``; None outside a sweep) whose own
    directory holds nothing to skip or resume, a finished run of the same settings found
    elsewhere (:func:`finished_twin`)."""
    from bnexp.engine.checkpoint import resume_candidates

    reason = skip_reason(cfg, run_dir)
    if reason or sweep_dir is None or not lists_cells(sweep_dir) or str(cfg.trainer.get("resume", "auto")) != "auto" \
            or resume_candidates(run_dir):
        return reason, run_dir
    twin = finished_twin(cfg, run_dir, sweep_dir)
    if twin is None:
        return None, run_dir
    return f"already {twin[1]} in {twin[0]}, with the same settings (trainer.resume=never trains it here)", twin[0]


@dataclass(frozen=True)
class CellPlan:
    """What a sweep will do with one cell: ``run``, ``resume`` or ``skip``; where its result is
    or will be; a label for ``--dry-run``; for a cell resumed from a periodic checkpoint, its
    step (None: from its final checkpoint, nothing left to train)."""

    action: str
    home: Path
    label: str
    step: Optional[int] = None


def cell_plan(run_dir: Path, fresh: bool = False) -> CellPlan:
    """From a cell's directory: skip a finished run, resume from a checkpoint, run otherwise
    (``fresh``, trainer.resume=never: run every cell from its start)."""
    from bnexp.engine.checkpoint import periodic_step, resume_candidates

    status = job_status(run_dir)[0] if (run_dir / "summary.json").is_file() else None
    if fresh:
        return CellPlan("run", run_dir, "to run again" if status else "to run")
    if status in FINISHED:
        return CellPlan("skip", run_dir, str(status))
    found = resume_candidates(run_dir)
    if found:
        step = periodic_step(found[0])
        where = f"step {step}" if step is not None else "its final checkpoint"
        return CellPlan("resume", run_dir, f"{status or 'stopped'}: resumes from {where}", step)
    return CellPlan("run", run_dir, status or "to run")


def trained_seconds(run_dir: Path) -> Optional[float]:
    """How long a finished run trained: the ``seconds`` of its last metrics.csv row (summed
    over the processes that resumed it), else its summary's ``wall_seconds`` (a metrics.csv that
    is no regular file, a FIFO say, is not read)."""
    try:
        with io.TextIOWrapper(open_regular(run_dir / "metrics.csv", TABLE_FILE), newline="") as f:
            rows = list(csv.DictReader(f))
        return float(rows[-1]["seconds"])
    except (OSError, IndexError, KeyError, TypeError, ValueError, csv.Error):
        pass
    try:
        return float(read_run_json(run_dir / "summary.json")["wall_seconds"])
    except (ConfigError, KeyError, TypeError, ValueError):
        return None


def projected(plans: Sequence[CellPlan]) -> str:
    """The time the cells to run and resume should take, projected from the median time of
    the finished ones (a resumed cell counts the part left after its checkpoint's step)."""
    done = [p.home for p in plans if p.action == "skip"]
    times = [t for t in map(trained_seconds, done) if t is not None]
    todo = [p for p in plans if p.action != "skip"]
    if not todo:
        return "nothing to train"
    if not times:
        return "projected time unknown until a cell has finished (each run prints its own after its first steps)"
    each = statistics.median(times)
    steps = statistics.median([job_steps(d) or 0 for d in done]) or None
    left = sum(cell_left(p, steps) for p in todo)
    cells = "1 finished cell" if len(times) == 1 else f"the {len(times)} finished cells"
    return f"projected: about {duration(each * left)} (the median of {cells}, {duration(each)} each)"


def cell_left(plan: CellPlan, steps: Optional[float]) -> float:
    """The part of a run that a cell to run (1) or to resume has left, for runs of ``steps`` steps."""
    if plan.action == "run":
        return 1.0
    if plan.step is None:
        return 0.0
    return max(0.0, 1 - plan.step / steps) if steps else 1.0


def job_steps(run_dir: Path) -> Optional[int]:
    """The steps a finished run trained, from its summary."""
    try:
        return int(read_run_json(run_dir / "summary.json")["steps"])
    except (ConfigError, KeyError, TypeError, ValueError):
        return None


def describe_jobs(jobs: Sequence[Job], sweep_dir: Path, places: Optional[Sequence[Path]] = None,
                  settings: Optional[Callable[[Job], DictConfig]] = None, fresh: bool = False) -> str:
    """A sweep's jobs, one line each (where its result is or will be, what the sweep does
    with it, its overrides), then how many run, resume and are skipped, and the projected
    time. ``places``: each job's directory (default: its cell folder in ``sweep_dir``);
    ``settings``: each job's config, for a listing sweep, whose cells may have finished runs
    of their settings elsewhere (:func:`finished_twin`; asked only when finished runs are
    there); ``fresh``: trainer.resume=never."""
    dirs = list(places) if places is not None else [sweep_dir / cell_name(job, str(sweep_dir)) for job in jobs]
    plans = [cell_plan(d, fresh) for d in dirs]
    if settings is not None and not fresh and dirs and others_finished(dirs, sweep_dir):
        plans = [twin_plan(p, job, sweep_dir, settings) if p.action == "run" else p for p, job in zip(plans, jobs)]
    lines = [f"{len(jobs)} jobs in {sweep_dir}:"]
    lines += [f"  {p.home}  [{p.label}]  {' '.join(job)}" for p, job in zip(plans, jobs)]
    counts = Counter(p.action for p in plans)
    lines.append(f"{counts['run']} to run, {counts['resume']} to resume, {counts['skip']} finished (skipped); "
                 f"{projected(plans)}")
    return "\n".join(lines)


def others_finished(dirs: Sequence[Path], sweep_dir: Path) -> bool:
    """Whether a finished run other than the cells' own (``dirs``) is where
    :func:`finished_twin` looks."""
    own = set(dirs)
    return any(p.parent not in own and recorded_fingerprint(p) for p in twin_candidates(dirs[0], sweep_dir))


def twin_plan(plan: CellPlan, job: Job, sweep_dir: Path, settings: Callable[[Job], DictConfig]) -> CellPlan:
    """A cell to run, unless a finished run of its settings is found elsewhere (:func:`finished_twin`)."""
    twin = finished_twin(settings(job), plan.home, sweep_dir)
    return plan if twin is None else CellPlan("skip", twin[0], f"{twin[1]}, the same settings")


def spread_over_gpus(job_num: int) -> None:
    """Sweep job ``n`` trains on GPU ``n mod count`` when several GPUs are visible."""
    import torch

    count = torch.cuda.device_count()
    if count > 1:
        torch.cuda.set_device(job_num % count)

SWEEP_ID_ENV = "BNEXP_SWEEP_ID"  # the running sweep's id, in the sweep's process and in each of its jobs
STATUSES = ("completed", "diverged", "failed", "skipped")
# Outcomes that leave a cell's result on disk: a sweep of only these exits 0. Diverged is a
# result (the paper's "collapsed"); failed, locked (running elsewhere), interrupted and
# preempted cells are not done.
DONE = ("completed", "diverged", "skipped")


def job_status(run_dir: Path) -> tuple[str, str | None]:
    """(status, error) from a run's summary.json; a run that wrote none counts as failed."""
    try:
        summary = read_run_json(run_dir / "summary.json")
    except ConfigError:
        return "failed", "no readable summary.json"
    return summary.get("status", "failed"), summary.get("error")


def record(run_dir: Path, status: str, error: Optional[str] = None) -> None:
    """Append one job's outcome to the running sweep's ledger (nothing outside a sweep)."""
    _append({"dir": str(run_dir), "status": status, "error": error})


def plan(count: int) -> None:
    """Note in the ledger how many cells the sweep will run (for a sweep stopped early)."""
    _append({"planned": count})


def ledger_file() -> Optional[Path]:
    """The running sweep's ledger (:class:`SweepReport`): in its folder, relative to where the
    sweep started; None outside a sweep."""
    sweep_id = os.environ.get(SWEEP_ID_ENV)
    if not sweep_id or not HydraConfig.initialized():
        return None
    hydra = HydraConfig.get()
    return Path(str(hydra.runtime.cwd)) / str(hydra.sweep.dir) / f".sweep-{sweep_id}.jsonl"


def _append(entry: dict[str, Any]) -> None:
    """One line of the running sweep's ledger; the sweep folder is made on the first line
    (a dry run makes none)."""
    ledger = ledger_file()
    if ledger and not os.environ.get(HELD_ENV):  # torchrun ranks: their launcher records the run
        ledger.parent.mkdir(parents=True, exist_ok=True)
        with open(ledger, "a") as f:
            f.write(json.dumps(entry) + "\n")


def format_report(entries: list[dict[str, Any]], planned: Optional[int] = None, stopped: bool = False) -> str:
    """Counts per status, then one line per cell that is not done, with its error and directory."""
    counts = Counter(e["status"] for e in entries)
    head = ", ".join(f"{counts.get(s, 0)} {s}" for s in STATUSES if s != "skipped" or counts.get(s))
    others = sorted(set(counts) - set(STATUSES))
    head += "".join(f", {counts[s]} {s}" for s in others)
    if planned is not None and planned > len(entries):
        head += f", {planned - len(entries)} not run"
    lines = [f"sweep {'stopped' if stopped else 'finished'}: {max(planned or 0, len(entries))} cells: {head}"]
    for e in entries:
        if e["status"] not in DONE:
            lines.append(f"  {e['status']}: {e['dir']}: {e['error']} (details in {Path(e['dir']) / 'train.log'})")
    return "\n".join(lines)


def print_sweep_report(stopped: bool = False) -> Optional[list[dict[str, Any]]]:
    """Print the running sweep's report and close its ledger; the entries, or None outside a sweep."""
    ledger = ledger_file()
    os.environ.pop(SWEEP_ID_ENV, None)
    if ledger is None or not ledger.is_file():
        return None
    lines = [json.loads(line) for line in ledger.read_text().splitlines() if line.strip()]
    ledger.unlink()
    planned = sum(e["planned"] for e in lines if "planned" in e) or None
    # One entry per run directory (a multi-task SLURM job reports once per task).
    entries = list({e["dir"]: e for e in lines if "dir" in e}.values())
    print(format_report(entries, planned, stopped), flush=True)
    return entries


class SweepReport(Callback):
    """Open the sweep's ledger at its start; at its end print the totals and exit non-zero
    (after the report) when any cell is not done."""

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        # The sweep folder's name reads ${hydra:overrides.task}, which Hydra only binds per
        # job: bind the sweep's own config first, for this callback, the sweeper and the launcher.
        HydraConfig.instance().set_config(config)
        sweep_id = uuid.uuid4().hex
        os.environ[SWEEP_ID_ENV] = sweep_id
        with read_write(config.hydra.overrides):  # what each job's config is composed with
            config.hydra.overrides.hydra.append(f"++hydra.job.env_set.{SWEEP_ID_ENV}={sweep_id}")

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        entries = print_sweep_report()
        if entries and any(e["status"] not in DONE for e in entries):
            raise SystemExit(EXIT_FAILED)
