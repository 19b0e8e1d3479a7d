"""A 2 x 2 micro-sweep end to end: runs, skip-on-rerun, report files and plots with data."""

import csv
import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tools import sweep

ROOT = Path(__file__).resolve().parents[2]


def run_sweep(tmp_path, model_dir):
    cmd = [sys.executable, "-m", "tools.sweep", "--algos", "grpo", "--seeds", "0", "--parallel", "2",
           "--name", "micro", "--output-dir", str(tmp_path), "--model", str(model_dir),
           "--total-steps", "2", "--eval-every", "1", "--eval-size", "8", "--num-prompts", "4",
           "--num-generations", "4", "--max-new-tokens", "24", "--set", "lr=1e-3,5e-4",
           "--set", "num_minibatches=2,4", "--wandb-mode", "disabled"]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "Warning" not in done.stderr, done.stderr  # (a panel with no data once drew an empty legend)
    return done.stdout


@pytest.mark.slow
def test_micro_sweep_report_and_resume(tmp_path, tiny_policy_dir):
    """Two --set flags (the documented form): both axes are swept, the plan line says so before anything runs,
    and every run's config.json holds its own grid point. One objective: each run is a train.py process (~9 s of
    imports on 2 cores); the report's rows and line styles per objective and setting are tested on data
    (test_study.py's test_sweep_report_keeps_every_swept_axis)."""
    out = run_sweep(tmp_path, tiny_policy_dir)
    assert out.splitlines()[0] == ("plan: 4 runs = 1 algos (grpo) x 1 seeds (0) x 2 lr (1e-3, 5e-4) x "
                                   "2 num_minibatches (2, 4)")
    configs = {p.parent.name: json.loads(p.read_text()) for p in (tmp_path / "micro" / "runs").glob("*/config.json")}
    assert len(configs) == 4
    points = {(c["algo"], c["lr"], c["num_minibatches"]) for c in configs.values()}
    assert points == {("grpo", lr, n) for lr in (1e-3, 5e-4) for n in (2, 4)}
    assert "grpo-lr1e-3-num_minibatches2-s0: done" in out and "grpo-lr5e-4-num_minibatches4-s0: done" in out
    assert "micro: 4 runs, all finished; " in out
    report = tmp_path / "micro" / "report"
    for name in ("summary.md", "summary.csv", "accuracy.png", "length_buckets.png", "clip.png", "lengths.png"):
        assert (report / name).is_file() and (report / name).stat().st_size > 0, name
    rows = list(csv.DictReader((report / "summary.csv").open()))
    # each swept setting keeps its own row: no axis is averaged away
    assert sorted((r["algo"], r["setting"]) for r in rows) == sorted(
        ("grpo", f"lr={lr} num_minibatches={n}") for lr in ("1e-3", "5e-4") for n in (2, 4))
    assert all(0 <= float(r["accuracy_after_mean"]) <= 1 for r in rows)
    # one seed and two steps: no spread, no length change and no unreached threshold printed as numbers
    md = (report / "summary.md").read_text()
    assert md.count("(1 seed)") == 4 and "± 0.000" not in md and "nan" not in md and "| +0.0 |" not in md

    # the report carries its data: one packed file per run, from which the same report is rebuilt
    runs = sweep.load_runs(report / "data")
    assert sorted(r["name"] for r in runs) == sorted(configs) and all(r["rows"] for r in runs)
    assert {r["name"]: r["config"] for r in runs} == configs
    points = sweep.write_report(runs, tmp_path / "again", 0.6, "again")
    assert set(points) == {"accuracy", "length_buckets", "clip", "lengths"}
    assert all(n > 0 for n in points.values()), points
    assert (tmp_path / "again" / "summary.csv").read_text() == (report / "summary.csv").read_text()

    # an interrupted run (no summary.json) is redone; a finished one is skipped
    (tmp_path / "micro" / "runs" / "grpo-lr1e-3-num_minibatches4-s0" / "summary.json").unlink()
    out = run_sweep(tmp_path, tiny_policy_dir)
    assert "grpo-lr1e-3-num_minibatches2-s0: skipped (finished)" in out
    assert "grpo-lr1e-3-num_minibatches4-s0: done" in out


def test_every_preset_is_sweepable_and_has_its_colour():
    """sweep.ALGOS is losses.PRESETS' keys (a preset added there is an --algos choice at once) and each has its own
    colour in every figure (the shadow-clip figure looks each one up)."""
    import losses

    assert sweep.ALGOS == tuple(losses.PRESETS)
    assert set(sweep.ALGO_COLORS) == set(losses.PRESETS)
    assert len(set(sweep.ALGO_COLORS.values())) == len(sweep.ALGO_COLORS)


def test_grid_names_and_overrides():
    runs = sweep.grid(sweep.SweepArgs(algos=("gspo",), seeds=(0, 1), set=("lr=1e-4,3e-4",)))
    assert [r["run_name"] for r in runs] == ["gspo-lr1e-4-s0", "gspo-lr3e-4-s0", "gspo-lr1e-4-s1", "gspo-lr3e-4-s1"]
    assert runs[1]["lr"] == "3e-4"


def test_a_swept_on_off_flag_reaches_each_run_as_its_value(tmp_path, monkeypatch):
    """--set mask_truncated=True,False: each run's train.py command parses to that value (every run of such a sweep
    stopped at parsing, 'Unrecognized options: True', before on/off flags took True and False)."""
    import train
    from plumbing import flags

    commands = []
    monkeypatch.setattr(sweep.subprocess, "call", lambda cmd, **kw: commands.append(cmd) or 0)
    for run in sweep.grid(sweep.SweepArgs(algos=("dapo",), seeds=(0,), set=("mask_truncated=True,False",))):
        sweep.launch(run, "t", [], tmp_path, 1)
    assert [cmd[1] for cmd in commands] == ["train.py", "train.py"]
    assert [flags.parse(train.Args, "", cmd[2:]).mask_truncated for cmd in commands] == [True, False]


@pytest.mark.slow
def test_a_run_stopped_by_an_error_is_not_rerun(tmp_path, tiny_policy_dir):
    """A run train.py stopped with exit code 2 (bad input, a non-finite stop, dynamic sampling giving up) would stop
    the same way again: a rerun of the sweep reports it and moves on."""
    flags = {"algo": "gspo", "seed": "0", "run_name": "bad", "lr": "-1"}
    train_args = ["--model", str(tiny_policy_dir), "--wandb-mode", "disabled"]
    name, _, rc = sweep.launch(flags, "t", train_args, tmp_path, 1)
    assert (name, rc) == ("bad", 2)
    assert "error: --lr must be > 0" in (tmp_path / "bad" / "console.log").read_text()
    assert sweep.launch(flags, "t", train_args, tmp_path, 1)[2] == -2


def test_repeated_set_flags_are_gathered_and_mistakes_refused():
    argv = ["--seeds", "0", "--set", "lr=1e-4,3e-4", "--set=num_minibatches=2,4", "--total-steps", "3"]
    assert sweep.merge_set_flags(argv) == ["--seeds", "0", "--total-steps", "3", "--set", "lr=1e-4,3e-4",
                                           "num_minibatches=2,4"]
    args = sweep.SweepArgs(algos=("gspo", "grpo"), seeds=(0, 1, 2), set=("lr=1e-4,3e-4", "num_minibatches=2,4"))
    assert len(sweep.grid(args)) == 2 * 3 * 2 * 2
    for items, train_args, message in [
            (("lr=1e-4,3e-4", "lr=1e-3"), [], "names lr twice"),
            (("learning_rate=1e-4",), [], "no field 'learning_rate'"),
            (("lr",), [], "must look like field=v1,v2"),
            (("lr=1e-4,",), [], "must look like field=v1,v2"),
            (("lr=1e-4,1e-4",), [], "names a value twice"),  # two runs of one name would share a folder
            (("seed=0,1",), [], "with --seeds"),
            (("lr=1e-4,3e-4",), ["--lr", "1e-3"], "both swept (--set) and fixed")]:
        with pytest.raises(sweep.SweepError, match=re.escape(message)):
            sweep.set_axes(items, train_args)


def test_an_empty_or_repeated_algo_or_seed_list_is_refused():
    """`--seeds` with no value planned 0 runs, then blamed missing runs; a repeated one named two runs alike, which
    would share a folder."""
    for argv, message in [(["--algos"], "--algos is empty"), (["--seeds"], "--seeds is empty"),
                          (["--seeds", "0", "1", "0"], "--seeds names 0 twice"),
                          (["--algos", "gspo", "grpo", "gspo"], "--algos names gspo twice")]:
        with pytest.raises(sweep.SweepError, match=re.escape(message)):
            sweep.settings(argv)


@pytest.mark.slow
def test_a_bad_set_is_one_line_before_any_run(tmp_path):
    done = subprocess.run([sys.executable, "-m", "tools.sweep", "--set", "lr=1e-4", "--set", "lr=2e-4", "--output-dir",
                           str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and done.stderr.strip().splitlines() == [
        "error: --set names lr twice; give all its values in one: --set lr=v1,v2"]
    assert not any(tmp_path.iterdir())


def test_report_only_without_runs_or_data_is_one_line(tmp_path):
    done = subprocess.run([sys.executable, "-m", "tools.sweep", "--report-only", "--output-dir", str(tmp_path)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1
    assert done.stderr.startswith("error: no finished runs under") and "without --report-only" in done.stderr
    assert not any(tmp_path.iterdir())


@pytest.mark.slow
def test_a_sweep_whose_every_run_failed_says_so(tmp_path, capsys):
    """Its one run refused by train.py (exit 2): the sweep's last line says every run failed, not "run the sweep
    first", which it just did."""
    with pytest.raises(SystemExit) as exc:
        sweep.main(["--algos", "gspo", "--seeds", "0", "--set", "lr=-1", "--total-steps", "1", "--output-dir",
                    str(tmp_path), "--wandb-mode", "disabled"])
    captured = capsys.readouterr()
    assert exc.value.code == 2 and "gspo-lr-1-s0: FAILED (exit 2" in captured.out
    assert "1 runs, 0 finished, 1 not (failed, skipped after an error or stopped)" in captured.out
    assert captured.err.strip().endswith("every run of the grid failed or was skipped: the lines above name each "
                                         "one's console.log")


@pytest.mark.slow
def test_the_committed_sweep_report_is_what_its_data_makes(tmp_path):
    """docs/sweep/ is `python -m tools.sweep --report-only --report-dir docs/sweep` of docs/sweep/data: the table, and
    every figure with as many points as the runs give."""
    runs = sweep.load_runs(ROOT / "docs" / "sweep" / "data")
    algos = {r["config"]["algo"] for r in runs}
    assert algos <= set(sweep.ALGOS) and len(runs) == 3 * len(algos)  # 3 seeds each
    points = sweep.write_report(runs, tmp_path, 0.6, f"Sweep default: {len(runs)} runs")
    assert all(n > 0 for n in points.values()), points
    for name in ("summary.md", "summary.csv"):
        assert (tmp_path / name).read_text() == (ROOT / "docs" / "sweep" / name).read_text(), name
    readme = (ROOT / "README.md").read_text()  # the README's results table: the same data, by the same code
    assert sweep.readme_table(runs, 0.6) in readme, "README's results table drifted from docs/sweep/data"


def test_the_held_out_area_averages_the_evaluations_after_training_began():
    """The summary's area under the held-out curve: the step-0 evaluation (before training) is left out, a run with
    no later evaluation has none."""
    run = {"rows": [{"step": 0, "eval/accuracy": 0.2}, {"step": 5, "charts/accuracy": 0.9},
                    {"step": 10, "eval/accuracy": 0.5}, {"step": 20, "eval/accuracy": 0.8}]}
    assert sweep.heldout_area(run) == pytest.approx(0.65)
    assert math.isnan(sweep.heldout_area({"rows": [{"step": 0, "eval/accuracy": 0.2}]}))


def test_steps_to_a_threshold_counts_reaching_it_and_drift_needs_two_whole_windows():
    run = {"rows": [{"step": 0, "eval/accuracy": 0.2}, {"step": 10, "eval/accuracy": 0.6},
                    {"step": 20, "eval/accuracy": 0.7}]}
    assert sweep.steps_to(run, 0.6) == 10 and sweep.steps_to(run, 0.65) == 20  # reaching it is enough
    assert math.isnan(sweep.steps_to(run, 0.9))
    rows = {"rows": [{"step": s, "charts/completion_len": float(s)} for s in range(1, 31)]}
    assert sweep.drift(rows, "charts/completion_len") == pytest.approx(25.5 - 5.5)  # last 10 minus first 10
    assert math.isnan(sweep.drift({"rows": rows["rows"][:19]}, "charts/completion_len"))  # the windows would overlap


def test_the_spread_over_seeds_is_the_sample_standard_deviation():
    """'mean ± sd' over seeds divides by n - 1, as the study's intervals do (README's grpo row: dividing by n gave
    0.062 for 0.076, a spread too narrow by a factor sqrt(3/2)); one seed has none."""
    assert sweep.seed_sd([0.758, 0.909, 0.818]) == pytest.approx(0.0760, abs=1e-4)
    assert sweep.seed_sd([0.2, 0.4]) == pytest.approx(0.2 / math.sqrt(2))
    assert math.isnan(sweep.seed_sd([0.5]))
    logged = [{"step": 1, "clip/frac": 0.1, "ratio/token_var": 0.1, "charts/completion_len": 5.0}]
    rows = sweep.summary_rows([{"config": {"algo": "gspo", "seed": s}, "axes": {}, "rows": logged,
                                "summary": {"accuracy_before": 0.2, "accuracy_after": a, "rl_minutes": 1.0}}
                               for s, a in ((0, 0.2), (1, 0.4))], 0.6)
    assert rows[0]["accuracy_after_std"] == pytest.approx(0.2 / math.sqrt(2))


def test_set_values_given_as_separate_words_are_each_an_axis():
    """`--set lr=1e-4,3e-4 num_minibatches=2,4` (one --set, several words) gathers every word, as repeated --set
    flags do."""
    argv = ["--set", "lr=1e-4,3e-4", "num_minibatches=2,4", "--total-steps", "3"]
    assert sweep.merge_set_flags(argv) == ["--total-steps", "3", "--set", "lr=1e-4,3e-4", "num_minibatches=2,4"]


def test_a_crashed_run_is_rerun_and_every_run_gets_its_share_of_the_cores(tmp_path, monkeypatch, capsys):
    """launch: exit code 2 (train.py refused it: it would again) is skipped on a rerun, any other failure (a crash,
    a kill) is run again from an empty folder; the command saves no model (a sweep reads metrics) and
    OMP_NUM_THREADS is the cores over --parallel. run_grid: a run that exits 0 without summary.json (a signal
    stopped it) is 'stopped early', not done."""
    calls = []

    def fake_call(cmd, env, **kw):
        calls.append((cmd, env["OMP_NUM_THREADS"]))
        return 0

    monkeypatch.setattr(sweep.subprocess, "call", fake_call)
    run = {"algo": "gspo", "seed": "0", "run_name": "r", "log_prefix_spread": True}  # True: a switch (the study's)
    (tmp_path / "r").mkdir()
    (tmp_path / "r" / "stale.txt").write_text("from the crashed run")
    (tmp_path / "r" / "sweep_exit.json").write_text(json.dumps({"exit_code": 1}))
    assert sweep.launch(run, "t", [], tmp_path, 3)[2] == 0 and len(calls) == 1
    assert not (tmp_path / "r" / "stale.txt").exists()
    assert "--no-save-model" in calls[0][0] and calls[0][0][-1] == "--log-prefix-spread" and calls[0][1] == "3"
    (tmp_path / "r" / "sweep_exit.json").write_text(json.dumps({"exit_code": 2}))
    assert sweep.launch(run, "t", [], tmp_path, 3)[2] == -2 and len(calls) == 1

    shares = []
    monkeypatch.setattr(sweep.os, "cpu_count", lambda: 8)
    monkeypatch.setattr(sweep, "launch",
                        lambda f, name, a, d, threads: shares.append(threads) or (f["run_name"], 1.0, 0))
    sweep.run_grid([{"run_name": "a", "seed": "0"}, {"run_name": "b", "seed": "0"}], "t", ["--model", "m"], tmp_path, 2)
    assert shares == [4, 4]
    assert "a: stopped early" in capsys.readouterr().out
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "summary.json").write_text("{}")
    sweep.run_grid([{"run_name": "a", "seed": "0"}, {"run_name": "b", "seed": "0"}], "t", ["--model", "m"], tmp_path, 2)
    out = capsys.readouterr().out
    assert "a: done in" in out and "b: stopped early" in out and "t: 2 runs, 1 finished, 1 not" in out


def test_warm_starts_are_built_once_per_seed_and_dataset_and_not_for_another_model(monkeypatch):
    import model

    built = []
    monkeypatch.setattr(model, "warm_start", lambda seed, settings: built.append((seed, settings)))
    runs = [{"seed": "1"}, {"seed": "0"}, {"seed": "0", "dataset": "embedded-long"}, {"seed": "1"}]
    sweep.warm_starts_first(runs, [])
    assert built == [(0, model.WARM_START), (0, model.WARM_START_LONG), (1, model.WARM_START)]
    built.clear()
    sweep.warm_starts_first(runs, ["--model", "some/folder"])
    assert built == []


def test_packed_data_is_the_same_bytes_whenever_it_is_packed(tmp_path, monkeypatch):
    """gzip writes the time into its header unless told otherwise: the committed data would change at every repack."""
    import gzip

    for later in ("a", "b"):  # (the header names the file too: the same name in two folders)
        (tmp_path / later).mkdir()
        sweep.write_jsonl_gz(tmp_path / later / "run.jsonl.gz", [{"x": 1}, "{\"y\": 2}"])
        monkeypatch.setattr(gzip.time, "time", lambda: 2_000_000_000.0)
    assert (tmp_path / "a" / "run.jsonl.gz").read_bytes() == (tmp_path / "b" / "run.jsonl.gz").read_bytes()
    assert sweep.read_jsonl_gz(tmp_path / "a" / "run.jsonl.gz") == [{"x": 1}, {"y": 2}]


def test_the_sweeps_own_flags_on_their_edges():
    """--parallel 1 and --threshold 0 or 1 are accepted, --parallel 0 and a threshold outside [0, 1] refused;
    --report-only needs no algos or seeds."""
    sweep.settings(["--parallel", "1", "--threshold", "0"])
    sweep.settings(["--threshold", "1"])
    sweep.settings(["--report-only", "--seeds"])
    for argv, message in [(["--parallel", "0"], "--parallel 0"), (["--threshold", "1.01"], "--threshold 1.01"),
                          (["--threshold", "-0.01"], "--threshold -0.01")]:
        with pytest.raises(sweep.SweepError, match=re.escape(message)):
            sweep.settings(argv)


def test_the_plots_draw_a_band_on_the_shared_steps_and_count_their_points():
    """mean_band: the mean over runs on the steps every run logged, with a min-max band; styles_of: one colour per
    objective, a line style per setting; plotted_points counts points, not lines; a length quartile whose values are
    all 0 (on-policy: nothing on a log axis) gives no point."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [{"rows": [{"step": s, "k": float(s)} for s in (1, 2, 3)]}, {"rows": [{"step": s, "k": 2.0 * s}
                                                                              for s in (2, 3, 4)]}]
    fig, ax = plt.subplots()
    sweep.mean_band(ax, runs, "k", "both", color="tab:blue")
    line, = ax.get_lines()
    assert list(line.get_xdata()) == [2, 3] and list(line.get_ydata()) == [3.0, 4.5]
    assert len(ax.collections) == 1  # the band
    assert sweep.plotted_points(fig) == 2
    plt.close(fig)
    fig, ax = plt.subplots()
    sweep.legend(ax)  # a panel without labelled lines gets no legend (matplotlib would warn)
    assert ax.get_legend() is None
    plt.close(fig)
    styles = sweep.styles_of({("gspo", "lr=1"): [], ("gspo", "lr=2"): [], ("grpo", "lr=1"): []})
    assert styles[("gspo", "lr=1")]["color"] == styles[("gspo", "lr=2")]["color"] != styles[("grpo", "lr=1")]["color"]
    assert styles[("gspo", "lr=1")]["linestyle"] == styles[("grpo", "lr=1")]["linestyle"] != \
        styles[("gspo", "lr=2")]["linestyle"]
    zero = [{"rows": [{"step": 1, "lenbucket/q1_len": 10.0, "lenbucket/q1_std_logsum": 0.0}]}]
    assert sweep.length_bucket_points(zero, "std_logsum") == []


def test_a_detail_cell_is_a_dash_where_any_run_of_its_group_lacks_the_metric():
    """A group whose runs were logged before a preset existed (one run of two has its shadow clip fraction) shows
    '-', not a mean over the runs that have it."""
    runs = [{"config": {"algo": "gspo", "seed": s}, "summary": {"accuracy_before": 0.2}, "axes": {},
             "rows": [{"step": 1, **({"clip/shadow_gspo": 0.5} if s == 0 else {"clip/shadow_grpo": 0.1})}]}
            for s in (0, 1)]
    table = sweep.detail_tables(runs)
    assert "| gspo | - |" in table and "| grpo | - |" in table
    runs[1]["rows"][0]["clip/shadow_gspo"] = 0.25
    assert "| gspo | 0.375 |" in sweep.detail_tables(runs)
