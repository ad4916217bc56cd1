"""Layers of packed runs: K models of one architecture side by side in one model.

A packed model (:mod:`bnexp.models.packing`) keeps run ``k``'s channels (or features) in
the ``k``-th of K equal blocks of every activation: convolutions are grouped by run
(:class:`PackedConv2d`: one grouped convolution, or K convolutions on CUDA streams), and
the per-channel normalizations need no change. A Linear has no groups in torch, so
:class:`PackedLinear` multiplies each run's block of features by that run's own weight.
"""

from __future__ import annotations

from typing import ClassVar, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

GROUPED = "grouped"  # one convolution with groups = runs * groups
STREAMS = "streams"  # one convolution per run, each on a CUDA stream of its own (in turn on a CPU)
PACK_CONVS = (GROUPED, STREAMS)
AUTO_CONV = "auto"  # trainer.pack_conv: the faster of PACK_CONVS, measured (bnexp.engine.pack_size.conv_form)
MAX_STREAMS = 16  # side streams per device, taken in turn by the runs of a convolution


class PackedConv2d(nn.Conv2d):
    """``runs`` convolutions side by side: an ``nn.Conv2d`` whose groups are the runs' groups
    times ``runs`` (its weight and state_dict are a grouped convolution's).

    ``conv="grouped"`` computes it as that grouped convolution; ``"streams"`` as ``runs``
    separate convolutions on the runs' blocks of channels, on CUDA each on a side stream
    (at most :data:`MAX_STREAMS`, taken in turn) that the current stream waits for, so a
    captured CUDA graph holds them as parallel branches. cuDNN's grouped kernels are slow
    for some layouts and precisions; which form is faster is measured on the GPU
    (``bnexp.bench.table_cost``). Both compute the same numbers up to the order of sums.
    """

    _streams: ClassVar[dict[torch.device, list[torch.cuda.Stream]]] = {}

    def __init__(self, runs: int, conv: str, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        if conv not in PACK_CONVS:
            raise ValueError(f"conv must be one of {', '.join(PACK_CONVS)}, got {conv!r}")
        self.runs = runs  # read by BNP (per-run regularizer)
        self.conv = conv

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, runs={self.runs}, conv={self.conv}"

    def forward(self, x: Tensor) -> Tensor:
        if self.conv == GROUPED or self.runs == 1:
            return super().forward(x)
        weights = self.weight.chunk(self.runs)
        biases: list[Optional[Tensor]] = [None] * self.runs if self.bias is None else list(self.bias.chunk(self.runs))
        inputs = x.chunk(self.runs, dim=1)
        if not x.is_cuda:
            return torch.cat([self._one_run(*run) for run in zip(inputs, weights, biases)], 1)
        main, side = torch.cuda.current_stream(x.device), self._side_streams(x.device)
        outs = []
        for k, run in enumerate(zip(inputs, weights, biases)):
            stream = side[k % len(side)]
            stream.wait_stream(main)
            with torch.cuda.stream(stream):
                outs.append(self._one_run(*run))
            run[0].record_stream(stream)  # the input, made on the current stream, is read on this one
        for stream in side[: self.runs]:
            main.wait_stream(stream)
        for out in outs:
            out.record_stream(main)  # made on a side stream, read on the current one
        return torch.cat(outs, 1)

    def _one_run(self, x: Tensor, weight: Tensor, bias: Optional[Tensor]) -> Tensor:
        """One run's convolution on its block of channels (its own groups)."""
        groups = self.groups // self.runs
        if self.padding_mode != "zeros":
            x = F.pad(x, self._reversed_padding_repeated_twice, mode=self.padding_mode)
            return F.conv2d(x, weight, bias, self.stride, 0, self.dilation, groups)
        return F.conv2d(x, weight, bias, self.stride, self.padding, self.dilation, groups)

    @classmethod
    def _side_streams(cls, device: torch.device) -> list[torch.cuda.Stream]:
        if device not in cls._streams:
            cls._streams[device] = [torch.cuda.Stream(device) for _ in range(MAX_STREAMS)]
        return cls._streams[device]


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
