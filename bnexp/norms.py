"""The normalization registry: one place that turns a ``norm`` config into modules.

A ``norm`` preset (``configs/norm/*.yaml``) names a ``kind`` (the module family), its
flags, the ``placement`` (``after_op`` or ``before_op``, METHODS.md section 1) and whether
the linear ops keep a bias. :func:`build_norm_spec` turns it into a :class:`NormSpec`
that the model builder (:mod:`bnexp.models.layers`) asks for modules.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional

from torch import nn

from bnexp.errors import ConfigError, unknown_choice
from bnexp.nn.family import AMAT_UPDATES, BEFORE_FORWARD
from bnexp.registry import Registry

AFTER_OP = "after_op"
BEFORE_OP = "before_op"
PLACEMENTS = (AFTER_OP, BEFORE_OP)
# Where a before_op residual block's shortcut joins (METHODS.md section 1, norm.join):
AFTER_ACT = "after_act"  # shortcut + act(h): the CBN paper's eq. 7
BEFORE_ACT = "before_act"  # act(h + shortcut): the standard ResNet join, kept by POP-Norm
JOINS = (AFTER_ACT, BEFORE_ACT)

# (num_features, dim) -> module, where dim is 1 (features) or 2 (images).
NormMaker = Callable[[int, int], nn.Module]

NORM_KINDS: Registry[Callable[[Mapping[str, Any]], Optional[NormMaker]]] = Registry("norm kind")


@dataclass(frozen=True)
class NormSpec:
    """The chosen normalization as the model builder sees it."""

    name: str
    placement: str
    op_bias: bool
    maker: Optional[NormMaker]
    join: str = AFTER_ACT  # before_op residual joins (norm.join)
    classifier: bool = True  # before_op: a normalization in front of the final Linear (norm.classifier)
    batch_statistics: bool = False  # the training forward normalizes with statistics over the batch

    @property
    def enabled(self) -> bool:
        return self.maker is not None

    @property
    def shortcut_after_act(self) -> bool:
        """Whether residual shortcuts join after the block's last activation (before_op, after_act)."""
        return self.placement == BEFORE_OP and self.join == AFTER_ACT

    @property
    def normalizes_classifier(self) -> bool:
        """Whether the final Linear gets a normalization in front (before_op with norm.classifier)."""
        return self.enabled and self.placement == BEFORE_OP and self.classifier

    def make(self, num_features: int, dim: int) -> nn.Module:
        """A normalization over ``num_features`` channels, or Identity when disabled."""
        if self.maker is None:
            return nn.Identity()
        return self.maker(num_features, dim)


@NORM_KINDS.register("none")
def _no_norm(cfg: Mapping[str, Any]) -> None:
    return None


BN_FLAGS = {"center": True, "scale": True, "decouple": False, "rho": 1.0, "amat": False}


def is_plain_bn(cfg: Mapping[str, Any]) -> bool:
    """True when the family flags reduce to vanilla BN without cross-process statistics
    (then torch's own module is used; ``norm.sync`` needs bnexp's, which syncs on any device)."""
    return not cfg.get("sync") and all(cfg.get(key, default) == default for key, default in BN_FLAGS.items())


def with_sync(module: nn.Module, cfg: Mapping[str, Any]) -> nn.Module:
    """Set ``norm.sync`` on a bnexp normalization (batch statistics over all processes)."""
    module.sync = bool(cfg.get("sync", False))
    return module


@NORM_KINDS.register("family")
def _family(cfg: Mapping[str, Any]) -> NormMaker:
    def make(num_features: int, dim: int) -> nn.Module:
        if is_plain_bn(cfg):
            cls = nn.BatchNorm1d if dim == 1 else nn.BatchNorm2d
            return cls(num_features, eps=cfg["eps"], momentum=cfg["momentum"])
        from bnexp.nn import NormFamily1d, NormFamily2d

        cls = NormFamily1d if dim == 1 else NormFamily2d
        amat = {"amat_eta": amat_eta(cfg), "amat_update": cfg.get("amat_update", BEFORE_FORWARD),
                "amat_r_max": amat_r_max(cfg)} if cfg["amat"] else {}
        module = cls(num_features, **{key: cfg[key] for key in BN_FLAGS}, eps=cfg["eps"], momentum=cfg["momentum"],
                     **amat)
        return with_sync(module, cfg)

    return make


def amat_eta(cfg: Mapping[str, Any]) -> Optional[float]:
    """``norm.amat_eta``: ``adaptive`` (None: eta = max(1 - 10 lr, 0)) or a fixed float in [0, 1]."""
    value = cfg.get("amat_eta", "adaptive")
    if value == "adaptive":
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
        raise ConfigError(f"norm.amat_eta={value!r} is not valid: use adaptive or a number in [0, 1]")
    return float(value)


def amat_r_max(cfg: Mapping[str, Any]) -> Optional[float]:
    """``norm.amat_r_max``: null (the paper's unclipped ``r_mu``) or a positive bound."""
    value = cfg.get("amat_r_max")
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ConfigError(f"norm.amat_r_max={value!r} is not valid: use null (unclipped) or a number > 0")
    return float(value)


@NORM_KINDS.register("bn_si")
def _bn_si(cfg: Mapping[str, Any]) -> NormMaker:
    from bnexp.nn import ScaleInvariantBN1d, ScaleInvariantBN2d

    def make(num_features: int, dim: int) -> nn.Module:
        cls = ScaleInvariantBN1d if dim == 1 else ScaleInvariantBN2d
        return with_sync(cls(num_features, eps=cfg["eps"], momentum=cfg["momentum"]), cfg)  # bound to its op later

    return make


@NORM_KINDS.register("brn")
def _brn(cfg: Mapping[str, Any]) -> NormMaker:
    from bnexp.nn import BatchRenorm1d, BatchRenorm2d

    def make(num_features: int, dim: int) -> nn.Module:
        cls = BatchRenorm1d if dim == 1 else BatchRenorm2d
        # ramp_steps=null means "the whole run": the trainer sets it once the length is known.
        module = cls(num_features, r_max=cfg["r_max"], d_max=cfg["d_max"], momentum=cfg["momentum"],
                     eps=cfg["eps"], ramp_steps=cfg.get("ramp_steps"))
        return with_sync(module, cfg)

    return make


@NORM_KINDS.register("gn")
def _gn(cfg: Mapping[str, Any]) -> NormMaker:
    def make(num_features: int, dim: int) -> nn.Module:
        # A layer whose channel count the group count does not divide (the 3 image channels
        # in front of a before_op stem) uses the largest common divisor.
        return nn.GroupNorm(math.gcd(int(cfg["groups"]), num_features), num_features, eps=cfg["eps"])

    return make


@NORM_KINDS.register("ln")
def _ln(cfg: Mapping[str, Any]) -> NormMaker:
    def make(num_features: int, dim: int) -> nn.Module:
        if dim == 1:
            return nn.LayerNorm(num_features, eps=cfg["eps"])
        return nn.GroupNorm(1, num_features, eps=cfg["eps"])  # all of C x H x W per sample

    return make


def build_norm_spec(cfg: Mapping[str, Any]) -> NormSpec:
    """Validate a ``norm`` config and return the spec models are built from."""
    placement = cfg.get("placement", AFTER_OP)
    if placement not in PLACEMENTS:
        raise unknown_choice("norm.placement", placement, PLACEMENTS)
    join = cfg.get("join", AFTER_ACT)
    if join not in JOINS:
        raise unknown_choice("norm.join", join, JOINS)
    classifier = cfg.get("classifier", True)
    if not isinstance(classifier, bool):
        raise ConfigError(f"norm.classifier must be true or false, got {classifier!r}")
    if cfg.get("amat") and cfg.get("amat_update", BEFORE_FORWARD) not in AMAT_UPDATES:
        raise unknown_choice("norm.amat_update", cfg["amat_update"], AMAT_UPDATES)
    maker = NORM_KINDS.get(cfg["kind"])(cfg)
    op_bias = cfg.get("op_bias")
    if op_bias is None:
        op_bias = maker is None
    if not isinstance(op_bias, bool):
        raise ConfigError(f"norm.op_bias must be true, false or null, got {op_bias!r}")
    return NormSpec(name=cfg.get("name", cfg["kind"]), placement=placement, op_bias=op_bias, maker=maker,
                    join=join, classifier=classifier, batch_statistics=uses_batch_statistics(cfg))


def uses_batch_statistics(cfg: Mapping[str, Any]) -> bool:
    """Whether a ``norm`` config normalizes with statistics over the batch (BN and its family
    when they center or scale, bn_si, batch renormalization); GN, LN, BNP and none do not."""
    kind = cfg["kind"]
    return kind in ("bn_si", "brn") or (kind == "family" and bool(cfg.get("center", True) or cfg.get("scale", True)))
