"""Packed runs: K models of one architecture trained as one model (``trainer.pack``).

Run ``k`` owns the ``k``-th of K equal blocks of channels in every activation: the input
images of the K runs are concatenated along the channels, every convolution is grouped by
run, every Linear becomes a :class:`bnexp.nn.packed.PackedLinear`, and the per-channel
normalizations (BN, the CBN/POP-Norm family with AMAT, batch renorm, bn_si, BN with 4
things, whose channel groups keep their size and so stay inside one run) simply have K
times the channels. Group and layer normalization get K times the groups. Nothing mixes
two runs' values, so run ``k`` of a pack computes what the same model alone computes.
A module of a new norm or model that none of these rules fits packs itself: it defines
``packed(runs) -> nn.Module`` (as :class:`bnexp.models.resnet_cifar.OptionAShortcut` does).

Every tensor of a packed model's state (parameters, buffers, momentum, BNP's statistics)
is the runs' tensors concatenated along dim 0, except 0-d counters, which the runs share:
:func:`pack_state` and :func:`unpack_state` convert, so a run's state taken out of a pack
loads into the plain model. The per-channel buffers that are not state (the family's
``rho_channels``) are the runs' concatenated too: that is how the runs of a pack may differ
in rho (CBN's rho, POP-Norm's kappa). Any other plain setting a module keeps (a float, a
flag) must be the same in every run, unless the module lists it in ``PER_RUN`` (as a
setting its forward reads from such a buffer): :func:`pack_models` names the first that
differs. Where some runs' layer is torch's BatchNorm and the others' the family with
another rho (CBN ablation row 6: BN's flags with a tuned rho, torch's BatchNorm at rho = 1),
those runs take the family's form of the same layer (:func:`bnexp.nn.family.as_norm_family`).
"""

from __future__ import annotations

import copy
from typing import Any, Mapping, Sequence

import torch
from torch import Tensor, nn
from torchvision.ops import StochasticDepth

from bnexp.models.layers import NormOp
from bnexp.nn._base import ChannelNorm
from bnexp.nn.family import ETA_BUFFER, NormFamily, as_norm_family
from bnexp.nn.packed import GROUPED, PackedConv2d, PackedLinear
from bnexp.support.errors import ConfigError

# Modules whose channels are independent whatever their number (nothing to change).
CHANNELWISE = (nn.Sequential, nn.Identity, nn.Flatten, nn.AdaptiveAvgPool2d, nn.MaxPool2d, nn.AvgPool2d,
               nn.ReLU, nn.Sigmoid, nn.Tanh, nn.SiLU, nn.SELU, nn.Softplus, nn.GELU)


def pack_state(states: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The packed state of ``states`` (one per run, same keys): tensors concatenated along
    dim 0, 0-d tensors and other values taken from the first run (they must agree)."""
    packed: dict[str, Any] = {}
    for key, first in states[0].items():
        if isinstance(first, Tensor) and first.dim() > 0:
            packed[key] = torch.cat([s[key] for s in states])
        elif isinstance(first, Mapping):
            packed[key] = pack_state([s[key] for s in states])
        else:
            packed[key] = first
    return packed


def unpack_state(state: Mapping[str, Any], runs: int) -> list[dict[str, Any]]:
    """One state per run out of a packed ``state``: the inverse of :func:`pack_state`."""
    out: list[dict[str, Any]] = [{} for _ in range(runs)]
    for key, value in state.items():
        if isinstance(value, Tensor) and value.dim() > 0:
            parts: Sequence[Any] = value.chunk(runs)
        elif isinstance(value, Mapping):
            parts = unpack_state(value, runs)
        else:
            parts = [value] * runs
        for k in range(runs):
            out[k][key] = parts[k].clone() if isinstance(parts[k], Tensor) else parts[k]
    return out


def _packed_conv(conv: nn.Conv2d, runs: int, form: str) -> nn.Conv2d:
    return PackedConv2d(runs, form, runs * conv.in_channels, runs * conv.out_channels, conv.kernel_size, conv.stride,
                        conv.padding, conv.dilation, runs * conv.groups, conv.bias is not None, conv.padding_mode,
                        device=conv.weight.device, dtype=conv.weight.dtype)


def _widen_channels(norm: nn.Module, runs: int) -> nn.Module:
    """A per-channel normalization with ``runs`` times its channels (values set later)."""
    norm.num_features *= runs
    for name, tensor in [*norm.named_parameters(recurse=False), *norm.named_buffers(recurse=False)]:
        if tensor.dim() > 0:
            wide = tensor.detach().repeat(runs, *[1] * (tensor.dim() - 1))
            setattr(norm, name, nn.Parameter(wide) if isinstance(tensor, nn.Parameter) else wide)
    return norm


def _packed_module(name: str, module: nn.Module, runs: int, conv: str) -> nn.Module:
    """The packed counterpart of one module, or a ConfigError naming what cannot be packed."""
    if hasattr(module, "packed"):  # a module that knows its packed form (the protocol new modules use)
        return module.packed(runs)
    if isinstance(module, nn.Conv2d):
        return _packed_conv(module, runs, conv)
    if isinstance(module, nn.Linear):
        packed = PackedLinear(runs, module.in_features, module.out_features, module.bias is not None)
        return packed.to(module.weight)
    if isinstance(module, nn.GroupNorm):
        return nn.GroupNorm(runs * module.num_groups, runs * module.num_channels, module.eps, module.affine,
                            device=module.weight.device, dtype=module.weight.dtype)
    if isinstance(module, nn.LayerNorm) and len(module.normalized_shape) == 1:  # over features: one group per run
        return nn.GroupNorm(runs, runs * module.normalized_shape[0], module.eps, module.elementwise_affine,
                            device=module.weight.device, dtype=module.weight.dtype)
    if isinstance(module, (ChannelNorm, nn.modules.batchnorm._BatchNorm)):
        return _widen_channels(module, runs)
    if isinstance(module, (nn.Dropout, StochasticDepth)):
        if module.p == 0:
            return module
        raise ConfigError(f"trainer.pack: {name or 'the model'} ({type(module).__name__}, p={module.p}) draws random "
                          "masks, which a pack cannot draw as each run alone would: set the model's dropout and "
                          "stochastic depth to 0, or use trainer.pack=1")
    if isinstance(module, CHANNELWISE) or not (list(module.parameters(False)) or list(module.buffers(False))):
        return module
    raise ConfigError(f"trainer.pack: {name} ({type(module).__name__}) cannot be packed: bnexp knows how to pack "
                      "convolutions, linear layers, per-channel, group and layer normalizations; use trainer.pack=1")


def pack_models(models: Sequence[nn.Module], conv: str = GROUPED) -> nn.Module:
    """One model computing ``models`` (same architecture, one per run) side by side, its
    convolutions computed as ``conv`` says (:class:`~bnexp.nn.packed.PackedConv2d`).

    Its input is the runs' images concatenated along the channels, its output the runs'
    logits concatenated along dim 1 (``(N, K * classes)``). The models are not changed.
    """
    runs = len(models)
    models = common_layers(models)
    packed = copy.deepcopy(models[0])
    if runs > 1:
        for name, module in list(packed.named_modules()):
            new = _packed_module(name, module, runs, conv)
            if new is not module:
                parent, _, attr = name.rpartition(".")
                setattr(packed.get_submodule(parent), attr, new)
        for unit in packed.modules():  # bn_si reads the weight of the op in front of it
            if isinstance(unit, NormOp) and hasattr(unit.post, "bind"):
                unit.post.bind(unit.op)
    state = pack_state([m.state_dict() for m in models])
    packed.load_state_dict(state)
    settings = [dict(m.named_buffers()) for m in models]
    for name, buffer in packed.named_buffers():  # the per-channel buffers that are not state: rho
        if name not in state and buffer.dim() > 0:
            buffer.copy_(torch.cat([s[name] for s in settings]))
    return packed


def same_layers(a: nn.Module, b: nn.Module) -> bool:
    """Whether two (packed) models have the same layers, settings (but ``PER_RUN``), and
    tensors of the same shapes and dtypes: one can take the other's values (:func:`load_packed`)."""
    # tensors shared between layers count in each; adaptive AMAT's eta is left out: a run's hook
    # gives every layer one eta tensor (one value per run in a pack across learning rates)
    tensors = [{k: t for k, t in [*m.named_parameters(remove_duplicate=False), *m.named_buffers(remove_duplicate=False)]
                if k.rpartition(".")[2] != ETA_BUFFER} for m in (a, b)]
    return first_difference([a, b]) is None and tensors[0].keys() == tensors[1].keys() and all(
        t.shape == tensors[1][k].shape and t.dtype == tensors[1][k].dtype for k, t in tensors[0].items())


def load_packed(target: nn.Module, source: nn.Module) -> None:
    """``source``'s values (its state and per-channel buffers) copied into ``target``'s own
    tensors (:func:`same_layers`), which keep their identity and memory format."""
    state = source.state_dict()
    target.load_state_dict(state)
    theirs = dict(source.named_buffers())
    with torch.no_grad():
        for name, buffer in target.named_buffers():
            if name not in state and buffer.dim() > 0 and name.rpartition(".")[2] != ETA_BUFFER:
                buffer.copy_(theirs[name])


def common_layers(models: Sequence[nn.Module]) -> list[nn.Module]:
    """``models`` with one class and the same plain settings in every layer: where some runs
    have torch's BatchNorm and others the family (BN's flags with another rho), a copy of
    each of the former with the family's form in its place; a ConfigError naming the first
    layer in which the runs differ otherwise."""
    if first_difference(models) is None:
        return list(models)
    layers = [dict(m.named_modules()) for m in models]
    mixed = [name for name in layers[0] if any(isinstance(layer.get(name), _BatchNorm) for layer in layers)
             and any(isinstance(layer.get(name), NormFamily) for layer in layers)]
    out = []
    for model in models:
        if any(isinstance(model.get_submodule(name), _BatchNorm) for name in mixed):
            model = copy.deepcopy(model)
            for name in mixed:
                parent, _, attr = name.rpartition(".")
                setattr(model.get_submodule(parent), attr, as_norm_family(model.get_submodule(name)))
        out.append(model)
    difference = first_difference(out)
    if difference is not None:
        raise ConfigError(f"trainer.pack: the runs of a pack differ in {difference}, which the layer keeps as a "
                          "constant: only runs that differ in their seed, rho (norm.rho) and learning rates train as one pack")
    return out


_BatchNorm = nn.modules.batchnorm._BatchNorm
PLAIN = (bool, int, float, str, type(None), tuple)  # the settings a module keeps as attributes


def first_difference(models: Sequence[nn.Module]) -> str | None:
    """The first layer (and setting) in which ``models`` differ: a class, or a plain public
    attribute (a setting; ``_private`` ones are the layer's bookkeeping) not in the layer's
    ``PER_RUN``; None when they agree."""
    layers = [dict(m.named_modules()) for m in models]
    if any(layer.keys() != layers[0].keys() for layer in layers):
        return "their layers"
    for name, first in layers[0].items():
        for other in (layer[name] for layer in layers[1:]):
            if type(other) is not type(first):
                return f"{name or 'the model'} ({type(first).__name__} and {type(other).__name__})"
            for key, value in vars(first).items():
                if isinstance(value, PLAIN) and not key.startswith("_") and key not in getattr(first, "PER_RUN", ()) \
                        and vars(other).get(key) != value:
                    return f"{name}.{key} ({value!r} and {vars(other).get(key)!r})"
    return None


def pack_inputs(images: Sequence[Tensor]) -> Tensor:
    """The runs' batches of images, ``(N, C, ...)`` each, as one packed input ``(N, K * C, ...)``."""
    return images[0] if len(images) == 1 else torch.cat(list(images), dim=1)


def per_run(logits: Tensor, runs: int) -> Tensor:
    """A packed model's logits ``(N, K * classes)`` as ``(N, K, classes)``."""
    return logits.view(logits.shape[0], runs, -1)


def packed_losses(logits: Tensor, targets: Tensor) -> Tensor:
    """Each run's mean cross-entropy, ``(K,)``, from packed logits and targets ``(N, K)``."""
    by_run = per_run(logits, targets.shape[1])
    return nn.functional.cross_entropy(by_run.transpose(1, 2), targets, reduction="none").mean(0)
