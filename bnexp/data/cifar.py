"""CIFAR-10/100: downloaded through torchvision, read and checked here, file by file.

Each batch file is a pickled dict whose ``data`` is ``N x 3072`` uint8 (3 x 32 x 32 bytes
per image) and whose ``labels`` (CIFAR-100: ``fine_labels``) holds one label per image.
With ``data.verify`` (the default) every file's md5 is compared with the official release
first; a file that cannot be unpickled, holds images of the wrong size, or labels that do
not match its images stops with a DataError naming it. The files are unpickled by
:class:`BatchUnpickler`, which builds nothing but numpy arrays and python's own containers,
so a hostile file (even read with ``data.verify=false``) cannot run code.
"""

from __future__ import annotations

import io
import pickle
from pathlib import Path
from typing import Any, Mapping

import numpy as np
import torch
from torchvision.datasets import CIFAR10, CIFAR100

from bnexp.data.arrays import ArrayData
from bnexp.data.files import WHOLE_FILE, DataFile, DataFiles, check_labels, ensure_present, read_file, verify_release
from bnexp.support.errors import DataError
from bnexp.support.untrusted import read_regular

IMAGE_SHAPE = (3, 32, 32)
IMAGE_BYTES = 3 * 32 * 32


def _files(cls: type[CIFAR10], root: Path, label: str) -> DataFiles:
    folder = root / cls.base_folder
    files = [DataFile(folder / name, md5) for name, md5 in cls.train_list + cls.test_list]
    files.append(DataFile(folder / cls.meta["filename"], cls.meta["md5"]))
    holds = f"{cls.base_folder}/ (or its {cls.filename} archive)"
    return DataFiles(label, folder, holds, tuple(files))


def cifar_files(cfg: Mapping[str, Any]) -> DataFiles:
    """The files of ``data=cifar10`` or ``cifar100`` under ``data.root``."""
    cls, label = (CIFAR10, "CIFAR-10") if cfg["name"] == "cifar10" else (CIFAR100, "CIFAR-100")
    return _files(cls, Path(str(cfg["root"])).expanduser(), label)


# Numpy pickles an array as ``_reconstruct(ndarray, (0,), b'b')``, then sets its shape, dtype
# and bytes (protocol 5: ``_frombuffer`` of its bytes); python 3 writes bytes in protocol 2
# as ``_codecs.encode(text, 'latin1')``, and an empty one as ``bytes()``.
RECONSTRUCT = (("numpy.core.multiarray", "_reconstruct"), ("numpy._core.multiarray", "_reconstruct"))
BATCH_GLOBALS = frozenset({
    ("numpy", "ndarray"), ("numpy", "dtype"), *RECONSTRUCT,
    ("numpy.core.numeric", "_frombuffer"), ("numpy._core.numeric", "_frombuffer"),
    ("_codecs", "encode"), ("__builtin__", "bytes"), ("builtins", "bytes"),
})


class RefusedGlobal(pickle.UnpicklingError):
    """A pickle asked for a callable that a CIFAR batch never holds, or called one as no batch does."""


class ArrayClass:
    """What ``numpy.ndarray`` unpickles to: the name :func:`_reconstruct` takes, not the class
    (called, it would allocate any shape)."""

    def __call__(self, *args: object) -> None:
        raise RefusedGlobal(f"numpy.ndarray{args!r:.40}")


ARRAY_CLASS = ArrayClass()


def _reconstruct(subtype: object, shape: tuple, dtype: object) -> np.ndarray:
    """numpy's ``_reconstruct``, for the empty array numpy starts every array from only (any other
    shape allocates memory before the file's bytes are read: a 6 KB file asked for 7.45 GiB)."""
    if subtype is not ARRAY_CLASS or shape != (0,):
        raise RefusedGlobal(f"numpy's _reconstruct of an array of shape {shape!r:.40}")
    return np.ndarray((0,), _dtype(dtype.decode("latin1") if isinstance(dtype, bytes) else dtype))


def _dtype(spec: object, align: bool = False, copy: bool = False) -> np.dtype:
    """``numpy.dtype``, without Python objects (an object array's state can be any list, and a
    list of the wrong length crashes numpy)."""
    dtype = np.dtype(spec, align, copy)
    if dtype.hasobject:
        raise RefusedGlobal(f"an array of Python objects ({dtype})")
    return dtype


def _encode(text: object, encoding: str = "utf-8", errors: str = "strict") -> bytes:
    """``_codecs.encode`` as protocol 2 uses it: text to latin-1 bytes, nothing else."""
    if not isinstance(text, str) or encoding not in ("latin1", "latin-1"):
        raise RefusedGlobal(f"_codecs.encode with the encoding {encoding!r}")
    return text.encode("latin1", errors)


def _empty_bytes(*args: object) -> bytes:
    """``bytes()`` as protocol 2 writes an empty one; with arguments it allocates at will."""
    if args:
        raise RefusedGlobal(f"bytes{args!r:.40}")
    return b""


class BatchUnpickler(pickle.Unpickler):
    """An unpickler that resolves only :data:`BATCH_GLOBALS`, each the way a CIFAR batch uses it:
    dicts, lists, strings, bytes, numbers and numpy arrays come out; anything that could run
    code, or allocate memory the file does not hold, is refused."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in BATCH_GLOBALS:
            raise RefusedGlobal(f"{module}.{name}")
        if (module, name) in RECONSTRUCT:
            return _reconstruct
        wrapped = {"ndarray": ARRAY_CLASS, "dtype": _dtype, "encode": _encode, "bytes": _empty_bytes}
        return wrapped.get(name) or super().find_class(module, name)


def _unpickle(path: Path) -> object:
    """One batch file's pickle, through :class:`BatchUnpickler`, from its bytes in memory (a
    length in the file never makes the reader allocate more than the file holds); a refused
    name is a DataError."""
    data = io.BytesIO(read_regular(path, WHOLE_FILE))
    try:
        return BatchUnpickler(data, encoding="latin1").load()
    except RefusedGlobal as err:
        raise DataError(
            f"refused data file {path}: unpickling it needs {err}, which a CIFAR batch never holds "
            "(only dicts, lists, strings and numpy arrays are read); it may run code, so it is not loaded"
        ) from None


def _labels(values: object, path: Path, key: str) -> np.ndarray:
    """A batch's labels as integers: a list of Python ints (CIFAR's own) or an integer array.
    Nothing else is converted (numpy would walk any nesting, shared lists included: a 4.5 KB
    file kept it busy for 44 s)."""
    if isinstance(values, np.ndarray) and values.dtype.kind in "iu":
        return values
    if isinstance(values, list) and all(type(v) is int for v in values):
        try:
            return np.array(values, dtype=np.int64)
        except OverflowError:
            pass
    raise DataError(f"corrupt data file {path}: {key!r} is not a list of integer labels")


def _read_batch(path: Path, labels_key: str, num_classes: int, label: str) -> tuple[np.ndarray, np.ndarray]:
    """One batch file's images (N x 3 x 32 x 32 uint8) and labels, checked against each other."""
    entry = read_file(path, _unpickle)
    if not isinstance(entry, dict) or "data" not in entry or labels_key not in entry:
        raise DataError(f"corrupt data file {path}: expected a pickled dict with 'data' and {labels_key!r}")
    images, labels = entry["data"], _labels(entry[labels_key], path, labels_key)
    if not isinstance(images, np.ndarray):
        raise DataError(f"corrupt data file {path}: 'data' is a {type(images).__name__}; expected a numpy array")
    if images.dtype != np.uint8 or images.ndim != 2 or images.shape[1] != IMAGE_BYTES:
        raise DataError(
            f"corrupt data file {path}: 'data' is {images.dtype} of shape {images.shape}; "
            f"expected uint8 N x {IMAGE_BYTES} ({IMAGE_BYTES} bytes per 3 x 32 x 32 image)"
        )
    if labels.dtype.kind not in "iu" or labels.shape != (len(images),):
        raise DataError(
            f"corrupt data file {path}: {labels_key!r} holds {labels.size} {labels.dtype} values for "
            f"{len(images)} images; expected one integer label per image"
        )
    check_labels(torch.from_numpy(labels), str(path), num_classes, f"{label} has {num_classes} classes")
    return images.reshape(-1, *IMAGE_SHAPE), labels


def _split(files: DataFiles, names: list[str], labels_key: str, num_classes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The images and labels of the batch files ``names``, concatenated."""
    batches = [_read_batch(files.folder / name, labels_key, num_classes, files.label) for name in names]
    images = np.concatenate([images for images, _ in batches])
    labels = np.concatenate([labels for _, labels in batches])
    return torch.from_numpy(images), torch.from_numpy(labels.astype(np.int64))


def load_cifar(cfg: Mapping[str, Any]) -> ArrayData:
    """CIFAR-10 or CIFAR-100 from ``data.root`` (downloaded there when allowed)."""
    cifar10 = cfg["name"] == "cifar10"
    cls, label = (CIFAR10, "CIFAR-10") if cifar10 else (CIFAR100, "CIFAR-100")
    labels_key, num_classes = ("labels", 10) if cifar10 else ("fine_labels", 100)
    root = Path(str(cfg["root"])).expanduser()
    files = cifar_files(cfg)
    # A release archive already in data.root is extracted even with downloading off.
    allowed = bool(cfg.get("download", True)) or (root / cls.filename).is_file()
    ensure_present(files, lambda: cls(str(root), train=True, download=True), allowed)
    if cfg.get("verify", True):
        verify_release(files)
    x_train, y_train = _split(files, [name for name, _ in cls.train_list], labels_key, num_classes)
    x_test, y_test = _split(files, [name for name, _ in cls.test_list], labels_key, num_classes)
    return ArrayData(cfg["name"], x_train, y_train, x_test, y_test, num_classes)
