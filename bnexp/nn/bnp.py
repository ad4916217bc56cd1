"""Batch Normalization Preconditioning (BNP Algorithms 2 and 3, METHODS.md section 4).

BNP leaves the forward alone. A forward pre-hook on every Linear and Conv2d keeps running
statistics of the layer's input; :meth:`BNP.step`, called between ``backward()`` and the
optimizer step, replaces the layer's gradients ``[G_b; G_w]`` by ``(1/q2) P P^T [G_b; G_w]``.
"""

from __future__ import annotations

import math
from functools import partial
from typing import Callable, Iterator, Mapping, Optional, Sequence

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from bnexp.nn._base import check_fraction, var_mean_per_channel
from bnexp.nn.packed import PackedLinear

# (batch means, batch variances) of every layer that saw a training input -> the same, e.g.
# averaged over DDP ranks in one all-reduce (bnexp.support.distributed.bnp_reducer).
StatsReducer = Callable[[Sequence[Tensor], Sequence[Tensor]], tuple[Sequence[Tensor], Sequence[Tensor]]]


def preconditioner_matrix(mu: Tensor, s2: Tensor) -> Tensor:
    """``P = [[1, -mu^T], [0, I]] @ diag(1, 1/sqrt(s2))`` over the vector ``[b, w]``."""
    n = mu.numel()
    shift = torch.eye(n + 1, dtype=mu.dtype, device=mu.device)
    shift[0, 1:] = -mu
    return shift @ torch.diag(torch.cat([mu.new_ones(1), s2.rsqrt()]))


class BNPLayer(nn.Module):
    """Running input statistics of one Linear or Conv2d layer, and its gradient rewrite.

    Buffers ``mu`` (init 0) and ``sigma2`` (init 1) hold one entry per input feature or
    input channel. ``batch_stats`` and ``update`` are separate so that batch statistics can
    be reduced across processes in between. In a packed model (a layer with ``runs``, see
    :mod:`bnexp.nn.packed`) the inputs are ``runs`` equal blocks, one per run, and the
    regularizer's ``max(sigma2)`` is taken per run.
    """

    def __init__(self, name: str, layer: nn.Module, rho: float, eps1: float, eps2: float) -> None:
        super().__init__()
        self.name = name
        self.conv = isinstance(layer, nn.Conv2d)
        self.in_features = layer.in_channels if self.conv else layer.in_features
        self.groups = getattr(layer, "groups", 1)
        self.runs = getattr(layer, "runs", 1)
        self.fan_in = layer.weight[0].numel()  # (c_in / groups) * kh * kw for a conv
        self.rho = rho
        self.eps1 = eps1
        self.eps2 = eps2
        self.batch_size: Optional[int] = None  # rows of the last training input (N)
        self.map_size = 1  # H * W of the last training input (convs)
        like = {"dtype": layer.weight.dtype, "device": layer.weight.device}
        self.register_buffer("mu", torch.zeros(self.in_features, **like))
        self.register_buffer("sigma2", torch.ones(self.in_features, **like))

    def extra_repr(self) -> str:
        return f"{self.name or '<model>'}: {self.in_features} inputs, groups={self.groups}, fan_in={self.fan_in}"

    def batch_stats(self, x: Tensor) -> tuple[Tensor, Tensor, int]:
        """Mean and biased variance of the input per feature/channel, and how many values each
        covers (N, or N*H*W for a conv); records N and H*W. One value has variance 0."""
        x = x.detach()
        if self.conv:
            if x.dim() == 3:
                x = x.unsqueeze(0)
            self.batch_size, self.map_size = x.shape[0], x.shape[2] * x.shape[3]
        else:
            x = x.reshape(-1, self.in_features)
            self.batch_size = x.shape[0]
        count = x.numel() // self.in_features
        # a half-precision input (autocast) is reduced in the statistics' precision
        var, mean = var_mean_per_channel(x.to(torch.promote_types(x.dtype, self.mu.dtype)))
        return mean.to(self.mu.dtype), var.to(self.mu.dtype), count

    @torch.no_grad()
    def observe(self, x: Tensor) -> None:
        """Steps 1-2 of METHODS.md section 4 for a training input ``x`` of this process alone."""
        self.absorb(*self.batch_stats(x))

    @torch.no_grad()
    def absorb(self, mean: Tensor, var: Tensor, count: int) -> None:
        """The running update from a batch's statistics over ``count`` values per feature.

        Where the whole batch holds a single value per feature (batch size 1, a Linear or a
        1x1 map), its variance is ``(h - mu)^2`` around the running mean; a one-value share
        of a larger batch enters the pooling over processes with variance 0 (it has no
        spread of its own).
        """
        if count == 1:
            var = (mean - self.mu).square()
        self.update(mean, var)

    @torch.no_grad()
    def update(self, mean: Tensor, var: Tensor) -> None:
        """``mu <- rho mu + (1 - rho) mean``, the same for ``sigma2``."""
        self.mu.lerp_(mean, 1.0 - self.rho)
        self.sigma2.lerp_(var, 1.0 - self.rho)

    def s2(self) -> Tensor:
        """The regularized variance ``sigma2 + eps1 * max(sigma2) + eps2`` (the max per run)."""
        largest = self.sigma2.view(self.runs, -1).amax(1).repeat_interleave(self.in_features // self.runs)
        return self.sigma2 + self.eps1 * largest + self.eps2

    def q2(self) -> float:
        """The block scaling ``max(n_in / N, 1)`` (Linear) or ``max(fan_in / N, sqrt(H W))`` (Conv2d)."""
        if self.batch_size is None:
            raise RuntimeError(f"BNP layer {self.name!r} has seen no training forward yet")
        floor = math.sqrt(self.map_size) if self.conv else 1.0
        return max(self.fan_in / self.batch_size, floor)

    def _per_weight(self, v: Tensor, weight: Tensor) -> Tensor:
        """``v`` (one entry per input channel) laid out to broadcast against ``weight``.

        In a grouped conv (or a :class:`PackedLinear`), ``weight[i, j]`` reads input channel
        ``g * (c_in / groups) + j`` where ``g`` is output channel ``i``'s group.
        """
        kernel = [1] * (weight.dim() - 2)
        if self.groups == 1:
            return v.view(1, -1, *kernel)
        per_group = self.in_features // self.groups
        rows = weight.shape[0] // self.groups
        v = v.view(self.groups, 1, per_group).expand(self.groups, rows, per_group)
        return v.reshape(weight.shape[0], per_group, *kernel)

    @torch.no_grad()
    def precondition(self, weight: Tensor, bias: Optional[Tensor]) -> None:
        """Rewrite ``weight.grad`` and ``bias.grad`` in place (Algorithm 2/3, steps 3-5)."""
        g_w = weight.grad
        if g_w is None:
            return
        q2 = self.q2()
        denom = self._per_weight(self.s2(), weight) * q2
        g_b = None if bias is None else bias.grad
        if g_b is None:
            g_w.div_(denom)
            return
        mu = self._per_weight(self.mu, weight)
        # In place, without weight-sized temporaries: g_w <- (g_w - mu g_b) / denom, then
        # g_b <- g_b / q2 - (each row of the new g_w) . mu.
        g_w.addcmul_(mu, g_b.view(-1, *([1] * (g_w.dim() - 1))), value=-1.0).div_(denom)
        if mu.shape[0] == 1:  # the same mu for every row: one matrix-vector product
            row_dot = g_w.flatten(1).mv(mu.expand(1, *g_w.shape[1:]).reshape(-1))
        else:  # grouped conv: each group of rows reads its own input channels
            row_dot = (g_w * mu).flatten(1).sum(1)
        g_b.div_(q2).sub_(row_dot)

    def matrix(self, group: int = 0) -> Tensor:
        """The explicit ``P`` for the output channels of ``group``, over ``[b_i, w_i.flatten()]``."""
        per_group = self.in_features // self.groups
        part = slice(group * per_group, (group + 1) * per_group)
        repeat = self.fan_in // per_group  # kernel positions per input channel
        return preconditioner_matrix(self.mu[part].repeat_interleave(repeat), self.s2()[part].repeat_interleave(repeat))


class BNP:
    """BNP on every Linear and Conv2d of ``model``.

    Statistics update on training-mode forwards only. With ``reduce_fn`` (DDP), each
    layer's batch ``(mean, var)`` is kept until :meth:`step` (or the layer's next forward),
    which hands those of every layer to ``reduce_fn`` at once (one all-reduce per step, and
    no collective inside the forward) and updates the running values with what it returns;
    ``processes`` is then the number of processes whose equal shares form the global batch,
    so that ``q2`` uses the global batch size. Create BNP after moving the model to its device.
    """

    def __init__(
        self,
        model: nn.Module,
        rho: float = 0.99,
        eps1: float = 1e-2,
        eps2: float = 1e-4,
        reduce_fn: Optional[StatsReducer] = None,
        processes: int = 1,
    ) -> None:
        check_fraction("rho", rho)
        if eps1 < 0 or eps2 < 0:
            raise ValueError(f"eps1 and eps2 must be non-negative, got {eps1}, {eps2}")
        self.reduce_fn = reduce_fn
        self.processes = processes
        self._pending: dict[BNPLayer, tuple[Tensor, Tensor, int]] = {}  # statistics awaiting reduce_fn
        self._pairs: list[tuple[nn.Module, BNPLayer]] = []
        self._handles: list[RemovableHandle] = []
        for name, module in model.named_modules():
            if isinstance(module, (nn.Linear, nn.Conv2d, PackedLinear)):
                state = BNPLayer(name, module, rho, eps1, eps2)
                self._pairs.append((module, state))
                self._handles.append(module.register_forward_pre_hook(partial(self._observe, state)))
        if not self._pairs:
            raise ValueError("BNP found no Linear or Conv2d layer in the model")

    def _observe(self, state: BNPLayer, module: nn.Module, args: tuple) -> None:
        if not module.training:
            return
        if self.reduce_fn is None:
            state.observe(args[0])
            return
        if state in self._pending:  # a second forward before the step: the first counts first
            self._reduce_pending()
        self._pending[state] = state.batch_stats(args[0])

    @torch.no_grad()
    def _reduce_pending(self) -> None:
        """Combine the kept statistics of every layer over processes, then update each layer."""
        if not self._pending:
            return
        states = list(self._pending)
        means, variances = self.reduce_fn([self._pending[s][0] for s in states], [self._pending[s][1] for s in states])
        for state, mean, var in zip(states, means, variances):
            state.batch_size *= self.processes
            state.absorb(mean, var, self._pending[state][2] * self.processes)
        self._pending.clear()

    def layers(self) -> Iterator[BNPLayer]:
        """The per-layer states, in module order."""
        return (state for _, state in self._pairs)

    def step(self) -> None:
        """Precondition the gradients of every layer; call after backward (and any all-reduce)."""
        self._reduce_pending()
        for module, state in self._pairs:
            state.precondition(module.weight, module.bias)

    def state_dict(self) -> dict[str, Tensor]:
        """``{"<layer name>.mu": ..., "<layer name>.sigma2": ...}`` for every layer."""
        return {_key(state.name, k): v for state in self.layers() for k, v in state.state_dict().items()}

    def load_state_dict(self, state_dict: Mapping[str, Tensor]) -> None:
        """Restore the running statistics; the keys must match this model's layers exactly."""
        expected = set(self.state_dict())
        if set(state_dict) != expected:
            missing, unexpected = sorted(expected - set(state_dict)), sorted(set(state_dict) - expected)
            raise KeyError(f"BNP state mismatch: missing {missing}, unexpected {unexpected}")
        for state in self.layers():
            state.load_state_dict({k: state_dict[_key(state.name, k)] for k in ("mu", "sigma2")})

    def remove(self) -> None:
        """Detach the forward hooks: the statistics stop updating."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()


def _key(layer: str, buffer: str) -> str:
    return f"{layer}.{buffer}" if layer else buffer
