"""CIFAR VGG-16 (METHODS.md section 6): 13 normalized 3x3 convs, 5 max-pools, one linear."""

from __future__ import annotations

from typing import Any, Mapping

import torch
from torch import nn

from bnexp.models.layers import LayerBuilder, he_normal_init
from bnexp.models.registry import DataSpec, register_model

VGG16_CFG = (64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M", 512, 512, 512, "M")


class VGG(nn.Module):
    """Each conv is followed by its activation; ``width`` scales the channels (64 = paper)."""

    def __init__(self, b: LayerBuilder, num_classes: int, in_channels: int = 3, width: int = 64, cfg=VGG16_CFG) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        cin = in_channels
        for v in cfg:
            if v == "M":
                layers.append(nn.MaxPool2d(2))
                continue
            cout = v * width // 64
            layers += [b.conv(cin, cout, 3, image_input=cin == in_channels and not layers), b.act()]
            cin = cout
        self.features = nn.Sequential(*layers)
        self.pool = nn.AdaptiveAvgPool2d(1)  # identity on 32x32 inputs (1x1 maps after 5 pools)
        self.fc = b.classifier(cin, num_classes)
        he_normal_init(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.flatten(self.pool(self.features(x)), 1))


@register_model("vgg16")
def _vgg16(b: LayerBuilder, data: DataSpec, cfg: Mapping[str, Any]) -> nn.Module:
    return VGG(b, data.num_classes, data.in_channels, width=cfg.get("width", 64))
