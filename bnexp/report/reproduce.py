"""``bnexp reproduce <paper>/<name>``: count, cost, run a preset's sweep, print its table.

The sweep is ``bnexp train -m experiment=<preset>`` run in this process (any Hydra
launcher override, such as ``hydra/launcher=joblib``, passes through). A full-scale
preset stops before launching on a machine without a GPU unless ``force=true``.
``tune_seeds=N`` runs the tuned-rho rows of CBN Tables 1-4 in two stages: the rho grid
on seeds 0..N-1, then the winning rho of each cell on the remaining seeds.
"""

from __future__ import annotations

import re
import sys
from typing import Sequence

from bnexp.errors import EXIT_CONFIG, ConfigError
from bnexp.commands import exit_on_error
from bnexp.report.presets import SEED, Plan, estimate, expand, hydra_session, job_value, parse_command
from bnexp.report.presets import plan, preset_overrides, sweep_arguments
from bnexp.report.results import load_summaries
from bnexp.report.table import best_choice, select, table_text

TUNED_KEY = "cbn_row"
TUNED_OPTION = re.compile(r"r(\d+)_rho(.+)")


def launch(p: Plan, arguments: Sequence[str]) -> None:
    """``bnexp train -m`` over the preset with these extra sweep arguments, in-process."""
    from bnexp.cli import multirun

    multirun([*preset_overrides(p.name, p.scale), *p.overrides, *arguments])


def options(p: Plan, key: str) -> list[str]:
    """The values ``key`` takes in the plan's jobs, in sweep order."""
    return list(dict.fromkeys(v for job in p.jobs if (v := job_value(job, key)) is not None))


def tuned_options(p: Plan) -> tuple[list[str], dict[int, list[str]]]:
    """The untuned row options, and the tuned ones grouped by row number."""
    if TUNED_KEY not in p.cfg.hydra.sweeper.params:
        raise ConfigError(f"tune_seeds applies to presets that sweep {TUNED_KEY} (cbn/table1-4), not {p.name}")
    untuned, tuned = [], {}
    for option in options(p, TUNED_KEY):
        match = TUNED_OPTION.fullmatch(option)
        if match:
            tuned.setdefault(int(match.group(1)), []).append(option)
        else:
            untuned.append(option)
    return untuned, tuned


def stage_one(p: Plan, tune_seeds: int) -> list[list[str]]:
    """Sweeps of stage 1: untuned rows on every seed, the rho grid on the first seeds."""
    untuned, tuned = tuned_options(p)
    grid = [o for row in tuned.values() for o in row]
    return [[f"{TUNED_KEY}={','.join(untuned)}"], [f"{TUNED_KEY}={','.join(grid)}", f"{SEED}=range({tune_seeds})"]]


def stage_two(p: Plan, tune_seeds: int) -> list[list[str]]:
    """Sweeps of stage 2: each tuned row's winning rho per activation, remaining seeds."""
    frame = load_summaries(p.results_dir)
    seeds = ",".join(str(s) for s in p.seeds if s >= tune_seeds)
    sweeps = []
    for row, acts in ((row, options(p, "act")) for row in tuned_options(p)[1]):
        for act in acts:
            runs = select(frame, {"tags.row": row, "act.name": act})
            runs = runs[runs[SEED] < tune_seeds] if len(runs) else runs
            rho = best_choice(runs, "norm.rho", "final_top1") if len(runs) else None
            if rho is not None and seeds:
                sweeps.append([f"{TUNED_KEY}=r{row}_rho{rho:g}", f"act={act}", f"{SEED}={seeds}"])
    return sweeps


def count(p: Plan, sweeps: Sequence[Sequence[str]]) -> int:
    """How many runs these sweeps of the preset make."""
    with hydra_session():
        return sum(len(expand([*sweep_arguments(p.cfg), *p.overrides, *sweep])) for sweep in sweeps)


def gate(p: Plan, force: bool) -> None:
    """Stop a full-scale sweep on a machine without a GPU, unless forced."""
    import torch

    if p.scale == "full" and not force and not torch.cuda.is_available():
        print(f"bnexp reproduce: no GPU visible; {p.name} at full scale is {estimate(p)}.\n"
              f"Run `bnexp reproduce {p.name} scale=quick` (make ... SCALE=quick) for the toy-scale pipeline, "
              "or add force=true (FORCE=1) to start anyway.", file=sys.stderr)
        sys.exit(EXIT_CONFIG)


def reproduce(name: str, scale: str = "full", force: bool = False, tune_seeds: int | None = None,
              overrides: Sequence[str] = ()) -> str:
    """Run a preset's sweep (staged when ``tune_seeds`` is set) and return its table."""
    p = plan(name, scale, overrides)
    if tune_seeds is None:
        print(f"bnexp reproduce {name} (scale {scale}): {estimate(p)}; results in {p.results_dir}", flush=True)
        gate(p, force)
        launch(p, [])
    else:
        first = stage_one(p, tune_seeds)
        print(f"bnexp reproduce {name} (scale {scale}, tune_seeds={tune_seeds}): stage 1, {count(p, first)} of the "
              f"{estimate(p)} of the full grid; results in {p.results_dir}", flush=True)
        gate(p, force)
        for sweep in first:
            launch(p, sweep)
        second = stage_two(p, tune_seeds)
        print(f"bnexp reproduce {name}: stage 2, {count(p, second)} runs at the winning rho", flush=True)
        for sweep in second:
            launch(p, sweep)
    return table_text(name, p.results_dir, len(p.seeds))


def command(args: list[str]) -> None:
    """``bnexp reproduce <paper>/<name> [scale=quick] [force=true] [tune_seeds=N] [overrides]``."""
    exit_on_error(lambda: print(reproduce_for(args), end=""))


def reproduce_for(args: list[str]) -> str:
    """Run what the command line asks for; return the table."""
    usage = "bnexp reproduce <paper>/<name> [scale=full|quick] [force=true] [tune_seeds=N] [Hydra overrides]"
    name, opts, overrides = parse_command(args, usage, {"scale": "full", "force": "false", "tune_seeds": ""})
    tune = int(opts["tune_seeds"]) if opts["tune_seeds"] else None
    return reproduce(name, opts["scale"], opts["force"].lower() in ("1", "true", "yes"), tune, overrides)
