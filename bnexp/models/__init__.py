"""The model zoo (METHODS.md section 6): :func:`build_model` builds ``model.name`` (a name of
:data:`MODELS`, which each model's module fills) with a norm preset and an activation."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Any, Callable, Mapping

from torch import nn

from bnexp.models.layers import LayerBuilder, scale_init
from bnexp.models.registry import MODELS, DataSpec, ModelBuilder, register_model
from bnexp.nn.create_norm import ChannelsError, NormSpec, build_norm_spec
from bnexp.support.errors import ConfigError


def build_model(model_cfg: Mapping[str, Any], norm_cfg: Mapping[str, Any], act: str, data: DataSpec) -> nn.Module:
    """Build ``model_cfg.name`` with the given normalization preset and activation, its
    conv and linear weights initialized as the model does, times ``model.init_scale``."""
    spec = build_norm_spec(norm_cfg)
    build = MODELS.get(model_cfg["name"])
    try:
        model = build(LayerBuilder(spec, act), data, model_cfg)
    except ChannelsError as err:
        valid = fitting_groups(lambda s: build(LayerBuilder(s, act), data, model_cfg), spec)
        raise ConfigError(f"norm.{err} of model={model_cfg['name']}: norm.groups must divide the channels of every "
                          f"normalized layer (the input images excepted); valid here: {', '.join(map(str, valid))}"
                          ) from None
    scale = model_cfg.get("init_scale")
    if scale not in (None, 1.0):  # null: the model's own initialization, as 1
        scale_init(model, scale)
    return model


@dataclass(frozen=True)
class _CountingSpec(NormSpec):
    """A norm spec that notes the channel count of every layer it makes (the input images' excepted)."""

    seen: list[int] = field(default_factory=list)

    def make(self, num_features: int, dim: int, image_input: bool = False) -> nn.Module:
        if not image_input:
            self.seen.append(num_features)
        return super().make(num_features, dim, image_input)


def fitting_groups(build: Callable[[NormSpec], nn.Module], spec: NormSpec) -> list[int]:
    """The group counts that divide the channels of every layer ``build`` normalizes."""
    counting = _CountingSpec(**{**{f.name: getattr(spec, f.name) for f in fields(NormSpec)},
                                "options": {**spec.options, "groups": 1}})
    build(counting)
    common = math.gcd(*counting.seen)
    return [g for g in range(1, common + 1) if common % g == 0]


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


__all__ = ["MODELS", "DataSpec", "ModelBuilder", "build_model", "count_parameters", "fitting_groups", "register_model"]
