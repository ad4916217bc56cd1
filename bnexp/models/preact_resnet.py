"""Pre-activation CIFAR ResNet (He et al. 2016, "Identity mappings"), METHODS.md section 6.

Each block computes ``x + conv2(act(N2(conv1(act(N1(x))))))``: the normalization order
is fixed by the architecture, so ``norm.placement`` does not apply (the module tree is
the same for both placements) and only the normalization type changes. ``N2`` reads
``conv1``'s output directly, so ``conv1``'s weight is scale-invariant under BN; ``N1`` reads
a sum of branches, which is why ``norm=bn_si`` (bound to one producing op) is refused here. The stem is a
bare conv; after the last block come a final ``N -> act``, the pool and the classifier.
Where the shape changes, the shortcut is a 1x1 strided projection of the block's
pre-activated input ``act(N1(x))``, as in the authors' code (resnet-1k-layers).
"""

from __future__ import annotations

from functools import partial
from typing import Any, Mapping

import torch
from torch import nn

from bnexp.models.layers import LayerBuilder, he_normal_init
from bnexp.models.registry import DataSpec, register_model
from bnexp.models.resnet_cifar import blocks_per_stage, residual_stages


class PreActBlock(nn.Module):
    """``N1 -> act -> conv3x3 -> N2 -> act -> conv3x3`` plus the shortcut; ``conv1`` holds
    the first conv with ``N2`` behind it (``conv1.op``, ``conv1.post``)."""

    def __init__(self, b: LayerBuilder, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.norm1 = b.norm_layer(cin)
        self.act1 = b.act()
        self.conv1 = b.conv_norm(cin, cout, 3, stride)
        self.act2 = b.act()
        self.conv2 = b.plain_conv(cout, cout, 3)
        self.shortcut = b.plain_conv(cin, cout, 1, stride) if stride != 1 or cin != cout else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.act1(self.norm1(x))
        shortcut = x if self.shortcut is None else self.shortcut(a)
        return shortcut + self.conv2(self.act2(self.conv1(a)))


class PreActResNet(nn.Module):
    """Stem conv, three stages of ``n`` pre-activation blocks at w, 2w, 4w, final N-act."""

    def __init__(self, b: LayerBuilder, depth: int, num_classes: int, in_channels: int = 3, width: int = 16) -> None:
        super().__init__()
        n = blocks_per_stage(depth)
        self.stem = b.plain_conv(in_channels, width, 3)
        self.blocks, cin = residual_stages(partial(PreActBlock, b), width, (width, 2 * width, 4 * width), (n, n, n))
        self.norm = b.norm_layer(cin)
        self.act = b.act()
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = b.linear(cin, num_classes)
        he_normal_init(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.act(self.norm(self.blocks(self.stem(x))))
        return self.fc(torch.flatten(self.pool(x), 1))


@register_model("preact_resnet110")
def _preact_resnet110(b: LayerBuilder, data: DataSpec, cfg: Mapping[str, Any]) -> nn.Module:
    return PreActResNet(b, 110, data.num_classes, data.in_channels, width=cfg.get("width", 16))
