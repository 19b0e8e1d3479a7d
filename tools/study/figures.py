"""Figures: bands are the statistic the verdicts use (mean over seeds with its 95% t interval). The helpers each
claim's figure is drawn with (claims.py), and the headline of every claim against its prediction."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from tools import sweep
from tools.study.data import arm_runs, peak_drop, run_mean
from tools.study.stats import estimate, t_quantile
from tools.sweep import ALGO_COLORS, series


def pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


ARM_STYLES = {"grpo-b0": "-", "gspo": "-", "dapo": "-", "dr_grpo": "-",  # colour: the algorithm (sweep.ALGO_COLORS)
              "cispo": "-", "sapo": "-", "gmpo": "-", "luspo": "-", "vespo": "-",
              "grpo-b0-sumnorm": "--", "dapo-eh0.2": "--", "grpo": ":", "gspo-b0.04": ":",
              "grpo-b0-eh0.28": "-."}  # line style: the arm
ARM_LABELS = {"grpo-b0": "GRPO β=0", "gspo": "GSPO β=0", "dapo": "DAPO ε_high=0.28", "dr_grpo": "Dr.GRPO",
              "grpo-b0-sumnorm": "GRPO β=0, Dr.GRPO aggregation", "dapo-eh0.2": "DAPO ε_high=0.2",
              "grpo": "GRPO β=0.04", "gspo-b0.04": "GSPO β=0.04", "grpo-b0-eh0.28": "GRPO β=0, ε_high=0.28", "cispo": "CISPO", "sapo": "SAPO", "gmpo": "GMPO",
              "luspo": "LUSPO", "vespo": "VESPO"}


def style(runs: list[dict]) -> dict:
    return {"color": ALGO_COLORS[runs[0]["algo"]], "linestyle": ARM_STYLES[runs[0]["arm"]],
            "label": ARM_LABELS[runs[0]["arm"]]}  # seeds per arm: in summary.md's arm table


def band(ax, runs: list[dict], key: str, log: bool = False, marker: str | None = None, floor: float | None = None) -> int:
    """Mean over seeds and its 95% t interval at each step all runs logged (in log space when `log`); `floor` bounds
    the band below (a fraction's interval is cut at 0, not drawn into values it cannot take)."""
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
    low = back(mean - half) if floor is None else np.maximum(back(mean - half), floor)
    ax.fill_between(steps, low, back(mean + half), color=st["color"], alpha=0.15, lw=0)
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


def arms(runs: list[dict], cell: str, names) -> list[list[dict]]:
    """The runs of each named arm of a cell that has any, in the order named."""
    return [rs for a in names if (rs := arm_runs(runs, cell, a))]


def headline(rows: list[dict], claims: dict, out: Path) -> tuple[int, str]:
    """Every claim's estimate with its interval, against 0 and the predicted effect (claims.png)."""
    plt = pyplot()
    fig, axes = plt.subplots(len(rows), 1, figsize=(9, 0.9 * len(rows) + 0.6))
    for ax, row in zip(np.atleast_1d(axes), rows):
        e, c = row["estimate"], claims[row["key"]]
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
    return (save(fig, out / "claims.png"), "each claim's estimate (dot) with its 95% t interval over seeds "
            "(bar), no effect (grey dotted) and the predicted effect or the non-inferiority margin (purple "
            "dashed), in the claim's unit")


def two_panels(runs: list[dict], out: Path, name: str, cell: str, names, panels, caption: str, threshold=None,
               runs_of=lambda rs: rs) -> dict:
    """Two panels of bands over RL steps, one line per arm: panels = ((key, log, title, ylabel), x2); `threshold`
    a grey line on the panel of clip/differs (a manipulation check's)."""
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    points = 0
    for rs in arms(runs, cell, names):
        for ax, (key, log, title, ylabel) in zip(axes, panels):
            points += band(ax, runs_of(rs), key, log=log, marker="o" if key == "eval/accuracy" else None,
                           floor=0.0 if key == "clip/differs" else None)  # a fraction: its band stops at 0
    for ax, (key, _, title, ylabel) in zip(axes, panels):
        ax.set(title=title, xlabel="RL step", ylabel=ylabel)
        if key == "clip/differs":  # the manipulation check's threshold
            ax.axhline(threshold, color="gray", ls=":", lw=1)
    legend_below(fig, axes)
    return {name: (save(fig, out / f"{name}.png") and points, caption)}


def stability(runs: list[dict], out: Path, name: str, names, caption: str, contrasts=(),
              cell: str = "stale16") -> dict:
    """A stale cell: accuracy bands per arm (left); right, what each verdict uses: per contrast (label, arm a, arm b,
    predicted), the paired difference of the drop from peak, drop(a) - drop(b), per seed (dots) with its mean and
    95% t interval (square), beside 0 (grey) and the predicted effect (purple dashes)."""
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    points = 0
    for a in names:
        if arm_runs(runs, cell, a):
            points += band(axes[0], arm_runs(runs, cell, a), "eval/accuracy", marker="o")
    shown = []
    for label, a, b, predicted in contrasts:
        drop = {arm: {r["seed"]: peak_drop(r) for r in arm_runs(runs, cell, arm)} for arm in (a, b)}
        diffs = [drop[a][s] - drop[b][s] for s in sorted(set(drop[a]) & set(drop[b]))]
        if not diffs:
            continue
        i, e = len(shown), estimate(diffs)
        axes[1].plot([i] * len(diffs), diffs, "o", color="tab:gray", alpha=0.6, ms=4)
        axes[1].errorbar([i + 0.15], [e.mean], yerr=[[e.mean - e.lo], [e.hi - e.mean]] if e.n > 1 else None,
                         fmt="s", color="black", capsize=4)
        axes[1].plot([i - 0.3, i + 0.4], [predicted] * 2, color="tab:purple", ls="--", lw=1.5)
        shown.append(label)
        points += len(diffs)
    axes[1].axhline(0, color="gray", ls=":", lw=1)
    axes[1].set_xticks(range(len(shown)), shown, fontsize=8)
    axes[0].set(title=f"{cell}: held-out greedy accuracy", xlabel="RL step", ylabel="accuracy", ylim=(0, 1))
    axes[1].set(title="the verdicts' paired differences (drop from peak), 95% t CI",
                ylabel="accuracy points")
    legend_below(fig, axes[:1])
    return {name: (save(fig, out / f"{name}.png") and points, caption)}
