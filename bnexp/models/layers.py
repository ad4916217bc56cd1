"""Placement in one place: every model is built from these units.

METHODS.md section 1. With ``after_op`` a normalized op computes ``N(op(x))``; with
``before_op`` it computes ``op(N(x))`` where ``N`` has the op's input channel count.
Models never test the placement themselves: they build :class:`NormOp` units through a
:class:`LayerBuilder`, their final Linear through :meth:`LayerBuilder.classifier`, and join
residual branches with :class:`ResidualJoin`. Two settings shape ``before_op`` networks:
``norm.join`` (where a shortcut joins), ``norm.classifier`` (a normalization in front of
the final Linear) and ``norm.input`` (a normalization of the network's input in front of
the stem; false leaves the input as it comes: with ``classifier`` on, every layer is then
``op -> act -> N``, the BNP paper's "post-activation" nets); ``after_op`` networks ignore
all three.

A projection shortcut in ``before_op`` reads its block's first normalized input instead of
owning a normalization: the set of normalized ops (:func:`normalized_ops`) is the same in
both placements, while the ``before_op`` model has one normalization MODULE fewer per
projection shortcut.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Callable

import torch
from torch import nn

from bnexp.nn.activations import build_act
from bnexp.nn.create_norm import AFTER_OP, BEFORE_OP, NormSpec
from bnexp.support.errors import ConfigError


class NormOp(nn.Module):
    """A conv or linear op with its normalization in front (``pre``) or behind (``post``).

    The unused slot is ``nn.Identity``. ``normalize_input`` and ``from_normalized`` split the
    forward so a projection shortcut can consume the same normalized input as the main op;
    such an op has both slots empty and ``shares_input_norm`` set.
    """

    def __init__(self, op: nn.Module, pre: nn.Module, post: nn.Module, shares_input_norm: bool = False) -> None:
        super().__init__()
        self.pre = pre
        self.op = op
        self.post = post
        self.shares_input_norm = shares_input_norm

    @property
    def normalized(self) -> bool:
        """Whether a normalization acts on this op (its own, or a shared input one)."""
        owns = not (isinstance(self.pre, nn.Identity) and isinstance(self.post, nn.Identity))
        return owns or self.shares_input_norm

    def normalize_input(self, x: torch.Tensor) -> torch.Tensor:
        return self.pre(x)

    def from_normalized(self, x: torch.Tensor) -> torch.Tensor:
        return self.post(self.op(x))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.post(self.op(self.pre(x)))


class ResidualJoin(nn.Module):
    """Adds a residual branch ``h`` to its shortcut, with the block's last activation.

    ``shortcut_after_act``: ``shortcut + act(h)`` (the shortcut joins after the block's last
    nonlinearity, the CBN paper's ``before_op`` block); otherwise ``act(h + shortcut)`` (the
    standard block). With ``act=None`` (linear bottlenecks) both are ``h + shortcut``.
    """

    def __init__(self, shortcut_after_act: bool, act: nn.Module | None) -> None:
        super().__init__()
        self.shortcut_after_act = shortcut_after_act
        self.act = act if act is not None else nn.Identity()

    def forward(self, h: torch.Tensor, shortcut: torch.Tensor) -> torch.Tensor:
        if self.shortcut_after_act:
            return shortcut + self.act(h)
        return self.act(h + shortcut)


@dataclass(frozen=True)
class LayerBuilder:
    """Builds normalized ops and activations for one model from the chosen norm and act."""

    norm: NormSpec
    act_name: str

    @property
    def placement(self) -> str:
        return self.norm.placement

    def _wrap(self, op: nn.Module, cin: int, cout: int, dim: int, normalize: bool, share_input_norm: bool,
              image_input: bool = False) -> NormOp:
        before = normalize and self.placement == BEFORE_OP and (self.norm.input or not image_input)
        after = normalize and self.placement == AFTER_OP
        pre = self._unbound(self.norm.make(cin, dim, image_input)) if before and not share_input_norm else nn.Identity()
        post = self.norm.make(cout, dim) if after else nn.Identity()
        if hasattr(post, "bind"):  # bn_si smooths with the norm of the weight producing each channel
            post.bind(op)
        return NormOp(op, pre, post, shares_input_norm=before and share_input_norm and self.norm.enabled)

    def _unbound(self, norm: nn.Module) -> nn.Module:
        """``norm``, unless it must be bound to the op producing its input (bn_si) and none does."""
        if hasattr(norm, "bind"):
            raise ConfigError(
                f"norm={self.norm.name} smooths each channel with the weight of the op that produces it, so it "
                "needs a normalization right after an op: use norm.placement=after_op (and a model other than "
                "preact_resnet110, whose block inputs are sums of branches), or norm=bn")
        return norm

    def conv(
        self,
        cin: int,
        cout: int,
        kernel_size: int,
        stride: int = 1,
        groups: int = 1,
        normalize: bool = True,
        share_input_norm: bool = False,
        padding: int | None = None,
        image_input: bool = False,
    ) -> NormOp:
        """A ``kernel_size`` conv with its normalization placed.

        ``normalize``: whether the op carries a normalization in the ``after_op`` model.
        ``share_input_norm``: with ``before_op``, the op reads an input someone else
        normalized (a projection shortcut reads its block's first normalized input).
        ``padding``: ``None`` pads to keep the size ("same"); 0 is "valid".
        ``image_input``: the op reads the input images (a stem), whose few channels a
        ``before_op`` group normalization splits into ``gcd(groups, channels)`` groups, and
        which ``norm.input=false`` leaves unnormalized.
        """
        bias = self.norm.op_bias or not normalize
        pad = kernel_size // 2 if padding is None else padding
        op = nn.Conv2d(cin, cout, kernel_size, stride, pad, groups=groups, bias=bias)
        return self._wrap(op, cin, cout, 2, normalize, share_input_norm, image_input)

    def plain_conv(self, cin: int, cout: int, kernel_size: int, stride: int = 1) -> nn.Conv2d:
        """A same-padded conv outside the placement scheme, for blocks that place their own
        normalizations (pre-activation ResNets); it has a bias when the norm spec says so."""
        return nn.Conv2d(cin, cout, kernel_size, stride, kernel_size // 2, bias=self.norm.op_bias)

    def conv_norm(self, cin: int, cout: int, kernel_size: int, stride: int = 1) -> NormOp:
        """:meth:`plain_conv` followed directly by a normalization of its output, whatever the
        placement (pre-activation blocks' ``conv1 -> N2``): its weight is tagged scale-invariant
        where that norm makes it so."""
        op = self.plain_conv(cin, cout, kernel_size, stride)
        post = self.norm.make(cout, 2)
        if hasattr(post, "bind"):
            post.bind(op)
        return NormOp(op, nn.Identity(), post)

    def linear(self, fin: int, fout: int, normalize: bool = False, image_input: bool = False) -> NormOp:
        """A linear layer; ``normalize=False`` leaves it unnormalized, with a bias;
        ``image_input``: it reads the flattened images (see :meth:`conv`)."""
        bias = self.norm.op_bias or not normalize
        return self._wrap(nn.Linear(fin, fout, bias=bias), fin, fout, 1, normalize, False, image_input)

    def classifier(self, fin: int, fout: int) -> NormOp:
        """The final Linear, with a bias; ``before_op`` with ``norm.classifier`` puts a
        normalization of its ``fin`` features in front (METHODS.md section 1)."""
        pre = self.norm.make(fin, 1) if self.norm.normalizes_classifier else nn.Identity()
        return NormOp(nn.Linear(fin, fout), pre, nn.Identity())

    def act(self) -> nn.Module:
        return build_act(self.act_name)

    def norm_layer(self, num_features: int, dim: int = 2) -> nn.Module:
        """A bare normalization of a block input, for blocks whose order is fixed (pre-activation ResNets)."""
        return self._unbound(self.norm.make(num_features, dim))

    def join(self, act: bool = True) -> ResidualJoin:
        """A residual join placed by ``norm.placement`` and ``norm.join``; ``act=False``: a plain sum."""
        return ResidualJoin(self.norm.shortcut_after_act, self.act() if act else None)


def normalized_ops(model: nn.Module) -> list[tuple[str, NormOp]]:
    """Every normalized NormOp (see :attr:`NormOp.normalized`), in module order, with its
    qualified name. A ``before_op`` projection shortcut is listed with empty slots."""
    return [(name, m) for name, m in model.named_modules() if isinstance(m, NormOp) and m.normalized]


def init_ops(
    model: nn.Module,
    init_weight: Callable[[torch.Tensor], object],
    kinds: tuple[type[nn.Module], ...] = (nn.Conv2d, nn.Linear),
) -> None:
    """Apply ``init_weight`` to the weight of every module of ``kinds``; zero its bias."""
    for m in model.modules():
        if isinstance(m, kinds):
            init_weight(m.weight)
            if m.bias is not None:
                nn.init.zeros_(m.bias)


def scale_init(model: nn.Module, factor: float) -> None:
    """Multiply the initial weight of every conv and linear layer by ``factor``
    (``model.init_scale``: BNP+GN's "He-Normal weight initialization scaled by 0.1")."""
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, (nn.Conv2d, nn.Linear)):
                m.weight.mul_(factor)


def he_normal_init(model: nn.Module) -> None:
    """He-normal (fan-in) weights for every conv and linear layer, zero biases."""
    init_ops(model, nn.init.kaiming_normal_)


def glorot_uniform_init(model: nn.Module) -> None:
    """Glorot-uniform weights for every conv and linear layer, zero biases (the BNP nets)."""
    init_ops(model, nn.init.xavier_uniform_)


def kaiming_fan_out_init(model: nn.Module) -> None:
    """torchvision's ImageNet conv init: He-normal over fan-out, zero biases; linears untouched."""
    init_ops(model, partial(nn.init.kaiming_normal_, mode="fan_out", nonlinearity="relu"), (nn.Conv2d,))
