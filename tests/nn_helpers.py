"""Helpers shared by the normalization tests."""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn


def assert_same_training_steps(ours: nn.Module, theirs: nn.Module, batch: Callable[[int], torch.Tensor],
                               seed: int, rtol: float, atol: float, steps: int = 3) -> None:
    """Train-mode forwards and backwards of two modules on the same batches agree: outputs,
    input gradients and gamma / beta gradients (accumulated over the steps)."""
    for step in range(steps):
        x1 = batch(step).requires_grad_()
        x2 = x1.detach().clone().requires_grad_()
        up = torch.randn(x1.shape, generator=torch.Generator().manual_seed(seed + step), dtype=x1.dtype)
        y1, y2 = ours(x1), theirs(x2)
        (y1 * up).sum().backward()
        (y2 * up).sum().backward()
        torch.testing.assert_close(y1, y2, rtol=rtol, atol=atol)
        torch.testing.assert_close(x1.grad, x2.grad, rtol=rtol, atol=atol)
        torch.testing.assert_close(ours.weight.grad, theirs.weight.grad, rtol=rtol, atol=atol)
        torch.testing.assert_close(ours.bias.grad, theirs.bias.grad, rtol=rtol, atol=atol)
