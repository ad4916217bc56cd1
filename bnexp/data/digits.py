"""``data=digits``: scikit-learn's bundled handwritten digits, real images that need no download.

1,797 grey 8x8 images of the digits 0-9 (the UCI "optical recognition of handwritten
digits" test set, shipped inside scikit-learn), about 180 per class. Pixel values 0..16
become uint8 0..255 (``round(v * 255 / 16)``); ``data.image_size`` 8, 16 or 32 repeats each
pixel (nearest upsampling) so CIFAR models take them; ``data.channels`` 3 repeats the grey
channel. The split is stratified by class, ``data.test_fraction`` of each class held out,
with the fixed ``data.split_seed``: the same 1,437 training and 360 test images every time.
"""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np
import torch

from bnexp.data.arrays import ArrayData
from bnexp.support.errors import ConfigError

NATIVE = 8  # side of the bundled images
SIZES = (8, 16, 32)
CHANNELS = (1, 3)
LEVELS = 16  # the bundled pixel values are 0..16


def _grid(images: np.ndarray, size: int, channels: int) -> torch.Tensor:
    """uint8 N x channels x size x size from N x 8 x 8 values 0..16."""
    x = torch.from_numpy(np.rint(images * (255 / LEVELS)).astype(np.uint8))
    factor = size // NATIVE
    x = x.repeat_interleave(factor, dim=1).repeat_interleave(factor, dim=2)
    return x[:, None].expand(-1, channels, -1, -1).contiguous()


def load_digits(cfg: Mapping[str, Any]) -> ArrayData:
    """The stratified train/test split of the bundled digits at ``data.image_size``."""
    from sklearn.datasets import load_digits as bundled
    from sklearn.model_selection import train_test_split

    size, channels = cfg.get("image_size", 32), cfg.get("channels", 3)
    for key, value, valid in (("image_size", size, SIZES), ("channels", channels, CHANNELS)):
        if value not in valid:
            raise ConfigError(f"data.{key}={value!r} is not valid for data=digits; valid choices: "
                              f"{', '.join(map(str, valid))}")
    fraction = cfg.get("test_fraction", 0.2)
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0 < fraction < 1:
        raise ConfigError(f"data.test_fraction={fraction!r} is not valid: a fraction strictly between 0 and 1")
    digits = bundled()
    x_train, x_test, y_train, y_test = train_test_split(
        digits.images, digits.target, test_size=fraction, stratify=digits.target,
        random_state=int(cfg.get("split_seed", 0)))
    return ArrayData("digits", _grid(x_train, size, channels), torch.from_numpy(y_train).long(),
                     _grid(x_test, size, channels), torch.from_numpy(y_test).long(), 10)
