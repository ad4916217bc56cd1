"""``bnexp reproduce <paper>/<name>``: count, cost, run a preset's sweeps, print its table.

The sweeps run as ``bnexp train -m experiment=<preset>`` in this process (any Hydra
launcher override, such as ``hydra/launcher=joblib``, passes through; on a machine with a
GPU and no launcher chosen, ``hydra/launcher=pack`` trains the runs as packs, see
docs/speed.md), under a progress bar over the whole table with an estimate of the time
left (:class:`TableProgress`; plain lines without a terminal). A full-scale
preset stops before launching on a machine without a GPU unless ``force=true``.
``tune_seeds=N`` runs a preset whose table tunes a parameter for the best mean (the rho
of CBN Tables 1-4) in two stages: the sweeps that vary it on seeds 0..N-1 (the others on
every seed), then each of their cells at its winning value on the remaining seeds; its
table then tests each tuned cell on those remaining seeds only (selection apart from testing).
``dry_run=true`` lists the runs, the packs the packing launcher would make, its workers and
the GPU-hours projected from the last ``make gpu-check`` (:func:`projection`); with
``tune_seeds``, the seeds that select and those that test, stage one's runs, and what stage
two will run.
"""

from __future__ import annotations

import dataclasses
import datetime
import itertools
import json
import math
import sys
import threading
import time
from pathlib import Path
from typing import Any, Optional, Sequence

from hydra import compose
from omegaconf import DictConfig, OmegaConf
from tqdm import tqdm

from bnexp.app.compose import hydra_session, is_group, parser
from bnexp.app.sweep import Job, describe_jobs, distinct_packs, ledger_file, pack_groups
from bnexp.app.train import multirun
from bnexp.engine.identity import PER_RUN_KEYS, RATE_KEYS
from bnexp.engine.pack import apart, unpackable
from bnexp.report.presets import SEED, Preset, count, estimate, job_value, load_preset, parse_command, preset_overrides, steps_per_run
from bnexp.report.results import load_summaries
from bnexp.report.selection import best_choice, preset_runs, select, tuned_key
from bnexp.report.table import seed_count, table_text
from bnexp.support.errors import EXIT_CONFIG
from bnexp.support.options import exit_on_error

Lines = list[str]  # one command-line sweep, "key=value" lines


GPU_CHECK = Path("results/gpu-check/table-cost.json")  # written by make gpu-check (bnexp/bench/table_cost.py)
PACK_LAUNCHER = "hydra/launcher=pack"


def launch(p: Preset, progress: "TableProgress", sweep: Optional[Sequence[str]] = None) -> int:
    """``bnexp train -m`` over the preset, in-process: its own sweeps, or only ``sweep``,
    counted by ``progress`` as it runs and as done once it ended. Returns EXIT_FAILED when
    cells failed, else 0."""
    only = [] if sweep is None else ["hydra.sweeper.sweeps=[]", *sweep]
    code = multirun([*preset_overrides(p.name, p.scale), *default_launcher(p.overrides), *p.overrides, *only])
    progress.sweep_ended(len(p.jobs) if sweep is None else count(p, [sweep]))
    return code


def default_launcher(overrides: Sequence[str]) -> list[str]:
    """``hydra/launcher=pack`` on a machine with a GPU unless ``overrides`` choose a launcher."""
    import torch

    chosen = any(o.lstrip("+~").startswith("hydra/launcher=") for o in overrides)
    return [PACK_LAUNCHER] if torch.cuda.is_available() and not chosen else []


def stage_one_preset(p: Preset, tune_seeds: int) -> Preset:
    """The preset with the sweeps of stage one: those that vary the tuned parameter on seeds
    below ``tune_seeds`` only, the others as they are."""
    key = tuned_key(p)
    sweeps = []
    for sweep in p.sweeps:
        values = dict(sweep)
        if key in sweep:
            values[SEED] = [s for s in sweep.get(SEED, [str(p.cfg.trainer.seed)]) if int(s) < tune_seeds]
        sweeps.append(values)
    return dataclasses.replace(p, sweeps=tuple(sweeps))


def stage_one(p: Preset, tune_seeds: int) -> list[Lines]:
    """The preset's sweeps, those that vary the tuned parameter on seeds below ``tune_seeds``."""
    return [[f"{k}={','.join(v)}" for k, v in values.items()] for values in stage_one_preset(p, tune_seeds).sweeps]


def stage_two(p: Preset, tune_seeds: int) -> list[Lines]:
    """For each cell of the tuning sweeps: its winning value (best mean over the first seeds)
    on the remaining seeds. A cell is a combination of the sweep's other keys; its runs are
    found by the overrides Hydra recorded for them."""
    key = tuned_key(p)
    frame = preset_runs(p, load_summaries(p.results_dir), p.results_dir)
    second = []
    for sweep in (s for s in p.sweeps if key in s):
        later = [s for s in sweep.get(SEED, []) if int(s) >= tune_seeds]
        others = [k for k in sweep if k not in (key, SEED)]
        for combo in itertools.product(*(sweep[k] for k in others)):
            runs = select(frame, {f"overrides.{k}": v for k, v in zip(others, combo)})
            runs = runs[runs[SEED] < tune_seeds] if len(runs) else runs
            best = best_choice(runs, key, "final_top1") if len(runs) else None
            if best is not None and later:
                second.append([*(f"{k}={v}" for k, v in zip(others, combo)), f"{key}={best}",
                               f"{SEED}={','.join(later)}"])
    return second


def gate(p: Preset, force: bool) -> None:
    """Stop a full-scale sweep on a machine without a GPU, unless forced."""
    import torch

    if p.scale == "full" and not force and not torch.cuda.is_available():
        print(f"bnexp reproduce: no GPU visible; {p.name} at full scale is {estimate(p)}.\n"
              f"Run `bnexp reproduce {p.name} scale=quick` (make ... SCALE=quick) for the toy-scale pipeline, "
              "or add force=true (FORCE=1) to start anyway.", file=sys.stderr)
        sys.exit(EXIT_CONFIG)


def reproduce(name: str, scale: str = "full", force: bool = False, tune_seeds: int | None = None,
              overrides: Sequence[str] = ()) -> tuple[str, int]:
    """Run a preset's sweeps (staged when ``tune_seeds`` is set); return its table and the
    exit code (EXIT_FAILED when cells failed, else 0)."""
    p = load_preset(name, scale, overrides)
    if tune_seeds is None:
        print(f"bnexp reproduce {name} (scale {scale}): {estimate(p)}; results in {p.results_dir}", flush=True)
        gate(p, force)
        with TableProgress(len(p.jobs)) as progress:
            codes = [launch(p, progress)]
    else:
        first = stage_one(p, tune_seeds)
        print(f"{staged_head(p, tune_seeds, count(p, first))}; results in {p.results_dir}", flush=True)
        gate(p, force)
        with TableProgress(count(p, first)) as progress:
            codes = [launch(p, progress, sweep) for sweep in first]
            second = stage_two(p, tune_seeds)
            print(f"bnexp reproduce {name}: stage 2, {count(p, second)} runs at the winning {p.layout.tune_name}",
                  flush=True)
            progress.add(count(p, second))
            codes += [launch(p, progress, sweep) for sweep in second]
    return table_text(p, p.results_dir, tune_seeds=tune_seeds), max(codes)


def staged_head(p: Preset, tune_seeds: int, first: int) -> str:
    """The first lines of a two-stage run's plan: the split of the seeds, and stage one's
    ``first`` runs beside the full grid's."""
    return (f"bnexp reproduce {p.name} (scale {p.scale}, tune_seeds={tune_seeds}): {split_plan(p, tune_seeds)}\n"
            f"stage 1, {first} of the {estimate(p)} of the full grid")


def split_plan(p: Preset, tune_seeds: int) -> str:
    """The selection/test split of a two-stage run, as the plan states it."""
    later = [s for s in p.seeds if s >= tune_seeds]
    tested = f"seeds {spans(later)}" if later else "no seed (add seeds: trainer.seed=range(10))"
    return (f"each tuned cell chooses its {p.layout.tune_name} by the best mean on seeds "
            f"{spans(list(range(tune_seeds)))} (selection) and is reported and tested on {tested} (test)")


def dry_run(name: str, scale: str = "full", overrides: Sequence[str] = (), tune_seeds: int | None = None) -> str:
    """The preset's cells and their run directories, the packs and workers that would train
    them (under the packing launcher, unless ``overrides`` choose another) and the GPU-hours
    projected from the last ``make gpu-check``, without running anything. With
    ``tune_seeds``: which seeds select and which test, stage one's cells, and stage two's
    (:func:`stage_two_plan`)."""
    chosen = any(o.lstrip("+~").startswith("hydra/launcher=") for o in overrides)
    p = load_preset(name, scale, [*([] if chosen else [PACK_LAUNCHER]), *overrides])
    if tune_seeds is None:
        head, runs, after = f"bnexp reproduce {name} (scale {scale}): {estimate(p)}", p, ""
    else:
        runs = stage_one_preset(p, tune_seeds)
        head, after = staged_head(p, tune_seeds, len(runs.jobs)), f"{stage_two_plan(p, tune_seeds)}\n"
    packs = pack_plan(runs)
    return (f"{head}\n{describe_jobs(runs.jobs, p.results_dir)}\n{describe_packs(runs, packs)}\n"
            f"{projection(runs, packs)}\n{after}")


def stage_two_plan(p: Preset, tune_seeds: int) -> str:
    """What stage two will run: each tuned cell at its winning value on the test seeds, the
    winners known now (from stage one's runs in the results folder) listed."""
    key = tuned_key(p)
    tested = [s for s in p.seeds if s >= tune_seeds]
    cells = sum(math.prod(len(v) for k, v in sweep.items() if k not in (key, SEED)) for sweep in p.sweeps if key in sweep)
    known = stage_two(p, tune_seeds)
    lines = [f"stage 2, after stage 1: {cells * len(tested)} runs, each of the {cells} tuned cells at the "
             f"{p.layout.tune_name} with the best mean on seeds {spans(list(range(tune_seeds)))}, on seeds "
             f"{spans(tested) or 'none'} (test); {len(known)} winners known from the runs there now"]
    return "\n".join([*lines, *(f"  {' '.join(sweep)}" for sweep in known)])


def pack_size(p: Preset) -> int:
    """The largest pack the packing launcher makes for the preset: ``trainer.pack``, or
    ``max_pack`` while it is 1; for ``auto``, the pack size of the best setting the last
    ``make gpu-check`` measured (``max_pack`` without one)."""
    pack, launcher = p.cfg.trainer.pack, p.cfg.hydra.launcher
    if pack == "auto":
        best = measured_best()
        return int(best["runs"]) if best else int(launcher.get("max_pack", 1))
    return int(launcher.get("max_pack", 1)) if pack == 1 else int(pack)


def pack_plan(p: Preset) -> list[list[Job]]:
    """The packs the packing launcher would make of the preset's runs (as
    :meth:`hydra_plugins.bnexp_launcher.PackLauncher.plan` makes them, each group's settings
    composed once); each run alone under another launcher."""
    if not str(p.cfg.hydra.launcher.get("_target_", "")).startswith("hydra_plugins.bnexp_launcher."):
        return [[job] for job in p.jobs]
    size, packs, composed = pack_size(p), [], {}
    with hydra_session():
        read = parser()
        for group in pack_groups(p.jobs):
            first = p.jobs[group[0]]
            choices = tuple(o.input_line for o in read.parse_overrides(list(first)) if is_group(o))
            if choices not in composed:
                composed[choices] = compose("train", [*preset_overrides(p.name, p.scale), *first])
            if unpackable(composed[choices]):
                packs += [[p.jobs[i]] for i in group]
                continue
            for part in rate_parts(p.jobs, group, composed[choices]):
                runs = [tuple(job_value(p.jobs[i], key) or str(OmegaConf.select(p.cfg, key)) for key in PER_RUN_KEYS)
                        for i in part]
                packs += [[p.jobs[part[i]] for i in pack] for pack in distinct_packs(runs, size)]
    return packs


def rate_parts(jobs: list[Job], group: list[int], cfg: DictConfig) -> list[list[int]]:
    """``group`` (positions in ``jobs``) cut by learning rate where ``cfg``'s optimizer takes
    no rate per run (:func:`bnexp.engine.pack.apart`), as the launcher cuts it."""
    if not apart(cfg):
        return [group]
    same_rates = [k for k in PER_RUN_KEYS if k not in RATE_KEYS]
    return [[group[i] for i in part] for part in pack_groups([jobs[i] for i in group], per_run=same_rates)]


def workers(p: Preset) -> tuple[int, str]:
    """How many workers train the packs (``per_gpu`` per GPU seen here; under
    ``hydra/launcher=pack_slurm`` the tasks of its job), and how that was counted."""
    import torch

    launcher = p.cfg.hydra.launcher
    per_gpu = int(launcher.get("per_gpu", 1))
    if "nodes" in launcher:  # pack_slurm: as PackSlurmLauncher.worker_count
        nodes, node_gpus = int(launcher.nodes), int(launcher.gpus_per_node)
        return nodes * per_gpu * max(1, node_gpus), (f"{per_gpu} per GPU x {node_gpus} GPUs per node x {nodes} "
                                                     "node(s): the tasks of one SLURM job")
    gpus = torch.cuda.device_count()
    return per_gpu * max(1, gpus), (f"{per_gpu} per GPU x {gpus} GPUs" if gpus else
                                    f"{per_gpu} per GPU (no GPU here: counted for one)")


def describe_packs(p: Preset, packs: list[list[Job]]) -> str:
    """The packs (their sizes, then each pack's runs by per-run values) and the workers."""
    sizes = sorted({len(pack) for pack in packs}, reverse=True)
    by_size = ", ".join(f"{sum(len(pack) == s for pack in packs)} of {s}" for s in sizes)
    count_, how = workers(p)
    lines = [f"{len(packs)} packs ({by_size} runs) for {count_} worker(s) ({how}):"]
    for i, pack in enumerate(packs, 1):
        shared = [o for o in pack[0] if o.split("=")[0] not in PER_RUN_KEYS]
        lines.append(f"  pack {i}: {' '.join(shared) or 'defaults'}: {pack_runs(pack)}")
    return "\n".join(lines)


def pack_runs(pack: list[Job]) -> str:
    """A pack's runs by their per-run values other than the seed, each with its seeds
    (``rho=0.25 seeds 0-9, rho=0.5 seeds 0-9``)."""
    seeds: dict[str, list[int]] = {}
    for job in pack:
        others = " ".join(f"{k.split('.')[-1]}={job_value(job, k)}" for k in PER_RUN_KEYS[1:] if job_value(job, k))
        seeds.setdefault(others, []).append(int(job_value(job, SEED) or 0))
    return ", ".join(f"{others + ' ' if others else ''}seeds {spans(sorted(s))}" for others, s in seeds.items())


def spans(values: list[int]) -> str:
    """Sorted integers as runs of consecutive ones: ``[0, 1, 2, 5]`` -> ``0-2,5``."""
    groups: list[list[int]] = []
    for value in values:
        if groups and value == groups[-1][-1] + 1:
            groups[-1].append(value)
        else:
            groups.append([value])
    return ",".join(str(g[0]) if len(g) == 1 else f"{g[0]}-{g[-1]}" for g in groups)


def measured_best(path: Path = GPU_CHECK, runs: int | None = None, per_gpu: int | None = None) -> dict[str, Any] | None:
    """The fastest setting the last ``make gpu-check`` measured (its table-cost records) with
    packs of ``runs`` and ``per_gpu`` workers (any, for None; the fastest of all when none
    matches), or None without a measurement."""
    try:
        records = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    measured = [r for r in records if isinstance(r, dict) and isinstance(r.get("images_per_second"), (int, float))]
    matching = [r for r in measured if runs in (None, r.get("runs")) and per_gpu in (None, r.get("workers"))]
    return max(matching or measured, key=lambda r: r["images_per_second"]) if measured else None


def projection(p: Preset, packs: list[list[Job]], path: Path = GPU_CHECK) -> str:
    """GPU-hours of the preset's runs at the images/s the last ``make gpu-check`` measured for
    the plan's packs and workers per GPU (its fastest setting where it measured no such one;
    training steps only), for the runs of the model it measured; a line saying there is no
    measurement otherwise."""
    best = measured_best(path, max(len(pack) for pack in packs), int(p.cfg.hydra.launcher.get("per_gpu", 1)))
    if best is None:
        return (f"projected GPU-hours: no measurement ({path} not found): run `make gpu-check` on the GPU "
                "(it measures the packing strategies and writes that file)")
    model = best.get("model", "resnet20")
    jobs = [job for pack in packs for job in pack]
    mine = [job for job in jobs if (job_value(job, "model") or p.cfg.model.name) == model]
    images = sum(steps_per_run(p.cfg, job) * int(p.cfg.trainer.batch_size) for job in mine)
    hours = images / best["images_per_second"] / 3600
    device = best.get("env", {}).get("device_name", "the measured device")
    date = str(best.get("env", {}).get("date", ""))[:10]
    text = (f"projected: {hours:,.1f} GPU-hours for the {len(mine)} runs of {model} on {device}, at the "
            f"{best['images_per_second']:,.0f} images/s of {best['name']} (measured {date} by make gpu-check; "
            "training steps only)")
    if len(mine) < len(jobs):
        text += f"; {len(jobs) - len(mine)} runs of other models: not measured"
    return text


class TableProgress:
    """A progress bar over a whole table: the runs the running sweep has recorded in its
    ledger (:func:`bnexp.app.sweep.ledger_file`), looked at every ``poll`` seconds, plus every
    run of the sweeps that have ended (:meth:`sweep_ended`), and the time left at the rate of
    the runs trained so far (those skipped as finished before do not count). With a terminal
    a tqdm bar on stderr; without one a plain line whenever the count changed, at most every
    ``every`` seconds."""

    def __init__(self, total: int, poll: float = 2.0, every: float = 60.0) -> None:
        self.total, self.poll, self.every = total, poll, every
        self.seen: dict[str, str] = {}  # run directory -> status, in the running sweep's ledger
        self.ended, self.trained = 0, 0  # runs of the sweeps that ended, and those of them trained
        self.started = time.monotonic()
        self.printed, self.last = 0.0, 0
        self.lock = threading.Lock()  # the watching thread and the sweeps' ends
        self.stop = threading.Event()
        self.bar = tqdm(total=total, desc="table", unit="run", disable=not sys.stderr.isatty(), dynamic_ncols=True)
        self.thread = threading.Thread(target=self.watch, daemon=True)

    def __enter__(self) -> "TableProgress":
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join()
        self.update(final=True)
        self.bar.close()

    def add(self, runs: int) -> None:
        """More runs to come (the second stage of a tuned table)."""
        self.total += runs
        self.bar.total = self.total
        self.bar.refresh()

    def sweep_ended(self, runs: int) -> None:
        """A sweep of ``runs`` runs has ended: all of them are done. Its report deleted its
        ledger, whose last lines may not have been read: those runs count as trained."""
        with self.lock:
            self.ended += runs
            self.trained += runs - sum(status == "skipped" for status in self.seen.values())
            self.seen = {}
        self.update()

    def watch(self) -> None:
        while not self.stop.wait(self.poll):
            self.update()

    def update(self, final: bool = False) -> None:
        """Read the running sweep's ledger, then move the bar or print a line."""
        ledger = ledger_file()
        try:
            lines = ledger.read_text().splitlines() if ledger else []
        except OSError:
            lines = []
        with self.lock:
            for line in lines:
                try:
                    entry = json.loads(line)
                except ValueError:
                    continue  # a line being written
                if "dir" in entry:
                    self.seen[entry["dir"]] = entry["status"]
            done, left = self.ended + len(self.seen), self.left()
        self.bar.n = done
        self.bar.set_postfix_str(left, refresh=True)
        now = time.monotonic()
        if self.bar.disable and done != self.last and (final or now - self.printed >= self.every):
            self.last, self.printed = done, now
            print(f"reproduce: {done}/{self.total} runs done, {left}", file=sys.stderr, flush=True)

    def left(self) -> str:
        """The estimated time left, from the rate of the runs trained (not skipped) so far."""
        trained = self.trained + sum(status != "skipped" for status in self.seen.values())
        todo = self.total - self.ended - len(self.seen)
        if not trained or todo <= 0:
            return "" if todo > 0 else "all done"
        seconds = (time.monotonic() - self.started) / trained * todo
        return f"about {datetime.timedelta(seconds=round(seconds))} left"


def command(args: list[str]) -> None:
    """``bnexp reproduce <paper>/<name> [scale=quick] [force=true] [tune_seeds=N] [dry_run=true] [overrides]``."""
    exit_on_error(lambda: reproduce_for(args))


def reproduce_for(args: list[str]) -> None:
    """Run what the command line asks for and print the table (or, with dry_run, the cells);
    exit non-zero after the table when cells failed."""
    usage = ("bnexp reproduce <paper>/<name> [scale=full|quick] [force=true] [tune_seeds=N] [dry_run=true] "
             "[Hydra overrides]")
    defaults = {"scale": "full", "force": "false", "tune_seeds": "", "dry_run": "false"}
    name, opts, overrides = parse_command(args, usage, defaults)
    tune = seed_count(opts["tune_seeds"], "tune_seeds")
    if opts["dry_run"].lower() in TRUE:
        print(dry_run(name, opts["scale"], overrides, tune), end="")
        return
    table, code = reproduce(name, opts["scale"], opts["force"].lower() in TRUE, tune, overrides)
    print(table, end="", flush=True)
    if code:
        sys.exit(code)


TRUE = ("1", "true", "yes")
