"""The model zoo: ``model.name`` -> builder (METHODS.md section 6)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping

from torch import nn

from bnexp.models.layers import LayerBuilder
from bnexp.models.resnet_cifar import CifarResNet
from bnexp.models.vgg import VGG
from bnexp.norms import build_norm_spec
from bnexp.registry import Registry


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


def build_model(model_cfg: Mapping[str, Any], norm_cfg: Mapping[str, Any], act: str, data: DataSpec) -> nn.Module:
    """Build ``model_cfg.name`` with the given normalization preset and activation."""
    builder = LayerBuilder(build_norm_spec(norm_cfg), act)
    return MODELS.get(model_cfg["name"])(builder, data, model_cfg)


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
