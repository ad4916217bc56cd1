"""Data sets read from files: present (or downloaded), intact, readable, else one clear error.

Shared by the CIFAR and MNIST loaders. A missing file means :class:`DataUnavailable` (the
message names the folder looked in, why nothing was fetched, and how to point at the
data); a bad file means :class:`DataError` naming that file.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, TypeVar

from torchvision.datasets.utils import check_integrity

from bnexp.errors import DataError, DataUnavailable

T = TypeVar("T")

OFFLINE_HINT = (
    "Point data.root=DIR at a folder that holds {holds}, "
    "or set data.download=true to fetch it; data=synthetic runs offline without any files."
)


@dataclass(frozen=True)
class DataFiles:
    """The files one data set needs, with their official md5 (``None``: none published)."""

    label: str  # the data set's name in messages, e.g. "CIFAR-10"
    folder: Path  # where the files must be
    holds: str  # what data.root must hold, for the offline hint
    files: tuple[tuple[Path, Optional[str]], ...]

    def missing(self) -> list[Path]:
        return [path for path, _ in self.files if not path.is_file()]


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


def verify_checksums(data: DataFiles) -> None:
    """Stop on the first file whose md5 differs from the official release."""
    for path, md5 in data.files:
        if md5 is not None and not check_integrity(str(path), md5):
            raise DataError(
                f"corrupt data file {path}: its md5 checksum does not match the official release. "
                "Delete it and re-download, or set data.verify=false to read it anyway."
            )


def read_or_fail(data: DataFiles, read: Callable[[], T], read_one: Callable[[Path], object]) -> T:
    """``read()``; if it fails, name the first file ``read_one`` cannot read either."""
    try:
        return read()
    except Exception as err:
        path, cause = data.folder, err
        for candidate, _ in data.files:
            try:
                read_one(candidate)
            except Exception as bad:
                path, cause = candidate, bad
                break
        raise DataError(f"corrupt or truncated data file {path}: {type(cause).__name__}: {cause}") from err
