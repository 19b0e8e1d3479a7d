"""The study preset and the claim analyses, on synthetic runs whose answers are known."""

import json
import math

import numpy as np

import study
import sweep


def test_study_expands_to_the_documented_grid():
    runs = study.grid(tuple(study.CELLS), (0, 1, 2))
    assert len(runs) == 3 * (4 + 1 + 4 + 4 + 2 + 2 + 3 + 1) == 63
    names = [r["run_name"] for r in runs]
    assert len(set(names)) == len(names)
    by_name = {r["run_name"]: r for r in runs}
    assert by_name["base-gspo-s0"] == {"algo": "gspo", "seed": "0", "run_name": "base-gspo-s0"}
    assert by_name["eh02-dapo-s1"]["epsilon_high"] == "0.2"
    assert by_name["stale16-dapo-s1"] == {"algo": "dapo", "seed": "1", "run_name": "stale16-dapo-s1",
                                          "num_minibatches": "16"}  # staleness alone: base lr
    assert by_name["stale-dr_grpo-s2"]["lr"] == "2e-4" and by_name["stale-dr_grpo-s2"]["num_minibatches"] == "16"
    assert by_name["stale-kl-grpo-s0"]["beta"] == "0" and by_name["stale-kl-gspo-s0"]["beta"] == "0.04"
    assert by_name["stale16-kl-gspo-s2"] == {"algo": "gspo", "seed": "2", "run_name": "stale16-kl-gspo-s2",
                                             "num_minibatches": "16", "beta": "0.04"}
    for cell in study.CELLS:  # every cell is documented where `python study.py --help` shows it
        assert f"\n    {cell} " in study.__doc__
    assert "--dataset" in study.COMMON and "embedded-long" in study.COMMON


def fake_run(name, algo, seed, acc, rng, cell=None, length_power=0.5, entropy=1.0, len_incorrect=None,
             steps=study.STEPS):
    """A run whose metrics follow chosen laws: std of the log-ratio sum = 0.01 * len^length_power."""
    rows = []
    for step in range(0, steps + 1):
        row = {"step": step}
        if step % study.EVAL_EVERY == 0:
            row["eval/accuracy"] = acc(step)
        if step > 0:
            for q, length in enumerate((25, 50, 100, 200), 1):
                noise = math.exp(rng.normal(0, 0.05))
                row[f"lenbucket/q{q}_len"] = length
                row[f"lenbucket/q{q}_std_logsum"] = 0.01 * length ** length_power * noise
                row[f"lenbucket/q{q}_std_log_s"] = 0.01 * length ** (length_power - 1) * noise
            row.update({"clip/frac": 0.3 if algo == "gspo" else 0.002, "losses/entropy": entropy,
                        "charts/len_incorrect": len_incorrect(step) if len_incorrect else 80.0,
                        "charts/len_correct": 60.0, "ratio/token_var": 1e-3, "losses/grad_norm": 0.5,
                        "ratio/seq_logsum_var": 1e-2, "charts/reward": 0.5, "charts/completion_len": 70.0,
                        "clip/shadow_gspo": 0.3, "clip/shadow_grpo": 0.002, "clip/shadow_dapo": 0.002,
                        "clip/shadow_dr_grpo": 0.002, "ratio/token_mean": 1.0})
        rows.append(row)
    return {"name": name, "cell": cell or name.rsplit("-", 2)[0], "algo": algo, "seed": seed, "total_steps": steps,
            "rows": rows, "stopped": None}


def synthetic_study():
    rng = np.random.default_rng(0)
    rising = lambda s: 0.4 + 0.005 * s  # noqa: E731
    falling = lambda s: 0.7 - abs(s - 15) / 50  # noqa: E731  a peak at step 15, then down 50 points
    runs = []
    for seed in range(3):
        for algo in sweep.ALGOS:
            runs.append(fake_run(f"base-{algo}-s{seed}", algo, seed, rising, rng,
                                 entropy=1.2 if algo == "dapo" else 1.0,
                                 len_incorrect=(lambda s: 80 + s) if algo == "grpo" else None))
            for cell in study.STALE_CELLS:
                runs.append(fake_run(f"{cell}-{algo}-s{seed}", algo, seed, rising if algo == "gspo" else falling, rng))
        runs.append(fake_run(f"eh02-dapo-s{seed}", "dapo", seed, rising, rng, entropy=0.8))
        for algo in ("grpo", "gspo"):
            runs.append(fake_run(f"stale-kl-{algo}-s{seed}", algo, seed, rising, rng))
            runs.append(fake_run(f"stale16-kl-{algo}-s{seed}", algo, seed, rising, rng))
    return runs


def test_collapse_rule():
    rng = np.random.default_rng(0)
    curve = {0: 0.4, 10: 0.6, 20: 0.7, 30: 0.55, 40: 0.49}
    peak_then_drop = fake_run("x-grpo-s0", "grpo", 0, lambda s: curve.get(s, 0.5), rng)
    assert study.collapse_step(peak_then_drop) == 40  # 0.49 <= 0.70 - 0.20 first at step 40
    curve[40] = 0.51
    wobble = fake_run("x-grpo-s0", "grpo", 0, lambda s: curve.get(s, 0.5), rng)
    assert study.collapse_step(wobble) is None  # 19 points below the peak is not a collapse
    assert not study.failed(wobble)
    wobble["stopped"] = study.STOPS["non-finite losses"]
    assert study.collapse_step(wobble) == study.STEPS  # a non-finite stop is one, at its last step
    sinking = fake_run("x-gspo-s0", "gspo", 0, lambda s: 0.24 - s / 400, rng)  # never above its start: no peak
    assert study.collapse_step(sinking) is None and study.failed(sinking)  # ... but it failed


def test_length_exponent_recovers_the_law():
    rng = np.random.default_rng(1)
    for power in (0.5, 0.2, 1.0):
        run = fake_run("base-grpo-s0", "grpo", 0, lambda s: 0.5, rng, length_power=power)
        assert abs(study.length_exponent(run, "std_logsum") - power) < 0.02
        assert abs(study.length_exponent(run, "std_log_s") - (power - 1)) < 0.02


def test_differ_rule_is_interval_overlap():
    assert study.differ((1.0, 0.1), (1.3, 0.1)) and not study.differ((1.0, 0.2), (1.3, 0.2))


def test_verdicts_on_a_synthetic_study_that_reproduces_every_claim(tmp_path):
    runs = synthetic_study()
    rows, numbers = study.verdicts(runs)
    assert [r["verdict"] for r in rows] == ["reproduced"] * 5, [(r["claim"], r["verdict"], r["measured"]) for r in rows]
    assert numbers["collapse"][("stale", "grpo")] == (3, 3) and numbers["collapse"][("stale", "gspo")] == (0, 3)
    points = study.write_report(runs, tmp_path)
    assert all(n > 0 for n in points.values()), points
    assert (tmp_path / "summary.md").read_text().count("**reproduced**") == 5
    assert len(json.loads((tmp_path / "verdicts.json").read_text())) == 5


def test_verdicts_say_not_reproduced_when_the_data_says_so():
    runs = synthetic_study()
    for r in runs:
        for row in r["rows"]:
            for q in range(1, 5):  # flat spread: no growth with length
                if f"lenbucket/q{q}_len" in row:
                    row[f"lenbucket/q{q}_std_logsum"] = 0.2
                    row[f"lenbucket/q{q}_std_log_s"] = 0.2 / row[f"lenbucket/q{q}_len"]
        if r["cell"] == "eh02":  # clip-higher changes nothing
            for row in r["rows"]:
                if "losses/entropy" in row:
                    row["losses/entropy"] = 1.2
    verdict = {r["claim"][0]: r["verdict"] for r in study.verdicts(runs)[0]}
    # the sum does not grow; log s_i shrinks like 1/len, faster than 1/sqrt(len), which still keeps it on scale
    assert verdict["1"] == "Σ: not reproduced; log s: reproduced" and verdict["5"] == "not reproduced"


def test_claim4_is_judged_per_horizon():
    """Flat incorrect lengths in 40 steps, GRPO's growing over 120 (long120): each horizon gets its verdict."""
    runs = [r for r in synthetic_study() if not (r["cell"] == "base" and r["algo"] == "grpo")]
    rng = np.random.default_rng(3)
    for seed in range(3):
        runs.append(fake_run(f"base-grpo-s{seed}", "grpo", seed, lambda s: 0.5, rng))
        runs.append(fake_run(f"long120-dr_grpo-s{seed}", "dr_grpo", seed, lambda s: 0.5, rng, steps=120))
        runs.append(fake_run(f"long120-grpo-s{seed}", "grpo", seed, lambda s: 0.5, rng, steps=120,
                             len_incorrect=lambda s: 80 + s / 2 + seed))
    assert study.repeats_base(runs[-1], runs) is False  # its incorrect lengths differ from base's from step 1
    twin = next(r for r in runs if r["name"] == "base-grpo-s2")
    longer = dict(twin, name="long120-grpo-s2", cell="long120", rows=twin["rows"] + [{"step": 41}])
    assert study.repeats_base(longer, runs) is True
    row = study.verdicts(runs)[0][3]
    assert row["verdict"] == "40 steps: not reproduced; 120 steps: reproduced", row
    assert "long120 (120 steps): GRPO 55 ± 0, Dr.GRPO 0 ± 0" in row["measured"], row["measured"]
    runs = [r for r in runs if not r["name"].startswith("long120-grpo")]  # GRPO at 120 steps missing: 40 alone
    assert study.verdicts(runs)[0][3]["verdict"] == "not reproduced"
    # claim 5 the same way: clip-higher keeps entropy up in 40 steps (synthetic base), not over 120
    for seed in range(3):
        runs.append(fake_run(f"long120-dapo-s{seed}", "dapo", seed, lambda s: 0.5, rng, steps=120, entropy=1.0))
        runs.append(fake_run(f"eh02-long120-dapo-s{seed}", "dapo", seed, lambda s: 0.5, rng, steps=120, entropy=1.0))
    assert {r["cell"] for r in runs} >= {"long120", "eh02-long120"}
    assert study.verdicts(runs)[0][4]["verdict"] == "40 steps: reproduced; 120 steps: not reproduced"


def test_claim3_is_judged_per_stale_regime():
    """GSPO survives staleness alone but fails with the larger lr too: each regime gets its own verdict."""
    runs = synthetic_study()
    rng = np.random.default_rng(2)
    runs = [r for r in runs if not (r["cell"] == "stale" and r["algo"] == "gspo")]
    runs += [fake_run(f"stale-gspo-s{seed}", "gspo", seed, lambda s: 0.7 - abs(s - 15) / 50, rng) for seed in range(3)]
    rows, numbers = study.verdicts(runs)
    assert rows[2]["verdict"] == "stale16: reproduced; stale: not reproduced", rows[2]
    assert numbers["failed"][("stale", "gspo")] == (3, 3) and numbers["failed"][("stale16", "gspo")] == (0, 3)
    # nothing fails anywhere: no collapse to protect against, so the claim is not reproduced, not "reproduced"
    assert study.stability_verdict((0, 3), [(0, 3)] * 3) == "not reproduced"
    assert study.stability_verdict((0, 1), [(3, 3)] * 3) == "inconclusive"  # one seed


def test_sweep_report_keeps_every_swept_axis(tmp_path):
    """`--set lr=5e-5,2e-4` must give one row and one line style per lr, not one averaged row per algo."""
    rng = np.random.default_rng(0)
    runs = []
    for algo in ("gspo", "grpo"):
        for lr in ("5e-5", "2e-4"):
            for seed in (0, 1):
                r = fake_run(f"{algo}-lr{lr}-s{seed}", algo, seed, (lambda s: 0.5) if lr == "5e-5" else
                             (lambda s: 0.2), rng)
                r.update(config={"algo": algo}, summary={"accuracy_before": 0.3, "accuracy_after": r["rows"][-1]
                                                         ["eval/accuracy"], "rl_minutes": 1.0}, axes={"lr": lr})
                runs.append(r)
    rows = sweep.summary_rows(runs, 0.4)
    assert {(r["algo"], r["setting"]) for r in rows} == {(a, f"lr={lr}") for a in ("gspo", "grpo")
                                                         for lr in ("5e-5", "2e-4")}
    assert {r["setting"]: r["accuracy_after_mean"] for r in rows if r["algo"] == "gspo"} == {"lr=5e-5": 0.5,
                                                                                            "lr=2e-4": 0.2}
    styles = sweep.styles_of(sweep.groups_of(runs))
    assert styles[("gspo", "lr=5e-5")]["color"] == styles[("gspo", "lr=2e-4")]["color"]  # colour = algo
    assert styles[("gspo", "lr=5e-5")]["linestyle"] != styles[("gspo", "lr=2e-4")]["linestyle"]  # style = value
    assert styles[("grpo", "lr=2e-4")]["linestyle"] == styles[("gspo", "lr=2e-4")]["linestyle"]
    points = sweep.write_report(runs, tmp_path, 0.4, "t")
    assert all(n > 0 for n in points.values())
    table = (tmp_path / "summary.md").read_text()
    assert table.count("| lr=5e-5 |") == 2 and table.count("| lr=2e-4 |") == 2
