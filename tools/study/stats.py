"""The verdict rule, for every claim (the words restate what the interval says; the registered predictions are CLAIMS'):
    The estimate is the mean over seeds of the paired difference (or of the per-seed value), with its 95% interval
    from Student's t with n - 1 degrees of freedom. The claim's effect is oriented so that the paper predicts a
    positive value, at least `predicted` (the paper's number, or "any effect above X" where the paper gives none).
    Each verdict states two facts: is 0 excluded, and is the predicted effect excluded?
    not exercised        the manipulation check fails: the intervention did not change what it acts through
    reproduced           0 excluded on the predicted side, the predicted effect not excluded (lo > 0, hi >= predicted)
    smaller than predicted   0 excluded on the predicted side and the predicted effect excluded (0 < lo, hi < predicted)
    opposite             0 excluded on the other side (hi < 0)
    predicted effect excluded, no effect not excluded   lo <= 0 <= hi < predicted
    inconclusive         both 0 and the predicted effect inside the interval; the report gives the smallest effect
                         this n detects with 80% power, MDE = (t_0.975 + t_0.80) * sd / sqrt(n)
    A claim of "as well as" is judged against a non-inferiority margin m: non-inferior when lo > -m, inferior when
    hi < -m, else inconclusive; its power statement is the true effect from which lo > -m has 80% power, MDE - m. A claim whose arms (or whose manipulation check's arms) have no runs yet is "not run".
    Beside each verdict: the same rule after Holm's correction within the claim's family, the tests its registration
    added (for each exercised claim "effect = 0" and "effect = predicted", two-sided t tests; for a non-inferiority
    claim "effect = -m" alone): a later registration is a family of its own and changes no earlier verdict. And how
    many of the n leave-one-seed-out estimates change the verdict.
"""

from __future__ import annotations

import ast
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

# the report quotes the docstring as written (Python 3.13 strips its indentation from __doc__; the source keeps it)
VERDICT_RULE = ast.get_docstring(ast.parse(Path(__file__).read_text()), clean=False).rstrip()


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
    return words(e.mean, e.lo > (-margin if margin is not None else 0) or e.hi < (-margin if margin is not None else 0),
                 e.lo > predicted or e.hi < predicted, predicted, margin)


def words(mean: float, zero_excluded: bool, predicted_excluded: bool, predicted: float,
          margin: float | None = None) -> str:
    """The verdict from which hypotheses the interval (or a corrected test) excludes; for a margin claim the first
    flag is "-m excluded". The side is the estimate's."""
    if margin is not None:
        return ("non-inferior" if mean > -margin else "inferior") if zero_excluded else "inconclusive"
    if zero_excluded and mean < 0:
        return "opposite"
    if zero_excluded:
        return "smaller than predicted" if predicted_excluded and mean < predicted else "reproduced"
    return "predicted effect excluded, no effect not excluded" if predicted_excluded and mean < predicted \
        else "inconclusive"


def p_value(e: Estimate, null: float) -> float:
    """Two-sided one-sample t test of `null` for the seeds' mean."""
    from scipy.stats import t

    if e.n < 2 or not e.sd > 0:
        return math.nan
    return float(2 * t.sf(abs(e.mean - null) / (e.sd / math.sqrt(e.n)), e.n - 1))


def holm(pvalues: list[float]) -> list[float]:
    """Holm's step-down adjustment (family-wise error): the k-th smallest of m p-values times (m - k + 1), made
    monotone, capped at 1. NaN (no test) stays NaN and is not counted in m."""
    tested = sorted((p, i) for i, p in enumerate(pvalues) if not math.isnan(p))
    out, running = [math.nan] * len(pvalues), 0.0
    for k, (p, i) in enumerate(tested):
        running = max(running, min(1.0, p * (len(tested) - k)))
        out[i] = running
    return out


def seed_drops(e: Estimate, predicted: float, exercised: bool, margin: float | None = None) -> int:
    """How many of the n leave-one-seed-out estimates give another verdict."""
    base = verdict(e, predicted, exercised, margin)
    return sum(verdict(estimate(e.values[:i] + e.values[i + 1:]), predicted, exercised, margin) != base
               for i in range(e.n)) if e.n > 2 else 0


def fmt_est(e: Estimate, digits: int = 3, signed: bool = True) -> str:
    """'mean [lo, hi] (n)': the interval is the 95% t interval over seeds; signed for differences."""
    if e.n == 0:
        return "n/a"
    f = f"{'+' if signed else ''}.{digits}g"
    # a mean that is zero but for its sum's rounding (-2.2e-17 of values ~0.1) reads as what it is: 0
    mean = 0.0 if abs(e.mean) <= 1e-12 * max(map(abs, e.values), default=0.0) else e.mean
    if e.n < 2:
        return f"{mean:{f}} (1 seed)"
    return f"{mean:{f}} [{e.lo:{f}}, {e.hi:{f}}] (n={e.n})"


def pct(v: float) -> str:
    return f"{v:.2%}" if math.isfinite(v) else "n/a"


def level(values) -> str:
    """An arm's own value (not a difference): mean [95% t interval] (n)."""
    return fmt_est(estimate(values), signed=False)
