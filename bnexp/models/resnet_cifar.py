"""CIFAR ResNets (6n+2 layers, option-A shortcuts), METHODS.md section 6."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from bnexp.models.layers import LayerBuilder, he_normal_init


class OptionAShortcut(nn.Module):
    """Parameter-free shortcut: strided subsampling plus zero channel padding."""

    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.stride = stride
        self.pad = cout - cin

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x[:, :, :: self.stride, :: self.stride]
        return F.pad(x, (0, 0, 0, 0, self.pad // 2, self.pad - self.pad // 2))


class BasicBlock(nn.Module):
    """Two 3x3 convs; the shortcut is identity, option A, or (option B) a 1x1 projection."""

    def __init__(self, b: LayerBuilder, cin: int, cout: int, stride: int, projection: bool = False) -> None:
        super().__init__()
        self.conv1 = b.conv(cin, cout, 3, stride)
        self.act1 = b.act()
        self.conv2 = b.conv(cout, cout, 3)
        self.join = b.join()
        self.projection = projection and (stride != 1 or cin != cout)
        if self.projection:
            self.shortcut: nn.Module = b.conv(cin, cout, 1, stride, share_input_norm=True)
        elif stride != 1 or cin != cout:
            self.shortcut = OptionAShortcut(cin, cout, stride)
        else:
            self.shortcut = nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n1 = self.conv1.normalize_input(x)
        h = self.conv2(self.act1(self.conv1.from_normalized(n1)))
        shortcut = self.shortcut.from_normalized(n1) if self.projection else self.shortcut(x)
        return self.join(h, shortcut)


class CifarResNet(nn.Module):
    """Stem conv, three stages of ``n`` basic blocks at widths w, 2w, 4w, pool, classifier."""

    def __init__(self, b: LayerBuilder, depth: int, num_classes: int, in_channels: int = 3, width: int = 16) -> None:
        super().__init__()
        if (depth - 2) % 6:
            raise ValueError(f"CIFAR ResNet depth must be 6n+2, got {depth}")
        n = (depth - 2) // 6
        self.stem = b.conv(in_channels, width, 3)
        self.stem_act = b.act()
        blocks: list[nn.Module] = []
        cin = width
        for stage, cout in enumerate((width, 2 * width, 4 * width)):
            for i in range(n):
                blocks.append(BasicBlock(b, cin, cout, 2 if stage > 0 and i == 0 else 1))
                cin = cout
        self.blocks = nn.Sequential(*blocks)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = b.linear(cin, num_classes)
        he_normal_init(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.blocks(self.stem_act(self.stem(x)))
        return self.fc(torch.flatten(self.pool(x), 1))

