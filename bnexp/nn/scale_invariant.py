"""Scale invariance (METHODS.md section 5): the ``bn_si`` module and the tagging rule."""

from __future__ import annotations

from typing import Optional

from torch import Tensor, nn

from bnexp.nn._base import FEATURES, IMAGES
from bnexp.nn.create_norm import register_norm
from bnexp.nn.family import NormFamily

_TORCH_BN = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm)


class ScaleInvariantBN(NormFamily):
    """BN whose smoothing term is ``eps * ||w_k||^2``; use the 1d/2d subclasses.

    ``w_k`` is the slice of the producing op's weight that makes channel ``k`` (a row of a
    Linear weight, one filter of a Conv2d). Scaling that weight by ``c`` scales the centered
    input and the smoothing term's square root alike, so the output is exactly unchanged.
    The op is bound once (constructor or :meth:`bind`) and its ``weight`` is read at every
    forward, so the gradient reaches it through the smoothing term too.
    """

    def __init__(self, num_features: int, op: Optional[nn.Module] = None, eps: float = 1e-5,
                 momentum: float = 0.1, sync: bool = False) -> None:
        super().__init__(num_features, eps=eps, momentum=momentum, sync=sync)
        # A tuple keeps the op out of this module's children, parameters and state_dict.
        self._op: tuple[nn.Module, ...] = ()
        if op is not None:
            self.bind(op)

    def extra_repr(self) -> str:
        bound = type(self._op[0]).__name__ if self._op else "nothing"
        return f"{self.num_features}, eps={self.eps}, momentum={self.momentum}, bound to {bound}"

    def bind(self, op: nn.Module) -> None:
        """Use ``op.weight`` (first dimension = this module's channels) for the smoothing."""
        weight = getattr(op, "weight", None)
        if not isinstance(weight, Tensor) or weight.dim() < 2 or weight.shape[0] != self.num_features:
            raise ValueError(
                f"{type(self).__name__}({self.num_features}) needs an op whose weight has "
                f"{self.num_features} rows, got {type(op).__name__}"
            )
        self._op = (op,)

    def _variance_eps(self) -> Tensor:
        if not self._op:
            raise RuntimeError(f"{type(self).__name__} is not bound to the op that feeds it: call .bind(op)")
        weight = self._op[0].weight
        return self.eps * weight.square().flatten(1).sum(1).to(self.weight.dtype)


class ScaleInvariantBN1d(ScaleInvariantBN):
    """``bn_si`` over features (after a Linear)."""

    input_dims = FEATURES


class ScaleInvariantBN2d(ScaleInvariantBN):
    """``bn_si`` over images (after a Conv2d)."""

    input_dims = IMAGES


def is_scale_invariant(norm: nn.Module, op_bias: bool = False) -> bool:
    """Whether the training-mode output of ``op -> norm`` ignores a positive scaling of ``op.weight``.

    ``op_bias`` says whether the op adds a bias (not scaled with the weight). True for
    torch's BatchNorm, ``bn_si``, and coupled family members that scale without AMAT
    (BN-style centering cancels a bias; without centering a bias breaks the invariance);
    GroupNorm and LayerNorm only without an op bias (they center over several channels,
    and are invariant to scaling the whole weight, not one filter). False for decoupled
    norms (beta joins before the division), AMAT and batch renormalization (historical
    statistics enter the forward value), ``scale=False`` and anything else. Apart from
    ``bn_si`` the invariance holds up to the ``eps`` smoothing.
    """
    if isinstance(norm, ScaleInvariantBN) or isinstance(norm, _TORCH_BN):
        return True
    if isinstance(norm, NormFamily):
        return norm.scale and not norm.decouple and not norm.amat and (norm.center or not op_bias)
    if isinstance(norm, (nn.GroupNorm, nn.LayerNorm)):
        return not op_bias
    return False


register_norm("bn_si", ScaleInvariantBN1d, ScaleInvariantBN2d, ("eps", "momentum", "sync"))  # bound to its op later
