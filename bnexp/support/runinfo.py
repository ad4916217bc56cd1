"""Run bookkeeping: seeding, device choice, version stamps, metrics.csv and summary.json."""

from __future__ import annotations

import csv
import errno
import functools
import json
import logging
import os
import random
import subprocess
import sys
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, Callable, Mapping

import bnexp
from bnexp.support.errors import ConfigError
from bnexp.support.untrusted import RECORD_FILE, read_regular_text

if TYPE_CHECKING:
    import torch

# torch and numpy are imported by the functions that use them: the commands that read run
# files only (bnexp table, plot, --version) do not pay for importing torch.


def seed_everything(seed: int, deterministic: bool = False) -> None:
    """Seed python, numpy and torch (CPU and CUDA); optionally force deterministic kernels."""
    import numpy as np
    import torch

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    if deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)


def configure_backends(tf32: bool, deterministic: bool) -> dict[str, bool]:
    """Set the process-wide float32 math of CUDA and cuDNN; returns what was set (for summary.json).

    ``tf32``: float32 matrix products and convolutions may use TensorFloat-32 on Ampere and
    newer GPUs (10-bit mantissa inputs, float32 accumulation). torch's own default lets cuDNN
    convolutions use it and matrix products not; bnexp sets both the same way, so
    ``trainer.amp=off trainer.tf32=false`` is IEEE float32 throughout. ``cudnn.benchmark``
    (autotuned convolution algorithms) is on unless the run asks for deterministic kernels.
    """
    import torch

    torch.backends.cuda.matmul.allow_tf32 = tf32
    torch.backends.cudnn.allow_tf32 = tf32
    torch.backends.cudnn.benchmark = not deterministic
    return {"tf32": tf32, "cudnn_benchmark": not deterministic}


def resolve_device(name: str, local_rank: int | None = None) -> torch.device:
    """``auto`` picks CUDA when present; asking for CUDA without one is a config error.

    A CUDA device is the current one (``torch.cuda.set_device``), or, for a process started
    by torchrun, GPU ``local_rank`` of the visible ones; where each process sees one GPU
    (SLURM binding one GPU per task), that one. (``trainer.nproc`` processes on a machine
    with fewer GPUs are refused before they start: :func:`bnexp.app.torchrun.check_gpus`.)
    """
    import torch

    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("trainer.device=cuda but no CUDA device is visible; use trainer.device=cpu or auto")
    if name != "cuda":
        return torch.device(name)
    if local_rank is None:
        return torch.device("cuda", torch.cuda.current_device())
    visible = torch.cuda.device_count()
    if visible == 1:
        return torch.device("cuda", 0)
    if local_rank >= visible:
        raise ConfigError(f"process of local rank {local_rank} sees {visible} GPUs: start at most {visible} "
                          "processes per node (trainer.nproc), or make one GPU visible to each")
    return torch.device("cuda", local_rank)


def _git(root: Path, *args: str) -> str | None:
    """``git args`` run in ``root``; its output, or None when it fails (no git, no repository).
    Without git's optional locks: ``git status`` then never writes the index, so a failing
    write (a full disk, ``ulimit -f``) cannot leave an ``index.lock`` in the repository."""
    try:
        out = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, timeout=5,
                             env={**os.environ, "GIT_OPTIONAL_LOCKS": "0"})
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


@functools.lru_cache(maxsize=1)
def source_of_bnexp() -> dict[str, Any]:
    """bnexp's version and, when it runs from a git checkout of bnexp itself (the package
    folder at the top of the repository, beside bnexp's pyproject.toml), that checkout's
    commit and whether tracked files differ from it; never the commit of a repository the
    package merely sits in (a wheel installed into a project's virtual environment)."""
    package = Path(bnexp.__file__).resolve().parent
    top = _git(package, "rev-parse", "--show-toplevel")
    project = package.parent / "pyproject.toml"
    ours = (top is not None and Path(top).resolve() == package.parent and project.is_file()
            and 'name = "bnexp"' in project.read_text(errors="replace"))
    commit = _git(package, "rev-parse", "HEAD") if ours else None
    dirty = bool(_git(package, "status", "--porcelain", "--untracked-files=no")) if commit else None
    return {"bnexp_version": bnexp.__version__, "git_commit": commit or None, "git_dirty": dirty}


def version_stamp() -> dict[str, Any]:
    """What a summary records of the software: :func:`source_of_bnexp` and torch's version."""
    import torch

    return {**source_of_bnexp(), "torch_version": torch.__version__}


def duration(seconds: float) -> str:
    """A span of time as people read it: ``42 s``, ``1.6 min``, ``2.5 h`` (hours from 90 minutes on)."""
    if seconds >= 5400:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 60:.1f} min" if seconds >= 60 else f"{seconds:.0f} s"


class MetricsWriter:
    """Appends one row per evaluation to a CSV file (header from the first row).

    Every process keeps the rows (checkpoints hold them); only an ``enabled`` writer (rank
    0 of a multi-process run) touches the file.
    """

    def __init__(self, path: Path, enabled: bool = True) -> None:
        self.path = path
        self.enabled = enabled
        self.rows: list[dict[str, Any]] = []

    def write(self, row: Mapping[str, Any]) -> None:
        new = not self.rows
        self.rows.append(dict(row))
        if not self.enabled:
            return
        with open(self.path, "w" if new else "a", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(self.rows[0]))
            if new:
                writer.writeheader()
            writer.writerow(row)

    def restore(self, rows: list[dict[str, Any]]) -> None:
        """Rewrite the file with exactly ``rows`` (the rows a checkpoint had seen)."""
        self.rows = []
        if self.enabled:
            self.path.unlink(missing_ok=True)
        for row in rows:
            self.write(row)


def atomic_write(path: Path, write: Callable[[IO[bytes]], None]) -> None:
    """Write ``path`` through a temporary sibling: write, flush, fsync, rename, fsync folder.

    On any error the temporary file is removed and the error re-raised; the previous
    file under ``path`` (if any) is untouched, so readers never see half a file.
    """
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


# What a write that cannot succeed until someone makes room raises: a full disk, a quota, a
# file-size limit (``ulimit -f``), a failing device.
STORAGE_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EIO)


def storage_error(err: BaseException) -> bool:
    """Whether ``err`` is a write refused by the storage (:data:`STORAGE_ERRNOS`)."""
    return isinstance(err, OSError) and err.errno in STORAGE_ERRNOS


class RunLogFile(logging.FileHandler):
    """A run's ``train.log``: when a write to it fails (a full disk, ``ulimit -f``), one line on
    stderr says so and the file is left as it is, with everything logged before; the log
    goes on on the console. (``logging`` would print a traceback for every message.)"""

    failed = False

    def emit(self, record: logging.LogRecord) -> None:
        if not self.failed:
            super().emit(record)

    def handleError(self, record: logging.LogRecord) -> None:
        err = sys.exc_info()[1]
        if not isinstance(err, OSError):
            super().handleError(record)
            return
        self.failed = True
        print(f"bnexp: warning: cannot write to {self.baseFilename} ({type(err).__name__}: {err}); what it holds is "
              "kept, and the log goes on on the console only", file=sys.stderr, flush=True)


def write_json(path: Path, data: Mapping[str, Any]) -> None:
    """JSON through :func:`atomic_write`."""
    text = json.dumps(data, indent=2, sort_keys=True, default=str)
    atomic_write(path, lambda f: f.write(text.encode()))


def read_run_json(path: Path) -> dict[str, Any]:
    """A JSON object bnexp wrote into a run folder (``summary.json``, ``eval.json``); a
    ConfigError naming the file if it cannot be read, does not parse (nesting too deep
    included) or holds something other than an object."""
    try:
        data = json.loads(read_regular_text(path, RECORD_FILE))
    except (OSError, ValueError, RecursionError) as err:
        raise ConfigError(f"damaged {path.name} {path}: {type(err).__name__}: {' '.join(str(err).split())[:200]}") \
            from None
    if not isinstance(data, dict):
        raise ConfigError(f"damaged {path.name} {path}: a JSON {type(data).__name__}, not the object bnexp writes")
    return data
