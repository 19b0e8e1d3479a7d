"""A 2 x 1 micro-sweep end to end: runs, skip-on-rerun, report files and plots with data."""

import csv
import subprocess
import sys
from pathlib import Path

import sweep

ROOT = Path(__file__).resolve().parents[1]


def run_sweep(tmp_path, model_dir):
    cmd = [sys.executable, "sweep.py", "--algos", "gspo", "grpo", "--seeds", "0", "--parallel", "2",
           "--name", "micro", "--output-dir", str(tmp_path), "--model", str(model_dir),
           "--total-steps", "3", "--eval-every", "1", "--eval-size", "8", "--num-prompts", "4",
           "--num-generations", "4", "--max-new-tokens", "24", "--num-minibatches", "2", "--set", "lr=1e-3,5e-4",
           "--wandb-mode", "disabled"]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def test_micro_sweep_report_and_resume(tmp_path, tiny_policy_dir):
    out = run_sweep(tmp_path, tiny_policy_dir)
    assert "gspo-lr1e-3-s0: done" in out and "grpo-lr5e-4-s0: done" in out
    report = tmp_path / "micro" / "report"
    for name in ("summary.md", "summary.csv", "accuracy.png", "length_buckets.png", "clip.png", "lengths.png"):
        assert (report / name).is_file() and (report / name).stat().st_size > 0, name
    rows = list(csv.DictReader((report / "summary.csv").open()))
    # the swept lr keeps its own row per algo: the axis is not averaged away
    assert sorted((r["algo"], r["setting"]) for r in rows) == [("grpo", "lr=1e-3"), ("grpo", "lr=5e-4"),
                                                              ("gspo", "lr=1e-3"), ("gspo", "lr=5e-4")]
    assert all(0 <= float(r["accuracy_after_mean"]) <= 1 for r in rows)

    runs = sweep.load_runs(tmp_path / "micro" / "runs")
    points = sweep.write_report(runs, tmp_path / "again", 0.6, "again")
    assert set(points) == {"accuracy", "length_buckets", "clip", "lengths"}
    assert all(n > 0 for n in points.values()), points

    # an interrupted run (no summary.json) is redone; a finished one is skipped
    (tmp_path / "micro" / "runs" / "grpo-lr1e-3-s0" / "summary.json").unlink()
    out = run_sweep(tmp_path, tiny_policy_dir)
    assert "gspo-lr1e-3-s0: skipped (finished)" in out and "grpo-lr1e-3-s0: done" in out


def test_grid_names_and_overrides():
    runs = sweep.grid(sweep.SweepArgs(algos=("gspo",), seeds=(0, 1), set=("lr=1e-4,3e-4",)))
    assert [r["run_name"] for r in runs] == ["gspo-lr1e-4-s0", "gspo-lr3e-4-s0", "gspo-lr1e-4-s1", "gspo-lr3e-4-s1"]
    assert runs[1]["lr"] == "3e-4"


def test_a_run_stopped_by_an_error_is_not_rerun(tmp_path, tiny_policy_dir):
    """A run train.py stopped with exit code 2 (bad input, a non-finite stop, dynamic sampling giving up) would stop
    the same way again: a rerun of the sweep reports it and moves on."""
    flags = {"algo": "gspo", "seed": "0", "run_name": "bad", "lr": "-1"}
    train_args = ["--model", str(tiny_policy_dir), "--wandb-mode", "disabled"]
    name, _, rc = sweep.launch(flags, "t", train_args, tmp_path, 1)
    assert (name, rc) == ("bad", 2)
    assert "error: --lr must be > 0" in (tmp_path / "bad" / "console.log").read_text()
    assert sweep.launch(flags, "t", train_args, tmp_path, 1)[2] == -2
