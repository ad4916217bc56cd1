"""``data=npz data.path=FILE``: any image classification set saved with ``numpy.savez``.

The file holds ``x_train``, ``y_train``, ``x_test``, ``y_test``. Images are uint8, either
``N x H x W`` (one channel) or four-dimensional with the channel axis of size 1 or 3
second (NCHW) or last (NHWC); they must be square. Labels are integers ``0..K-1``;
``K`` (the number of classes) is the largest label plus one unless ``data.num_classes``
is set. Anything else (a NaN or infinity in a float array is reported before its dtype)
stops with a DataError naming the file, the key and what was expected.
"""

from __future__ import annotations

import zipfile
from pathlib import Path
from typing import Any, Mapping, Optional

import numpy as np
import torch

from bnexp.data.arrays import ArrayData
from bnexp.data.files import check_labels
from bnexp.support.errors import ConfigError, DataError
from bnexp.support.untrusted import DATA_FILE, open_regular

KEYS = ("x_train", "y_train", "x_test", "y_test")
CHANNELS = (1, 3)


def _array(arrays: Mapping[str, np.ndarray], key: str, path: Path) -> np.ndarray:
    if key not in arrays:
        raise DataError(f"{path} has no array {key!r}; expected the keys {', '.join(KEYS)} (has: {', '.join(arrays)})")
    return arrays[key]


def _finite(a: np.ndarray, where: str, expected: str) -> None:
    """Stop on NaN or infinity (only a float array holds them), said before its dtype is."""
    if np.issubdtype(a.dtype, np.inexact) and not np.isfinite(a).all():
        kind = "NaN" if np.isnan(a).any() else "infinity"
        raise DataError(f"{where} contains {kind}; expected {expected}")


def _images(x: np.ndarray, key: str, path: Path) -> torch.Tensor:
    """uint8 NCHW images from an N x H x W, NCHW or NHWC array."""
    where = f"{path}: {key}"
    expected = "uint8 images (0..255)"
    _finite(x, where, expected)
    if x.dtype != np.uint8:
        raise DataError(f"{where} has dtype {x.dtype}; expected {expected}")
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


def _labels(y: np.ndarray, key: str, path: Path, count: int, images_key: str,
            num_classes: Optional[int]) -> torch.Tensor:
    """int64 labels, one per image of ``images_key``, below ``num_classes`` when that is given."""
    where = f"{path}: {key}"
    _finite(y, where, "integer class labels")
    if not np.issubdtype(y.dtype, np.integer):
        raise DataError(f"{where} has dtype {y.dtype}; expected integer class labels")
    if y.ndim != 1 or len(y) != count:
        raise DataError(f"{where} has shape {y.shape}; expected ({count},), one label per image of {images_key}")
    labels = torch.from_numpy(y.astype(np.int64))
    check_labels(labels, where, num_classes, f"data.num_classes={num_classes}")
    return labels


def load_npz(cfg: Mapping[str, Any]) -> ArrayData:
    """The four arrays of ``data.path`` as an :class:`ArrayData`."""
    if not cfg.get("path"):
        raise ConfigError("data=npz needs data.path=FILE, an .npz file with x_train, y_train, x_test, y_test")
    path = Path(str(cfg["path"])).expanduser()
    if not path.is_file():
        raise DataError(f"data.path={path}: no such file; expected an .npz with {', '.join(KEYS)}")
    if not zipfile.is_zipfile(path):
        raise DataError(f"{path} is not an .npz file: expected a zip archive of .npy arrays (numpy.savez or "
                        f"numpy.savez_compressed) holding {', '.join(KEYS)}")
    try:
        with open_regular(path, DATA_FILE) as raw, np.load(raw, allow_pickle=False) as f:
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
    given = None if cfg.get("num_classes") is None else int(cfg["num_classes"])
    y_train = _labels(_array(arrays, "y_train", path), "y_train", path, len(x_train), "x_train", given)
    y_test = _labels(_array(arrays, "y_test", path), "y_test", path, len(x_test), "x_test", given)
    num_classes = given if given is not None else int(torch.cat([y_train, y_test]).max()) + 1
    return ArrayData("npz", x_train, y_train, x_test, y_test, num_classes)
