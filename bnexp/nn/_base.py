"""Shared pieces of the per-channel normalizations: shapes, parameters, the fused affine."""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor, nn

FEATURES = (2, 3)  # 1d modules: (N, C) or (N, C, L), like torch.nn.BatchNorm1d
IMAGES = (4,)  # 2d modules: (N, C, H, W)


def channel_dims(x: Tensor) -> list[int]:
    """The dimensions a per-channel statistic reduces over: every one but dim 1."""
    return [0, *range(2, x.dim())]


def per_channel(v: Tensor, x: Tensor) -> Tensor:
    """``v`` (one value per channel) viewed so that it broadcasts against ``x``."""
    return v.view(1, -1, *([1] * (x.dim() - 2)))


def affine(x: Tensor, a: Tensor, b: Optional[Tensor]) -> Tensor:
    """``a * x + b`` with per-channel ``a`` and ``b``, in ``x``'s dtype, in one kernel."""
    a = per_channel(a, x).to(x.dtype)
    if b is None:
        return x * a
    return torch.addcmul(per_channel(b, x).to(x.dtype), x, a)


def check_fraction(name: str, value: float) -> None:
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"{name} must lie in [0, 1], got {value!r}")


class ChannelNorm(nn.Module):
    """A normalization with one ``weight`` (gamma, init 1) and ``bias`` (beta, init 0) per channel.

    Subclasses set ``input_dims`` (``FEATURES`` or ``IMAGES``) and implement ``forward``.
    """

    input_dims: tuple[int, ...] = ()
    sync = False  # combine batch statistics over processes (set by bnexp.distributed.enable_sync)

    def __init__(self, num_features: int, eps: float) -> None:
        super().__init__()
        if num_features < 1:
            raise ValueError(f"num_features must be positive, got {num_features}")
        if eps < 0:
            raise ValueError(f"eps must be non-negative, got {eps}")
        self.num_features = num_features
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(num_features))
        self.bias = nn.Parameter(torch.zeros(num_features))

    def check_input(self, x: Tensor) -> None:
        """Reject inputs of the wrong rank or channel count with a readable message."""
        if x.dim() not in self.input_dims:
            ranks = " or ".join(f"{d}D" for d in self.input_dims)
            raise ValueError(f"{type(self).__name__} expects a {ranks} input, got {x.dim()}D")
        if x.shape[1] != self.num_features:
            raise ValueError(f"{type(self).__name__} has {self.num_features} channels, the input has {x.shape[1]}")

    def batch_var_mean(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """Biased per-channel variance and mean in one pass, in the parameters' dtype.

        A half-precision input (autocast) is reduced in the parameters' precision. With
        ``sync`` set (``norm.sync=true`` under DDP) the statistics are those of the batch of
        all processes together.
        """
        wide = x.to(torch.promote_types(x.dtype, self.weight.dtype))
        var, mean = torch.var_mean(wide, channel_dims(x), correction=0)
        if self.sync:
            from bnexp.distributed import synced_var_mean

            var, mean = synced_var_mean(var, mean, x.numel() // self.num_features)
        return var.to(self.weight.dtype), mean.to(self.weight.dtype)
