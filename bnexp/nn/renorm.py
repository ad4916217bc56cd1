"""Batch renormalization (Ioffe 2017), the BNP paper's baseline (METHODS.md section 3)."""

from __future__ import annotations

import math
from typing import Optional, Union

import torch
from torch import Tensor

from bnexp.nn._base import FEATURES, IMAGES, ChannelNorm, affine, check_fraction, widen
from bnexp.nn.create_norm import register_norm


def _check_schedule(r_max: Optional[float], d_max: Optional[float], relax_start: Optional[int],
                    r_max_step: Optional[int], d_max_step: Optional[int]) -> None:
    """Each step of the schedule a clipping limit uses is a step count >= 0, the ends not
    before ``relax_start``; a step no limit uses (its limit None) must be None."""
    steps = {"relax_start": (relax_start, r_max is not None or d_max is not None),
             "r_max_step": (r_max_step, r_max is not None), "d_max_step": (d_max_step, d_max is not None)}
    for name, (step, used) in steps.items():
        if not used and step is not None:
            raise ValueError(f"{name}={step!r} does nothing when r_max={r_max} and d_max={d_max} "
                             f"(null: never clipped): set it to null")
        if used and (isinstance(step, bool) or not isinstance(step, int) or step < 0):
            raise ValueError(f"{name} must be a step count >= 0, got {step!r}")
    ends = {name: step for name, (step, used) in steps.items() if used and name != "relax_start"}
    if relax_start is not None and any(step < relax_start for step in ends.values()):
        raise ValueError(f"{' and '.join(f'{k}={v}' for k, v in ends.items())} must not come before "
                         f"relax_start={relax_start}")


class BatchRenorm(ChannelNorm):
    """``y = gamma * ((x - mu_B) / sigma_B * r + d) + beta``; use the 1d/2d subclasses.

    ``sigma_B = sqrt(var_B + eps)`` (biased variance). ``r = clip(sigma_B / sigma, 1/r_max,
    r_max)`` and ``d = clip((mu_B - mu) / sigma, -d_max, d_max)`` are constants for autograd;
    ``mu`` (``running_mean``) and ``sigma`` (``running_std``) are moving averages of
    ``mu_B`` and ``sigma_B`` with ``momentum``, and eval computes ``gamma * (x - mu) / sigma +
    beta``.

    The limits follow Ioffe (2017)'s schedule, in training steps: ``r_max = 1, d_max = 0``
    (plain BN) up to step ``relax_start``, then linearly to the given ``r_max`` at step
    ``r_max_step`` and the given ``d_max`` at step ``d_max_step``, constant after (the
    paper's 5,000, 40,000 and 25,000 steps for 3 and 5). ``r_max=None`` / ``d_max=None``:
    that ratio is never clipped (TensorFlow's default ``renorm_clipping=None``); the steps of
    a limit that is never applied must be None too (``relax_start`` when neither is), so a
    schedule that would do nothing is refused rather than ignored.
    """

    def __init__(
        self,
        num_features: int,
        r_max: Optional[float] = 3.0,
        d_max: Optional[float] = 5.0,
        momentum: float = 0.01,
        eps: float = 1e-5,
        relax_start: Optional[int] = 5000,
        r_max_step: Optional[int] = 40000,
        d_max_step: Optional[int] = 25000,
        sync: bool = False,
    ) -> None:
        super().__init__(num_features, eps, sync)
        if (r_max is not None and r_max < 1) or (d_max is not None and d_max < 0):
            raise ValueError(f"need r_max >= 1 and d_max >= 0 (or null: no clipping), got r_max={r_max}, "
                             f"d_max={d_max}")
        _check_schedule(r_max, d_max, relax_start, r_max_step, d_max_step)
        check_fraction("momentum", momentum)
        self.r_max = None if r_max is None else float(r_max)
        self.d_max = None if d_max is None else float(d_max)
        self.momentum = momentum
        self.relax_start, self.r_max_step, self.d_max_step = relax_start, r_max_step, d_max_step
        self.register_buffer("running_mean", torch.zeros(num_features))
        self.register_buffer("running_std", torch.ones(num_features))
        self.register_buffer("num_batches_tracked", torch.tensor(0, dtype=torch.long))

    def extra_repr(self) -> str:
        return (
            f"{self.num_features}, r_max={self.r_max}, d_max={self.d_max}, momentum={self.momentum}, "
            f"eps={self.eps}, relax_start={self.relax_start}, r_max_step={self.r_max_step}, "
            f"d_max_step={self.d_max_step}"
        )

    def _relaxed(self, end: Optional[int]) -> Tensor:
        """How far the coming step is from ``relax_start`` (0) to ``end`` (1), clamped."""
        step = self.num_batches_tracked.to(self.running_std.dtype)
        if end == self.relax_start:
            return (step >= end).to(step.dtype)
        return ((step - self.relax_start) / (end - self.relax_start)).clamp(0.0, 1.0)

    def limits(self) -> tuple[Union[float, Tensor], Union[float, Tensor]]:
        """The clipping limits ``(r_max, d_max)`` of the coming training step (inf: unclipped)."""
        r_max = math.inf if self.r_max is None else 1.0 + (self.r_max - 1.0) * self._relaxed(self.r_max_step)
        d_max = math.inf if self.d_max is None else self.d_max * self._relaxed(self.d_max_step)
        return r_max, d_max

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
            r = torch.clamp(sigma / self.running_std, 1.0 / r_max, r_max)  # 1 / inf = 0
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


register_norm("batch_renorm", BatchRenorm1d, BatchRenorm2d, ("r_max", "d_max", "momentum", "eps", "relax_start",
              "r_max_step", "d_max_step", "sync"), short="brn")
