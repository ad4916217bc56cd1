"""``bnexp bench norms``: forward + backward of each normalization module against BatchNorm2d.

Each module runs in training mode over the activation shapes of a network (every shape as
many times as the network has normalizations of it), eager and compiled. The baseline is
torch.nn.BatchNorm2d, eager, on the same shapes; the inputs and output gradients are shared
by all cases, so only the modules differ.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

import torch
from torch import Tensor, nn

from bnexp.bench.common import COMMON, MODES, Record, device_of, measure, record
from bnexp.nn import set_learning_rate
from bnexp.nn.create_norm import NORM_LAYERS, create_norm
from bnexp.support.errors import unknown_choice

# (channels, height = width, normalizations of that shape) of each network's norms
NETS: dict[str, tuple[tuple[int, int, int], ...]] = {
    "resnet20": ((16, 32, 7), (32, 16, 6), (64, 8, 6)),
    "resnet50": ((64, 112, 1), (64, 56, 6), (256, 56, 4), (128, 28, 8), (512, 28, 5), (256, 14, 12),
                 (1024, 14, 7), (512, 7, 6), (2048, 7, 4)),
}
BATCH = {"resnet20": 128, "resnet50": 32}  # a CIFAR batch; an ImageNet per-GPU batch
BASELINE = "bn/eager"


def bench_norms() -> dict[str, str]:
    """Bench name -> layer, for every layer of :data:`~bnexp.nn.create_norm.NORM_LAYERS` (the
    methods of bnexp/nn/ and of ``BNEXP_PLUGINS``), built by create_norm as models build it;
    "bn" is torch's own BatchNorm2d, "family" bnexp's NormFamily2d at BN's flags."""
    names = {NORM_LAYERS.get(layer).short or layer: layer for layer in NORM_LAYERS}
    return {name: names[name] for name in sorted(names, key=lambda n: (n != "bn", n))}  # the baseline first


def make_norm(name: str, channels: int, device: torch.device) -> nn.Module:
    """The ``name`` module over ``channels``; ``bn_si`` bound to a 1x1 conv of that width
    (only its weight is read)."""
    module = create_norm(bench_norms()[name], channels, 2).to(device)
    if hasattr(module, "bind"):
        module.bind(nn.Conv2d(channels, channels, 1, bias=False, device=device))
    return module
DEFAULTS: dict[str, Any] = {**COMMON, "modes": MODES, "number": 10, "nets": tuple(NETS), "norms": tuple(bench_norms()),
                            "batch": 0, "out": "results/bench/norms.json"}
COLUMNS = ("net", "name", "mode", "seconds_median", "seconds_iqr", "ratio", "ratio_iqr")

Layer = tuple[Tensor, Tensor, int]  # input, output gradient, repeats


def layer_inputs(net: str, batch: int, device: torch.device) -> list[Layer]:
    """One random input (requiring grad) and output gradient per shape of ``net``."""
    g = torch.Generator(device).manual_seed(0)
    return [(torch.randn(batch, c, s, s, device=device, generator=g).requires_grad_(),
             torch.randn(batch, c, s, s, device=device, generator=g), k) for c, s, k in NETS[net]]


def norm_case(name: str, mode: str, layers: Sequence[Layer], device: torch.device) -> Callable[[], None]:
    """Forward + backward through one ``name`` module per shape (its own compiled copy)."""
    modules = [make_norm(name, x.shape[1], device).train() for x, _, _ in layers]
    for m in modules:
        set_learning_rate(m, 0.01)  # AMAT's adaptive eta needs one; a no-op elsewhere
    calls = [torch.compile(m, dynamic=False) if mode == "compiled" else m for m in modules]
    params = [[x, *m.parameters()] for m, (x, _, _) in zip(modules, layers)]

    def run() -> None:
        for call, inputs, (x, grad, repeats) in zip(calls, params, layers):
            for _ in range(repeats):
                torch.autograd.grad(call(x), inputs, grad)

    return run


def bench(options: Mapping[str, Any], overrides: Sequence[str]) -> list[Record]:
    device = device_of(options)
    for name in options["norms"]:
        if name not in bench_norms():
            raise unknown_choice("norm module", name, bench_norms())
    records = []
    for net in options["nets"]:
        if net not in NETS:
            raise unknown_choice("net", net, NETS)
        batch = options["batch"] or BATCH[net]
        layers = layer_inputs(net, batch, device)
        wanted = [f"{n}/{m}" for n in options["norms"] for m in options["modes"]]
        cases = {key: norm_case(*key.split("/"), layers, device) for key in dict.fromkeys([BASELINE, *wanted])}
        times = measure(cases, options["reps"], options["number"], options["warmup"], device)
        shapes = ",".join(f"{k}x{c}x{s}x{s}" for c, s, k in NETS[net])
        for key in wanted:
            norm, mode = key.split("/")
            records.append(record(norm, mode, device, times[key], BASELINE, times[BASELINE], net=net, batch=batch,
                                  shapes=shapes))
    return records
