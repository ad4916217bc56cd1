"""One autograd function for the scaled members of the family: a closed-form backward.

Every training forward that divides (BN, POP-Norm, CBN, the ablation rows, AMAT) has the
form ``y = g * z / (q * s) (+ beta when coupled)`` per channel, with

    z = x - k * mu_B + (beta when decoupled),   s = sqrt(mean(z^2) + eps),   g = gamma / rho,

where ``k`` is 1 (centered), 0 (not centered) or AMAT's ratio ``mu_A / mu_B``, and ``q`` is
1 or AMAT's ratio ``sigma_A / sigma_B``; both ratios are constants for autograd. Autograd
through the dozen small ops of that formula costs several passes over the activations in
the backward; the closed form below needs one pass for two per-channel sums and one
per-channel combination of ``G`` and ``x``:

    dL/dz = a * G - (a * sum(G z) / (n s^2)) * z,     a = g / (q s)
    dL/dx = dL/dz - (k / n) * sum(dL/dz)
    dL/dbeta = sum(dL/dz) (decoupled) or sum(G) (coupled),   dL/dgamma = sum(G z) / (rho q s)
"""

from __future__ import annotations

from typing import Any, Optional, Union

import torch
from torch import Tensor

from bnexp.nn._base import affine, channel_sums, per_channel

Coefficient = Union[float, Tensor]


class _ScaledNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, weight: Tensor, bias: Tensor, mean: Tensor, var: Tensor, k: Coefficient,
                q: Coefficient, rho: Coefficient, eps: float, decouple: bool) -> Tensor:
        shift = -k * mean + (bias if decouple else 0.0)  # z = x + shift
        z_mean = mean + shift
        s = (var + z_mean.square() + eps).sqrt()
        divisor = (rho if isinstance(q, float) and q == 1.0 else rho * q) * s  # rho * q exactly rho when q is 1
        a = weight / divisor
        b = a * shift + (0.0 if decouple else bias)
        # A constant k (1 or 0) stays a Python number: no tensor made per layer and step.
        ctx.k = None if isinstance(k, Tensor) else k
        ctx.save_for_backward(x, shift, z_mean, s, a, divisor, *([k] if ctx.k is None else []))
        ctx.decouple = decouple
        return affine(x, a, b)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Optional[Tensor], ...]:
        x, shift, z_mean, s, a, divisor, *saved_k = ctx.saved_tensors
        k = saved_k[0] if saved_k else ctx.k
        n = x.numel() // x.shape[1]
        sum_g, sum_gx = channel_sums(grad, x, a.dtype)
        sum_gz = sum_gx + shift * sum_g  # sum(G z) with z = x + shift
        c = a * sum_gz / (n * s.square())  # dL/dz = a G - c z
        sum_dz = a * sum_g - c * n * z_mean  # sum over the channel of dL/dz
        # dL/dx = a G - c x + (-c * shift - k * sum_dz / n), written into one new tensor.
        const = -c * shift - k * sum_dz / n
        grad_x = affine(grad, a, const, keep_wide=True).addcmul_(x, per_channel(-c, x)).to(grad.dtype)
        grad_weight = sum_gz / divisor
        grad_bias = sum_dz if ctx.decouple else sum_g
        return grad_x, grad_weight.to(a.dtype), grad_bias.to(a.dtype), None, None, None, None, None, None, None


def scaled_norm(x: Tensor, weight: Tensor, bias: Tensor, mean: Tensor, var: Tensor, k: Coefficient,
                q: Coefficient, rho: Coefficient, eps: float, decouple: bool) -> Tensor:
    """``gamma / rho * z / (q * s)`` (``+ beta`` when coupled) with the closed-form backward.

    ``mean`` and ``var`` are the batch statistics of ``x`` (biased variance), passed in
    detached: the backward accounts for their dependence on ``x`` itself. ``k`` and ``q``
    are numbers, or per-channel tensors (AMAT's ratios); neither receives a gradient, nor does
    ``rho`` (a number, or one per channel: a pack's runs may each have their own).
    """
    return _ScaledNorm.apply(x, weight, bias, mean.detach(), var.detach(), k, q, rho, eps, decouple)
