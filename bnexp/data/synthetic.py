"""``data=synthetic``: CIFAR-shaped images with learnable labels, made in memory.

Each class owns a fixed smooth random pattern; an image is its class pattern plus pixel
noise, so a network can learn the labels within a few dozen steps. Nothing touches disk.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch
import torch.nn.functional as F

from bnexp.data.arrays import ArrayData
from bnexp.support.errors import ConfigError


def _images(templates: torch.Tensor, labels: torch.Tensor, noise: float, g: torch.Generator) -> torch.Tensor:
    x = 128 + 60 * templates[labels] + noise * torch.randn(templates[labels].shape, generator=g)
    return x.clamp(0, 255).round().to(torch.uint8)


def make_synthetic(cfg: Mapping[str, Any]) -> ArrayData:
    """Build the synthetic split from ``data.num_classes``, ``image_size``, sizes and ``seed``."""
    classes, size, channels = cfg["num_classes"], cfg["image_size"], cfg.get("channels", 3)
    for key in ("num_classes", "image_size", "train_size", "test_size"):
        if int(cfg[key]) < 1:
            raise ConfigError(f"data.{key} must be at least 1, got {cfg[key]}")
    g = torch.Generator().manual_seed(int(cfg.get("seed", 0)))
    coarse = torch.randn(classes, channels, 4, 4, generator=g)
    templates = F.interpolate(coarse, size=(size, size), mode="bilinear", align_corners=False)
    y_train = torch.randint(classes, (cfg["train_size"],), generator=g)
    y_test = torch.randint(classes, (cfg["test_size"],), generator=g)
    noise = float(cfg.get("noise", 40.0))
    return ArrayData(
        "synthetic",
        _images(templates, y_train, noise, g),
        y_train,
        _images(templates, y_test, noise, g),
        y_test,
        classes,
    )
