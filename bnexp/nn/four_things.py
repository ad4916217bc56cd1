"""BN with the four improvements of Summers and Dinneen (ICLR 2020), a baseline of BNP Figs. 4-5.

One layer holds the four parts, each switched off by its own argument so they ablate one
by one (``docs/methods/bn_4things.md`` states the definitions and the defaults):

1. ghost batches (``ghost_batch``): the training statistics of each example come from its
   ghost batch, the consecutive ``ghost_batch`` examples it belongs to;
2. batch-group normalization (``groups``): the statistics pool ``num_features / groups``
   neighbouring channels as well, so a batch of one still has several values per statistic;
3. weight decay on gamma and beta (``affine_decay``): read by the optimizer factory
   (:func:`bnexp.engine.optim.build_optimizer`), which pulls gamma toward 1 and beta toward 0;
4. inference example weighing (``alpha``): at eval, the mean and second moment are
   ``alpha`` times the example's own (over its group of channels) plus ``1 - alpha`` times
   the population's.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import Tensor, nn

from bnexp.nn._base import FEATURES, IMAGES, ChannelNorm, check_fraction, widen
from bnexp.nn.create_norm import Builder, ChannelsError, register_norm


class FourThingsBN(ChannelNorm):
    """``y = gamma * (x - mu) / sqrt(var + eps) + beta`` with grouped statistics; use the 1d/2d subclasses.

    Training: ``mu`` and ``var`` (biased) are taken over the values of a statistics group:
    the examples of one ghost batch (``ghost_batch`` consecutive examples, the last one
    shorter when it does not divide the batch; ``None``: the whole batch) times the
    ``num_features // groups`` channels of one channel group (``None``: one channel), times
    every position. ``running_mean`` and ``running_sq`` are moving averages (``momentum``)
    of the whole batch's per-channel mean and mean square. Eval: per example and channel
    group, ``m = alpha * E_ex[x] + (1 - alpha) * E_pop[x]`` and ``s = alpha * E_ex[x^2] +
    (1 - alpha) * E_pop[x^2]`` (both averaged over the group's channels), ``var = s - m^2``.
    ``affine_decay`` changes nothing here: the optimizer reads it.
    """

    def __init__(
        self,
        num_features: int,
        ghost_batch: Optional[int] = 16,
        groups: Optional[int] = None,
        alpha: float = 0.1,
        affine_decay: float = 5e-4,
        momentum: float = 0.01,
        eps: float = 1e-5,
    ) -> None:
        super().__init__(num_features, eps)
        if ghost_batch is not None and (isinstance(ghost_batch, bool) or not isinstance(ghost_batch, int)
                                        or ghost_batch < 1):
            raise ValueError(f"ghost_batch={ghost_batch!r} is not valid: an integer >= 1, or null for the whole batch")
        if groups is not None and (isinstance(groups, bool) or not isinstance(groups, int) or groups < 1):
            raise ValueError(f"groups={groups!r} is not valid: an integer >= 1, or null for one channel per group")
        if groups is not None and num_features % groups:
            raise ValueError(f"groups={groups} does not divide the {num_features} channels of a normalized layer")
        if affine_decay < 0:
            raise ValueError(f"affine_decay must be >= 0, got {affine_decay!r}")
        check_fraction("alpha", alpha)
        check_fraction("momentum", momentum)
        self.ghost_batch = ghost_batch
        # Kept per group, not as a count: a packed model widens the channels and keeps groups within a run.
        self.channels_per_group = 1 if groups is None else num_features // groups
        self.alpha = float(alpha)
        self.affine_decay = float(affine_decay)
        self.momentum = momentum
        self.register_buffer("running_mean", torch.zeros(num_features))
        self.register_buffer("running_sq", torch.ones(num_features))
        self.register_buffer("num_batches_tracked", torch.tensor(0, dtype=torch.long))

    def extra_repr(self) -> str:
        return (f"{self.num_features}, ghost_batch={self.ghost_batch}, channels_per_group={self.channels_per_group}, "
                f"alpha={self.alpha}, affine_decay={self.affine_decay}, momentum={self.momentum}, eps={self.eps}")

    def group_channels(self, v: Tensor) -> Tensor:
        """``v`` (``(..., C)``) averaged over each channel group and repeated back to ``C``."""
        cpg = self.channels_per_group
        if cpg == 1:
            return v
        grouped = v.unflatten(-1, (-1, cpg)).mean(-1, keepdim=True)
        return grouped.expand(*grouped.shape[:-1], cpg).flatten(-2)

    def ghost_mean(self, v: Tensor) -> Tensor:
        """``v`` (``(N, C)``, one value per example) averaged over each ghost batch, per example."""
        n = v.shape[0]
        size = n if self.ghost_batch is None else min(self.ghost_batch, n)
        parts = [p.mean(0, keepdim=True).expand_as(p) for p in v.split(size)]
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def forward(self, x: Tensor) -> Tensor:
        self.check_input(x)
        dtype, x = x.dtype, widen(x).to(self.weight.dtype)
        positions = list(range(2, x.dim()))
        mean_ex = x.mean(positions) if positions else x  # (N, C): each example's per-channel mean
        sq_ex = x.square().mean(positions) if positions else x.square()
        if self.training:
            with torch.no_grad():
                self.running_mean = torch.lerp(self.running_mean, mean_ex.mean(0), self.momentum)
                self.running_sq = torch.lerp(self.running_sq, sq_ex.mean(0), self.momentum)
                self.num_batches_tracked = self.num_batches_tracked + 1
            mean = self.ghost_mean(self.group_channels(mean_ex))
            centred = x - mean.view(*mean.shape, *[1] * len(positions))
            dev = centred.square().mean(positions) if positions else centred.square()
            var = self.ghost_mean(self.group_channels(dev))
        else:
            a = self.alpha
            mean = self.group_channels(a * mean_ex + (1 - a) * self.running_mean)
            var = self.group_channels(a * sq_ex + (1 - a) * self.running_sq) - mean.square()
            centred = x - mean.view(*mean.shape, *[1] * len(positions))
        scale = self.weight * (var + self.eps).rsqrt()  # (N, C)
        shape = (*scale.shape, *[1] * len(positions))
        return (centred * scale.view(shape) + self.bias.view(1, -1, *[1] * len(positions))).to(dtype)


class FourThingsBN1d(FourThingsBN):
    """BN with 4 things over features: (N, C) or (N, C, L) inputs."""

    input_dims = FEATURES


class FourThingsBN2d(FourThingsBN):
    """BN with 4 things over images: (N, C, H, W)."""

    input_dims = IMAGES


def four_things(family: type[nn.Module]) -> Builder:
    """BN with 4 things whose ``groups`` (when set) must divide the channels, as for :func:`group_norm`."""

    def make(num_features: int, **options: Any) -> nn.Module:
        groups = options.get("groups")
        if isinstance(groups, int) and not isinstance(groups, bool) and groups >= 1 and num_features % groups:
            raise ChannelsError(f"groups={groups} does not divide the {num_features} channels of a normalized layer")
        return family(num_features, **options)

    return make


register_norm("four_things", four_things(FourThingsBN1d), four_things(FourThingsBN2d),
              ("ghost_batch", "groups", "alpha", "affine_decay", "momentum", "eps"), short="bn_4things")
