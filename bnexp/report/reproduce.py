"""``bnexp reproduce <paper>/<name>``: count, cost, run a preset's sweeps, print its table.

The sweeps run as ``bnexp train -m experiment=<preset>`` in this process (any Hydra
launcher override, such as ``hydra/launcher=joblib``, passes through; on a machine with a
GPU and no launcher chosen, ``hydra/launcher=pack`` trains each cell's seeds as packs, see
docs/speed.md). A full-scale
preset stops before launching on a machine without a GPU unless ``force=true``.
``tune_seeds=N`` runs a preset whose table tunes a parameter for the best mean (the rho
of CBN Tables 1-4) in two stages: the sweeps that vary it on seeds 0..N-1 (the others on
every seed), then each of their cells at its winning value on the remaining seeds; its
table then tests each tuned cell on those remaining seeds only (selection apart from testing).
"""

from __future__ import annotations

import itertools
import sys
from typing import Optional, Sequence

from bnexp.app.sweep import describe_jobs
from bnexp.app.train import multirun
from bnexp.report.presets import SEED, Preset, count, estimate, load_preset, parse_command, preset_overrides
from bnexp.report.results import load_summaries
from bnexp.report.selection import best_choice, preset_runs, select, tuned_key
from bnexp.report.table import seed_count, table_text
from bnexp.support.errors import EXIT_CONFIG
from bnexp.support.options import exit_on_error

Lines = list[str]  # one command-line sweep, "key=value" lines


def launch(p: Preset, sweep: Optional[Sequence[str]] = None) -> int:
    """``bnexp train -m`` over the preset, in-process: its own sweeps, or only ``sweep``.
    Returns EXIT_FAILED when cells failed, else 0."""
    only = [] if sweep is None else ["hydra.sweeper.sweeps=[]", *sweep]
    return multirun([*preset_overrides(p.name, p.scale), *default_launcher(p.overrides), *p.overrides, *only])


def default_launcher(overrides: Sequence[str]) -> list[str]:
    """``hydra/launcher=pack`` on a machine with a GPU unless ``overrides`` choose a launcher."""
    import torch

    chosen = any(o.lstrip("+~").startswith("hydra/launcher=") for o in overrides)
    return ["hydra/launcher=pack"] if torch.cuda.is_available() and not chosen else []


def stage_one(p: Preset, tune_seeds: int) -> list[Lines]:
    """The preset's sweeps, those that vary the tuned parameter on seeds below ``tune_seeds``."""
    key = tuned_key(p)
    sweeps = []
    for sweep in p.sweeps:
        values = dict(sweep)
        if key in sweep:
            values[SEED] = [s for s in sweep.get(SEED, [str(p.cfg.trainer.seed)]) if int(s) < tune_seeds]
        sweeps.append([f"{k}={','.join(v)}" for k, v in values.items()])
    return sweeps


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
        codes = [launch(p)]
    else:
        first = stage_one(p, tune_seeds)
        print(f"bnexp reproduce {name} (scale {scale}, tune_seeds={tune_seeds}): {split_plan(p, tune_seeds)}\n"
              f"stage 1, {count(p, first)} of the {estimate(p)} of the full grid; results in {p.results_dir}",
              flush=True)
        gate(p, force)
        codes = [launch(p, sweep) for sweep in first]
        second = stage_two(p, tune_seeds)
        print(f"bnexp reproduce {name}: stage 2, {count(p, second)} runs at the winning {p.layout.tune_name}",
              flush=True)
        codes += [launch(p, sweep) for sweep in second]
    return table_text(p, p.results_dir, tune_seeds=tune_seeds), max(codes)


def split_plan(p: Preset, tune_seeds: int) -> str:
    """The selection/test split of a two-stage run, as the plan states it."""
    later = [s for s in p.seeds if s >= tune_seeds]
    tested = f"seeds {later[0]}-{later[-1]}" if later else "no seed (add seeds: trainer.seed=range(10))"
    return (f"each tuned cell chooses its {p.layout.tune_name} by the best mean on seeds 0-{tune_seeds - 1} "
            f"(selection) and is reported and tested on {tested} (test)")


def dry_run(name: str, scale: str = "full", overrides: Sequence[str] = ()) -> str:
    """The preset's cells and their run directories, without running anything."""
    p = load_preset(name, scale, overrides)
    return f"bnexp reproduce {name} (scale {scale}): {estimate(p)}\n{describe_jobs(p.jobs, p.results_dir)}\n"


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
    if opts["dry_run"].lower() in TRUE:
        print(dry_run(name, opts["scale"], overrides), end="")
        return
    tune = seed_count(opts["tune_seeds"], "tune_seeds")
    table, code = reproduce(name, opts["scale"], opts["force"].lower() in TRUE, tune, overrides)
    print(table, end="", flush=True)
    if code:
        sys.exit(code)


TRUE = ("1", "true", "yes")
