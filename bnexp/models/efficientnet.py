"""ImageNet EfficientNet-B0 (torchvision's architecture), METHODS.md section 6.

MBConv blocks: 1x1 expand conv -> act, depthwise kxk conv -> act, squeeze-excitation,
1x1 project conv with no activation; a residual (through stochastic depth, "row" mode,
rate 0.2 * block index / number of blocks) when stride is 1 and channels are unchanged.
The expand, depthwise and project convs, the stem and the 1x1 head conv are normalized;
the squeeze-excitation stays unnormalized (two biased 1x1 convs with SiLU and sigmoid
inside, torchvision's choice, whatever ``act`` is). ``act`` (swish in the paper) is used
everywhere else. With ``norm=bn``, ``after_op`` the parameter count equals
``torchvision.models.efficientnet_b0()`` (5,288,548); torchvision's BN eps of 1e-3 is not
copied: the norm preset decides. Initialization as torchvision.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

import torch
from torch import nn
from torchvision.ops import StochasticDepth

from bnexp.models.layers import LayerBuilder, kaiming_fan_out_init
from bnexp.models.registry import DataSpec, register_model

# expand ratio, kernel, stride, input channels, output channels, blocks (B0 at width 1.0)
B0_STAGES = (
    (1, 3, 1, 32, 16, 1),
    (6, 3, 2, 16, 24, 2),
    (6, 5, 2, 24, 40, 2),
    (6, 3, 2, 40, 80, 3),
    (6, 5, 1, 80, 112, 3),
    (6, 5, 2, 112, 192, 4),
    (6, 3, 1, 192, 320, 1),
)


def divisible(channels: float, divisor: int = 8) -> int:
    """Round ``channels`` to a multiple of ``divisor``, never below 90% of it (torchvision)."""
    rounded = max(divisor, int(channels + divisor / 2) // divisor * divisor)
    return rounded + divisor if rounded < 0.9 * channels else rounded


class SqueezeExcite(nn.Module):
    """Channel gates ``sigmoid(conv(silu(conv(avgpool(x)))))``, never normalized."""

    def __init__(self, b: LayerBuilder, channels: int, squeeze: int) -> None:
        super().__init__()
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.reduce = b.conv(channels, squeeze, 1, normalize=False)
        self.act = nn.SiLU()
        self.expand = b.conv(squeeze, channels, 1, normalize=False)
        self.gate = nn.Sigmoid()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.gate(self.expand(self.act(self.reduce(self.pool(x)))))


class MBConv(nn.Module):
    """Inverted residual block with squeeze-excitation 0.25 (of the block's input channels)."""

    def __init__(
        self, b: LayerBuilder, cin: int, cout: int, expand: int, kernel: int, stride: int, drop: float
    ) -> None:
        super().__init__()
        hidden = divisible(cin * expand)
        layers: list[nn.Module] = []
        if hidden != cin:
            layers += [b.conv(cin, hidden, 1), b.act()]
        layers += [
            b.conv(hidden, hidden, kernel, stride, groups=hidden),
            b.act(),
            SqueezeExcite(b, hidden, max(1, cin // 4)),
            b.conv(hidden, cout, 1),
        ]
        self.block = nn.Sequential(*layers)
        self.residual = stride == 1 and cin == cout
        self.drop = StochasticDepth(drop, "row")
        self.join = b.join(act=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.block(x)
        return self.join(self.drop(h), x) if self.residual else h


class EfficientNet(nn.Module):
    """Stem 3x3/2 conv, MBConv stages, 1x1 head conv to 4x the last stage, dropout, linear."""

    def __init__(
        self,
        b: LayerBuilder,
        num_classes: int,
        in_channels: int = 3,
        width_mult: float = 1.0,
        depth_mult: float = 1.0,
        dropout: float = 0.2,
        stochastic_depth: float = 0.2,
    ) -> None:
        super().__init__()
        # one (expand, kernel, stride, output channels) per block; a stage strides once
        blocks = [
            (e, k, s if i == 0 else 1, divisible(co * width_mult))
            for e, k, s, _, co, n in B0_STAGES
            for i in range(math.ceil(n * depth_mult))
        ]
        cin = divisible(B0_STAGES[0][3] * width_mult)
        layers: list[nn.Module] = [b.conv(in_channels, cin, 3, 2, image_input=True), b.act()]
        for index, (expand, kernel, stride, cout) in enumerate(blocks):
            drop = stochastic_depth * index / len(blocks)
            layers.append(MBConv(b, cin, cout, expand, kernel, stride, drop))
            cin = cout
        layers += [b.conv(cin, 4 * cin, 1), b.act()]
        self.features = nn.Sequential(*layers)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.dropout = nn.Dropout(dropout)
        self.fc = b.classifier(4 * cin, num_classes)
        self._init_weights()

    def _init_weights(self) -> None:
        """torchvision: fan-out He-normal convs, uniform(+-1/sqrt(classes)) linear, zero biases."""
        kaiming_fan_out_init(self)
        bound = 1.0 / math.sqrt(self.fc.op.out_features)
        nn.init.uniform_(self.fc.op.weight, -bound, bound)
        nn.init.zeros_(self.fc.op.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # a before_op classifier normalization sees the features before dropout, as in eval
        x = self.fc.normalize_input(torch.flatten(self.pool(self.features(x)), 1))
        return self.fc.from_normalized(self.dropout(x))


@register_model("efficientnet_b0")
def _efficientnet_b0(b: LayerBuilder, data: DataSpec, cfg: Mapping[str, Any]) -> nn.Module:
    return EfficientNet(
        b,
        data.num_classes,
        data.in_channels,
        width_mult=cfg.get("width_mult", 1.0),
        depth_mult=cfg.get("depth_mult", 1.0),
        dropout=cfg.get("dropout", 0.2),
        stochastic_depth=cfg.get("stochastic_depth", 0.2),
    )
