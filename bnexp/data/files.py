"""Data sets read from files: present (or downloaded), intact, readable, else one clear error.

Shared by the CIFAR, MNIST and npz loaders. A missing file means :class:`DataUnavailable`
(the message names the folder looked in, why nothing was fetched, and how to point at
the data); a bad file means :class:`DataError` naming that file and what is wrong.
"""

from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, NamedTuple, Optional, Sequence, TypeVar

import torch
from torchvision.datasets.utils import check_integrity

from bnexp.support.errors import DataError, DataUnavailable
from bnexp.support.untrusted import DATA_FILE, open_regular

T = TypeVar("T")

OFFLINE_HINT = (
    "Point data.root=DIR at a folder that holds {holds}{fetch}. Without files or network, "
    "data=digits trains on real images bundled with scikit-learn (8x8 handwritten digits) "
    "and data=synthetic on generated ones."
)
FETCH_HINT = ", or set data.download=true to fetch it"  # only where downloading was off
REDOWNLOAD_HINT = "Delete it and re-download, or set data.verify=false to read it anyway."
# A data file read into memory whole: CIFAR's batches and MNIST's idx files (the largest of
# their releases is 158 MB).
WHOLE_FILE = 2**31


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
    hint = OFFLINE_HINT.format(holds=data.holds, fetch="")
    if not allowed:
        raise DataUnavailable(f"{looked} and downloading is off (data.download=false). "
                              f"{OFFLINE_HINT.format(holds=data.holds, fetch=FETCH_HINT)}")
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
    """``read(path)``; any failure becomes a :class:`DataError` naming the file (one that
    ``read`` raises itself is passed on)."""
    try:
        return read(path)
    except DataError:
        raise
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


@functools.lru_cache(maxsize=256)
def file_digest(path: str, size: int, mtime_ns: int, algorithm: str) -> str:
    """The hex digest of a file's bytes; cached per (path, size, modification time), so a
    sweep's cells that read one file hash it once."""
    digest = hashlib.new(algorithm)
    with open_regular(path, DATA_FILE) as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def identify(files: Iterable[DataFile], verified: bool) -> dict[str, dict[str, Any]]:
    """What identifies the content of each present file, by path: its size, modification time
    and digest: the official md5 where ``verified`` (checked against the release already),
    else its sha256."""
    found = {}
    for file in files:
        if not file.path.is_file():
            continue
        stat = file.path.stat()
        algorithm, digest = ("md5", file.md5) if verified and file.md5 else ("sha256", None)
        found[str(file.path)] = {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns,
                                 algorithm: digest or file_digest(str(file.path), stat.st_size, stat.st_mtime_ns,
                                                                  algorithm)}
    return found


def identity_problem(recorded: object) -> str:
    """Why ``recorded`` (read back from a summary or checkpoint) is not an identity as
    :func:`identify` writes it, as words that follow "its data_files"; empty if it is one, or
    ``None`` (not recorded, as by bnexp before data files were)."""
    if recorded is None:
        return ""
    if not isinstance(recorded, Mapping):
        return f"is a {type(recorded).__name__}, not a mapping of file paths to their size and digest"
    for name, entry in recorded.items():
        fields = entry if isinstance(entry, Mapping) else {}
        whole = all(isinstance(fields.get(key), int) and not isinstance(fields.get(key), bool)
                    for key in ("size", "mtime_ns"))
        if not isinstance(name, str) or not whole or not any(isinstance(fields.get(a), str) for a in ("md5", "sha256")):
            return (f"entry {name!r} is {entry!r:.60}, not a mapping of a whole-number size and mtime_ns "
                    "and an md5 or sha256 string")
    return ""


# The records of files a run keeps in its summary and checkpoints, and what each file is called.
RECORDS = {"data_files": "data file", "init_weights": "starting weights file"}


def changed_files(recorded: object, now: Sequence[Path] = (), key: str = "data_files") -> list[str]:
    """The files of an identity :func:`identify` recorded (under ``key`` of :data:`RECORDS`)
    whose content differs now, each as ``data file path: <size and digest> there, <now> here``. A recorded file is compared with the
    file of the same name among ``now`` (the files the run reads now, wherever the data set
    has moved), else with the file at its recorded path. A file with its recorded size and
    modification time is taken as unchanged (not hashed again); a file now missing is not
    compared (reading it would fail). A damaged record (:func:`identity_problem`) is itself
    the difference: the data it was made from cannot be told."""
    problem = identity_problem(recorded)
    if problem:
        return [f"the record of its {RECORDS[key]}s is damaged: its {key} {problem}"]
    changes = []
    for name, there in (recorded or {}).items():
        same_name = [p for p in now if p.name == Path(name).name]
        path = same_name[0] if len(same_name) == 1 else Path(name)
        if not path.is_file():
            continue
        stat = path.stat()
        if (str(path), stat.st_size, stat.st_mtime_ns) == (name, there.get("size"), there.get("mtime_ns")):
            continue
        algorithm = "md5" if "md5" in there else "sha256"
        digest = file_digest(str(path), stat.st_size, stat.st_mtime_ns, algorithm)
        if (stat.st_size, digest) != (there.get("size"), there.get(algorithm)):
            changes.append(f"{RECORDS[key]} {path}: {there.get('size')} bytes, {algorithm} {str(there.get(algorithm))[:12]}... "
                           f"there; {stat.st_size} bytes, {algorithm} {digest[:12]}... here")
    return changes
