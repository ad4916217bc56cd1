"""Convert checkpoints of bnexp before 2026-11-23 to today's format, in place.

Usage: python scripts/convert_checkpoints.py FILE [FILE ...]

bnexp before 2026-11-23 stored numpy's random state as a numpy array, which bnexp's loader
(``torch.load(weights_only=True)``: tensors and plain containers only) refuses. For each FILE:

- a ``FILE.sha256`` beside it that does not match: refused (a damaged file is not rewritten);
- a file ``weights_only=True`` reads: already today's format, left as it is;
- a file that reads once numpy's array globals are allowed as well (``_reconstruct``,
  ``ndarray``, ``dtype`` and uint32's dtype class; torch's ``safe_globals``), and nothing else: its numpy state is
  rewritten as tensors and plain numbers, the file replaced through a temporary file that
  ``weights_only=True`` must read, and a new ``FILE.sha256`` written;
- anything else (a file that needs other code, as a hostile one does): refused, left as it is.

No file is ever unpickled in full, so no file can run code here, and a refused file never
gets a fresh checksum. It needs torch and numpy, not bnexp: the file can be copied alone.
Exit status: 0 when every file was converted or already in today's format, 1 otherwise.
"""

from __future__ import annotations

import hashlib
import io
import os
import pickle
import re
import stat
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch

MAX_BYTES = 2**36  # a checkpoint larger than this is no bnexp checkpoint


def numpy_globals() -> list[Any]:
    """What an older checkpoint's numpy state needs beyond tensors, under numpy 2's names and
    numpy 1's (``numpy.core``), which older files hold."""
    from numpy._core import multiarray

    return [multiarray._reconstruct, (multiarray._reconstruct, "numpy.core.multiarray._reconstruct"),
            np.ndarray, np.dtype, type(np.dtype(np.uint32))]  # the key array's dtype and its class


def read(path: Path) -> bytes:
    """The file's bytes, if it is a regular file of a checkpoint's size (a FIFO, a device or a
    directory is refused), checked against ``FILE.sha256`` when there is one."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    with os.fdopen(fd, "rb") as f:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_size > MAX_BYTES:
            raise ValueError("not a regular file of a checkpoint's size")
        os.set_blocking(fd, True)
        data = f.read()
    digest = path.with_name(path.name + ".sha256")
    if digest.exists() and digest.read_bytes().split()[:1] != [hashlib.sha256(data).hexdigest().encode()]:
        raise ValueError(f"it does not match {digest.name} (damaged, or changed since)")
    return data


def today(state: Any) -> dict[str, Any]:
    """numpy's random state in today's format: its key array as a tensor, the rest as numbers."""
    kind, keys, pos, has_gauss, cached = state
    return {"name": kind, "keys": torch.from_numpy(np.asarray(keys).astype("int64")), "pos": int(pos),
            "has_gauss": int(has_gauss), "cached_gaussian": float(cached)}


def convert(path: Path) -> str:
    """Convert one file; what was done, as the line to print."""
    data = read(path)
    try:
        torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
        return f"left as it is: {path} (already today's format)"
    except pickle.UnpicklingError:
        pass
    with torch.serialization.safe_globals(numpy_globals()):
        payload = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    for state in payload["rng"]:
        if not isinstance(state["numpy"], dict):
            state["numpy"] = today(state["numpy"])
    buffer = io.BytesIO()
    torch.save(payload, buffer)
    torch.load(io.BytesIO(buffer.getvalue()), weights_only=True)  # as bnexp will load it
    new = path.with_name(path.name + ".new")
    new.write_bytes(buffer.getvalue())
    new.replace(path)
    path.with_name(path.name + ".sha256").write_text(f"{hashlib.sha256(buffer.getvalue()).hexdigest()}  {path.name}\n")
    return f"converted: {path} (its numpy random state, read with numpy's array globals allowed; nothing else)"


def reason(err: Exception) -> str:
    """Why a file was refused, in a few words (torch's message for a global it refuses is long)."""
    needs = re.search(r"GLOBAL (\S+) (?:was not an allowed global|whose module)", str(err))
    if needs:
        return f"unpickling it needs {needs.group(1)}, more than a checkpoint of an older bnexp holds"
    return f"{type(err).__name__}: {' '.join(str(err).split())[:300]}"


def main(paths: list[str]) -> int:
    if not paths:
        print(__doc__.split("\n\n")[1], file=sys.stderr)
        return 1
    failed = 0
    for name in paths:
        try:
            print(convert(Path(name)), flush=True)
        except Exception as err:  # torch's and pickle's errors of a file that is not an older checkpoint
            failed += 1
            print(f"refused: {name} (not converted, left as it is): {reason(err)}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
