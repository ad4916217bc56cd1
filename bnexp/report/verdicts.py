"""The tests behind a table's ``test`` column, and what many of them say together.

A cell is compared with its published value by Welch's two-sided t-test (:func:`welch`).
Three things a single p-value does not say are handled here:

- **Selection.** A tuned cell reports the best of ``k`` settings. Chosen on the very runs it is
  tested on, its p-value is multiplied by ``k`` (:func:`selection_adjusted`): Bonferroni's
  simultaneous tests of all ``k`` settings, of which the chosen one is one, so the level holds
  whichever one the data picked. Chosen on other seeds, no correction is needed.
- **Many cells.** At level ``alpha`` about ``alpha * m`` of ``m`` tests say "differ" when every
  cell reproduces; :func:`holm` and :func:`benjamini_hochberg` give the adjusted p-values the
  closing line counts (family-wise error rate and false discovery rate).
- **Equivalence.** "agree" only means p >= alpha. :func:`tost` tests the opposite hypothesis,
  that the means differ by at least a margin, with two one-sided Welch tests.

The t tails come from ``scipy.special.stdtr``, the function ``scipy.stats.t``'s ``cdf`` and
``sf`` call, and Benjamini-Hochberg is ``scipy.stats.false_discovery_control``'s computation:
importing ``scipy.stats`` takes seconds, a large part of a table's time (the same values,
``tests/test_verdicts.py``).
"""

from __future__ import annotations

import math
from typing import NamedTuple, Sequence

import numpy as np


class Welch(NamedTuple):
    """Our mean minus the paper's, its standard error and Welch-Satterthwaite degrees of freedom."""

    diff: float
    se: float
    df: float


def welch(mean1: float, std1: float, n1: int, mean2: float, std2: float, n2: int) -> Welch:
    """The parts of Welch's test of two groups given as mean, sample std and count."""
    a, b = std1**2 / n1, std2**2 / n2
    se = math.sqrt(a + b)
    df = (a + b) ** 2 / (a**2 / (n1 - 1) + b**2 / (n2 - 1)) if se > 0 else math.inf
    return Welch(mean1 - mean2, se, df)


def t_cdf(t: float, df: float) -> float:
    """Student's t distribution function, P(T <= t) with ``df`` degrees of freedom
    (``scipy.stats.t.cdf``; its tail ``sf(t)`` is ``t_cdf(-t)``)."""
    from scipy.special import stdtr

    return float(stdtr(df, t))


def welch_p(w: Welch) -> float:
    """The two-sided p-value. Two groups without spread: 1 when their means are equal, 0
    otherwise (the t statistic is 0/0 or infinite)."""
    if w.se == 0:
        return 1.0 if w.diff == 0 else 0.0
    return 2 * t_cdf(-(abs(w.diff) / w.se), w.df)


def tost(w: Welch, margin: float) -> float:
    """The p-value of two one-sided Welch tests of "the means differ by at least ``margin``":
    the larger of P(T >= (diff + margin) / se) and P(T <= (diff - margin) / se). Small: the
    means are within the margin (equivalent at that level)."""
    if w.se == 0:
        return 0.0 if abs(w.diff) < margin else 1.0
    lower = t_cdf(-((w.diff + margin) / w.se), w.df)  # H0: diff <= -margin
    upper = t_cdf((w.diff - margin) / w.se, w.df)  # H0: diff >= +margin
    return max(lower, upper)


def selection_adjusted(p: float, candidates: int) -> float:
    """``p`` of a setting chosen among ``candidates`` on the runs it is tested on: Bonferroni
    over the candidates, ``min(1, k p)``."""
    return min(1.0, p * max(1, candidates))


def holm(pvalues: Sequence[float]) -> list[float]:
    """Holm's step-down adjusted p-values, in the input's order: the i-th smallest of ``m`` is
    ``max over j <= i of min(1, (m - j + 1) p_(j))``. A test rejects at family-wise level
    alpha when its adjusted p-value is below alpha. (scipy has no Holm.)"""
    m = len(pvalues)
    order = sorted(range(m), key=lambda i: pvalues[i])
    adjusted, running = [0.0] * m, 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (m - rank) * pvalues[i]))
        adjusted[i] = running
    return adjusted


def benjamini_hochberg(pvalues: Sequence[float]) -> list[float]:
    """Benjamini-Hochberg adjusted p-values, in the input's order: below alpha, the false
    discovery rate of those called "differ" is at most alpha. The i-th smallest of ``m`` is
    ``min over j >= i of m p_(j) / j``, at most 1, computed as
    ``scipy.stats.false_discovery_control(method="bh")`` does (the same floating-point steps)."""
    p = np.asarray(pvalues, dtype=float)
    order = np.argsort(p)
    ranked = p[order] * (len(p) / np.arange(1, len(p) + 1, dtype=float))
    adjusted = np.empty_like(p)
    adjusted[order] = np.minimum.accumulate(ranked[::-1])[::-1]
    return [float(q) for q in np.clip(adjusted, 0.0, 1.0)]
