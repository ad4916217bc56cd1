"""MNIST through torchvision (uint8 N x 1 x 28 x 28), with the same errors as CIFAR.

torchvision reads the four extracted idx-ubyte files from ``<data.root>/MNIST/raw/``
(downloading the ``.gz`` archives there when allowed). It publishes md5 sums only for the
archives, so the extracted files are checked when read: a truncated file, or image and
label files of different lengths, stop with a DataError naming the file.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

import torch
from torchvision.datasets import MNIST
from torchvision.datasets.mnist import read_image_file, read_label_file

from bnexp.data.arrays import ArrayData
from bnexp.data.files import DataFiles, ensure_present, read_or_fail
from bnexp.errors import DataError

# the extracted names of torchvision's resources: train-images-idx3-ubyte, ...
RAW_FILES = tuple(Path(url).stem for url, _ in MNIST.resources)


def _files(root: Path) -> DataFiles:
    folder = root / "MNIST" / "raw"
    holds = "MNIST/raw/ with " + ", ".join(RAW_FILES)
    return DataFiles("MNIST", folder, holds, tuple((folder / name, None) for name in RAW_FILES))


def _read_one(path: Path) -> torch.Tensor:
    return read_label_file(str(path)) if "labels" in path.name else read_image_file(str(path))


def _split(root: Path, train: bool) -> tuple[torch.Tensor, torch.Tensor]:
    ds = MNIST(str(root), train=train, download=False)
    return ds.data.unsqueeze(1).contiguous(), ds.targets.to(torch.int64)


def _check_lengths(folder: Path, train: bool, images: torch.Tensor, labels: torch.Tensor) -> None:
    if len(images) != len(labels):
        prefix = "train" if train else "t10k"
        raise DataError(
            f"{folder / f'{prefix}-images-idx3-ubyte'} holds {len(images)} images but "
            f"{folder / f'{prefix}-labels-idx1-ubyte'} holds {len(labels)} labels; expected the same number"
        )


def load_mnist(cfg: Mapping[str, Any]) -> ArrayData:
    """MNIST from ``data.root`` (downloaded there when ``data.download``)."""
    root = Path(str(cfg["root"])).expanduser()
    files = _files(root)
    ensure_present(files, lambda: MNIST(str(root), train=True, download=True), bool(cfg.get("download", True)))
    (x_train, y_train), (x_test, y_test) = read_or_fail(
        files, lambda: (_split(root, train=True), _split(root, train=False)), _read_one
    )
    _check_lengths(files.folder, True, x_train, y_train)
    _check_lengths(files.folder, False, x_test, y_test)
    return ArrayData("mnist", x_train, y_train, x_test, y_test, 10)
