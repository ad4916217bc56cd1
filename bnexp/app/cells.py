"""Where the cells of a sweep live.

An ad-hoc sweep's folder, named after its command line (``results/multirun/<overrides>/``,
the default ``hydra.sweep.dir``), *lists* its cells in :data:`CELLS`: each cell trains where
``bnexp train <the cell's overrides>`` trains that run (``hydra.run.dir``,
``results/runs/<overrides>/``), so a grown sweep (another seed, another value) finds the
cells that ran before, whatever its own command line. A sweep folder chosen by hand or by a
preset (``hydra.sweep.dir=...``), and an ad-hoc folder made before cells were listed (its
cells inside, no list), *holds* its cells, each named after its overrides, as Hydra's
sweep folders do.

The list is started by bnexp's sweeper before the first job (:func:`start_list`); each job
adds the directory that holds its result (:func:`note_cell`), so the list survives any
launcher. ``hydra.sweep.subdir`` (configs/train.yaml) is :func:`cell_dir`.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Sequence

from bnexp.engine.identity import cell_name
from bnexp.support.options import print_warning
from bnexp.support.untrusted import TABLE_FILE, UnsafeFile, read_regular

CELLS = "cells.txt"  # a listing sweep folder: one cell directory a line, relative to the folder


def lists_cells(sweep_dir: Path) -> bool:
    """Whether a sweep folder lists its cells (its sweeper started the list)."""
    return (sweep_dir / CELLS).is_file()


def will_list(sweep_dir: Path, sweep_name: str) -> bool:
    """Whether bnexp's sweeper makes ``sweep_dir`` list its cells: it does already, or it is
    named after the sweep's command line (``sweep_name``) and holds no cell folder (as
    folders made before cells were listed do; ``.submitit/`` and the like aside)."""
    if lists_cells(sweep_dir):
        return True
    if sweep_dir.name != sweep_name:
        return False
    return not sweep_dir.is_dir() or not any(p.is_dir() and not p.name.startswith(".") for p in sweep_dir.iterdir())


def start_list(sweep_dir: Path) -> None:
    """Make ``sweep_dir`` a listing folder (before its first job)."""
    sweep_dir.mkdir(parents=True, exist_ok=True)
    (sweep_dir / CELLS).touch()


def place(sweep_dir: Path, run_dir: Path, task: Sequence[str], listing: bool) -> Path:
    """Where one cell trains: its run directory (``hydra.run.dir``) for a listing sweep,
    else the folder named after its overrides inside the sweep folder."""
    return run_dir if listing else sweep_dir / cell_name(task, str(sweep_dir))


def cell_dir(sweep_dir: str, run_dir: str, task: Sequence[str]) -> str:
    """``hydra.sweep.subdir`` of a job, which Hydra joins to ``hydra.sweep.dir``: the
    absolute run directory for a listing sweep, else the cell's name (:func:`place`)."""
    return str(Path(run_dir).absolute()) if lists_cells(Path(sweep_dir)) else cell_name([str(o) for o in task], sweep_dir)


def note_cell(sweep_dir: Path, home: Path) -> None:
    """Add ``home``, the directory holding a cell's result, to a listing folder's list."""
    if lists_cells(sweep_dir):
        with open(sweep_dir / CELLS, "a") as f:
            f.write(os.path.relpath(home.absolute(), sweep_dir.absolute()) + "\n")


def listed(sweep_dir: Path) -> list[Path]:
    """The cell directories a listing folder names, each once, in the order they were added
    (none for a folder without a list); a line that is no path is passed over. A list that is
    no regular file (a FIFO, a device) lists nothing, with a warning naming it."""
    try:
        lines = read_regular(sweep_dir / CELLS, TABLE_FILE).decode(errors="replace").splitlines()
    except UnsafeFile as err:
        print_warning(f"{err}; it lists no cells")
        return []
    except OSError:
        return []
    found = [sweep_dir / line.strip() for line in lines if line.strip() and "\0" not in line]
    return list(dict.fromkeys(Path(os.path.normpath(p)) for p in found))
