"""The data: each finished run's per-step metrics, committed as docs/study/data/<run>.jsonl.gz, and the per-run
quantities the claims and runs.csv read from them."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import numpy as np

from tools import sweep
from tools.sweep import drift, series

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
                  "seed": int(flags["seed"]), "flags": flags, "stopped": stopped,
                  "config": json.loads((d / "config.json").read_text()) if (d / "config.json").is_file() else None}
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


def warm_start(run: dict) -> tuple:
    """The starting policy's fingerprint: its greedy held-out accuracy and mean reward before training. Seeds >= 1
    of the embedded model train their warm start when a run begins, and another machine trains another policy."""
    before = run["rows"][0]
    return before.get("eval/accuracy"), before.get("eval/reward")


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
    return slope(xs, ys) if len(set(xs)) > 1 else math.nan


def slope(xs: list[float], ys: list[float]) -> float:
    """Least-squares slope, sum (x - mean x)(y - mean y) / sum (x - mean x)^2, in exactly rounded sums (math.fsum):
    the same bits on every CPU. (numpy's polyfit goes through LAPACK, whose kernels differ between CPUs in the last
    bits, so the committed verdicts.json would rebuild differently on another machine.)"""
    mx, my = math.fsum(xs) / len(xs), math.fsum(ys) / len(ys)
    return math.fsum((x - mx) * (y - my) for x, y in zip(xs, ys)) / math.fsum((x - mx) ** 2 for x in xs)


PREFIX_K = (4, 8, 16, 32, 64)  # metrics.PREFIX_K, the prefix lengths train.py --log-prefix-spread logs


def prefix_stds(run: dict, last: int | None = None) -> list[float]:
    """Per k in PREFIX_K: the root mean square over the run's steps (up to `last`) of std_i S_ik
    (metrics.prefix_spread)."""
    out = []
    for k in PREFIX_K:
        steps, stds = series(run, f"prefix/std_k{k}")
        stds = stds[steps <= last] if last is not None else stds
        out.append(math.sqrt(np.mean(np.square(stds))) if len(stds) else math.nan)
    return out


def prefix_slope(run: dict, last: int | None = None) -> float:
    """Least-squares slope of log prefix_stds against log k: 0.5 for i.i.d. token log-ratios, 1 for tokens that all
    move alike."""
    stds = prefix_stds(run, last)
    if not all(math.isfinite(v) and v > 0 for v in stds):
        return math.nan
    return slope([math.log(k) for k in PREFIX_K], [math.log(v) for v in stds])


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


def probe_regime(run: dict) -> str:
    """A probe's flags that differ from the study's defaults (lr 5e-5, 4 minibatches), as text."""
    model = [f"model {Path(run['flags']['model']).name} on {run['flags'].get('dataset')}"] if "model" in run["flags"] else []
    return ", ".join(model + [f"{k} {v}" for k, v in run["flags"].items()
                              if k in ("lr", "num_minibatches", "num_epochs", "temperature")])
