"""Batch renormalization (Ioffe 2017), the BNP paper's baseline (METHODS.md section 3)."""

from __future__ import annotations

from typing import Optional, Union

import torch
from torch import Tensor

from bnexp.nn._base import FEATURES, IMAGES, ChannelNorm, affine, check_fraction, widen


class BatchRenorm(ChannelNorm):
    """``y = gamma * ((x - mu_B) / sigma_B * r + d) + beta``; use the 1d/2d subclasses.

    ``sigma_B = sqrt(var_B + eps)`` (biased variance). ``r = clip(sigma_B / sigma, 1/r_max,
    r_max)`` and ``d = clip((mu_B - mu) / sigma, -d_max, d_max)`` are constants for autograd;
    ``mu`` (``running_mean``) and ``sigma`` (``running_std``) are moving averages of
    ``mu_B`` and ``sigma_B`` with ``momentum``, and eval computes ``gamma * (x - mu) / sigma +
    beta``. With ``ramp_steps`` the clipping limits grow linearly from ``r_max = 1, d_max = 0``
    at step 0 to the given values at step ``ramp_steps`` (the trainer passes the run's
    length); ``ramp_steps=None`` uses the given limits from the start.
    """

    def __init__(
        self,
        num_features: int,
        r_max: float = 3.0,
        d_max: float = 5.0,
        momentum: float = 0.01,
        eps: float = 1e-5,
        ramp_steps: Optional[int] = None,
        sync: bool = False,
    ) -> None:
        super().__init__(num_features, eps, sync)
        if r_max < 1 or d_max < 0:
            raise ValueError(f"need r_max >= 1 and d_max >= 0, got r_max={r_max}, d_max={d_max}")
        if ramp_steps is not None and ramp_steps < 1:
            raise ValueError(f"ramp_steps must be a positive step count or None, got {ramp_steps}")
        check_fraction("momentum", momentum)
        self.r_max = float(r_max)
        self.d_max = float(d_max)
        self.momentum = momentum
        self.ramp_steps = ramp_steps
        self.register_buffer("running_mean", torch.zeros(num_features))
        self.register_buffer("running_std", torch.ones(num_features))
        self.register_buffer("num_batches_tracked", torch.tensor(0, dtype=torch.long))

    def extra_repr(self) -> str:
        return (
            f"{self.num_features}, r_max={self.r_max}, d_max={self.d_max}, momentum={self.momentum}, "
            f"eps={self.eps}, ramp_steps={self.ramp_steps}"
        )

    def limits(self) -> tuple[Union[float, Tensor], Union[float, Tensor]]:
        """The clipping limits ``(r_max, d_max)`` of the coming training step."""
        if self.ramp_steps is None:
            return self.r_max, self.d_max
        done = (self.num_batches_tracked / self.ramp_steps).clamp(max=1.0).to(self.running_std.dtype)
        return 1.0 + (self.r_max - 1.0) * done, self.d_max * done

    def forward(self, x: Tensor) -> Tensor:
        self.check_input(x)
        if not self.training:
            # Built from fresh tensors, so autograd holds no reference to the buffers themselves.
            a = self.weight * self.running_std.reciprocal()
            return affine(x, a, self.bias + (-self.running_mean) * a)
        dtype, x = x.dtype, widen(x)
        var, mean = self.batch_var_mean(x)
        sigma = (var + self.eps).sqrt()
        with torch.no_grad():
            r_max, d_max = self.limits()
            r = torch.clamp(sigma / self.running_std, 1.0 / r_max, r_max)
            d = torch.clamp((mean - self.running_mean) / self.running_std, -d_max, d_max)
            # Replaced, not updated in place: r and d come from the old values, and under
            # torch.compile an in-place write lets the backward recompute them from the new ones.
            self.running_mean = torch.lerp(self.running_mean, mean, self.momentum)
            self.running_std = torch.lerp(self.running_std, sigma, self.momentum)
            self.num_batches_tracked = self.num_batches_tracked + 1
        a = self.weight * r / sigma
        return affine(x, a, self.bias + self.weight * d - mean * a).to(dtype)


class BatchRenorm1d(BatchRenorm):
    """Batch renormalization over features: (N, C) or (N, C, L) inputs."""

    input_dims = FEATURES


class BatchRenorm2d(BatchRenorm):
    """Batch renormalization over images: (N, C, H, W), statistics over N*H*W per channel."""

    input_dims = IMAGES
