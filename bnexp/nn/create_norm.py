"""Normalizations by name: one map from a layer name to its modules, and the spec models use.

A ``norm`` preset (``configs/norm/*.yaml``) names a ``layer`` (a key of :data:`NORM_LAYERS`,
or null for no normalization), that layer's keyword arguments, and how a model places it
(``placement``, ``join``, ``classifier``, ``input``, ``op_bias``). :func:`create_norm` builds one module
from a name, a class or any callable, as timm's ``create_norm_layer`` does: ``norm=cbn``
builds :class:`bnexp.nn.CBN2d`, the class users import. :func:`build_norm_spec` turns a
preset into the :class:`NormSpec` the model builder (:mod:`bnexp.models.layers`) asks for
modules.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional, Union

from torch import nn

from bnexp.support.errors import ConfigError, unknown_choice
from bnexp.support.registry import Registry

AFTER_OP = "after_op"
BEFORE_OP = "before_op"
PLACEMENTS = (AFTER_OP, BEFORE_OP)
# Where a before_op residual block's shortcut joins (METHODS.md section 1, norm.join):
AFTER_ACT = "after_act"  # shortcut + act(h): the CBN paper's eq. 7
BEFORE_ACT = "before_act"  # act(h + shortcut): the standard ResNet join, kept by POP-Norm
JOINS = (AFTER_ACT, BEFORE_ACT)

Builder = Callable[..., nn.Module]  # (num_features, **options) -> module


@dataclass(frozen=True)
class NormLayer:
    """One entry of the map: the module over features (1d, ``(N, C)`` or ``(N, C, L)``) and
    over images (2d), and the preset keys that are its keyword arguments."""

    features: Builder
    images: Builder
    keys: tuple[str, ...]
    batch_statistics: bool = True  # whether its training forward normalizes with batch statistics
    short: str = ""  # the name `bnexp bench norms` gives it (the layer's name when empty)


# Filled by the modules of bnexp/nn/ (and BNEXP_PLUGINS) as they are imported: each method
# registers its layer beside its class; the first lookup imports them all.
NORM_LAYERS: Registry[NormLayer] = Registry("norm layer", package="bnexp.nn")


def register_norm(name: str, features: Builder, images: Builder, keys: tuple[str, ...],
                  batch_statistics: bool = True, short: str = "") -> None:
    """Make ``name`` a ``layer`` of the norm presets (and of :func:`create_norm`): its module
    over features and over images, the preset keys that are their keyword arguments,
    whether it normalizes with batch statistics (the flag rules and the batch-size check
    read it) and the short name benches print."""
    NORM_LAYERS.register(name)(NormLayer(features, images, keys, batch_statistics, short))


def group_norm(num_features: int, groups: int = 4, eps: float = 1e-5) -> nn.Module:
    """GroupNorm with ``groups`` groups, which must divide the channels (see
    :meth:`NormSpec.make` for the input images in front of a ``before_op`` stem)."""
    if isinstance(groups, bool) or not isinstance(groups, int) or groups < 1:
        raise ValueError(f"groups={groups!r} is not valid: norm.groups must be an integer >= 1")
    if num_features % groups:
        raise ChannelsError(f"groups={groups} does not divide the {num_features} channels of a normalized layer")
    return nn.GroupNorm(groups, num_features, eps=eps)


class ChannelsError(ValueError):
    """A normalization's options do not fit a layer's channel count (GN groups)."""


def layer_norm_images(num_features: int, eps: float = 1e-5) -> nn.Module:
    """LayerNorm over all of C x H x W per sample: GroupNorm with one group."""
    return nn.GroupNorm(1, num_features, eps=eps)


# torch's own normalizations; bnexp's methods register theirs in their modules.
register_norm("groupnorm", group_norm, group_norm, ("groups", "eps"), batch_statistics=False, short="gn")
register_norm("layernorm", nn.LayerNorm, layer_norm_images, ("eps",), batch_statistics=False, short="ln")


def create_norm(layer: Union[str, Builder], num_features: int, dim: int = 2, **options: Any) -> nn.Module:
    """A normalization over ``num_features`` channels of features (``dim=1``) or images (2).

    ``layer`` is a name of :data:`NORM_LAYERS` (``"cbn"``), or a class or callable taking
    ``(num_features, **options)`` (``functools.partial(CBN2d, rho=0.5)``).
    """
    if not isinstance(layer, str):
        return layer(num_features, **options)
    entry = NORM_LAYERS.get(layer)
    return (entry.features if dim == 1 else entry.images)(num_features, **options)


def layer_options(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """The keyword arguments a ``norm`` preset gives its layer (its keys the layer takes)."""
    return {key: cfg[key] for key in NORM_LAYERS.get(cfg["layer"]).keys if key in cfg}


def uses_batch_statistics(cfg: Mapping[str, Any]) -> bool:
    """Whether a ``norm`` preset normalizes with statistics over the batch that one example
    cannot give: BN and its family when they center or scale, bn_si, batch renormalization,
    BN with 4 things without channel groups; not GN, LN, BNP or none, nor BN with 4 things
    whose statistics pool ``norm.groups`` groups of channels (batch-group normalization)."""
    layer = cfg.get("layer")
    if layer is None or not NORM_LAYERS.get(layer).batch_statistics or cfg.get("groups") is not None:
        return False
    return bool(cfg.get("center", True) or cfg.get("scale", True))


@dataclass(frozen=True)
class NormSpec:
    """The chosen normalization as the model builder sees it."""

    name: str
    placement: str
    op_bias: bool
    layer: Optional[str]  # a key of NORM_LAYERS; None: no normalization
    options: Mapping[str, Any] = field(default_factory=dict)  # the layer's keyword arguments
    join: str = AFTER_ACT  # before_op residual joins (norm.join)
    classifier: bool = True  # before_op: a normalization in front of the final Linear (norm.classifier)
    input: bool = True  # before_op: a normalization of the network's input, in front of the stem (norm.input)
    batch_statistics: bool = False  # the training forward normalizes with statistics over the batch

    @property
    def enabled(self) -> bool:
        return self.layer is not None

    @property
    def shortcut_after_act(self) -> bool:
        """Whether residual shortcuts join after the block's last activation (before_op, after_act)."""
        return self.placement == BEFORE_OP and self.join == AFTER_ACT

    @property
    def normalizes_classifier(self) -> bool:
        """Whether the final Linear gets a normalization in front (before_op with norm.classifier)."""
        return self.enabled and self.placement == BEFORE_OP and self.classifier

    def make(self, num_features: int, dim: int, image_input: bool = False) -> nn.Module:
        """A normalization over ``num_features`` channels, or Identity when disabled.

        ``image_input``: it normalizes the input images (``before_op``, in front of the stem),
        whose channel count (3, or 1 for MNIST) no group count of the other layers divides:
        there ``norm.groups`` becomes ``gcd(groups, channels)``, the one exception to the rule
        that the groups divide every layer's channels.
        """
        if self.layer is None:
            return nn.Identity()
        options = dict(self.options)
        if image_input and isinstance(options.get("groups"), int) and options["groups"] >= 1:
            options["groups"] = math.gcd(options["groups"], num_features)
        return create_norm(self.layer, num_features, dim, **options)


def build_norm_spec(cfg: Mapping[str, Any]) -> NormSpec:
    """Check a ``norm`` preset (building one module of its layer) and return its spec."""
    placement = cfg.get("placement", AFTER_OP)
    if placement not in PLACEMENTS:
        raise unknown_choice("norm.placement", placement, PLACEMENTS)
    join = cfg.get("join", AFTER_ACT)
    if join not in JOINS:
        raise unknown_choice("norm.join", join, JOINS)
    classifier, normalize_input = cfg.get("classifier", True), cfg.get("input", True)
    for key, value in (("classifier", classifier), ("input", normalize_input)):
        if not isinstance(value, bool):
            raise ConfigError(f"norm.{key} must be true or false, got {value!r}")
    layer = cfg.get("layer")
    options = layer_options(cfg) if layer is not None else {}
    if layer is not None:
        try:
            create_norm(layer, 4, 2, **options)
        except ChannelsError:  # the options are valid; whether they fit the model's layers is checked as it is built
            pass
        except (TypeError, ValueError) as err:
            raise ConfigError(f"norm={cfg.get('name', layer)} (layer {layer}): norm.{err}") from None
    op_bias = cfg.get("op_bias")
    if op_bias is None:
        op_bias = layer is None
    if not isinstance(op_bias, bool):
        raise ConfigError(f"norm.op_bias must be true, false or null, got {op_bias!r}")
    return NormSpec(name=cfg.get("name", str(layer)), placement=placement, op_bias=op_bias, layer=layer,
                    options=options, join=join, classifier=classifier, input=normalize_input,
                    batch_statistics=uses_batch_statistics(cfg))
