"""The model map: ``model.name`` -> builder, filled by the model modules themselves.

Each module of ``bnexp/models/`` that defines a network registers its builder beside it
with :func:`register_model` (timm's ``@register_model``); the first lookup imports every
module of the package and of ``BNEXP_PLUGINS`` (:mod:`bnexp.support.registry`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping

from torch import nn

from bnexp.models.layers import LayerBuilder
from bnexp.support.registry import Registry


@dataclass(frozen=True)
class DataSpec:
    """What a model needs to know about its data."""

    num_classes: int
    in_channels: int
    image_size: int


ModelBuilder = Callable[[LayerBuilder, DataSpec, Mapping[str, Any]], nn.Module]
MODELS: Registry[ModelBuilder] = Registry("model", package="bnexp.models")


def register_model(name: str) -> Callable[[ModelBuilder], ModelBuilder]:
    """Decorator: ``model=<name>`` builds with the decorated ``(builder, data, model_cfg)`` function."""
    return MODELS.register(name)
