"""Activation functions by name (the ``act`` config group)."""

from __future__ import annotations

from torch import nn

from bnexp.support.registry import Registry

ACTIVATIONS: Registry[type[nn.Module]] = Registry("activation")
ACTIVATIONS.register("sigmoid")(nn.Sigmoid)
ACTIVATIONS.register("tanh")(nn.Tanh)
ACTIVATIONS.register("relu")(nn.ReLU)
ACTIVATIONS.register("selu")(nn.SELU)
ACTIVATIONS.register("swish")(nn.SiLU)
ACTIVATIONS.register("softplus")(nn.Softplus)


def build_act(name: str) -> nn.Module:
    """A fresh activation module for ``name`` (sigmoid, tanh, relu, selu, swish, softplus)."""
    return ACTIVATIONS.get(name)()
