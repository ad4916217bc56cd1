"""ImageNet ResNet-18/50 (torchvision's architecture), METHODS.md section 6.

7x7 stride-2 stem, 3x3 max-pool, four stages (64/128/256/512 channels times the block
expansion) with 1x1 projection shortcuts where the shape changes, global pool, linear.
Under ``norm=bn`` with ``after_op`` the parameter counts equal torchvision's
(11,689,512 and 25,557,032). Initialization as torchvision: He-normal over fan-out for
the convs, normalizations at weight 1 / bias 0 (their defaults), default linear init.
"""

from __future__ import annotations

from functools import partial
from typing import Any, Mapping

import torch
from torch import nn

from bnexp.models.layers import LayerBuilder, kaiming_fan_out_init
from bnexp.models.registry import DataSpec, ModelBuilder, register_model
from bnexp.models.resnet_cifar import BasicBlock, ResidualBlock, residual_stages


class Bottleneck(ResidualBlock):
    """1x1 reduce to ``planes``, strided 3x3, 1x1 expand to ``4 * planes`` (ResNet v1.5)."""

    expansion = 4

    def __init__(self, b: LayerBuilder, cin: int, planes: int, stride: int, projection: bool = True) -> None:
        super().__init__()
        cout = planes * self.expansion
        self.conv1 = b.conv(cin, planes, 1)
        self.act1 = b.act()
        self.conv2 = b.conv(planes, planes, 3, stride)
        self.act2 = b.act()
        self.conv3 = b.conv(planes, cout, 1)
        self._init_shortcut(b, cin, cout, stride, projection)

    def residual(self, h: torch.Tensor) -> torch.Tensor:
        return self.conv3(self.act2(self.conv2(self.act1(h))))


class ImageNetResNet(nn.Module):
    """``block`` stages of ``depths`` blocks; ``width`` is the stem's channel count (64)."""

    def __init__(
        self,
        b: LayerBuilder,
        block: type[ResidualBlock],
        depths: tuple[int, ...],
        num_classes: int,
        in_channels: int = 3,
        width: int = 64,
    ) -> None:
        super().__init__()
        self.stem = b.conv(in_channels, width, 7, 2, image_input=True)
        self.stem_act = b.act()
        self.maxpool = nn.MaxPool2d(3, 2, 1)
        widths = [width * 2**i for i in range(len(depths))]
        make_block = partial(block, b, projection=True)
        self.blocks, cout = residual_stages(make_block, width, widths, depths, block.expansion)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = b.classifier(cout, num_classes)
        kaiming_fan_out_init(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.blocks(self.maxpool(self.stem_act(self.stem(x))))
        return self.fc(torch.flatten(self.pool(x), 1))


RESNET_DEPTHS: dict[str, tuple[type[ResidualBlock], tuple[int, ...]]] = {
    "resnet18": (BasicBlock, (2, 2, 2, 2)),
    "resnet50": (Bottleneck, (3, 4, 6, 3)),
}


def _imagenet_resnet(name: str) -> ModelBuilder:
    block, depths = RESNET_DEPTHS[name]

    def build(b: LayerBuilder, data: DataSpec, cfg: Mapping[str, Any]) -> nn.Module:
        return ImageNetResNet(b, block, depths, data.num_classes, data.in_channels, width=cfg.get("width", 64))

    return build


for _name in RESNET_DEPTHS:
    register_model(_name)(_imagenet_resnet(_name))
