"""Several workers per device: the packs of a sweep shared out among worker processes.

The packing launcher (``hydra/launcher=pack`` or ``pack_slurm`` with ``per_gpu`` above 1, or
on several GPUs) writes the sweep's packs to a plan folder inside the sweep's folder
(:func:`write_plan`: each pack's jobs, by index and overrides, as JSON) and starts its
workers: processes on this machine, or SLURM tasks. Each worker binds one device
(:func:`bind_device`: GPU ``slot // per_gpu``, or its share of the CPU's threads) and takes
pack after pack (:class:`PackClaims`): a pack is claimed by an exclusive ``flock`` on its
lock file, held while the worker trains it, and finished when its outcome file exists. The
kernel drops the lock of a worker that dies, however it dies, so a killed worker's pack is
free again: a worker still looking for work takes it (and resumes its runs from their
checkpoints, taking over their stale run locks), as does the next round of workers or a
re-run. No two workers ever train one pack, and the run locks
(:mod:`bnexp.support.runlock`) keep any other process out of its run directories.

Nothing here is unpickled: the plan and the outcomes are JSON.
"""

from __future__ import annotations

import fcntl
import json
import os
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Optional, Sequence

from bnexp.support.runinfo import atomic_write

PLAN = "plan.json"
VISIBLE = "CUDA_VISIBLE_DEVICES"

Outcome = list[tuple[int, str, Any]]  # (job index, Hydra's job status name, the job's return value)


def write_plan(folder: Path, packs: Sequence[Sequence[tuple[int, Sequence[str]]]]) -> None:
    """The packs to train, each a list of (job index, overrides), into ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    text = json.dumps([[[i, list(o)] for i, o in pack] for pack in packs])
    atomic_write(folder / PLAN, lambda f: f.write(text.encode()))


def read_plan(folder: Path) -> list[list[tuple[int, list[str]]]]:
    return [[(int(i), [str(o) for o in overrides]) for i, overrides in pack]
            for pack in json.loads((folder / PLAN).read_text())]


class PackClaims:
    """The packs of a plan folder, each taken by one worker at a time (module docstring)."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.count = len(read_plan(folder))

    def outcome_path(self, pack: int) -> Path:
        return self.folder / f"outcome-{pack}.json"

    def outcome(self, pack: int) -> Optional[Outcome]:
        """The recorded outcome of a finished pack, None for one not finished."""
        try:
            return [(int(i), str(status), value) for i, status, value in json.loads(self.outcome_path(pack).read_text())]
        except FileNotFoundError:
            return None

    def unfinished(self) -> list[int]:
        return [i for i in range(self.count) if not self.outcome_path(i).exists()]

    @contextmanager
    def claim(self, pack: int) -> Iterator[bool]:
        """Hold ``pack``'s lock inside: True when this worker holds it and the pack is not
        finished (False: another worker trains it or has trained it)."""
        fd = os.open(self.folder / f"pack-{pack}.lock", os.O_CREAT | os.O_RDWR, 0o644)  # read-write: flock on NFS
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                yield False
                return
            yield not self.outcome_path(pack).exists()  # finished between the look and the lock
        finally:
            os.close(fd)

    def finish(self, pack: int, outcome: Outcome) -> None:
        text = json.dumps(outcome)
        atomic_write(self.outcome_path(pack), lambda f: f.write(text.encode()))

    def take(self) -> Iterator[int]:
        """Claim packs one after another (each held until the next is asked for), until every
        pack is finished, held by another worker or taken once by this one already; a pack
        freed by a dead worker is taken on the next pass."""
        tried: set[int] = set()
        while True:
            taken = False
            for pack in [p for p in self.unfinished() if p not in tried]:
                with self.claim(pack) as mine:
                    if mine:
                        taken = True
                        tried.add(pack)
                        yield pack
            if not taken:
                return


def visible_gpus() -> list[str]:
    """The GPUs this process may use, as ``CUDA_VISIBLE_DEVICES`` names them (indices when it
    is unset); none without CUDA."""
    import torch

    visible = os.environ.get(VISIBLE)
    if visible is not None:
        return [g for g in visible.split(",") if g.strip() and g.strip() != "-1"]
    return [str(i) for i in range(torch.cuda.device_count())]


def bind_device(slot: int, per_gpu: int, gpus: Sequence[str], workers: int) -> str:
    """Give worker ``slot`` its device before anything touches CUDA: GPU ``slot // per_gpu``
    of ``gpus`` (``CUDA_VISIBLE_DEVICES`` narrowed to it), or, with no GPU, an equal share of
    the CPU's threads. Returns what it took, for the log."""
    if gpus:
        gpu = gpus[(slot // per_gpu) % len(gpus)]
        os.environ[VISIBLE] = gpu
        return f"GPU {gpu}"
    import torch

    threads = max(1, (os.cpu_count() or 1) // workers)
    torch.set_num_threads(threads)
    return f"CPU, {threads} thread(s)"
