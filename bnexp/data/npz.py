"""``data=npz data.path=FILE``: any image classification set saved with ``numpy.savez``.

The file holds ``x_train``, ``y_train``, ``x_test``, ``y_test``. Images are uint8, either
``N x H x W`` (one channel) or four-dimensional with the channel axis of size 1 or 3
second (NCHW) or last (NHWC); they must be square. Labels are integers ``0..K-1``;
``K`` (the number of classes) is the largest label plus one unless ``data.num_classes``
is set. Anything else stops with a DataError naming the key and what was expected.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

import numpy as np
import torch

from bnexp.data.arrays import ArrayData
from bnexp.errors import ConfigError, DataError

KEYS = ("x_train", "y_train", "x_test", "y_test")
CHANNELS = (1, 3)


def _array(arrays: Mapping[str, np.ndarray], key: str, path: Path) -> np.ndarray:
    if key not in arrays:
        raise DataError(f"{path} has no array {key!r}; expected the keys {', '.join(KEYS)} (has: {', '.join(arrays)})")
    return arrays[key]


def _images(x: np.ndarray, key: str, path: Path) -> torch.Tensor:
    """uint8 NCHW images from an N x H x W, NCHW or NHWC array."""
    where = f"{path}: {key}"
    if x.dtype != np.uint8:
        raise DataError(f"{where} has dtype {x.dtype}; expected uint8 images (0..255)")
    if x.ndim == 3:
        x = x[:, None]
    elif x.ndim != 4:
        raise DataError(f"{where} has shape {x.shape}; expected N x H x W, N x C x H x W or N x H x W x C")
    elif x.shape[1] not in CHANNELS:
        if x.shape[3] not in CHANNELS:
            raise DataError(f"{where} has shape {x.shape}; expected a channel axis of size 1 or 3 second or last")
        x = x.transpose(0, 3, 1, 2)
    if len(x) == 0:
        raise DataError(f"{where} holds no images; expected at least one")
    if x.shape[2] != x.shape[3]:
        raise DataError(f"{where} holds {x.shape[2]}x{x.shape[3]} images; expected square images")
    return torch.from_numpy(np.ascontiguousarray(x))


def _labels(y: np.ndarray, key: str, path: Path, count: int, images_key: str) -> torch.Tensor:
    where = f"{path}: {key}"
    if not np.issubdtype(y.dtype, np.integer):
        raise DataError(f"{where} has dtype {y.dtype}; expected integer class labels")
    if y.ndim != 1 or len(y) != count:
        raise DataError(f"{where} has shape {y.shape}; expected ({count},), one label per image of {images_key}")
    if len(y) and y.min() < 0:
        raise DataError(f"{where} holds the label {y.min()}; expected labels 0..K-1")
    return torch.from_numpy(y.astype(np.int64))


def _num_classes(cfg: Mapping[str, Any], path: Path, y_train: torch.Tensor, y_test: torch.Tensor) -> int:
    largest = int(torch.cat([y_train, y_test]).max())
    given = cfg.get("num_classes")
    if given is None:
        return largest + 1
    if largest >= int(given):
        raise DataError(f"{path} holds the label {largest} but data.num_classes={given}; expected labels below it")
    return int(given)


def load_npz(cfg: Mapping[str, Any]) -> ArrayData:
    """The four arrays of ``data.path`` as an :class:`ArrayData`."""
    if not cfg.get("path"):
        raise ConfigError("data=npz needs data.path=FILE, an .npz file with x_train, y_train, x_test, y_test")
    path = Path(str(cfg["path"])).expanduser()
    if not path.is_file():
        raise DataError(f"data.path={path}: no such file; expected an .npz with {', '.join(KEYS)}")
    try:
        with np.load(path, allow_pickle=False) as f:
            arrays = {key: f[key] for key in f.files}
    except Exception as err:
        raise DataError(f"cannot read {path} as an .npz file: {type(err).__name__}: {err}") from err
    x_train = _images(_array(arrays, "x_train", path), "x_train", path)
    x_test = _images(_array(arrays, "x_test", path), "x_test", path)
    if x_train.shape[1:] != x_test.shape[1:]:
        raise DataError(
            f"{path}: x_test images are {tuple(x_test.shape[1:])} (C, H, W) but x_train images are "
            f"{tuple(x_train.shape[1:])}; expected the same shape"
        )
    y_train = _labels(_array(arrays, "y_train", path), "y_train", path, len(x_train), "x_train")
    y_test = _labels(_array(arrays, "y_test", path), "y_test", path, len(x_test), "x_test")
    return ArrayData("npz", x_train, y_train, x_test, y_test, _num_classes(cfg, path, y_train, y_test))
