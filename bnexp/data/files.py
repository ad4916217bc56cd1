"""Data sets read from files: present (or downloaded), intact, readable, else one clear error.

Shared by the CIFAR, MNIST and npz loaders. A missing file means :class:`DataUnavailable`
(the message names the folder looked in, why nothing was fetched, and how to point at
the data); a bad file means :class:`DataError` naming that file and what is wrong.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable, NamedTuple, Optional, TypeVar

import torch
from torchvision.datasets.utils import check_integrity

from bnexp.errors import DataError, DataUnavailable

T = TypeVar("T")

OFFLINE_HINT = (
    "Point data.root=DIR at a folder that holds {holds}, "
    "or set data.download=true to fetch it; data=synthetic runs offline without any files."
)
REDOWNLOAD_HINT = "Delete it and re-download, or set data.verify=false to read it anyway."


class DataFile(NamedTuple):
    """One file of a data set with its official md5 and byte size (``None``: not published)."""

    path: Path
    md5: Optional[str] = None
    size: Optional[int] = None


@dataclass(frozen=True)
class DataFiles:
    """The files one data set needs."""

    label: str  # the data set's name in messages, e.g. "CIFAR-10"
    folder: Path  # where the files must be
    holds: str  # what data.root must hold, for the offline hint
    files: tuple[DataFile, ...]

    def missing(self) -> list[Path]:
        return [f.path for f in self.files if not f.path.is_file()]


def ensure_present(data: DataFiles, download: Callable[[], object], allowed: bool) -> None:
    """Run ``download`` when files are missing, or stop with the offline message."""
    missing = data.missing()
    if not missing:
        return
    looked = f"{data.label} is not complete under {data.folder} (missing: {', '.join(p.name for p in missing)})"
    hint = OFFLINE_HINT.format(holds=data.holds)
    if not allowed:
        raise DataUnavailable(f"{looked} and downloading is off (data.download=false). {hint}")
    try:
        download()
    except Exception as err:  # urllib, socket and archive errors all mean "could not fetch"
        why = " ".join(str(err).split())  # torchvision's multi-line reasons, on one line
        raise DataUnavailable(f"{looked} and the download failed ({type(err).__name__}: {why}). {hint}") from err


def verify_release(data: DataFiles) -> None:
    """Stop on the first file whose size or md5 differs from the official release."""
    for path, md5, size in data.files:
        actual = path.stat().st_size
        if size is not None and actual != size:
            raise DataError(
                f"corrupt data file {path}: it is {actual} bytes; the official file is {size} bytes. {REDOWNLOAD_HINT}"
            )
        if md5 is not None and not check_integrity(str(path), md5):
            raise DataError(
                f"corrupt data file {path}: its md5 checksum does not match the official release. {REDOWNLOAD_HINT}"
            )


def read_file(path: Path, read: Callable[[Path], T]) -> T:
    """``read(path)``; any failure becomes a :class:`DataError` naming the file."""
    try:
        return read(path)
    except Exception as err:
        raise DataError(f"corrupt or truncated data file {path}: {type(err).__name__}: {err}") from err


def check_labels(labels: torch.Tensor, where: str, num_classes: Optional[int], source: str = "") -> None:
    """Stop on a negative label, or on one of ``num_classes`` or more (``source`` says why
    there are that many classes, e.g. "data.num_classes=3")."""
    if labels.numel() == 0:
        return
    low, high = int(labels.min()), int(labels.max())
    if low < 0:
        raise DataError(f"{where} holds the label {low}; expected class labels from 0")
    if num_classes is not None and high >= num_classes:
        raise DataError(f"{where} holds the label {high} but {source}; expected labels 0..{num_classes - 1}")
