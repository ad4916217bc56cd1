"""Layers of packed runs: K models of one architecture side by side in one model.

A packed model (:mod:`bnexp.models.packing`) keeps run ``k``'s channels (or features) in
the ``k``-th of K equal blocks of every activation: convolutions are grouped by run, and
the per-channel normalizations need no change. A Linear has no groups in torch, so
:class:`PackedLinear` multiplies each run's block of features by that run's own weight.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn


class PackedLinear(nn.Module):
    """``runs`` Linear layers of ``in_features -> out_features`` each, side by side.

    The input is ``(N, runs * in_features)`` (run-major), the output ``(N, runs *
    out_features)``. ``weight`` is the runs' weights stacked along dim 0, ``(runs *
    out_features, in_features)``, and ``bias`` their biases: the same layout as a grouped
    convolution's, so that slicing dim 0 in ``runs`` equal chunks gives each run's Linear.
    ``in_features`` and ``groups`` describe the packed input, as for a grouped conv.
    """

    def __init__(self, runs: int, in_features: int, out_features: int, bias: bool = True) -> None:
        super().__init__()
        self.runs = runs
        self.groups = runs
        self.in_features = runs * in_features
        self.out_features = runs * out_features
        self.weight = nn.Parameter(torch.empty(runs * out_features, in_features))
        self.bias = nn.Parameter(torch.zeros(runs * out_features)) if bias else None

    def extra_repr(self) -> str:
        per_in, per_out = self.in_features // self.runs, self.out_features // self.runs
        return f"runs={self.runs}, in_features={per_in}, out_features={per_out}, bias={self.bias is not None}"

    def forward(self, x: Tensor) -> Tensor:
        n, runs = x.shape[0], self.runs
        blocks = x.reshape(n, runs, -1).transpose(0, 1)  # (runs, N, in)
        weight = self.weight.view(runs, -1, self.weight.shape[1]).transpose(1, 2)  # (runs, in, out)
        if self.bias is None:
            out = torch.bmm(blocks, weight)
        else:
            out = torch.baddbmm(self.bias.view(runs, 1, -1), blocks, weight)
        return out.transpose(0, 1).reshape(n, self.out_features)
