"""The verdict rule, for every claim (written before the runs were read; CLAIMS holds each prediction):
    The estimate is the mean over seeds of the paired difference (or of the per-seed value), with its 95% interval
    from Student's t with n - 1 degrees of freedom. The claim's effect is oriented so that the paper predicts a
    positive value, at least `predicted` (the paper's number, or "any effect above X" where the paper gives none).
    not exercised   the manipulation check fails: the intervention did not change what it acts through
    reproduced      the interval excludes 0 on the predicted side and reaches the predicted effect (lo > 0, hi >= predicted)
    contradicted    the interval lies wholly below the predicted effect (hi < predicted)
    inconclusive    neither; the report gives the smallest effect this n detects with 80% power,
                    MDE = (t_0.975 + t_0.80) * sd / sqrt(n)
    A claim of "as well as" is judged against a non-inferiority margin m: reproduced when lo > -m, contradicted when
    hi < -m, else inconclusive. A claim whose arms (or whose manipulation check's arms) have no runs yet is "not run".
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

VERDICT_RULE = __doc__.rstrip()  # the report quotes it


@dataclass
class Estimate:
    """Mean over seeds of a per-seed value (or paired difference), with its 95% t interval and the 80%-power MDE."""
    mean: float
    lo: float
    hi: float
    n: int
    sd: float
    mde: float
    values: list[float] = field(default_factory=list)


def t_quantile(q: float, dof: int) -> float:
    from scipy.stats import t

    return float(t.ppf(q, dof))


def estimate(values) -> Estimate:
    v = np.asarray([x for x in values if x is not None and math.isfinite(x)], dtype=float)
    n = len(v)
    if n < 2:
        m = float(v[0]) if n else math.nan
        return Estimate(m, math.nan, math.nan, n, math.nan, math.nan, v.tolist())
    sd = float(v.std(ddof=1))
    half = t_quantile(0.975, n - 1) * sd / math.sqrt(n)
    mde = (t_quantile(0.975, n - 1) + t_quantile(0.80, n - 1)) * sd / math.sqrt(n)
    return Estimate(float(v.mean()), float(v.mean()) - half, float(v.mean()) + half, n, sd, mde, v.tolist())


def paired(a: dict[int, float], b: dict[int, float]) -> Estimate:
    """a - b over the seeds both arms have (they share the seed's warm start)."""
    return estimate([a[s] - b[s] for s in sorted(set(a) & set(b))])


def verdict(e: Estimate, predicted: float, exercised: bool, margin: float | None = None) -> str:
    if e.n == 0:
        return "not run"  # the arms it needs have no runs yet (the run order says which come first)
    if not exercised:
        return "not exercised"
    if e.n < 2 or math.isnan(e.lo):
        return "inconclusive"
    if margin is not None:  # "as well as": non-inferiority
        return "reproduced" if e.lo > -margin else "contradicted" if e.hi < -margin else "inconclusive"
    if e.lo > 0 and e.hi >= predicted:
        return "reproduced"
    if e.hi < predicted:
        return "contradicted"
    return "inconclusive"


def fmt_est(e: Estimate, digits: int = 3, signed: bool = True) -> str:
    """'mean [lo, hi] (n)': the interval is the 95% t interval over seeds; signed for differences."""
    if e.n == 0:
        return "n/a"
    f = f"{'+' if signed else ''}.{digits}g"
    if e.n < 2:
        return f"{e.mean:{f}} (1 seed)"
    return f"{e.mean:{f}} [{e.lo:{f}}, {e.hi:{f}}] (n={e.n})"


def pct(v: float) -> str:
    return f"{v:.2%}" if math.isfinite(v) else "n/a"


def level(values) -> str:
    """An arm's own value (not a difference): mean [95% t interval] (n)."""
    return fmt_est(estimate(values), signed=False)
