"""Chi-square goodness of fit for the statistical exactness tests: emitted sequences against an exact law."""

from __future__ import annotations

import math
from collections.abc import Hashable, Mapping

__all__ = ["chi2_crit", "chi2_stat"]


def chi2_stat(counts: Mapping[Hashable, int], law: Mapping[Hashable, float], n_draws: int) -> tuple[float, int]:
    """(statistic, degrees of freedom) over the cells with an expected count of at least 5; the rest pooled."""
    stat, cells, pooled_e, pooled_o = 0.0, 0, 0.0, 0
    for key, p in law.items():
        e, o = p * n_draws, counts.get(key, 0)
        if e >= 5:
            stat += (o - e) ** 2 / e
            cells += 1
        else:
            pooled_e, pooled_o = pooled_e + e, pooled_o + o
    if pooled_e > 0:
        stat += (pooled_o - pooled_e) ** 2 / pooled_e
        cells += 1
    return stat, cells - 1


def chi2_crit(dof: int) -> float:
    """Wilson-Hilferty approximation of the chi-square 0.9999 quantile: a false alarm 1 run in 10^4."""
    z = 3.719
    return dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3
