"""The model zoo: ``model.name`` -> builder (METHODS.md section 6)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Any, Callable, Mapping

from torch import nn

from bnexp.models.bnp_nets import CNN5, MLP
from bnexp.models.efficientnet import EfficientNet
from bnexp.models.layers import LayerBuilder, scale_init
from bnexp.models.preact_resnet import PreActResNet
from bnexp.models.resnet_cifar import CifarResNet
from bnexp.models.resnet_imagenet import RESNET_DEPTHS, ImageNetResNet
from bnexp.models.vgg import VGG
from bnexp.nn.create_norm import ChannelsError, NormSpec, build_norm_spec
from bnexp.support.errors import ConfigError
from bnexp.support.registry import Registry


@dataclass(frozen=True)
class DataSpec:
    """What a model needs to know about its data."""

    num_classes: int
    in_channels: int
    image_size: int


ModelBuilder = Callable[[LayerBuilder, DataSpec, Mapping[str, Any]], nn.Module]
MODELS: Registry[ModelBuilder] = Registry("model")


def _cifar_resnet(depth: int) -> ModelBuilder:
    def build(b: LayerBuilder, data: DataSpec, cfg: Mapping[str, Any]) -> nn.Module:
        return CifarResNet(b, depth, data.num_classes, data.in_channels, width=cfg.get("width", 16))

    return build


for _depth in (20, 32, 44, 56, 110):
    MODELS.register(f"resnet{_depth}")(_cifar_resnet(_depth))


@MODELS.register("vgg16")
def _vgg16(b: LayerBuilder, data: DataSpec, cfg: Mapping[str, Any]) -> nn.Module:
    return VGG(b, data.num_classes, data.in_channels, width=cfg.get("width", 64))


@MODELS.register("preact_resnet110")
def _preact_resnet110(b: LayerBuilder, data: DataSpec, cfg: Mapping[str, Any]) -> nn.Module:
    return PreActResNet(b, 110, data.num_classes, data.in_channels, width=cfg.get("width", 16))


def _imagenet_resnet(name: str) -> ModelBuilder:
    block, depths = RESNET_DEPTHS[name]

    def build(b: LayerBuilder, data: DataSpec, cfg: Mapping[str, Any]) -> nn.Module:
        return ImageNetResNet(b, block, depths, data.num_classes, data.in_channels, width=cfg.get("width", 64))

    return build


for _name in RESNET_DEPTHS:
    MODELS.register(_name)(_imagenet_resnet(_name))


@MODELS.register("efficientnet_b0")
def _efficientnet_b0(b: LayerBuilder, data: DataSpec, cfg: Mapping[str, Any]) -> nn.Module:
    return EfficientNet(
        b,
        data.num_classes,
        data.in_channels,
        width_mult=cfg.get("width_mult", 1.0),
        depth_mult=cfg.get("depth_mult", 1.0),
        dropout=cfg.get("dropout", 0.2),
        stochastic_depth=cfg.get("stochastic_depth", 0.2),
    )


def _mlp(depth: int) -> ModelBuilder:
    def build(b: LayerBuilder, data: DataSpec, cfg: Mapping[str, Any]) -> nn.Module:
        num_features = data.in_channels * data.image_size**2
        return MLP(b, num_features, data.num_classes, depth, width=cfg.get("width", 100))

    return build


for _depth in (3, 2):
    MODELS.register(f"mlp{_depth}x100")(_mlp(_depth))


@MODELS.register("cnn5")
def _cnn5(b: LayerBuilder, data: DataSpec, cfg: Mapping[str, Any]) -> nn.Module:
    width, padding = cfg.get("width", 32), cfg.get("padding", "valid")
    return CNN5(b, data.num_classes, data.in_channels, data.image_size, width=width, padding=padding)


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
