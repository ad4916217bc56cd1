"""Time a toy table trained as seed packs and as rho packs, on this machine, in one process.

Usage::

    python scripts/toy_table_packs.py [REPS] [key=value ...]

The toy table is CBN Table 1 at ``scale=quick`` narrowed to one tuned row and one
activation (``cbn_row=r2 act=relu``): its 6 rho values x 2 seeds = 12 runs. It is trained
under the packing launcher twice per repetition, in alternating order, each time into a
fresh folder: with ``trainer.pack=2`` (each pack a cell's 2 seeds: packs of seeds) and with
``trainer.pack=12`` (one pack across the rho grid). It prints each wall time and the median
of the per-repetition ratios (rho packs over seed packs; below 1: packing across rho is
faster). Extra ``key=value`` are Hydra overrides of both (``trainer.device=cpu`` is set).
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path

from bnexp.app.train import multirun
from bnexp.report.presets import preset_overrides

TABLE = [*preset_overrides("cbn/table1", "quick"), "cbn_row=r2", "act=relu", "hydra/launcher=pack",
         "trainer.device=cpu"]
PACKS = {"seed packs": "trainer.pack=2", "rho packs": "trainer.pack=12"}


def seconds(pack: str, folder: Path, extra: list[str]) -> float:
    """Wall seconds of the toy table trained with ``pack`` into ``folder``."""
    start = time.perf_counter()
    code = multirun([*TABLE, pack, f"hydra.sweep.dir={folder}", *extra])
    if code:
        raise SystemExit(f"the toy table failed ({pack}): see {folder}")
    return time.perf_counter() - start


def main(args: list[str]) -> None:
    reps = int(args[0]) if args and "=" not in args[0] else 3
    extra = [a for a in args if "=" in a]
    times: dict[str, list[float]] = {name: [] for name in PACKS}
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(reps):
            order = list(PACKS) if rep % 2 == 0 else list(reversed(PACKS))
            for name in order:
                times[name].append(seconds(PACKS[name], Path(tmp) / f"{name}-{rep}", extra))
    ratios = [r / s for r, s in zip(times["rho packs"], times["seed packs"])]
    for name, values in times.items():
        print(f"{name} ({PACKS[name]}): " + ", ".join(f"{v:.1f} s" for v in values))
    print(f"rho packs / seed packs: median {statistics.median(ratios):.2f} "
          f"(each repetition: {', '.join(f'{r:.2f}' for r in ratios)})")


if __name__ == "__main__":
    main(sys.argv[1:])
