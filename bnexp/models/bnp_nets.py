"""The BNP paper's small nets (METHODS.md section 6), Glorot-uniform weights, zero biases.

- ``mlp3x100``: the flattened image (C*H*W values), three hidden layers of 100, output
  layer; the BNP paper's fully connected net (after Ioffe and Szegedy), section 5.
- ``mlp2x100``: the same with two hidden layers, the net of the paper's condition-number
  analysis (its Fig. 8).
- ``cnn5``: the TensorFlow tutorial CNN the paper cites: conv3x3 32 -> max-pool 2 ->
  conv3x3 64 -> max-pool 2 -> conv3x3 32 -> dense 64 -> dense classes. The convs are
  unpadded ("valid", the tutorial's Keras default; ``padding: same`` keeps the size), so
  a 32x32 image reaches the first dense layer as 32 x 4 x 4 and a 28x28 one as 32 x 3 x 3.

Every hidden layer and every conv is a normalized op followed by ``act``; the output
layer is the classifier (normalized in front only in ``before_op`` with ``norm.classifier``).
"""

from __future__ import annotations

from typing import Any, Mapping

import torch
from torch import nn

from bnexp.models.layers import LayerBuilder, glorot_uniform_init
from bnexp.models.registry import DataSpec, ModelBuilder, register_model
from bnexp.support.errors import ConfigError, unknown_choice

PADDINGS = ("valid", "same")


class MLP(nn.Module):
    """``depth`` hidden layers of ``width`` units (normalized, then ``act``) and a classifier."""

    def __init__(self, b: LayerBuilder, num_features: int, num_classes: int, depth: int, width: int = 100) -> None:
        super().__init__()
        layers: list[nn.Module] = [nn.Flatten()]
        fin = num_features
        for i in range(depth):
            layers += [b.linear(fin, width, normalize=True, image_input=i == 0), b.act()]
            fin = width
        self.hidden = nn.Sequential(*layers)
        self.fc = b.classifier(fin, num_classes)
        glorot_uniform_init(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.hidden(x))


def cnn5_map_size(image_size: int, padding: str) -> int:
    """Side of the last conv's output map: three 3x3 convs with a 2x2 pool after two."""
    shrink = 2 if padding == "valid" else 0
    size = ((image_size - shrink) // 2 - shrink) // 2 - shrink
    if size < 1:
        raise ConfigError(f"cnn5 with {padding} padding needs larger images than {image_size}x{image_size}")
    return size


class CNN5(nn.Module):
    """Three normalized 3x3 convs (width, 2*width, width), two pools, dense 2*width, dense."""

    def __init__(
        self,
        b: LayerBuilder,
        num_classes: int,
        in_channels: int,
        image_size: int,
        width: int = 32,
        padding: str = "valid",
    ) -> None:
        super().__init__()
        if padding not in PADDINGS:
            raise unknown_choice("model.padding", padding, PADDINGS)
        pad = 0 if padding == "valid" else None
        self.features = nn.Sequential(
            b.conv(in_channels, width, 3, padding=pad, image_input=True),
            b.act(),
            nn.MaxPool2d(2),
            b.conv(width, 2 * width, 3, padding=pad),
            b.act(),
            nn.MaxPool2d(2),
            b.conv(2 * width, width, 3, padding=pad),
            b.act(),
            nn.Flatten(),
        )
        side = cnn5_map_size(image_size, padding)
        self.dense = nn.Sequential(b.linear(width * side * side, 2 * width, normalize=True), b.act())
        self.fc = b.classifier(2 * width, num_classes)
        glorot_uniform_init(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.dense(self.features(x)))


def _mlp(depth: int) -> ModelBuilder:
    def build(b: LayerBuilder, data: DataSpec, cfg: Mapping[str, Any]) -> nn.Module:
        num_features = data.in_channels * data.image_size**2
        return MLP(b, num_features, data.num_classes, depth, width=cfg.get("width", 100))

    return build


for _depth in (3, 2):
    register_model(f"mlp{_depth}x100")(_mlp(_depth))


@register_model("cnn5")
def _cnn5(b: LayerBuilder, data: DataSpec, cfg: Mapping[str, Any]) -> nn.Module:
    width, padding = cfg.get("width", 32), cfg.get("padding", "valid")
    return CNN5(b, data.num_classes, data.in_channels, data.image_size, width=width, padding=padding)
