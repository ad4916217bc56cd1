"""Shared pieces of the per-channel normalizations: shapes, parameters, the fused affine."""

from __future__ import annotations

import math
from typing import Any, Optional

import torch
from torch import Tensor, nn
from torch.autograd.function import once_differentiable

from bnexp.support.distributed import synced_var_mean

FEATURES = (2, 3)  # 1d modules: (N, C) or (N, C, L), like torch.nn.BatchNorm1d
IMAGES = (4,)  # 2d modules: (N, C, H, W)
FUSED_PLANE = 1 << 16  # largest H * W that channel_sums hands to the batch-norm kernel


def channel_dims(x: Tensor) -> list[int]:
    """The dimensions a per-channel statistic reduces over: every one but dim 1."""
    return [0, *range(2, x.dim())]


def per_channel(v: Tensor, x: Tensor) -> Tensor:
    """``v`` (one value per channel) viewed so that it broadcasts against ``x``."""
    return v.view(1, -1, *([1] * (x.dim() - 2)))


def cpu_eager(x: Tensor) -> bool:
    """Whether ``x`` is on the CPU outside torch.compile, where torch's generic kernels for
    per-channel statistics and broadcast multiply-adds are slow and these helpers use others.
    On a GPU, and under the compiler (which fuses them itself), they use the plain ops."""
    return x.device.type == "cpu" and not torch.compiler.is_compiling()


def var_mean_per_channel(x: Tensor) -> tuple[Tensor, Tensor]:
    """Biased variance and mean over every dimension but 1.

    ``torch.var_mean``, except eager on a CPU, where ``var_mean`` over the strided
    dimensions of an NCHW tensor is several times slower than a contiguous sum: there it
    is the same two-pass computation from cheaper kernels, the mean ``m``, then the sums
    of ``d = x - m`` and ``d^2``, the first of which corrects ``m``'s rounding. Under
    autograd its backward is one elementwise pass, ``dx = (g_mean + 2 g_var (x - mean)) / n``.
    """
    if not cpu_eager(x):
        return torch.var_mean(x, channel_dims(x), correction=0)
    if x.requires_grad and torch.is_grad_enabled():
        return _VarMean.apply(x)
    return _two_pass_var_mean(x)


def _two_pass_var_mean(x: Tensor) -> tuple[Tensor, Tensor]:
    n = x.numel() // x.shape[1]
    mean = x.sum(channel_dims(x)) / n
    d = x - per_channel(mean, x)
    sum_d, sum_dd = channel_sums(d, d, d.dtype)
    shift = sum_d / n
    return sum_dd / n - shift.square(), mean + shift


class _VarMean(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor) -> tuple[Tensor, Tensor]:
        var, mean = _two_pass_var_mean(x)
        ctx.save_for_backward(x, mean)
        return var, mean

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_var: Tensor, grad_mean: Tensor) -> Tensor:
        x, mean = ctx.saved_tensors
        n = x.numel() // x.shape[1]
        a = 2.0 * grad_var / n
        return affine(x, a, grad_mean / n - a * mean)


def channel_sums(g: Tensor, x: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """``sum(g)`` and ``sum(g * x)`` over every dimension but 1, accumulated in ``dtype``.

    Eager and in ``dtype`` already, both come from one pass of torch's batch-norm backward
    reduction (its bias and weight gradients for ``g``, with mean 0 and inverse std 1);
    otherwise two reductions, the products formed in ``dtype`` (or wider). On the CPU only for NCHW-contiguous inputs with planes (the
    dims after 1) of at most :data:`FUSED_PLANE` values: the CPU kernel sums each plane in a
    few float32 accumulators and runs through 2-D and channels_last inputs serially, which
    loses about 1e-4 of a sum of 10^6 positive terms where torch's sums stay near 1e-7.
    Used for a backward's sums and for ``sum(d), sum(d^2)``.
    """
    fused = g.dtype == x.dtype == dtype and (x.device.type != "cpu" or (
        x.dim() > 2 and x.is_contiguous() and g.is_contiguous() and math.prod(x.shape[2:]) <= FUSED_PLANE))
    if torch.compiler.is_compiling() or not fused:
        dims = channel_dims(x)
        wide = torch.promote_types(torch.promote_types(g.dtype, x.dtype), dtype)  # bf16 products are not rounded
        return g.sum(dims, dtype=dtype), (g.to(wide) * x.to(wide)).sum(dims, dtype=dtype)
    zero, one = x.new_zeros(x.shape[1]), x.new_ones(x.shape[1])
    # weight=one is not used by these two outputs; some backends size them from it.
    _, sum_gx, sum_g = torch.ops.aten.native_batch_norm_backward(
        g, x, one, None, None, zero, one, True, 0.0, [False, True, True])
    return sum_g, sum_gx


def affine(x: Tensor, a: Tensor, b: Optional[Tensor], keep_wide: bool = False) -> Tensor:
    """``a * x + b`` with per-channel ``a`` and ``b``: one ``addcmul``, returned in ``x``'s dtype
    (in float32 at least with ``keep_wide``, for more arithmetic before the one rounding).

    The arithmetic is in float32 at least: under mixed precision, ``b = beta - a * mean``
    rounded to bf16 loses about log2(|mean| / std) bits (the same rounding on ``a``), so
    a bf16 ``x`` is widened instead, as torch's BatchNorm does. Eager on a CPU it is a
    multiply, then an in-place add: ``addcmul`` with the broadcast ``b`` as its first
    operand runs two to three times slower there.
    """
    dtype = torch.promote_types(x.dtype, torch.float32)
    wide = x.to(dtype)
    a = per_channel(a, x).to(dtype)
    if b is None:
        out = wide * a
    else:
        b = per_channel(b, x).to(dtype)
        out = (wide * a).add_(b) if cpu_eager(x) else torch.addcmul(b, wide, a)
    return out if keep_wide else out.to(x.dtype)


def widen(x: Tensor) -> Tensor:
    """``x`` in float32 at least. An autograd forward that reads a half-precision input
    twice (statistics and the affine) widens it once, so the two gradients add up in
    float32 and are rounded once, at the cast, instead of each on its own."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def check_fraction(name: str, value: float) -> None:
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"{name} must lie in [0, 1], got {value!r}")


class ChannelNorm(nn.Module):
    """A normalization with one ``weight`` (gamma, init 1) and ``bias`` (beta, init 0) per channel.

    Subclasses set ``input_dims`` (``FEATURES`` or ``IMAGES``) and implement ``forward``.
    """

    input_dims: tuple[int, ...] = ()

    def __init__(self, num_features: int, eps: float, sync: bool = False) -> None:
        super().__init__()
        if num_features < 1:
            raise ValueError(f"num_features must be positive, got {num_features}")
        if eps < 0:
            raise ValueError(f"eps must be non-negative, got {eps}")
        self.num_features = num_features
        self.eps = eps
        self.sync = sync  # combine batch statistics over processes (norm.sync under DDP)
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
        var, mean = var_mean_per_channel(wide)
        if self.sync:
            var, mean = synced_var_mean(var, mean, x.numel() // self.num_features)
        return var.to(self.weight.dtype), mean.to(self.weight.dtype)
