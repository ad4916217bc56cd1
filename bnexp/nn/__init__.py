"""Normalization methods as plain torch modules: the BN/POP-Norm/CBN family (with AMAT),
batch renormalization, BN with 4 things, scale-invariant BN and BNP gradient preconditioning.

METHODS.md sections 2-5 define them; ``docs/methods/`` explains each with an example.
"""

from bnexp.nn.bnp import BNP, BNPLayer, preconditioner_matrix
from bnexp.nn.family import (
    AMAT_OMEGA,
    CBN1d,
    CBN2d,
    NormFamily,
    NormFamily1d,
    NormFamily2d,
    POPNorm1d,
    POPNorm2d,
    set_learning_rate,
)
from bnexp.nn.four_things import FourThingsBN, FourThingsBN1d, FourThingsBN2d
from bnexp.nn.renorm import BatchRenorm, BatchRenorm1d, BatchRenorm2d
from bnexp.nn.scale_invariant import ScaleInvariantBN, ScaleInvariantBN1d, ScaleInvariantBN2d, is_scale_invariant

__all__ = [
    "AMAT_OMEGA",
    "BNP",
    "BNPLayer",
    "BatchRenorm",
    "BatchRenorm1d",
    "BatchRenorm2d",
    "CBN1d",
    "CBN2d",
    "FourThingsBN",
    "FourThingsBN1d",
    "FourThingsBN2d",
    "NormFamily",
    "NormFamily1d",
    "NormFamily2d",
    "POPNorm1d",
    "POPNorm2d",
    "ScaleInvariantBN",
    "ScaleInvariantBN1d",
    "ScaleInvariantBN2d",
    "is_scale_invariant",
    "preconditioner_matrix",
    "set_learning_rate",
]
