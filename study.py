"""The study: each paper's claim about the importance ratio, tested on long answers with a verdict rule that has power.

    python study.py                      # every run below (resumable: finished runs are skipped), then the report
    python study.py --report-only        # rebuild docs/study/ and the README's study section from docs/study/data/

Every run is `train.py --dataset embedded-long --num-prompts 8` (answers of 20-300 tokens, 8 prompts x 8
completions per rollout) for 40 RL steps, held-out greedy accuracy every 5 steps, 5 seeds. A seed is one warm start:
every arm of a seed starts from the same policy, so contrasts are paired by seed. Two cells (regimes):

    base      lr 5e-5, 4 minibatches per rollout (the papers' regime)        claims 1, 2, 4
    stale16   lr 5e-5, 16 minibatches per rollout: stale ratios alone        claims 1, 3, 5

and in each, arms that change one thing at a time (every arm at β = 0 unless its name says otherwise; the GRPO
preset's β 0.04 would otherwise ride along with the ratio level):

    base:     grpo-b0, gspo, grpo-b0-sumnorm (GRPO with Dr.GRPO's aggregation only), dr_grpo
    stale16:  grpo-b0, gspo, dapo, dapo-eh0.2 (clip-higher off), grpo (β 0.04), gspo-b0.04

The verdict rule, for every claim (written before the runs were read; CLAIMS holds each prediction):
    The estimate is the mean over seeds of the paired difference (or of the per-seed value), with its 95% interval
    from Student's t with n - 1 degrees of freedom. The claim's effect is oriented so that the paper predicts a
    positive value, at least `predicted` (the paper's number, or "any effect above X" where the paper gives none).
    not exercised   the manipulation check fails: the intervention did not change what it acts through
    reproduced      the interval excludes 0 on the predicted side and reaches the predicted effect (lo > 0, hi >= predicted)
    contradicted    the interval lies wholly below the predicted effect (hi < predicted)
    inconclusive    neither; the report gives the smallest effect this n detects with 80% power,
                    MDE = (t_0.975 + t_0.80) * sd / sqrt(n)
    A claim of "as well as" is judged against a non-inferiority margin m: reproduced when lo > -m, contradicted when
    hi < -m, else inconclusive.
The report (verdicts, one figure per claim, every run in runs.csv) goes to docs/study/; the per-step data it is built
from is committed in docs/study/data/ (one gzipped JSONL per run).
"""

from __future__ import annotations

import gzip
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

import sweep
from sweep import ALGO_COLORS, series

STEPS, EVAL_EVERY, PROMPTS = 40, 5, 8
# 8 prompts x 8 completions per rollout (the default run uses 16), 40 RL steps: ~5 run-minutes a run on 1 thread
COMMON = ["--dataset", "embedded-long", "--total-steps", str(STEPS), "--eval-every", str(EVAL_EVERY),
          "--num-prompts", str(PROMPTS), "--wandb-mode", "disabled"]
# cell -> the overrides every run of the cell gets (the regime), and its arms: arm -> (algo, the arm's overrides).
# Every arm names its β when it is not the preset's; a contrast changes one thing (see CLAIMS).
CELLS: dict[str, tuple[dict[str, str], dict[str, tuple[str, dict[str, str]]]]] = {
    "stale16": ({"num_minibatches": "16"}, {
        "grpo-b0": ("grpo", {"beta": "0"}),
        "gspo": ("gspo", {}),
        "dapo": ("dapo", {}),
        "dapo-eh0.2": ("dapo", {"epsilon_high": "0.2"}),
        "grpo": ("grpo", {}),
        "gspo-b0.04": ("gspo", {"beta": "0.04"}),
    }),
    "base": ({}, {
        "grpo-b0": ("grpo", {"beta": "0"}),
        "gspo": ("gspo", {}),
        "grpo-b0-sumnorm": ("grpo", {"beta": "0", "loss_agg_mode": "seq-mean-token-sum-norm"}),
        "dr_grpo": ("dr_grpo", {}),
    }),
}
# The arms each claim's main verdict rests on run first (all seeds), the others after: a study cut short keeps the
# verdicts' seeds whole.
SECOND = {("stale16", "grpo"), ("stale16", "gspo-b0.04"), ("base", "dr_grpo")}
SEEDS = (0, 1, 2, 3, 4)


def grid(cells: tuple[str, ...], seeds: tuple[int, ...]) -> list[dict]:
    """Every run of the study as train.py flags: the main arms seed by seed, then the SECOND ones."""
    runs = []
    for second in (False, True):
        for seed in seeds:
            for cell in cells:
                regime, arms = CELLS[cell]
                for arm, (algo, overrides) in arms.items():
                    if ((cell, arm) in SECOND) == second:
                        runs.append({"algo": algo, "seed": str(seed), "run_name": f"{cell}-{arm}-s{seed}",
                                     **regime, **overrides})
    return runs


# ---------------------------------------------------------------------------------------------------------------
# The claims, pre-registered: quantity, contrast, predicted effect, manipulation check
# ---------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Claim:
    key: str
    title: str
    source: str
    quantity: str  # what is measured per seed, with its unit
    contrast: str  # which arms, paired by seed
    predicted: float  # the effect the paper predicts, oriented positive, in the quantity's unit
    manipulation: str  # what must move for the claim to be exercised, and the threshold
    margin: float | None = None  # "as well as" claims: the non-inferiority margin


CLAIMS = [
    Claim("1-base", "1. ratio spread grows with length (seed note; GSPO §3-4), base",
          "GSPO §3-4; seed note 000",
          "exponent a of std_i(Σ_t log ρ_it) ∝ |y|^a over length quartiles (per run; mean over the seed's arms); "
          "GSPO's log s_i = Σ/|y| then goes as |y|^(a-1)",
          "base, all four arms, per seed", 0.5,
          "mean |log ρ_t| over the update's tokens >= 1e-3 nats (ratios leave 1 at all)"),
    Claim("1-stale16", "1. ratio spread grows with length, stale16",
          "GSPO §3-4; seed note 000",
          "exponent a of std_i(Σ_t log ρ_it) ∝ |y|^a (as above)",
          "stale16, all six arms, per seed", 0.5,
          "mean |log ρ_t| >= 1e-3 nats"),
    Claim("2-clip", "2a. GSPO clips ~100x more units than GRPO (GSPO §5.2)", "GSPO §5.2, Fig. 4",
          "log10 of the run-mean clip fraction (GSPO: sequences; GRPO: tokens)",
          "base: gspo - grpo-b0, paired by seed", 2.0,
          "GRPO clips some tokens at all: its clip fraction > 0 in every seed"),
    Claim("2-learn", "2b. ...and learns as well (GSPO §5.2)", "GSPO §5.2, Fig. 4",
          "final held-out accuracy (step 40)",
          "base: gspo - grpo-b0, paired by seed", 0.0,
          "GSPO's clip fraction is above GRPO's in every seed (the clipping really differs)", margin=0.10),
    Claim("3-b0", "3. token-level ratios collapse under stale data, GSPO does not (β = 0)", "GSPO §1, §5.1",
          "peak-to-final drop of held-out accuracy (max over evaluations minus the last)",
          "stale16: grpo-b0 - gspo, paired by seed", 0.10,
          "staleness acts: mean |log ρ_t| in stale16 >= 2x base, for both algorithms"),
    Claim("3-b0.04", "3. the same at β = 0.04", "GSPO §1, §5.1",
          "peak-to-final drop of held-out accuracy",
          "stale16: grpo - gspo-b0.04 (both β 0.04), paired by seed", 0.10,
          "staleness acts: mean |log ρ_t| in stale16 >= 2x base"),
    Claim("4-agg", "4. GRPO's 1/|y| lets wrong answers grow longer (Dr.GRPO §3)", "Dr.GRPO §3.1, Fig. 5",
          "drift (last 10 minus first 10 steps) of incorrect/correct length within mixed groups "
          "(charts/len_incorrect_rel: free of which prompts are wrong)",
          "base: grpo-b0 - grpo-b0-sumnorm (aggregation only), paired by seed", 0.05,
          "lengths differ within a batch: median over steps of longest/shortest completion >= 2 (so 1/|y| "
          "weights tokens differently)"),
    Claim("5-entropy", "5. clip-higher keeps entropy up (DAPO §3.1)", "DAPO §3.1, Fig. 2",
          "log of the entropy ratio, entropy over the last 10 steps (nats/token)",
          "stale16: dapo (ε_high 0.28) vs dapo-eh0.2, paired by seed", math.log(1.1),
          "ε_high binds: >= 1% of tokens have a clip outcome that differs between 0.2 and 0.28 (A > 0 and "
          "1.2 < ρ <= 1.28), in the ε_high 0.2 arm's updates"),
]
# Reported beside claim 4, with no prediction of its own: the std scaling, the other half of Dr.GRPO's change.
STD_CONTRAST = ("base", "grpo-b0-sumnorm", "dr_grpo")
MANIPULATION = {"abs_log": 1e-3, "stale_x": 2.0, "length_x": 2.0, "clip_differs": 0.01}


# ---------------------------------------------------------------------------------------------------------------
# The verdict rule (the module docstring states it)
# ---------------------------------------------------------------------------------------------------------------


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


# ---------------------------------------------------------------------------------------------------------------
# Reading the runs
# ---------------------------------------------------------------------------------------------------------------


def load(runs_dir: Path) -> list[dict]:
    """Every run folder the study started: finished (summary.json) or stopped by an error (a non-finite stop)."""
    out = []
    for flags_file in sorted(runs_dir.glob("*/sweep.json")):
        d = flags_file.parent
        if not (d / "metrics.jsonl").is_file():
            continue
        rows = [json.loads(line) for line in (d / "metrics.jsonl").open()]
        finished = (d / "summary.json").is_file()
        log = (d / "console.log").read_text(errors="ignore") if (d / "console.log").is_file() else ""
        stopped = None if finished else next((why for key, why in STOPS.items() if key in log), None)
        if not finished and not stopped:
            continue  # still running, or interrupted: not a result yet
        flags = json.loads(flags_file.read_text())
        out.append({"name": d.name, "cell": d.name.rsplit("-", 2)[0], "algo": flags["algo"],
                    "seed": int(flags["seed"]), "total_steps": int(flags.get("total_steps", STEPS)), "rows": rows,
                    "stopped": stopped})
    return out


def cell_runs(runs: list[dict], cell: str, algo: str) -> list[dict]:
    return [r for r in runs if r["cell"] == cell and r["algo"] == algo]


def mean_std(values) -> tuple[float, float]:
    """Mean and sample std over seeds; the std is nan for a single run (no spread to compare against)."""
    v = np.asarray([x for x in values if x is not None and math.isfinite(x)], dtype=float)
    return (float(v.mean()), float(v.std(ddof=1)) if len(v) > 1 else math.nan) if len(v) else (math.nan, math.nan)


def differ(a: tuple[float, float], b: tuple[float, float]) -> bool:
    """The study's rule: two means differ when their mean ± std intervals do not overlap (never on one seed)."""
    return a[0] + a[1] < b[0] - b[1] or b[0] + b[1] < a[0] - a[1]


def comparable(*cells: tuple[float, float]) -> bool:
    """Every cell has at least two seeds, so the rule can be applied."""
    return all(math.isfinite(m) and math.isfinite(s) for m, s in cells)


def fmt(ms: tuple[float, float], digits: int = 3) -> str:
    if math.isnan(ms[0]):
        return "n/a"
    return f"{ms[0]:.{digits}g} (1 seed)" if math.isnan(ms[1]) else f"{ms[0]:.{digits}g} ± {ms[1]:.{digits - 1}g}"


def run_mean(run: dict, key: str, first: int = 1, last: int | None = None) -> float:
    s, y = series(run, key)
    keep = (s >= first) & (s <= (last if last is not None else s.max() if len(s) else 0))
    return float(np.mean(y[keep])) if keep.any() else math.nan


def final_accuracy(run: dict) -> float:
    s, acc = series(run, "eval/accuracy")
    return float(acc[-1]) if len(acc) else math.nan


# ---------------------------------------------------------------------------------------------------------------
# The claims
# ---------------------------------------------------------------------------------------------------------------


def length_exponent(run: dict, key: str) -> float:
    """Least-squares slope of log std vs log length over every (step, length quartile) of one run."""
    xs, ys = [], []
    for q in range(1, 5):
        s_len, lens = series(run, f"lenbucket/q{q}_len")
        s_std, stds = series(run, f"lenbucket/q{q}_{key}")
        by_step = dict(zip(s_std.tolist(), stds.tolist()))
        for step, length in zip(s_len.tolist(), lens.tolist()):
            if by_step.get(step, 0) > 0 and length > 0:
                xs.append(math.log(length))
                ys.append(math.log(by_step[step]))
    return float(np.polyfit(xs, ys, 1)[0]) if len(set(xs)) > 1 else math.nan


def ci95(values) -> tuple[float, float]:
    """(mean, half-width of the 95% t interval) over seeds."""
    v = [x for x in values if math.isfinite(x)]
    if len(v) < 2:
        return (v[0] if v else math.nan, math.nan)
    return float(np.mean(v)), T_95.get(len(v), 1.96) * float(np.std(v, ddof=1)) / math.sqrt(len(v))


def collapse_step(run: dict) -> int | None:
    """The first evaluation at which held-out accuracy sits COLLAPSE_DROP below its running peak (or the step of a
    non-finite stop); None when the run never collapsed."""
    if run["stopped"] == STOPS["non-finite losses"]:
        return max(r["step"] for r in run["rows"])
    s, acc = series(run, "eval/accuracy")
    peak = -1.0
    for step, a in zip(s.tolist(), acc.tolist()):
        peak = max(peak, a)
        if a <= peak - COLLAPSE_DROP:
            return int(step)
    return None


def failed(run: dict) -> bool:
    """Collapsed, stopped by an error, or ended below the accuracy it started from (a run that only ever falls has
    no peak to fall from)."""
    return (collapse_step(run) is not None or run["stopped"] is not None
            or final_accuracy(run) < run["rows"][0].get("eval/accuracy", math.nan))


def length_drift(run: dict, key: str) -> float:
    """Mean of `key` over the last 10 steps minus over the first 10; nan for a run too short for two windows."""
    return sweep.drift(run, key) if len(series(run, key)[1]) >= 20 else math.nan


# ---------------------------------------------------------------------------------------------------------------
# The report
# ---------------------------------------------------------------------------------------------------------------

CELL_STYLES = {"base": "-", "eh02": "--", "stale16": (0, (5, 1, 1, 1, 1, 1)), "stale": ":",  # one line style
               "stale-kl": "-.", "stale16-kl": (0, (1, 2)), "long120": (0, (8, 2)),  # per cell, in every figure
               "eh02-long120": (0, (3, 1, 1, 1))}


def style(cell: str, algo: str) -> dict:
    return {"color": ALGO_COLORS[algo], "linestyle": CELL_STYLES[cell]}


def label(cell: str, algo: str, runs: list[dict]) -> str:
    extra = " ε_high=0.2" if cell.startswith("eh02") else f" β={KL_SWAP.get(algo, '')}" if cell.endswith("-kl") else ""
    return f"{algo}{extra} [{cell}, {len(runs)} seeds]"


def claim_length(runs: list[dict]) -> dict:
    """Claim 1: exponents of std(Σ_t log ρ_t) and std(log s_i) against length, per algo (base and stale)."""
    out = {}
    for cell in ("base", "stale"):
        for algo in ALGOS:
            rs = cell_runs(runs, cell, algo)
            if rs:
                out[(cell, algo)] = {k: ci95([length_exponent(r, k) for r in rs]) for k in ("std_logsum", "std_log_s")}
    pooled = [r for r in runs if r["cell"] == "base"]
    out["pooled"] = {k: ci95([length_exponent(r, k) for r in pooled]) for k in ("std_logsum", "std_log_s")}
    return out


def exponent_verdict(ms: tuple[float, float], predicted: float, sign: int) -> str:
    """Reproduced when the 95% interval holds the i.i.d. exponent or lies beyond it (faster growth / shrinkage)."""
    mean, half = ms
    if math.isnan(mean) or math.isnan(half):
        return "inconclusive"
    lo, hi = mean - half, mean + half
    if lo <= predicted <= hi or (sign > 0 and lo > predicted) or (sign < 0 and hi < predicted):
        return "reproduced"
    return "not reproduced"


STALE_CELLS = ("stale16", "stale")  # claim 3's regimes, mildest first
STALE_NAMES = {"stale16": "16 minibatches, lr 5e-5", "stale": "16 minibatches, lr 2e-4"}
TOKEN_ALGOS = ("grpo", "dr_grpo", "dapo")


def stability_verdict(gspo: tuple[int, int], token: list[tuple[int, int]]) -> str:
    """Claim 3 in one regime, from (failed, runs) counts: reproduced when GSPO never fails while at least two
    token-level objectives fail in most of their seeds; not reproduced when GSPO fails at least as often as the
    token-level objectives on average (including when none fails); inconclusive otherwise or with < 2 seeds."""
    if not token or gspo[1] < 2 or any(m < 2 for _, m in token):
        return "inconclusive"
    if gspo[0] == 0 and sum(n > m / 2 for n, m in token) >= 2:
        return "reproduced"
    if gspo[0] / gspo[1] >= np.mean([n / m for n, m in token]):
        return "not reproduced"
    return "inconclusive"


def matched_beta(acc: dict, cell: str) -> str:
    """GRPO against GSPO at the same KL weight (the presets differ in β as well as in the ratio): one from the
    cell, the other from its KL-swapped twin, compared by the study's rule."""
    twin = cell + "-kl"
    pairs = {"0": ((twin, "grpo"), (cell, "gspo")), "0.04": ((cell, "grpo"), (twin, "gspo"))}
    parts = []
    for beta, (g, s) in pairs.items():
        a, b = acc[g], acc[s]  # every cell x algo has an entry (nan without runs)
        if comparable(a, b):
            verdict = "same by the rule" if not differ(a, b) else ("GSPO higher" if b[0] > a[0] else "GRPO higher")
            parts.append(f"β={beta}: GRPO {fmt(a)} vs GSPO {fmt(b)} ({verdict})")
    return f"; at equal β, final accuracy: {', '.join(parts)}" if parts else ""


def repeats_base(run: dict, runs: list[dict]) -> bool | None:
    """Whether a 120-step run's first STEPS steps are those of the 40-step run it extends (same algo and seed),
    metric for metric (timings aside); None without that run."""
    twin = [r for r in cell_runs(runs, LONGER[run["cell"]], run["algo"]) if r["seed"] == run["seed"]]
    head = lambda rows: [{k: v for k, v in row.items() if not k.startswith("perf/")}  # noqa: E731
                         for row in rows if row["step"] <= STEPS]
    return head(run["rows"]) == head(twin[0]["rows"]) if twin else None


def per_horizon(judged: dict[str, str]) -> str:
    """One verdict when the 40- and 120-step cells agree (or one alone could be judged), else each with its own."""
    judged = {h: v for h, v in judged.items() if v != "inconclusive"} or {"": "inconclusive"}
    return next(iter(judged.values())) if len(set(judged.values())) == 1 else \
        "; ".join(f"{h}: {v}" for h, v in judged.items())


def above(a: tuple[float, float], b: tuple[float, float], also: bool = True) -> str:
    """A claim that a's mean is above b's: reproduced when it is and they differ by the rule (and `also` holds),
    inconclusive without two seeds on each side."""
    if not comparable(a, b):
        return "inconclusive"
    return "reproduced" if also and a[0] > b[0] and differ(a, b) else "not reproduced"


def verdicts(runs: list[dict]) -> tuple[list[dict], dict]:
    """The verdict table's rows, and the numbers behind them."""
    rows, numbers = [], {}
    # 1. length and ratio spread
    ln = claim_length(runs)
    numbers["length"] = ln
    grow, shrink = ln["pooled"]["std_logsum"], ln["pooled"]["std_log_s"]
    per_algo = "; ".join(f"{a} {ln[('base', a)]['std_logsum'][0]:+.2f}/{ln[('base', a)]['std_log_s'][0]:+.2f}"
                         for a in ALGOS if ("base", a) in ln)
    v_grow, v_shrink = exponent_verdict(grow, 0.5, +1), exponent_verdict(shrink, -0.5, -1)
    rows.append({"claim": "1. ratio spread vs length (seed note; GSPO §4)",
                 "predicted": "std Σ_t log ρ_t ∝ |y|^0.5 (or faster); std log s_i ∝ |y|^-0.5",
                 "measured": f"exponents (95% CI, base cell, all algos): Σ {grow[0]:+.2f} ± {grow[1]:.2f}, "
                             f"log s {shrink[0]:+.2f} ± {shrink[1]:.2f}; per algo Σ/log s: {per_algo}",
                 "verdict": v_grow if v_grow == v_shrink else f"Σ: {v_grow}; log s: {v_shrink}"})
    # 2. clip fractions
    clip = {(c, a): mean_std([run_mean(r, "clip/frac") for r in cell_runs(runs, c, a)])
            for c in ("base",) + STALE_CELLS for a in ALGOS}
    numbers["clip"] = clip
    measured, ratio = [], {}
    for c in ("base",) + STALE_CELLS:
        g, t = clip[(c, "gspo")][0], clip[(c, "grpo")][0]
        if math.isfinite(g) and math.isfinite(t) and t > 0:
            ratio[c] = g / t
            measured.append(f"{c}: GSPO {g:.3g} of sequences vs GRPO {t:.3g} of tokens ({g / t:.0f}x)")
    acc = {(c, a): mean_std([final_accuracy(r) for r in cell_runs(runs, c, a)]) for c in CELLS for a in ALGOS}
    numbers["accuracy"] = acc
    start = mean_std([r["rows"][0].get("eval/accuracy") for r in runs if r["rows"]])
    threshold = round(start[0] + 0.2, 2) if math.isfinite(start[0]) else 0.5
    reach = {a: mean_std([steps_to(r, threshold) for r in cell_runs(runs, "base", a)]) for a in ALGOS}
    numbers["steps_to"] = (threshold, reach)
    learn_known = comparable(acc[("base", "gspo")], acc[("base", "grpo")])
    learn_ok = not differ(acc[("base", "gspo")], acc[("base", "grpo")]) or acc[("base", "gspo")][0] > acc[("base", "grpo")][0]
    measured.append(f"final accuracy (base) GSPO {fmt(acc[('base', 'gspo')])} vs GRPO {fmt(acc[('base', 'grpo')])}; "
                    f"steps to {threshold:g}: GSPO {fmt(reach['gspo'], 2)}, GRPO {fmt(reach['grpo'], 2)}")
    rows.append({"claim": "2. GSPO clips ~100x more, learns as well (GSPO §5.2)",
                 "predicted": "clip fraction ratio ~100 (we require >= 30 in the base cell); GSPO learns at least as "
                              "well (final accuracy not below GRPO's by the rule)",
                 "measured": "; ".join(measured),
                 # judged in the paper's regime (base: 4 minibatches); the stale ratio is reported beside it
                 "verdict": "inconclusive" if "base" not in ratio or not learn_known else
                 "reproduced" if ratio["base"] >= 30 and learn_ok else
                 "not reproduced" if ratio["base"] < 30 and not learn_ok else
                 f"clip ratio: {'reproduced' if ratio['base'] >= 30 else 'not reproduced'}; learning: "
                 f"{'reproduced' if learn_ok else 'not reproduced'}"})
    # 3. stability under stale ratios: staleness alone (stale16), then with a 4x larger lr (stale)
    coll, fail = {}, {}
    for c in ("base",) + STALE_CELLS + tuple(f"{c}-kl" for c in STALE_CELLS):
        for a in ALGOS:
            rs = cell_runs(runs, c, a)
            if rs:
                coll[(c, a)] = (sum(collapse_step(r) is not None for r in rs), len(rs))
                fail[(c, a)] = (sum(failed(r) for r in rs), len(rs))
    numbers["collapse"], numbers["failed"] = coll, fail
    measured, per_regime = [], {}
    for c in STALE_CELLS:
        if (c, "gspo") not in fail:
            continue
        per_regime[c] = stability_verdict(fail[(c, "gspo")], [fail[(c, a)] for a in TOKEN_ALGOS if (c, a) in fail])
        each_algo = ", ".join(f"{a} {coll[(c, a)][0]}/{coll[(c, a)][1]} collapsed, {fail[(c, a)][0]} failed, final "
                              f"{fmt(acc[(c, a)])}" for a in ALGOS if (c, a) in coll)
        kl = ", ".join(f"{a} β={KL_SWAP[a]} {coll[(c + '-kl', a)][0]}/{coll[(c + '-kl', a)][1]} collapsed, "
                       f"{fail[(c + '-kl', a)][0]} failed, final {fmt(acc[(c + '-kl', a)])}"
                       for a in ("grpo", "gspo") if (c + "-kl", a) in fail)
        measured.append(f"{c} ({STALE_NAMES[c]}): {each_algo}" + (f"; KL swapped: {kl}" if kl else "")
                        + matched_beta(acc, c))
    verdict3 = "; ".join(f"{c}: {v}" for c, v in per_regime.items()) or "inconclusive"
    if len(set(per_regime.values())) == 1:
        verdict3 = next(iter(per_regime.values()))
    rows.append({"claim": "3. token-level ratios collapse under stale data; GSPO does not (GSPO headline)",
                 "predicted": "collapses for GRPO/Dr.GRPO/DAPO, none for GSPO",
                 "measured": "per algo: collapsed (pre-registered rule), failed (collapsed, ended below its start, or "
                             "stopped), final accuracy; " + " | ".join(measured),
                 "verdict": verdict3})
    # 4. length bias
    drift = {(c, a): mean_std([length_drift(r, "charts/len_incorrect") for r in cell_runs(runs, c, a)])
             for c in ("base", "long120") + STALE_CELLS for a in ("grpo", "dr_grpo")}
    numbers["len_incorrect_drift"] = drift
    rows.append({"claim": "4. GRPO's 1/|y| lets incorrect answers grow longer than Dr.GRPO's (Dr.GRPO)",
                 "predicted": "incorrect length rises under GRPO, flat under Dr.GRPO",
                 "measured": "incorrect-answer length, last 10 minus first 10 steps (tokens): " + "; ".join(
                     f"{c}{f' ({LONG_STEPS} steps)' if c == 'long120' else ''}: GRPO {fmt(drift[(c, 'grpo')], 2)}, "
                     f"Dr.GRPO {fmt(drift[(c, 'dr_grpo')], 2)}" for c in ("base", "long120") + STALE_CELLS
                     if c == "base" or comparable(drift[(c, "grpo")], drift[(c, "dr_grpo")])),
                 # GRPO's incorrect answers lengthen, and more than Dr.GRPO's
                 "verdict": per_horizon({f"{n} steps": above(drift[(c, "grpo")], drift[(c, "dr_grpo")],
                                                             also=drift[(c, "grpo")][0] > 0)
                                         for n, c in ((STEPS, "base"), (LONG_STEPS, "long120"))})})
    # 5. clip-higher and entropy
    ent = {(c, a): mean_std([run_mean(r, "losses/entropy", first=r["total_steps"] - 9) for r in cell_runs(runs, c, a)])
           for c, a in (("base", "dapo"), ("eh02", "dapo"), ("base", "grpo"), ("long120", "dapo"),
                        ("eh02-long120", "dapo"))}
    numbers["entropy_last10"] = ent
    hi, lo = ent[("base", "dapo")], ent[("eh02", "dapo")]
    hi3, lo3 = ent[("long120", "dapo")], ent[("eh02-long120", "dapo")]
    rows.append({"claim": "5. clip-higher (ε_high 0.28) keeps entropy higher (DAPO §3.1)",
                 "predicted": "entropy DAPO > DAPO with ε_high 0.2, and higher accuracy",
                 "measured": f"entropy (nats/token, last 10 steps): DAPO {fmt(hi)}, ε_high 0.2 {fmt(lo)}, GRPO "
                             f"{fmt(ent[('base', 'grpo')])}; final accuracy DAPO {fmt(acc[('base', 'dapo')])}, "
                             f"ε_high 0.2 {fmt(acc[('eh02', 'dapo')])}" + (
                                 f"; {LONG_STEPS} steps (long120): entropy DAPO {fmt(hi3)}, ε_high 0.2 {fmt(lo3)}, final "
                                 f"accuracy DAPO {fmt(acc[('long120', 'dapo')])}, ε_high 0.2 "
                                 f"{fmt(acc[('eh02-long120', 'dapo')])}" if comparable(hi3, lo3) else ""),
                 "verdict": per_horizon({f"{STEPS} steps": above(hi, lo), f"{LONG_STEPS} steps": above(hi3, lo3)})})
    return rows, numbers


PRECURSORS = ("ratio/token_var", "ratio/seq_logsum_var", "clip/frac", "losses/entropy", "losses/grad_norm")


def precursor_rows(runs: list[dict], window: int = EVAL_EVERY) -> list[str]:
    """Markdown rows: each collapsed run's diagnostics over the `window` steps before its collapse, next to the same
    steps' mean over the runs of its cell that did not collapse."""
    lines = []
    for r in runs:
        step = collapse_step(r)
        if step is None:
            continue
        calm = [o for o in runs if o["cell"] == r["cell"] and collapse_step(o) is None]
        cells = []
        for key in PRECURSORS:
            mine = run_mean(r, key, first=step - window + 1, last=step)
            theirs = np.nanmean([run_mean(o, key, first=step - window + 1, last=step) for o in calm]) if calm else math.nan
            cells.append(f"{mine:.3g} ({theirs:.3g})")
        lines.append(f"| {r['name']} | {step} | " + " | ".join(cells) + " |")
    return lines


def write_figures(runs: list[dict], out: Path) -> dict[str, int]:
    """One PNG per claim; returns the number of plotted points in each (0 would mean an empty figure)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    band = sweep.mean_band
    points = {}

    def each(cells, algos=ALGOS):
        for c in cells:
            for a in algos:
                rs = cell_runs(runs, c, a)
                if rs:
                    yield c, a, rs

    # claim 1: bucket std against length, log-log, with the i.i.d. slopes
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for c, a, rs in each(("base", "stale")):
        for ax, key in zip(axes, ("std_logsum", "std_log_s")):
            pts = sweep.length_bucket_points(rs, key)
            if pts:
                x, y = np.array(pts).T
                ax.loglog(x, y, marker="o", label=label(c, a, rs), **style(c, a))
    for ax, power, name in ((axes[0], 0.5, "|y|^0.5"), (axes[1], -0.5, "|y|^-0.5")):
        lines = ax.get_lines()
        if lines:
            x = np.geomspace(min(min(ln.get_xdata()) for ln in lines), max(max(ln.get_xdata()) for ln in lines), 20)
            y0 = np.exp(np.mean([np.log(ln.get_ydata()).mean() for ln in lines]))
            ax.loglog(x, y0 * (x / np.exp(np.log(x).mean())) ** power, "k", lw=1, alpha=0.6, label=f"∝ {name} (i.i.d.)")
        ax.set(xlabel="completion length |y| (tokens, quartile mean)")
        ax.legend(fontsize=6)
    axes[0].set(title="std of Σ_t log ρ_t over sequences", ylabel="std (nats), RMS over steps and seeds")
    axes[1].set(title="std of GSPO's log s_i over sequences")
    points["claim1_length"] = sweep.save_figure(fig, out / "claim1_length.png")

    # claim 2: clip fractions and learning speed
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for c, a, rs in each(("base",) + STALE_CELLS):
        band(axes[0], rs, "clip/frac", label(c, a, rs), **style(c, a))
        band(axes[1], rs, "eval/accuracy", label(c, a, rs), marker="o", ms=3, **style(c, a))
    axes[0].set(title="clip fraction (GSPO: sequences; others: tokens)", xlabel="RL step", ylabel="fraction clipped",
                yscale="log")
    axes[1].set(title="held-out greedy accuracy", xlabel="RL step", ylabel="accuracy")
    axes[0].legend(fontsize=6)
    points["claim2_clip"] = sweep.save_figure(fig, out / "claim2_clip.png")

    # claim 3: the stale regimes: accuracy per seed (one panel per cell), and what precedes a collapse
    fig, axes = plt.subplots(2, 5, figsize=(25, 8))
    stale = tuple(cell for c in STALE_CELLS for cell in (c, c + "-kl"))  # each regime beside its KL swap
    for c, a, rs in each(stale):
        ax = axes[0, stale.index(c)]
        for i, r in enumerate(rs):
            s, acc = series(r, "eval/accuracy")
            ax.plot(s, acc, marker="o", ms=3, lw=1, label=label(c, a, rs) if i == 0 else None, **style(c, a))
            cs = collapse_step(r)
            if cs is not None:
                ax.plot([cs], [dict(zip(s.tolist(), acc.tolist())).get(cs, 0)], "kx", ms=8)
        for ax, key in zip(list(axes.flat)[4:], ("ratio/token_var", "clip/frac", "losses/entropy",
                                                  "losses/grad_norm", "ratio/seq_logsum_var")):
            band(ax, rs, key, label(c, a, rs), **style(c, a))
    for ax, c in zip(axes[0, :4], stale):
        ax.set(title=f"{c}: held-out accuracy, each seed (x: collapse)", xlabel="RL step", ylabel="accuracy",
               ylim=(0, 1))
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=6)
    for ax, (title, ylabel, log) in zip(list(axes.flat)[4:], (
            ("variance of token ratios ρ_t", "var", True), ("clip fraction", "fraction", True),
            ("entropy of π_old", "nats/token", False), ("gradient norm before clipping", "L2 norm", True),
            ("variance of Σ_t log ρ_t", "nats²", True))):
        ax.set(title=title, xlabel="RL step", ylabel=ylabel, yscale="log" if log else "linear")
    axes[0, 4].legend(fontsize=5)
    axes[1, 4].axis("off")
    points["claim3_stability"] = sweep.save_figure(fig, out / "claim3_stability.png")

    # claim 4: lengths of correct and incorrect completions, GRPO vs Dr.GRPO
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    for c, a, rs in each(("base", "long120", "stale"), ("grpo", "dr_grpo")):
        band(axes[0], rs, "charts/len_incorrect", label(c, a, rs), **style(c, a))
        band(axes[1], rs, "charts/len_correct", label(c, a, rs), **style(c, a))
    axes[0].set(title="mean length of incorrect completions", xlabel="RL step", ylabel="tokens")
    axes[1].set(title="mean length of correct completions", xlabel="RL step")
    axes[0].legend(fontsize=6)
    points["claim4_length_bias"] = sweep.save_figure(fig, out / "claim4_length_bias.png")

    # claim 5: entropy with and without clip-higher
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for c, a in (("base", "dapo"), ("eh02", "dapo"), ("base", "grpo"), ("long120", "dapo"), ("eh02-long120", "dapo")):
        rs = cell_runs(runs, c, a)
        if rs:
            band(axes[0], rs, "losses/entropy", label(c, a, rs), **style(c, a))
            band(axes[1], rs, "eval/accuracy", label(c, a, rs), marker="o", ms=3, **style(c, a))
    axes[0].set(title="entropy of the sampling policy", xlabel="RL step", ylabel="nats/token")
    axes[1].set(title="held-out greedy accuracy", xlabel="RL step", ylabel="accuracy")
    axes[0].legend(fontsize=6)
    points["claim5_entropy"] = sweep.save_figure(fig, out / "claim5_entropy.png")
    return points


def run_minutes(runs: list[dict]) -> float:
    """Minutes the runs took by their own clocks (train.py's perf/elapsed_min at each run's last logged step)."""
    return sum(next((row["perf/elapsed_min"] for row in reversed(r["rows"]) if "perf/elapsed_min" in row), 0.0)
               for r in runs)


def write_report(runs: list[dict], out: Path) -> dict[str, int]:
    out.mkdir(parents=True, exist_ok=True)
    minutes = run_minutes(runs)
    points = write_figures(runs, out)
    rows, numbers = verdicts(runs)
    per_run = [{"run": r["name"], "cell": r["cell"], "algo": r["algo"], "seed": r["seed"],
                "accuracy_before": r["rows"][0].get("eval/accuracy"), "accuracy_after": final_accuracy(r),
                "collapse_step": collapse_step(r), "stopped": r["stopped"] or "", "failed": failed(r),
                "clip_frac_mean": run_mean(r, "clip/frac"), "token_ratio_var_mean": run_mean(r, "ratio/token_var"),
                "exp_logsum": length_exponent(r, "std_logsum"), "exp_log_s": length_exponent(r, "std_log_s"),
                "entropy_last10": run_mean(r, "losses/entropy", first=r["total_steps"] - 9),
                "len_incorrect_drift": length_drift(r, "charts/len_incorrect")} for r in runs]
    import csv

    with (out / "runs.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(per_run[0]))
        writer.writeheader()
        writer.writerows(per_run)
    cells = sorted({(r["cell"], r["algo"]) for r in runs})
    lines = ["# Study: where the four objectives part ways (embedded-long task)", "",
             f"{len(runs)} runs ({', '.join(f'{c}/{a}' for c, a in cells)}); "
             f"each {STEPS} RL steps (the long120 cells: {LONG_STEPS}) of {PROMPTS} prompts x 8 completions, answers "
             "20-300 tokens.",
             "Command: `python study.py` (the runs, resumable, then this report); `python study.py --report-only` "
             "(this report alone).",
             f"Cost: {minutes:.0f} run-minutes in all (the sum of each run's own clock, 1 thread per run), "
             f"so ~{minutes / 2:.0f} min wall at 2 runs at a time on 2 cores, plus the cached warm start "
             "of each seed (~3.6 min each, once).", "",
             "Rule: two cells differ only when their mean ± std (over seeds) intervals do not overlap; exponents are "
             "least-squares slopes of log std against log length, with 95% t intervals over runs.", "",
             "| claim | paper's prediction | what we measured | verdict |", "|---|---|---|---|"]
    lines += [f"| {r['claim']} | {r['predicted']} | {r['measured']} | **{r['verdict']}** |" for r in rows]
    lines += ["", "## Final held-out accuracy per cell (mean ± std over seeds), collapses, runs that ended below start", "",
              "| cell | " + " | ".join(ALGOS) + " |", "|---|" + "---|" * len(ALGOS)]
    for c in CELLS:
        cells = []
        for a in ALGOS:
            rs = cell_runs(runs, c, a)
            if not rs:
                cells.append("-")
                continue
            n_coll = sum(collapse_step(r) is not None for r in rs)
            n_below = sum(final_accuracy(r) < r["rows"][0].get("eval/accuracy", math.nan) for r in rs)
            n_stop = sum(r["stopped"] is not None for r in rs)
            cells.append(f"{fmt(numbers['accuracy'][(c, a)])}; collapsed {n_coll}/{len(rs)}, below start "
                         f"{n_below}/{len(rs)}" + (f", stopped {n_stop}/{len(rs)}" if n_stop else ""))
        lines.append(f"| {c} | " + " | ".join(cells) + " |")
    lines += ["", "Collapsed: the pre-registered rule (held-out accuracy 20 points below its running peak, or a "
                  "non-finite stop). Below start: final held-out accuracy (the last evaluation before a stop) under "
                  "the warm start's. Stopped: train.py ended the run with an error (dynamic sampling found too few "
                  "groups with mixed correctness: the policy had stopped getting answers right). The last two counts "
                  "were added after the first stale runs showed runs that never rose above their start, so could "
                  "not fall 20 points below a peak; claim 3 counts a run as failed when any of the three holds."]
    longer = [repeats_base(r, runs) for r in runs if r["cell"] in LONGER]
    if any(x is not None for x in longer):
        same, known = sum(x is True for x in longer), sum(x is not None for x in longer)
        lines += ["", f"The long120 cells: the first {STEPS} steps repeat the 40-step run they extend (base, eh02; "
                      f"same algo and seed) metric for metric (timings aside) in {same} of {known} runs, so the "
                      f"{LONG_STEPS - STEPS} steps after them are the only difference."]
    collapsed = precursor_rows(runs)
    if collapsed:
        lines += ["", f"## What preceded each collapse (mean over the {EVAL_EVERY} steps up to it; in brackets: the "
                      "same steps in the runs of that cell that did not collapse)", "",
                  "| run | collapse step | " + " | ".join(PRECURSORS) + " |", "|---|---|" + "---|" * len(PRECURSORS)]
        lines += collapsed
    lines += [""] + [f"![{name}]({name}.png)" for name in points] + [""]
    (out / "summary.md").write_text("\n".join(lines))
    (out / "verdicts.json").write_text(json.dumps(rows, indent=2))
    return points


def main() -> None:
    import tyro

    args = tyro.cli(StudyArgs, description=__doc__)
    unknown = [c for c in args.cells if c not in CELLS]
    if unknown:
        raise SystemExit(f"error: unknown cell(s) {unknown}; the cells are {list(CELLS)}")
    runs_dir = Path(args.output_dir) / "study" / "runs"
    if not args.report_only:  # run_grid prints the wall time of the runs it made
        sweep.run_grid(grid(args.cells, args.seeds), "study", COMMON, runs_dir, args.parallel)
    runs = load(runs_dir)
    if not runs:
        raise SystemExit(f"error: no finished runs under {runs_dir}; run the study first (without --report-only)")
    write_report(runs, Path(args.report_dir))
    print(f"report: {Path(args.report_dir) / 'summary.md'}")


if __name__ == "__main__":
    main()
