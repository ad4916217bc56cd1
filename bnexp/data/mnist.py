"""MNIST (uint8 N x 1 x 28 x 28): downloaded through torchvision, read and checked here.

torchvision fetches the ``.gz`` archives into ``<data.root>/MNIST/raw/`` (when allowed) and
extracts the four idx-ubyte files; it publishes md5 sums for the archives only. An idx
file is a header (the magic ``00 00 08 <ndim>``, then ``ndim`` big-endian uint32 sizes)
followed by the uint8 values, so its byte size follows from its header: a file whose size
disagrees with its own header, image and label files of different lengths, or labels
outside 0..9 stop with a DataError naming the file. With ``data.verify`` (the default)
each file must also have the official release's size.
"""

from __future__ import annotations

import math
import struct
from pathlib import Path
from typing import Any, Mapping

import numpy as np
import torch
from torchvision.datasets import MNIST

from bnexp.data.arrays import ArrayData
from bnexp.data.files import WHOLE_FILE, DataFile, DataFiles, check_labels, ensure_present, read_file, verify_release
from bnexp.support.errors import DataError
from bnexp.support.untrusted import read_regular

SPLIT_SIZES = {"train": 60000, "t10k": 10000}  # images (and labels) per split of the release
NUM_CLASSES = 10


def _names(prefix: str) -> tuple[str, str]:
    """The extracted image and label files of split ``prefix`` (``train`` or ``t10k``)."""
    return f"{prefix}-images-idx3-ubyte", f"{prefix}-labels-idx1-ubyte"


# The official sizes: a 16-byte header + N images of 28 x 28, an 8-byte header + N labels.
OFFICIAL_SIZES = {
    name: size
    for prefix, n in SPLIT_SIZES.items()
    for name, size in zip(_names(prefix), (16 + n * 28 * 28, 8 + n))
}


def _files(root: Path) -> DataFiles:
    folder = root / "MNIST" / "raw"
    names = list(OFFICIAL_SIZES)
    holds = "MNIST/raw/ with " + ", ".join(names)
    return DataFiles("MNIST", folder, holds, tuple(DataFile(folder / n, size=OFFICIAL_SIZES[n]) for n in names))


def mnist_files(cfg: Mapping[str, Any]) -> DataFiles:
    """The files of ``data=mnist`` under ``data.root``."""
    return _files(Path(str(cfg["root"])).expanduser())


def read_idx(path: Path, ndim: int) -> torch.Tensor:
    """The uint8 array in an idx-ubyte file of ``ndim`` dimensions, if its size matches its header."""
    raw = read_file(path, lambda p: read_regular(p, WHOLE_FILE))
    header = 4 + 4 * ndim
    if len(raw) < header or raw[:4] != bytes((0, 0, 8, ndim)):
        raise DataError(
            f"corrupt data file {path}: it does not start with an idx header of uint8 data in {ndim} "
            f"dimension(s) (the bytes 00 00 08 {ndim:02x} and {ndim} sizes); it starts with {raw[:header].hex(' ')}"
        )
    shape = struct.unpack(f">{ndim}I", raw[4:header])
    expected = header + math.prod(shape)
    if len(raw) != expected:
        raise DataError(
            f"truncated or corrupt data file {path}: it is {len(raw)} bytes but its header "
            f"(uint8 {' x '.join(map(str, shape))}) says {expected}"
        )
    return torch.from_numpy(np.frombuffer(raw, np.uint8, offset=header).reshape(shape).copy())


def _split(folder: Path, prefix: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The images (N x 1 x 28 x 28) and int64 labels of ``train`` or ``t10k``."""
    images_path, labels_path = (folder / name for name in _names(prefix))
    images, labels = read_idx(images_path, 3), read_idx(labels_path, 1)
    if len(images) != len(labels):
        raise DataError(
            f"{images_path} holds {len(images)} images but {labels_path} holds {len(labels)} labels; "
            "expected the same number"
        )
    check_labels(labels, str(labels_path), NUM_CLASSES, f"MNIST has {NUM_CLASSES} classes")
    return images.unsqueeze(1), labels.to(torch.int64)


def load_mnist(cfg: Mapping[str, Any]) -> ArrayData:
    """MNIST from ``data.root`` (downloaded there when ``data.download``)."""
    root = Path(str(cfg["root"])).expanduser()
    files = mnist_files(cfg)
    ensure_present(files, lambda: MNIST(str(root), train=True, download=True), bool(cfg.get("download", True)))
    if cfg.get("verify", True):
        verify_release(files)
    x_train, y_train = _split(files.folder, "train")
    x_test, y_test = _split(files.folder, "t10k")
    return ArrayData("mnist", x_train, y_train, x_test, y_test, NUM_CLASSES)
