"""CIFAR ResNets (6n+2 layers, option-A shortcuts), METHODS.md section 6.

Also home of the residual blocks shared with the ImageNet ResNets: every block's first
op normalizes the block input once (``n1``), and a projection shortcut reads that same
``n1`` in ``before_op`` (METHODS.md section 1).
"""

from __future__ import annotations

from functools import partial
from typing import Any, Callable, Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from bnexp.models.layers import LayerBuilder, NormOp, he_normal_init
from bnexp.models.registry import DataSpec, ModelBuilder, register_model


class OptionAShortcut(nn.Module):
    """Parameter-free shortcut: strided subsampling plus zero channel padding.

    ``runs`` > 1 (a packed model, :mod:`bnexp.models.packing`): the channels are ``runs``
    equal blocks and each block is padded on its own.
    """

    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.stride = stride
        self.pad = cout - cin
        self.runs = 1

    def packed(self, runs: int) -> OptionAShortcut:
        """Itself, padding each of ``runs`` blocks of channels (the packing protocol)."""
        self.runs = runs
        return self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x[:, :, :: self.stride, :: self.stride]
        x = x.unflatten(1, (self.runs, -1))  # (N, runs, C, H, W): the padding below is on C
        return F.pad(x, (0, 0, 0, 0, self.pad // 2, self.pad - self.pad // 2)).flatten(1, 2)


class ResidualBlock(nn.Module):
    """A residual block: subclasses build ``conv1`` and ``residual`` (the branch after it).

    The shortcut is the identity when shapes match, otherwise a 1x1 projection (option B,
    ``projection=True``) or :class:`OptionAShortcut`.
    """

    expansion = 1
    conv1: NormOp

    def _init_shortcut(self, b: LayerBuilder, cin: int, cout: int, stride: int, projection: bool) -> None:
        self.join = b.join()
        self.projection = projection and (stride != 1 or cin != cout)
        if self.projection:
            self.shortcut: nn.Module = b.conv(cin, cout, 1, stride, share_input_norm=True)
        elif stride != 1 or cin != cout:
            self.shortcut = OptionAShortcut(cin, cout, stride)
        else:
            self.shortcut = nn.Identity()

    def residual(self, h: torch.Tensor) -> torch.Tensor:
        """The branch after ``conv1``, given ``conv1``'s output."""
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n1 = self.conv1.normalize_input(x)
        h = self.residual(self.conv1.from_normalized(n1))
        shortcut = self.shortcut.from_normalized(n1) if self.projection else self.shortcut(x)
        return self.join(h, shortcut)


class BasicBlock(ResidualBlock):
    """Two 3x3 convs, ``cin`` -> ``cout`` channels, the first one strided."""

    def __init__(self, b: LayerBuilder, cin: int, cout: int, stride: int, projection: bool = False) -> None:
        super().__init__()
        self.conv1 = b.conv(cin, cout, 3, stride)
        self.act1 = b.act()
        self.conv2 = b.conv(cout, cout, 3)
        self._init_shortcut(b, cin, cout, stride, projection)

    def residual(self, h: torch.Tensor) -> torch.Tensor:
        return self.conv2(self.act1(h))


def residual_stages(
    make_block: Callable[[int, int, int], nn.Module],
    cin: int,
    widths: Sequence[int],
    depths: Sequence[int],
    expansion: int = 1,
) -> tuple[nn.Sequential, int]:
    """Stages of ``depths[i]`` blocks ``make_block(cin, width, stride)`` at ``widths[i]``;
    every stage after the first starts with stride 2. Returns the blocks and their output
    channel count (``expansion`` times the last width)."""
    blocks: list[nn.Module] = []
    for stage, (width, depth) in enumerate(zip(widths, depths)):
        for i in range(depth):
            blocks.append(make_block(cin, width, 2 if stage > 0 and i == 0 else 1))
            cin = width * expansion
    return nn.Sequential(*blocks), cin


def blocks_per_stage(depth: int) -> int:
    """``n`` of a 6n+2-layer CIFAR ResNet (three stages of ``n`` two-conv blocks)."""
    if depth < 8 or (depth - 2) % 6:
        raise ValueError(f"CIFAR ResNet depth must be 6n+2 with n >= 1, got {depth}")
    return (depth - 2) // 6


class CifarResNet(nn.Module):
    """Stem conv, three stages of ``n`` basic blocks at widths w, 2w, 4w, pool, classifier."""

    def __init__(self, b: LayerBuilder, depth: int, num_classes: int, in_channels: int = 3, width: int = 16) -> None:
        super().__init__()
        n = blocks_per_stage(depth)
        self.stem = b.conv(in_channels, width, 3, image_input=True)
        self.stem_act = b.act()
        make_block = partial(BasicBlock, b)
        self.blocks, cout = residual_stages(make_block, width, (width, 2 * width, 4 * width), (n, n, n))
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = b.classifier(cout, num_classes)
        he_normal_init(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.blocks(self.stem_act(self.stem(x)))
        return self.fc(torch.flatten(self.pool(x), 1))


def _cifar_resnet(depth: int) -> ModelBuilder:
    def build(b: LayerBuilder, data: DataSpec, cfg: Mapping[str, Any]) -> nn.Module:
        return CifarResNet(b, depth, data.num_classes, data.in_channels, width=cfg.get("width", 16))

    return build


for _depth in (20, 32, 44, 56, 110):
    register_model(f"resnet{_depth}")(_cifar_resnet(_depth))
