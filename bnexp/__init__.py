"""bnexp: reproduce and extend batch-normalization experiments (BN, POP-Norm, CBN, BNP)."""

__version__ = "0.1.0"
