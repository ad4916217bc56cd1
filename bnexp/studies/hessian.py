"""``bnexp hessian``: BNP Fig. 8, the Hessian's condition number during training.

Trains the BNP Fig. 8 protocol (``experiment=bnp/hessian``: the 2x100 MLP, batch 60,
CIFAR-10, plain SGD at a constant lr) once per entry of ``norms`` (``none``: plain SGD,
``bnp``: BNP), plus the command line's Hydra overrides, with the ``hessian`` probe on
(``probe.hessian.every`` sets M), in ``<out>/<norm>``; a finished run there is reused.
Then writes ``<out>/hessian.csv`` (one row per run and measured step) and
``<out>/hessian.png``.
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from bnexp.probes.callback import enable_probe, read_probes
from bnexp.probes.plot import draw_hessian
from bnexp.studies.runs import compose_config, list_option, run_command, run_or_reuse

PRESET = "experiment=bnp/hessian"
OPTIONS = {"norms": "[none,bnp]", "out": "results/hessian"}


def study(norms: list[str], out: Path, overrides: list[str]) -> pd.DataFrame:
    """Train (or reuse) one run per norm; return the hessian probe's rows of all of them."""
    frames = []
    for norm in norms:
        cfg = compose_config([PRESET, *overrides, f"norm={norm}"])
        enable_probe(cfg, "hessian")
        summary, reused = run_or_reuse(cfg, out / norm)
        print(f"hessian: norm={norm}: {summary['status']}{' (reused)' if reused else ''}", flush=True)
        rows = read_probes(out / norm)
        frames.append(rows[rows["probe"] == "hessian"].assign(run=norm))
    return pd.concat(frames, ignore_index=True)


def main(options: dict[str, str], overrides: list[str]) -> None:
    """Run the study, write hessian.csv and hessian.png, print where they are."""
    out = Path(options["out"])
    frame = study(list_option(options["norms"], str), out, overrides)
    table = frame.pivot_table(index=["run", "step"], columns="quantity", values="value", sort=False).reset_index()
    table.rename(columns={"run": "norm"}).astype({"rank_hessian": int}).to_csv(out / "hessian.csv", index=False)
    draw_hessian(frame, out, "hessian.png")
    print(f"wrote {out / 'hessian.csv'} and {out / 'hessian.png'}", flush=True)


def command(args: list[str]) -> None:
    """``bnexp hessian [norms=[none,bnp]] [out=DIR] [Hydra overrides for every run]``."""
    run_command(main, args, OPTIONS)
