"""Ablation sweeps: a grid of train.py runs, then a report that puts the algorithms side by side.

    python -m tools.sweep                                    # 9 algorithms x 3 seeds, defaults, 2 runs at a time
    python -m tools.sweep --algos gspo grpo --seeds 0 --set lr=1e-4,3e-4 --set num_minibatches=2,4
    python -m tools.sweep --report-only --name default       # rebuild the report from the sweep's packed data
    python -m tools.sweep --report-only --report-dir docs/sweep  # the committed 9 x 3 sweep, from docs/sweep/data/
    python -m tools.sweep --algos gspo grpo --total-steps 20 # any other flag goes to every train.py run

Each run is its own `python train.py` process, logged to wandb (group = the sweep name, tags = algo and sweep)
and to <output_dir>/<name>/runs/<run>/metrics.jsonl. A run is finished when its summary.json exists; re-running
the same command skips finished runs and runs that train.py stopped with an error (exit code 2: it would stop
again), and restarts interrupted ones from scratch. Each finished run is packed into <report_dir>/data/ (one
gzipped JSONL: a header with its config, summary and swept axes, then its metric rows); the report (markdown, CSV
and four PNG plots) is built from that data and written beside it, so a committed report carries its data.
"""

from __future__ import annotations

import csv
import gzip
import itertools
import json
import math
import os
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

import losses

ALGOS = tuple(losses.PRESETS)  # every --algo, in losses.py's order


@dataclass
class SweepArgs:
    algos: tuple[str, ...] = ALGOS
    """algorithms to compare"""
    seeds: tuple[int, ...] = (0, 1, 2)
    set: tuple[str, ...] = ()
    """train.py overrides as field=v1,v2 (one flag per field); the grid is their product with algos and seeds"""
    parallel: int = 2
    """runs at a time; each gets cores/parallel threads"""
    name: str = "default"
    """the sweep's name: its folder, and its wandb group"""
    output_dir: str = "sweeps"
    report_dir: str = ""
    """where the report goes; default <output_dir>/<name>/report"""
    threshold: float = 0.6
    """held-out accuracy for the 'steps to threshold' column"""
    report_only: bool = False
    """skip running, only rebuild the report from <report_dir>/data/"""
    readme: str = ""
    """also write the results table into this README, between its results markers (the committed sweep's)"""


README_BEGIN = "<!-- results:begin (written by python -m tools.sweep --report-only --report-dir docs/sweep --readme README.md) -->"
README_END = "<!-- results:end -->"


class SweepError(ValueError):
    """A sweep the user asked for that cannot run as asked: main() prints it as one `error:` line, exit 2."""


def merge_set_flags(argv: list[str]) -> list[str]:
    """Gather every `--set` into one, so that `--set lr=1e-4,3e-4 --set num_minibatches=2,4` sweeps both axes.

    argparse (under tyro) keeps only the last of a repeated flag, which would silently drop an axis; `--set a b`
    and `--set=a` are gathered the same way."""
    items, rest, i = [], [], 0
    while i < len(argv):
        arg = argv[i]
        if arg.startswith("--set="):
            items.append(arg.split("=", 1)[1])
        elif arg == "--set":
            while i + 1 < len(argv) and not argv[i + 1].startswith("--"):
                i += 1
                items.append(argv[i])
        else:
            rest.append(arg)
        i += 1
    return rest + (["--set", *items] if items else [])


def repeated(values: list):
    """The first value named twice, or None: two grid points of one name would run in one folder."""
    return next((v for i, v in enumerate(values) if v in values[:i]), None)


def set_axes(items: tuple[str, ...], train_args: list[str] = ()) -> list[tuple[str, list[str]]]:
    """The swept axes of --set as (train.py field, values), each field once; a mistake is one `error:` line."""
    import dataclasses

    import train

    fields = {f.name for f in dataclasses.fields(train.Args)}
    fixed = {a[2:].split("=", 1)[0].replace("-", "_") for a in train_args if a.startswith("--")}
    axes: list[tuple[str, list[str]]] = []
    for item in items:
        field, _, values = item.partition("=")
        field = field.replace("-", "_")
        if not values or not field or any(not v for v in values.split(",")):
            raise SweepError(f"--set {item!r} must look like field=v1,v2 (e.g. lr=1e-4,3e-4)")
        if field in ("algo", "seed"):
            raise SweepError(f"--set {item!r}: sweep {field}s with --{field}s, not --set")
        if field not in fields:
            raise SweepError(f"--set {item!r}: train.py has no field {field!r}; `python train.py --help` "
                             "lists them")
        if field in (f for f, _ in axes):
            raise SweepError(f"--set names {field} twice; give all its values in one: --set {field}=v1,v2")
        if field in fixed:
            raise SweepError(f"{field} is both swept (--set) and fixed (--{field.replace('_', '-')}); "
                             "keep one")
        if repeated(values.split(",")) is not None:
            raise SweepError(f"--set {item!r} names a value twice; give each once")
        axes.append((field, values.split(",")))
    return axes


def plan(args: SweepArgs, axes: list[tuple[str, list[str]]]) -> str:
    """One line that says what the grid holds, so a missing axis shows before anything runs."""
    parts = [f"{len(args.algos)} algos ({', '.join(args.algos)})", f"{len(args.seeds)} seeds "
             f"({', '.join(map(str, args.seeds))})"] + [f"{len(v)} {f} ({', '.join(v)})" for f, v in axes]
    return f"plan: {math.prod([len(args.algos), len(args.seeds), *(len(v) for _, v in axes)])} runs = " + \
        " x ".join(parts)


def grid(args: SweepArgs, axes: list[tuple[str, list[str]]] | None = None) -> list[dict]:
    """Every combination, as {flag: value} dicts with a readable run name."""
    grid_axes = [[("algo", a) for a in args.algos], [("seed", str(s)) for s in args.seeds]]
    for field, values in set_axes(args.set) if axes is None else axes:
        grid_axes.append([(field, v) for v in values])
    axes = grid_axes
    runs = []
    for combo in itertools.product(*axes):
        flags = dict(combo)
        extras = "-".join(f"{k}{v}" for k, v in combo[2:])
        flags["run_name"] = f"{flags['algo']}{'-' + extras if extras else ''}-s{flags['seed']}"
        runs.append(flags)
    return runs


def launch(flags: dict, name: str, train_args: list[str], runs_dir: Path, threads: int) -> tuple[str, float, int]:
    """One train.py process for one grid point; its flags are kept in sweep.json so the report knows its axes."""
    run_dir = runs_dir / flags["run_name"]
    if (run_dir / "summary.json").is_file():
        return flags["run_name"], 0.0, -1  # finished earlier: skipped
    exit_file = run_dir / "sweep_exit.json"
    if exit_file.is_file() and json.loads(exit_file.read_text())["exit_code"] == 2:
        return flags["run_name"], 0.0, -2  # stopped by train.py with an error: a result, and it would stop again
    shutil.rmtree(run_dir, ignore_errors=True)  # an interrupted run restarts from scratch
    cmd = [sys.executable, "train.py", "--output-dir", str(runs_dir), "--wandb-group", name,
           "--wandb-tags", "sweep", flags["algo"], "--no-save-model", "--log-study-metrics", *train_args]
    for k, v in flags.items():  # a True value is a switch (--log-prefix-spread), anything else a value
        cmd += [f"--{k.replace('_', '-')}"] + ([] if v is True else [v])
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    start = time.time()
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "sweep.json").write_text(json.dumps(flags, indent=2))
    with (run_dir / "console.log").open("w") as log:
        rc = subprocess.call(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=Path(__file__).resolve().parents[1])
    exit_file.write_text(json.dumps({"exit_code": rc}))
    return flags["run_name"], time.time() - start, rc


def warm_starts_first(runs: list[dict], train_args: list[str]) -> None:
    """Build each (seed, dataset) warm start once, before parallel runs race to build it (runs of another
    `--model` need none)."""
    if "--model" in train_args:
        return
    import model

    default = train_args[train_args.index("--dataset") + 1] if "--dataset" in train_args[:-1] else "embedded"
    for seed, dataset in sorted({(int(r["seed"]), r.get("dataset", default)) for r in runs if "model" not in r}):
        model.warm_start(seed=seed, settings=model.warm_start_settings(dataset))


def run_grid(runs: list[dict], name: str, train_args: list[str], runs_dir: Path, parallel: int) -> None:
    """Run every grid point not yet finished, `parallel` at a time; print each one's outcome and the wall time."""
    warm_starts_first(runs, train_args)
    threads = max(1, (os.cpu_count() or 1) // parallel)
    start, done = time.time(), 0
    with ThreadPoolExecutor(parallel) as pool:
        for run, seconds, rc in pool.map(lambda f: launch(f, name, train_args, runs_dir, threads), runs):
            finished = (runs_dir / run / "summary.json").is_file()  # a run stopped by a signal exits 0 unfinished
            done += finished
            status = ("skipped (finished)" if rc == -1 else
                      f"skipped (stopped with an error before; see {runs_dir / run / 'console.log'}, delete the "
                      "folder to run it again)" if rc == -2 else f"done in {seconds / 60:.1f} min" if finished
                      else f"FAILED (exit {rc}; see {runs_dir / run / 'console.log'})" if rc else "stopped early")
            print(f"{run}: {status}", flush=True)
    outcome = "all finished" if done == len(runs) else \
        f"{done} finished, {len(runs) - done} not (failed, skipped after an error or stopped)"
    print(f"{name}: {len(runs)} runs, {outcome}; {(time.time() - start) / 60:.1f} min wall", flush=True)


# ---------------------------------------------------------------------------------------------------------------
# The report
# ---------------------------------------------------------------------------------------------------------------


def write_jsonl_gz(path: Path, records: list) -> None:
    """One JSON record per line, gzipped with mtime 0 so that the same run always packs to the same bytes."""
    with gzip.GzipFile(path, "wb", mtime=0) as f:
        f.write("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records).encode())


def read_jsonl_gz(path: Path) -> list:
    return [json.loads(line) for line in gzip.open(path, "rt")]


def pack(runs_dir: Path, data_dir: Path) -> list[str]:
    """Pack every finished run under runs_dir (those with a summary.json) into data_dir as <run>.jsonl.gz: a header
    (name, config, summary, swept axes), then its metrics.jsonl rows; a run redone since is packed again. Returns
    the names packed."""
    new = []
    for summary in sorted(runs_dir.glob("*/summary.json")):
        d = summary.parent
        out = data_dir / f"{d.name}.jsonl.gz"
        flags = json.loads((d / "sweep.json").read_text()) if (d / "sweep.json").is_file() else {}
        header = {"name": d.name, "config": json.loads((d / "config.json").read_text()),
                  "summary": json.loads(summary.read_text()),
                  "axes": {k: str(v) for k, v in flags.items() if k not in ("algo", "seed", "run_name")}}
        data_dir.mkdir(parents=True, exist_ok=True)
        write_jsonl_gz(out, [header] + (d / "metrics.jsonl").read_text().splitlines())
        new.append(d.name)
    return new


def load_runs(data_dir: Path) -> list[dict]:
    """Every packed run: its config, summary and swept axes, and `rows` (the metrics of each logged step)."""
    return [{**header, "rows": rows} for header, *rows in map(read_jsonl_gz, sorted(data_dir.glob("*.jsonl.gz")))]


def series(run: dict, key: str) -> tuple[np.ndarray, np.ndarray]:
    pts = [(r["step"], r[key]) for r in run["rows"] if r.get(key) is not None]
    return (np.array([p[0] for p in pts]), np.array([p[1] for p in pts])) if pts else (np.array([]), np.array([]))


def drift(run: dict, key: str, window: int = 10) -> float:
    """Mean of `key` over the last `window` logged steps minus over the first `window` (nan with fewer than
    2 x window logged steps, where the two windows would overlap)."""
    y = series(run, key)[1]
    return float(y[-window:].mean() - y[:window].mean()) if len(y) >= 2 * window else math.nan


def heldout_area(run: dict) -> float:
    """Held-out accuracy averaged over the evaluations after training began: the area under the held-out learning
    curve, per evaluation (nan with none)."""
    s, acc = series(run, "eval/accuracy")
    return float(acc[s > 0].mean()) if (s > 0).any() else math.nan


def steps_to(run: dict, threshold: float) -> float:
    """The first evaluated step at which held-out accuracy reaches `threshold` (nan if it never does)."""
    s, acc = series(run, "eval/accuracy")
    hit = s[acc >= threshold]
    return float(hit[0]) if len(hit) else math.nan


# An algorithm keeps one colour, and a setting of the swept axes one line style, in every figure (a new preset in
# losses.PRESETS needs its colour here: tested).
ALGO_COLORS = {"gspo": "tab:blue", "grpo": "tab:orange", "dr_grpo": "tab:green", "dapo": "tab:red",
               "cispo": "tab:purple", "sapo": "tab:brown", "gmpo": "tab:pink", "luspo": "tab:olive",
               "vespo": "tab:cyan"}
LINE_STYLES = ["-", "--", ":", "-.", (0, (5, 1)), (0, (3, 1, 1, 1, 1, 1))]


def axes_label(axes: dict) -> str:
    return " ".join(f"{k}={v}" for k, v in sorted(axes.items()))


def paper_order(algo: str) -> tuple[int, str]:
    """Sort key of an objective: the papers' order (ALGOS, the README's), any other name after them."""
    return ALGOS.index(algo) if algo in ALGOS else len(ALGOS), algo


def groups_of(runs: list[dict]) -> dict[tuple[str, str], list[dict]]:
    """Runs grouped by (algo, setting of every swept axis): the seeds of one grid cell form one group; the objectives
    in the papers' order (ALGOS, the README's), so every table and legend lists them alike."""
    out: dict[tuple[str, str], list[dict]] = {}
    for r in sorted(runs, key=lambda r: (paper_order(r["config"]["algo"]), axes_label(r["axes"]))):
        out.setdefault((r["config"]["algo"], axes_label(r["axes"])), []).append(r)
    return out


def styles_of(groups: dict) -> dict[tuple[str, str], dict]:
    """matplotlib style per group: colour from the algo, line style from the swept setting."""
    settings = sorted({setting for _, setting in groups})
    return {(algo, setting): {"color": ALGO_COLORS.get(algo, "tab:gray"),
                              "linestyle": LINE_STYLES[settings.index(setting) % len(LINE_STYLES)]}
            for algo, setting in groups}


def group_label(algo: str, setting: str) -> str:
    return f"{algo} {setting}".strip()


def mean_band(ax, runs: list[dict], key: str, label: str, **style) -> None:
    """Mean over runs (seeds) with a min-max band, on the steps all runs share."""
    curves = [series(r, key) for r in runs]
    steps = sorted(set.intersection(*(set(s.tolist()) for s, _ in curves))) if curves else []
    if not steps:
        return
    ys = np.array([[dict(zip(s.tolist(), y.tolist()))[t] for t in steps] for s, y in curves])
    line, = ax.plot(steps, ys.mean(0), label=label, **style)
    ax.fill_between(steps, ys.min(0), ys.max(0), alpha=0.2, color=line.get_color())


def summary_rows(runs: list[dict], threshold: float) -> list[dict]:
    """One row per grid cell (algo x swept setting), averaged over its seeds."""
    rows = []
    for (algo, setting), rs in groups_of(runs).items():
        final = [r["summary"]["accuracy_after"] for r in rs]
        reach = [steps_to(r, threshold) for r in rs]
        def mean_of(key):  # noqa: E306
            return float(np.mean([np.nanmean(series(r, key)[1]) for r in rs]))
        rows.append({
            "algo": algo, "setting": setting, "runs": len(rs),
            "accuracy_before": float(np.mean([r["summary"]["accuracy_before"] for r in rs])),
            "accuracy_after_mean": float(np.mean(final)), "accuracy_after_std": seed_sd(final),
            "heldout_accuracy_auc": float(np.mean([heldout_area(r) for r in rs])),
            f"steps_to_{threshold:g}": float(np.nanmean(reach)) if not all(map(math.isnan, reach)) else float("nan"),
            "clip_frac_mean": mean_of("clip/frac"), "token_ratio_var_mean": mean_of("ratio/token_var"),
            "length_change": float(np.mean([drift(r, "charts/completion_len") for r in rs])),
            "minutes_mean": float(np.mean([r["summary"]["rl_minutes"] for r in rs])),
        })
    return rows


def seed_sd(values: list[float]) -> float:
    """The sample standard deviation over seeds (n - 1 in the denominator, as the study's intervals use): the usual
    estimate of the seed-to-seed spread from a few seeds. nan for one seed, which has none."""
    return float(np.std(values, ddof=1)) if len(values) > 1 else math.nan


def detail_tables(runs: list[dict]) -> list[str]:
    """The numbers behind the figures, per group (mean over steps, then over seeds): held-out accuracy before
    training per seed, the shadow clip fractions (what each preset's rule would clip on the group's own batches),
    the length-bucket spread of the sequence log-ratio, and the lengths of correct and incorrect completions."""
    groups = groups_of(runs)
    names = [group_label(*g) for g in groups]
    def cell(rs, key, fmt):
        """fmt(per-run series) for a table cell; "-" where a run never logged the key (an older run, or a preset
        added since)."""
        per_run = [series(r, key)[1] for r in rs]
        return fmt(per_run) if all(len(y) for y in per_run) else "-"

    def mean_of(rs, key):
        return cell(rs, key, lambda ys: f"{np.mean([y.mean() for y in ys]):.3g}")

    def first_last(rs, key):
        return cell(rs, key, lambda ys: f"{np.mean([y[:10].mean() for y in ys]):.1f} → "
                                        f"{np.mean([y[-10:].mean() for y in ys]):.1f}")

    seeds = sorted({(r["config"]["seed"], r["summary"]["accuracy_before"]) for r in runs})
    out = ["Held-out accuracy before training, per seed (each seed has its own warm start): "
           + ", ".join(f"seed {s} {a:.3f}" for s, a in seeds) + ".", "",
           "Shadow clip fractions: what each preset's rule would clip on each group's batches (sequences for GSPO, "
           "LUSPO and VESPO's kernel, tokens otherwise; the diagonal is what the group itself clipped; - where the "
           "runs were logged before that preset existed).", "",
           "| rule \\ batches of | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    shadow = sorted({k.removeprefix("clip/shadow_") for r in runs for row in r["rows"] for k in row
                     if k.startswith("clip/shadow_")}, key=paper_order)
    for preset in shadow:
        out.append(f"| {preset} | " + " | ".join(mean_of(rs, f"clip/shadow_{preset}") for rs in groups.values()) + " |")
    out += ["", "Spread of the sequence log-ratio by length quartile (RMS over steps and seeds; the figure's points): "
            "mean length → std of Σ_t log ρ_t, and of GSPO's log s_i.", "",
            "| group | Σ_t log ρ_t | log s_i |", "|---|---|---|"]
    for name, rs in zip(names, groups.values()):
        cells = [", ".join(f"{x:.0f} → {y:.3g}" for x, y in length_bucket_points(rs, key)) or "-"
                 for key in ("std_logsum", "std_log_s")]
        out.append(f"| {name} | {cells[0]} | {cells[1]} |")
    out += ["", "Mean length (tokens) of correct and incorrect completions, first 10 steps → last 10.", "",
            "| group | correct | incorrect |", "|---|---|---|"]
    for name, rs in zip(names, groups.values()):
        out.append(f"| {name} | {first_last(rs, 'charts/len_correct')} | {first_last(rs, 'charts/len_incorrect')} |")
    return out


def legend(ax) -> None:
    """A legend where the panel has labelled lines (one with no data has none: e.g. no completion was correct)."""
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7)


def save_figure(fig, path: Path) -> int:
    """Save and close a figure; returns how many data points its lines carry (0 means an empty plot). Step axes get
    whole-number ticks (a short sweep's would read 0.25 steps) and legends long enough samples to show each line
    style (a setting), with the point markers on them."""
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    for ax in fig.axes:
        if ax.get_xlabel() == "step":
            ax.xaxis.set_major_locator(MaxNLocator(integer=True, steps=[1, 2, 5, 10]))
        if ax.get_legend() is not None:
            ax.legend(fontsize=7, handlelength=4)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    points = plotted_points(fig)
    plt.close(fig)
    return points


def plotted_points(fig) -> int:
    """How many data points a figure's lines carry (reference lines included): 0 means an empty plot."""
    return sum(len(line.get_xdata()) for ax in fig.axes for line in ax.get_lines())


def length_bucket_points(rs: list[dict], key: str) -> list[tuple[float, float]]:
    """(mean length, RMS over steps and seeds of `key`) per length quartile, for one group of runs."""
    pts = []
    for q in range(1, 5):
        lens = [v for r in rs for v in series(r, f"lenbucket/q{q}_len")[1]]
        vals = [v for r in rs for v in series(r, f"lenbucket/q{q}_{key}")[1]]
        if lens and vals and np.any(vals):  # all zero: on-policy, nothing to put on a log axis
            pts.append((float(np.mean(lens)), float(np.sqrt(np.mean(np.square(vals))))))
    return pts


def readme_table(runs: list[dict], threshold: float) -> str:
    """The README's results table: one row per algorithm, held-out accuracy at the first evaluation (how fast) and
    after the run (mean and sd over the seeds, and each seed), minutes per run; rows in the objectives table's order.
    The caption gives each seed's accuracy before training (its warm start, the same for every objective)."""
    order = list(ALGOS)
    rows = sorted(summary_rows(runs, threshold), key=lambda r: (order.index(r["algo"]), r["setting"]))
    groups = groups_of(runs)
    seeds = sorted({r["summary"]["seed"] for r in runs})
    steps = sorted({r["summary"]["steps"] for r in runs})
    before = {r["summary"]["seed"]: r["summary"]["accuracy_before"] for r in runs}
    first = min(int(s) for r in runs for s in series(r, "eval/accuracy")[0] if s > 0)
    seed0 = {r["config"]["algo"]: r["summary"]["accuracy_after"] for r in runs if r["summary"]["seed"] == 0}

    def at_first(r):
        s, acc = series(r, "eval/accuracy")
        return float(acc[s == first][0])

    lines = [README_BEGIN, "",
             f"`python train.py --algo A --seed S`, seeds {', '.join(map(str, seeds))}, {'/'.join(map(str, steps))} steps "
             "each: greedy accuracy on the default task's held-out problems, from "
             + " / ".join(f"{before[s]:.3f}" for s in seeds) + " before training (each seed's warm start, shared by "
             "every objective). The sweep gave each run one thread, which rounds differently from the two-thread "
             f"printout above: its gspo seed 0 ends at {seed0.get('gspo', float('nan')):.3f} ([command, machine and "
             "spread](docs/short-task.md#the-nine-objectives-side-by-side)).", "",
             f"| `--algo` | at step {first}: mean (per seed) | after: mean ± sd (n) | after, per seed | minutes per run |",
             "|---|---|---|---|---|"]
    for r in rows:
        per_seed = sorted(groups[(r["algo"], r["setting"])], key=lambda x: x["summary"]["seed"])
        early = [at_first(x) for x in per_seed]
        lines.append(f"| `{r['algo']}` | {np.mean(early):.3f} (" + " / ".join(f"{v:.3f}" for v in early) + ") | "
                     f"{spread(r['accuracy_after_mean'], r['accuracy_after_std'], r['runs'])} ({r['runs']}) | "
                     + " / ".join(f"{x['summary']['accuracy_after']:.3f}" for x in per_seed)
                     + f" | {r['minutes_mean']:.1f} |")
    lines += ["", README_END]
    return "\n".join(lines)


def write_readme(readme: Path, table: str) -> None:
    text = readme.read_text()
    start, end = text.index(README_BEGIN), text.index(README_END) + len(README_END)
    readme.write_text(text[:start] + table + text[end:])


def spread(mean: float, std: float, n: int) -> str:
    """'mean ± sd' over seeds (seed_sd); one seed has no spread to show."""
    return f"{mean:.3f} (1 seed)" if n == 1 else f"{mean:.3f} ± {std:.3f}"


def write_report(runs: list[dict], out: Path, threshold: float, title: str) -> dict[str, int]:
    """Write summary.md, summary.csv and four plots; returns the number of data points in each plot.

    Every grid cell (algo x setting of the swept axes) is its own table row and its own line: colour = algo,
    line style = setting.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    groups = groups_of(runs)
    styles = styles_of(groups)
    points = {}

    # 1. held-out accuracy and train reward
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for g, rs in groups.items():
        mean_band(axes[0], rs, "eval/accuracy", group_label(*g), marker="o", ms=3, **styles[g])
        mean_band(axes[1], rs, "charts/reward", group_label(*g), **styles[g])
    axes[0].set(title="held-out greedy accuracy", xlabel="step", ylabel="accuracy")
    axes[1].set(title="train reward", xlabel="step", ylabel="mean reward")
    legend(axes[0])
    points["accuracy"] = save_figure(fig, out / "accuracy.png")

    # 2. the seeds' claim: std of the unnormalised sequence log-ratio and of GSPO's log s_i, per length bucket
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for g, rs in groups.items():
        for ax, key in zip(axes, ("std_logsum", "std_log_s")):
            pts = length_bucket_points(rs, key)
            if pts:
                x, y = np.array(pts).T
                ax.loglog(x, y, marker="o", label=group_label(*g), **styles[g])
    for ax, power, name in ((axes[0], 0.5, "√len"), (axes[1], -0.5, "1/√len")):
        lines = [ln for ln in ax.get_lines()]
        if lines:
            x = np.array(lines[0].get_xdata())
            y0 = np.exp(np.mean([np.log(ln.get_ydata()).mean() for ln in lines]))
            ref = y0 * (x / np.exp(np.log(x).mean())) ** power
            ax.loglog(x, ref, "k--", lw=1, label=f"∝ {name}")
        ax.set(xlabel="response length (tokens, bucket mean)")
        legend(ax)
    axes[0].set(title="std of Σ_t log ρ_t (unnormalised sequence log-ratio)")
    axes[1].set(title="std of log s_i (GSPO, length-normalised)")
    points["length_buckets"] = save_figure(fig, out / "length_buckets.png")

    # 3. clip fractions, log scale: what each objective clipped, and the shadow fractions on the same batches
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for g, rs in groups.items():
        mean_band(axes[0], rs, "clip/frac", group_label(*g), **styles[g])
    for preset in ALGOS:
        mean_band(axes[1], runs, f"clip/shadow_{preset}", f"as {preset} would clip", color=ALGO_COLORS[preset])
    axes[0].set(title="clip fraction of the trained objective", xlabel="step", yscale="log")
    axes[1].set(title="shadow clip fractions (all runs' batches)", xlabel="step", yscale="log")
    for ax in axes:
        legend(ax)
    points["clip"] = save_figure(fig, out / "clip.png")

    # 4. response length of correct and incorrect completions
    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    for g, rs in groups.items():
        mean_band(axes[0], rs, "charts/len_correct", group_label(*g), **styles[g])
        mean_band(axes[1], rs, "charts/len_incorrect", group_label(*g), **styles[g])
    axes[0].set(title="mean length, correct completions", xlabel="step", ylabel="tokens")
    axes[1].set(title="mean length, incorrect completions", xlabel="step")
    legend(axes[0] if axes[0].get_lines() else axes[1])  # (before any correct completion, the left panel is empty)
    points["lengths"] = save_figure(fig, out / "lengths.png")

    rows = summary_rows(runs, threshold)
    with (out / "summary.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    fmt = lambda v: "n/a" if isinstance(v, float) and math.isnan(v) else f"{v:.3g}" if isinstance(v, float) \
        else str(v)  # noqa: E731
    lines = [f"# {title}", "", "| algo | swept setting | runs | accuracy before | accuracy after (mean ± sd) | "
             f"held-out accuracy, mean over evaluations | steps to {threshold:g} | mean clip fraction | "
             "mean token-ratio variance | length change | minutes |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['algo']} | {r['setting'] or '-'} | {r['runs']} | {r['accuracy_before']:.3f} | "
                     f"{spread(r['accuracy_after_mean'], r['accuracy_after_std'], r['runs'])} | "
                     f"{'n/a' if math.isnan(r['heldout_accuracy_auc']) else format(r['heldout_accuracy_auc'], '.3f')} | "
                     f"{fmt(r[f'steps_to_{threshold:g}'])} | {fmt(r['clip_frac_mean'])} | "
                     f"{fmt(r['token_ratio_var_mean'])} | "
                     f"{'n/a' if math.isnan(r['length_change']) else format(r['length_change'], '+.1f')} | "
                     f"{r['minutes_mean']:.1f} |")
    lines += ["", "(Accuracy after: the mean over seeds ± their sample standard deviation (n - 1). Held-out "
              "accuracy, mean over evaluations: every evaluation after training began, averaged, the "
              "area under the held-out learning curve per evaluation; it tells apart objectives that end alike but "
              "learn at different speeds. Steps to the threshold: the first evaluated step at or above "
              "it, n/a where none was; it cannot be finer than --eval-every. Clip fraction: of sequences for "
              "sequence-level ratios and VESPO's kernel, of tokens otherwise. Length change: mean completion length "
              "over the last 10 steps minus the first 10, n/a under 20 steps.)", ""] + detail_tables(runs)
    lines += ["", "![accuracy](accuracy.png)", "![length buckets](length_buckets.png)", "![clip](clip.png)",
              "![lengths](lengths.png)", ""]
    (out / "summary.md").write_text("\n".join(lines))
    return points


def settings(argv: list[str] | None) -> tuple[SweepArgs, list[str], list[tuple[str, list[str]]]]:
    """The sweep's flags, the train.py flags it passes on, and its --set axes (none with --report-only), checked
    before anything runs (SweepError says what is wrong)."""
    from plumbing import flags

    args, train_args = flags.parse(SweepArgs, __doc__, merge_set_flags(sys.argv[1:] if argv is None else argv),
                                   program="python -m tools.sweep", return_unknown_args=True)
    if args.parallel < 1:
        raise SweepError(f"--parallel {args.parallel}: must be at least 1 (runs at a time)")
    if not 0 <= args.threshold <= 1:
        raise SweepError(f"--threshold {args.threshold}: a held-out accuracy, between 0 and 1")
    for flag, given in (("--algos", list(args.algos)), ("--seeds", list(args.seeds))):
        if not args.report_only and not given:
            raise SweepError(f"{flag} is empty: name at least one (the grid would hold no run)")
        if (twice := repeated(given)) is not None:
            raise SweepError(f"{flag} names {twice} twice; give each once")
    unknown = [a for a in args.algos if a not in ALGOS]
    if unknown:
        raise SweepError(f"--algos {unknown[0]!r} is not an objective; use some of {', '.join(ALGOS)}")
    return args, train_args, [] if args.report_only else set_axes(args.set, train_args)


def main(argv: list[str] | None = None) -> None:
    try:
        args, train_args, axes = settings(argv)
        runs_dir = Path(args.output_dir) / args.name / "runs"
        out = Path(args.report_dir or Path(args.output_dir) / args.name / "report")
        if not args.report_only:
            print(plan(args, axes), flush=True)
            run_grid(grid(args, axes), args.name, train_args, runs_dir, args.parallel)
        pack(runs_dir, out / "data")
        runs = load_runs(out / "data")
        if not runs:
            raise SweepError(f"no finished runs under {runs_dir} nor packed in {out / 'data'}; " + (
                "run the sweep first (without --report-only)" if args.report_only else
                "every run of the grid failed or was skipped: the lines above name each one's console.log"))
    except SweepError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    write_report(runs, out, args.threshold, f"Sweep {args.name}: {len(runs)} runs")
    print(f"report: {out / 'summary.md'}")
    if args.readme:
        write_readme(Path(args.readme), readme_table(runs, args.threshold))
        print(f"results table: {args.readme}")


if __name__ == "__main__":
    main()
