"""A preset's sweeps as values, without Hydra: each key's values, the command line's choice
among the sweeps, and the jobs their products make. Parsing override lines into values
needs Hydra's parser (:func:`bnexp.app.sweep.parse_values`); the table commands read the
values parsed before from bnexp's cache folder and use these functions alone."""

from __future__ import annotations

import itertools
from typing import Any, Mapping, Optional, Sequence

Sweep = Mapping[str, Any]  # one sweep as a preset writes it: key -> value(s) in override syntax
Values = dict[str, list[str]]  # one sweep parsed: key -> its values
Job = list[str]  # one job's overrides, "key=value"


def sweep_lines(sweep: Optional[Sweep]) -> list[str]:
    """A sweep as override strings (``act: relu,tanh`` -> ``act=relu,tanh``)."""
    return [f"{key}={value}" for key, value in (sweep or {}).items()]


def _bare(key: str) -> str:
    return key.lstrip("+~")


def _same(a: str, b: str) -> bool:
    try:
        return float(a) == float(b)
    except ValueError:
        return a == b


def select(sweeps: Sequence[Values], given: Values) -> list[Values]:
    """A preset's sweeps with command-line values applied.

    A key that some sweeps set is a choice among them: each of those sweeps keeps the given
    values it has, plus any given value that no sweep has (a seed beyond the preset's range,
    say); a sweep left with none is dropped. ``cbn_row=r1`` thus runs row 1 of the untuned
    sweep and drops the tuned one, and ``norm.rho=1.0,2.0`` shrinks the rho grid without
    giving the untuned rows a rho. A key no sweep sets applies to every sweep.
    """
    chosen = [dict(sweep) for sweep in sweeps]
    for key, values in given.items():
        holders = [(sweep, k) for sweep in chosen for k in sweep if _bare(k) == _bare(key)]
        if not holders:
            for sweep in chosen:
                sweep[key] = list(values)
            continue
        known = [v for sweep, k in holders for v in sweep[k]]
        extra = [v for v in values if not any(_same(v, k) for k in known)]
        for sweep, k in holders:
            sweep[k] = [v for v in values if any(_same(v, w) for w in sweep[k])] + extra
        chosen = [sweep for sweep in chosen if all(sweep[k] for k in sweep if _bare(k) == _bare(key))]
    return chosen


def product(sweep: Values) -> list[Job]:
    """The jobs of one sweep: every combination of its keys' values."""
    return [[f"{key}={value}" for key, value in zip(sweep, combo)] for combo in itertools.product(*sweep.values())]


def union(sweeps: Sequence[Values]) -> list[Job]:
    """Every job of the sweeps, in order, a job that several sweeps make only once."""
    jobs: list[Job] = []
    seen: set[frozenset[str]] = set()
    for sweep in sweeps:
        for job in product(sweep):
            if frozenset(job) not in seen:
                seen.add(frozenset(job))
                jobs.append(job)
    return jobs
