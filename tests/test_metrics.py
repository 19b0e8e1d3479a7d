"""What a step logs equals its definition: each metric of the update (losses.ratio_diagnostics, the KL to the
reference, the sampler-trainer mismatch, the rollout correction, the length buckets) and of the rollout
(metrics.rollout_metrics, metrics.timing) against a plain-Python recomputation, unit by unit, on a small batch whose
rows have different lengths. Elsewhere these keys are only checked to be finite; the study reads several of them
(ratio/abs_log_* is its manipulation check, ratio/seq_logsum_var claim 1's quantity)."""

import math
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import losses
import metrics
from losses import PRESETS
from plumbing.ddp import SINGLE

LENGTHS = [5, 2, 6, 0, 3]  # row 3 has no valid token (every metric leaves it out)


def batch(seed=0):
    gen = torch.Generator().manual_seed(seed)
    b, t = len(LENGTHS), max(LENGTHS)
    mask = torch.tensor([[1.0] * n + [0.0] * (t - n) for n in LENGTHS], dtype=torch.float64)
    old = -torch.rand(b, t, generator=gen, dtype=torch.float64) * 2
    logp = old + torch.randn(b, t, generator=gen, dtype=torch.float64) * 0.5  # ratios well outside 1 +- 0.2
    adv = torch.tensor([1.0, -1.0, -0.5, 2.0, 0.7], dtype=torch.float64)
    return logp, old, adv, mask


def mean(xs):
    return sum(xs) / len(xs)


def pvar(xs):
    m = mean(xs)
    return sum((x - m) ** 2 for x in xs) / len(xs)


def log_ratios(logp, old):
    """The token log-ratios l_it of batch()'s valid rows, by row (the empty row has none)."""
    return {i: [float(logp[i, t] - old[i, t]) for t in range(n)] for i, n in enumerate(LENGTHS) if n}


def clipped(w, a, eps, eps_high):  # PPO's rule, as the papers state it: the min takes the clipped term
    return (a < 0 and w < 1 - eps) or (a > 0 and w > 1 + eps_high)


@pytest.mark.parametrize("algo", ["dapo", "gspo"])
@pytest.mark.parametrize("eps_high", [0.28, 0.3])
def test_ratio_diagnostics_equal_their_definitions(algo, eps_high):
    """Row 2's s_i is 1.29 with A > 0: clipped above 1 + 0.28, and inside the band clip-higher opens at 0.3 (so a
    rule that read epsilon for the upper side would show)."""
    logp, old, adv, mask = batch()
    adv[2] = 0.5
    cfg = replace(PRESETS[algo], epsilon=0.2, epsilon_high=eps_high)  # gspo's own 3e-4 would clip every sequence
    diag = losses.ratio_diagnostics(logp, old, adv, mask, cfg)
    l = log_ratios(logp, old)
    rows = list(l)
    tokens = [(x, float(adv[i]), i) for i in rows for x in l[i]]
    log_s = {i: mean(l[i]) for i in rows}  # log of GSPO's s_i
    tok_low = sum(clipped(math.exp(x), a, 0.2, eps_high) and a < 0 for x, a, _ in tokens) / len(tokens)
    tok_high = sum(clipped(math.exp(x), a, 0.2, eps_high) and a > 0 for x, a, _ in tokens) / len(tokens)
    seq_clipped = [i for i in rows if clipped(math.exp(log_s[i]), float(adv[i]), 0.2, eps_high)]
    want = {
        "ratio/token_mean": mean([math.exp(x) for x, _, _ in tokens]),
        "ratio/token_var": pvar([math.exp(x) for x, _, _ in tokens]),
        "ratio/seq_mean": mean([math.exp(log_s[i]) for i in rows]),
        "ratio/seq_var": pvar([math.exp(log_s[i]) for i in rows]),
        "ratio/seq_logsum_var": pvar([sum(l[i]) for i in rows]),
        "ratio/abs_log_token": mean([abs(x) for x, _, _ in tokens]),
        "ratio/abs_log_seq": mean([abs(log_s[i]) for i in rows]),
        "clip/token_low": tok_low, "clip/token_high": tok_high, "clip/token_frac": tok_low + tok_high,
        "clip/seq_low": sum(float(adv[i]) < 0 for i in seq_clipped) / len(rows),  # floats: pytest 9.2 approx
        "clip/seq_high": sum(float(adv[i]) > 0 for i in seq_clipped) / len(rows),  # takes no tensor in a dict
        "clip/seq_frac": len(seq_clipped) / len(rows),
        "clip/seq_token_frac": sum(LENGTHS[i] for i in seq_clipped) / len(tokens),
        "approx_kl": mean([math.exp(x) - 1 - x for x, _, _ in tokens]),
    }
    want["clip/frac"] = want["clip/token_frac" if algo == "dapo" else "clip/seq_frac"]  # at the objective's level
    assert 0 < want["clip/token_low"] and 0 < want["clip/token_high"] and 0 < want["clip/seq_frac"] < 1  # all exercised
    assert (want["clip/seq_high"] > 0) == (eps_high == 0.28)  # row 2: clipped, or inside the band
    assert diag == pytest.approx(want, rel=1e-9, abs=1e-12)


def gate_slope(w, tau):  # SAPO's f'(w) = 4 sigmoid(tau (w - 1)) (1 - sigmoid(...)), by hand
    s = 1 / (1 + math.exp(-tau * (w - 1)))
    return 4 * s * (1 - s)


def kernel(w, a):  # VESPO's phi(W) = e^lambda W^k e^(-lambda W), preset (k, lambda): (2, 3) for A >= 0, else (3, 2)
    k, lam = (2.0, 3.0) if a >= 0 else (3.0, 2.0)
    return math.exp(lam) * w ** k * math.exp(-lam * w)


SAPO_STEEP = replace(PRESETS["sapo"], sapo_tau_pos=4.5, sapo_tau_neg=5.5)  # steep gates: some units under half
# Each objective's clip rule by hand: its config, its unit (a token's rho_it, a sequence's s_i, or VESPO's whole W_i,
# each with its advantage) and the weight it leaves on the unit's gradient, below half of which a unit counts
# (SAPO's gate, VESPO's kernel), or else whether the unit is clipped.
RULES = {
    "clip-token": (replace(PRESETS["dapo"], epsilon=0.2, epsilon_high=0.28), "token", None,
                   lambda w, a: clipped(w, a, 0.2, 0.28)),
    "clip-sequence": (replace(PRESETS["gspo"], epsilon=0.2, epsilon_high=0.28), "sequence", None,
                      lambda w, a: clipped(w, a, 0.2, 0.28)),
    "cispo": (replace(PRESETS["cispo"], epsilon=0.2, epsilon_high=0.28), "token", None,
              lambda w, a: not 0.8 <= w <= 1.28),
    "gmpo": (PRESETS["gmpo"], "token", None,
             lambda w, a: (a > 0 and math.log(w) > 0.4) or (a < 0 and math.log(w) < -0.4)),
    "sapo-token": (SAPO_STEEP, "token", lambda w, a: gate_slope(w, 4.5 if a > 0 else 5.5), None),
    "sapo-sequence": (replace(SAPO_STEEP, importance_sampling_level="sequence"), "sequence",
                      lambda w, a: gate_slope(w, 4.5 if a > 0 else 5.5), None),
    "vespo": (PRESETS["vespo"], "whole", kernel, None),
}


def units_of(unit, logp, old, adv):
    """(ratio, advantage) of each unit of batch()'s valid rows: tokens, sequences (s_i) or whole sequences (W_i)."""
    l = log_ratios(logp, old)
    rows = list(l)
    if unit == "token":
        return [(math.exp(x), float(adv[i])) for i in rows for x in l[i]]
    return [(math.exp(mean(l[i]) if unit == "sequence" else sum(l[i])), float(adv[i])) for i in rows]


@pytest.mark.parametrize("rule", list(RULES))
def test_clip_fraction_counts_each_rules_own_units_by_hand(rule):
    """clip/frac is the share of the objective's units its rule clips (or leaves under half their gradient), over
    the valid units only: batch()'s empty row is in no denominator. Where a weight is read, some unit lies between
    0.4 and 0.5 of it, so the threshold is the one counted."""
    cfg, unit, weight, is_clipped = RULES[rule]
    logp, old, adv, mask = batch()
    units = units_of(unit, logp, old, adv)
    weights = None if weight is None else [weight(w, a) for w, a in units]
    counted = [x < 0.5 for x in weights] if weight else [is_clipped(w, a) for w, a in units]
    assert 0 < sum(counted) < len(counted)  # the rule acts, and not on everything
    if weights is not None:
        assert any(0.4 <= x < 0.5 for x in weights), sorted(weights)
    got = losses.ratio_diagnostics(logp, old, adv, mask, cfg)["clip/frac"]
    assert got == pytest.approx(sum(counted) / len(counted), rel=1e-12)


@pytest.mark.parametrize("rule", [*RULES, "clip_cov", "kl_cov"])
def test_a_step_of_no_valid_token_logs_zeros_and_of_one_clipped_unit_logs_one(rule):
    """Every completion masked (--mask-truncated with each one truncated): every diagnostic is 0, none nan. One valid
    token, which the rule clips: its own share, 1, whatever the unit."""
    cfg = RULES[rule][0] if rule in RULES else replace(PRESETS["grpo"], surrogate=rule)
    logp, old, adv, mask = batch()
    empty = losses.ratio_diagnostics(logp, old, adv, torch.zeros_like(mask), cfg)
    assert empty == {k: 0.0 for k in empty}
    if rule not in RULES:  # (the covariance rules: test_cov_fraction_is_what_each_covariance_rule_acts_on)
        return
    _, _, weight, is_clipped = RULES[rule]
    counts = (lambda w, a: weight(w, a) < 0.5) if weight else is_clipped  # alone, a token is its sequence too
    i, t = next((i, t) for i, n in enumerate(LENGTHS) for t in range(n)
                if counts(math.exp(float(logp[i, t] - old[i, t])), float(adv[i])))
    one = torch.zeros_like(mask)
    one[i, t] = 1.0
    assert losses.ratio_diagnostics(logp, old, adv, one, cfg)["clip/frac"] == 1.0


def test_cov_fraction_is_what_each_covariance_rule_acts_on():
    """KL-Cov penalises cov_tokens(n) of the n valid tokens whatever their covariance; Clip-Cov cuts at most that
    many of its candidates, and none where no token's covariance lies in its band (every advantage 0 here)."""
    logp, old, adv, mask = batch()
    n, zero = int(mask.sum()), torch.zeros_like(adv)
    got = {s: losses.ratio_diagnostics(logp, old, zero, mask, replace(PRESETS["grpo"], surrogate=s))["clip/cov_frac"]
           for s in ("kl_cov", "clip_cov")}
    assert got == {"kl_cov": losses.cov_tokens(n) / n, "clip_cov": 0.0}


def test_update_metrics_read_the_rows_each_micro_batch_scored_against_their_own_pi_old():
    """The update scores the rollout's rows shuffled, in micro-batches: every metric of the update (the card's,
    the study's, the mismatch, the rollout correction, the entropy) equals its function over the rows in order,
    each row's log-probs against its own pi_old, mu and mask (rows differ in length, so a mix-up shows)."""
    logp, old, adv, mask = batch()
    mu = old + torch.randn(old.shape, generator=torch.Generator().manual_seed(3), dtype=torch.float64) * 0.3
    entropy = torch.rand(old.shape, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    order = [[3, 0, 4], [1, 2]]  # two micro-batches of a shuffled minibatch
    seen = [(torch.tensor(r), logp[r], entropy[r]) for r in order]
    cfg, correction = PRESETS["dapo"], ("token_truncate", 0.7, 3.0)
    got = metrics.update_metrics(seen, old, entropy, None, adv, mask, cfg, SINGLE, mu, correction, study=True)
    want = {**losses.ratio_diagnostics(logp, old, adv, mask, cfg), **metrics.study_metrics(logp, old, adv, mask),
            **metrics.mismatch_metrics(old, mu, mask), **metrics.correction_metrics(old, mu, mask, correction),
            "losses/entropy": losses.masked_mean(entropy, mask)}
    want["losses/approx_kl"] = want.pop("approx_kl")
    assert got == pytest.approx(want, rel=1e-9, abs=1e-12)
    assert 0 < got["clip/frac"] and got["ratio/token_var"] > 0.01  # the ratios are far from 1
    on = metrics.update_metrics(seen, None, None, None, adv, mask, cfg, SINGLE)  # on-policy: the entropy scored
    assert on["losses/entropy"] == pytest.approx(losses.masked_mean(entropy, mask), rel=1e-12)
    assert on["ratio/token_var"] == 0.0 and on["clip/frac"] == 0.0


def test_rollout_metrics_equal_their_definitions():
    """Two groups of 3 drawn and kept, one group dropped by dynamic sampling (all wrong): rewards, correctness,
    lengths and advantages of the kept rows; group fractions over every group drawn."""
    reward = [1.1, 0.0, 1.0, 0.5, 0.5, 0.5]
    correct = [1.0, 0.0, 1.0, 0.0, 0.0, 0.0]
    lengths, truncated = [4, 9, 6, 12, 12, 3], [0, 1, 0, 1, 1, 0]
    ro = SimpleNamespace(lengths=torch.tensor(lengths), truncated=torch.tensor(truncated).bool())
    b = SimpleNamespace(ro=ro, scores={"reward": reward, "correct": correct, "format": [1.0, 0, 1, 0, 1, 0]})
    adv = torch.tensor([0.5, -1.0, 0.5, 0.0, 0.0, 0.0])
    drawn = torch.tensor([[1.0, 0, 1], [0, 0, 0], [0, 0, 0]])  # groups drawn: the first two kept, the third dropped
    m = metrics.rollout_metrics(b, adv, 3, drawn, 9, 3, SINGLE, mask_truncated=True)
    assert m == pytest.approx({
        "dynamic/drawn": 9, "dynamic/dropped": 3,
        "charts/all_wrong_group_frac": 2 / 3, "charts/all_right_group_frac": 0.0,
        "charts/reward": mean(reward), "charts/reward_std": math.sqrt(pvar(reward) * 6 / 5),  # unbiased, as torch's
        "charts/accuracy": 2 / 6, "charts/zero_std_group_frac": 1 / 2,
        "charts/completion_len": mean(lengths), "charts/completion_len_min": 3, "charts/completion_len_max": 12,
        "charts/truncated_frac": 3 / 6, "charts/masked_frac": 3 / 6, "charts/advantage_abs": 2 / 6,
        "rewards/correct": 2 / 6, "rewards/format": 3 / 6,
        "charts/len_correct": 5.0, "charts/len_incorrect": (9 + 12 + 12 + 3) / 4,
    }, rel=1e-6)
    # a group whose rewards differ by the format term alone (0.1 apart) is not a zero-std group: it has a gradient
    near = SimpleNamespace(ro=ro, scores={**b.scores, "reward": [1.0, 1.1, 1.0, 0.5, 0.5, 0.5]})
    assert metrics.rollout_metrics(near, adv, 3, drawn, 9, 3, SINGLE)["charts/zero_std_group_frac"] == 1 / 2


def test_group_fractions_count_groups_and_each_length_needs_its_kind():
    """Three kept groups of 2, one with equal rewards; four drawn, one all right and one all wrong: each share is of
    groups. A batch all right has no charts/len_incorrect, one all wrong no charts/len_correct."""
    ro = SimpleNamespace(lengths=torch.tensor([4, 9, 6, 12, 3, 5]), truncated=torch.zeros(6).bool())
    scores = {"reward": [1.0, 0.0, 0.5, 0.5, 1.1, 1.0], "correct": [1.0, 0.0, 0.0, 0.0, 1.0, 1.0]}
    drawn = torch.tensor([[1.0, 1], [0, 0], [1, 0], [1, 0]])
    m = metrics.rollout_metrics(SimpleNamespace(ro=ro, scores=scores), torch.zeros(6), 2, drawn, 8, 2, SINGLE)
    assert (m["charts/zero_std_group_frac"], m["charts/all_right_group_frac"], m["charts/all_wrong_group_frac"]) \
        == pytest.approx((1 / 3, 1 / 4, 1 / 4))  # float32 means
    for kind, absent in ((1.0, "charts/len_incorrect"), (0.0, "charts/len_correct")):
        same = SimpleNamespace(ro=ro, scores={**scores, "correct": [kind] * 6})
        assert absent not in metrics.rollout_metrics(same, torch.zeros(6), 2, drawn, 8, 2, SINGLE)


def test_timing_divides_generated_tokens_by_the_rollout_time():
    b = SimpleNamespace(ro=SimpleNamespace(lengths=torch.tensor([10, 30])))
    m = metrics.timing(b, rollout_s=2.0, update_s=5.0, lr=1e-5, world=SINGLE)
    assert m["perf/gen_tokens_per_s"] == 20.0 and m["perf/rollout_s"] == 2.0 and m["perf/update_s"] == 5.0
    assert m["charts/lr"] == 1e-5 and m["perf/peak_memory_gib_min"] == m["perf/peak_memory_gib_max"] > 0


def test_peak_memory_is_every_ranks_range_in_gib(monkeypatch):
    """perf/peak_memory_gib_max and _min over the ranks' peaks (two here); CUDA's allocated peak in GiB where this
    process uses CUDA, else the resident peak: from Linux's kB, or where /proc is missing from ru_maxrss (kB on
    Linux, bytes on macOS)."""
    two = SimpleNamespace(sum=lambda xs: [2 * x for x in xs], gather=lambda x: [x, x + 3])
    m = metrics.timing(SimpleNamespace(ro=SimpleNamespace(lengths=torch.tensor([10]))), 1.0, 1.0, 0.0, two)
    assert m["perf/peak_memory_gib_max"] - m["perf/peak_memory_gib_min"] == pytest.approx(3.0)
    assert 0.05 < metrics.resident_peak_gib() < 64  # this process (python and torch), in GiB
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda *a: 3 * 2**30)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for initialized in (True, False):  # CUDA's high-water mark where this process uses CUDA (a CPU run does not)
        monkeypatch.setattr(torch.cuda, "is_initialized", lambda: initialized)
        assert (metrics.peak_memory_gib() == 3.0) == initialized
    resource = pytest.importorskip("resource")

    def no_proc(*a, **k):
        raise OSError("no /proc")
    monkeypatch.setattr(metrics, "open", no_proc, raising=False)
    for platform, unit in (("linux", 2**10), ("darwin", 1)):
        monkeypatch.setattr(sys, "platform", platform)
        monkeypatch.setattr(resource, "getrusage", lambda who: SimpleNamespace(ru_maxrss=3 * 2**30 // unit))
        assert metrics.resident_peak_gib() == 3.0, platform


def test_update_metrics_kl_to_the_reference_is_k3_over_the_scored_tokens():
    logp, old, adv, mask = batch()
    ref = old + torch.randn(old.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64) * 0.4
    seen = [(torch.tensor([3, 0, 4]), logp[[3, 0, 4]], None), (torch.tensor([1, 2]), logp[[1, 2]], None)]
    m = metrics.update_metrics(seen, old, torch.zeros_like(old), ref, adv, mask, PRESETS["grpo"], SINGLE)
    k3 = [math.exp(x) - x - 1 for i, n in enumerate(LENGTHS) for x in (ref[i, :n] - logp[i, :n]).tolist()]
    assert m["losses/kl_ref"] == pytest.approx(mean(k3), rel=1e-12)


def test_mismatch_metrics_equal_their_definitions():
    """d_it = log pi_old - log mu: |d| mean and max, k3 of KL(mu || pi_old), the sequences' mean d (std with
    Bessel's correction, as torch's), and the shares beyond 0.2 (tokens) and 3e-4 (sequences)."""
    logp, old, _, mask = batch()
    mask[3, 0] = 1.0  # every row has a valid token (a sequence of none would count as mean d 0)
    lengths = [max(n, 1) for n in LENGTHS]
    d = {i: [float(old[i, t] - logp[i, t]) * 0.5 for t in range(n)] for i, n in enumerate(lengths)}
    sampler = old - (old - logp) * 0.5
    m = metrics.mismatch_metrics(old, sampler, mask)
    flat, seq = [x for xs in d.values() for x in xs], [mean(xs) for xs in d.values()]
    assert m == pytest.approx({
        "mismatch/abs_mean": mean([abs(x) for x in flat]), "mismatch/abs_max": max(abs(x) for x in flat),
        "mismatch/kl_k3": mean([math.exp(x) - 1 - x for x in flat]),
        "mismatch/seq_std": math.sqrt(pvar(seq) * len(seq) / (len(seq) - 1)),
        "mismatch/seq_abs_max": max(abs(s) for s in seq),
        "mismatch/token_frac": sum(abs(x) > 0.2 for x in flat) / len(flat),
        "mismatch/seq_frac": sum(abs(s) > 3e-4 for s in seq) / len(seq),
    }, rel=1e-6)  # the shares are float32 means
    assert 0 < m["mismatch/token_frac"] < 1


@pytest.mark.parametrize("mode,c_min", [("token_truncate", 0.7), ("token_mask", 0.7), ("sequence_mask", None)])
def test_correction_metrics_equal_their_definitions(mode, c_min):
    """w = pi_old / mu per token, or per sequence as the product of its token ratios; truncate clamps it to
    [C_min, C_max], mask sets it to 0 outside; logged: the mean w over the units and the share it changed."""
    logp, old, _, mask = batch()
    rows = [i for i, n in enumerate(LENGTHS) if n]
    level, kind = mode.split("_")
    if level == "token":
        raw = [math.exp(float(old[i, t] - logp[i, t])) for i in rows for t in range(LENGTHS[i])]
    else:  # every row is a unit here, the empty one with ratio 1
        raw = [math.exp(float((old[i, :n] - logp[i, :n]).sum())) for i, n in enumerate(LENGTHS)]
    low, high = c_min if c_min is not None else -math.inf, 3.0
    w = [min(max(r, low), high) if kind == "truncate" else (r if low <= r <= high else 0.0) for r in raw]
    m = metrics.correction_metrics(old, logp, mask, (mode, c_min, 3.0))
    if level == "sequence":
        w, raw = [x for x, n in zip(w, LENGTHS) if n], [x for x, n in zip(raw, LENGTHS) if n]
    changed = sum(a != b for a, b in zip(w, raw)) / len(w)
    assert 0 < changed < 1
    assert m == pytest.approx({"correction/weight_mean": mean(w), "correction/changed_frac": changed}, rel=1e-9)


def test_length_buckets_sort_rows_by_length_and_spread_within_each():
    """Four quartiles of |y| (two rows each here): mean length, and the std (Bessel's) of sum_t l_it and of log s_i."""
    gen = torch.Generator().manual_seed(2)
    lengths = [7, 1, 4, 8, 2, 6, 3, 5]
    mask = torch.tensor([[1.0] * n + [0.0] * (8 - n) for n in lengths], dtype=torch.float64)
    old = -torch.rand(8, 8, generator=gen, dtype=torch.float64)
    logp = old + torch.randn(8, 8, generator=gen, dtype=torch.float64) * 0.2
    l = [[float(logp[i, t] - old[i, t]) for t in range(n)] for i, n in enumerate(lengths)]
    std = lambda a, b: abs(a - b) / math.sqrt(2)  # noqa: E731  the sample std of two numbers
    want = []
    for pair in ([1, 4], [6, 2], [7, 5], [0, 3]):  # rows by length: 1, 2 | 3, 4 | 5, 6 | 7, 8
        i, j = pair
        want.append({"len": (lengths[i] + lengths[j]) / 2, "std_logsum": std(sum(l[i]), sum(l[j])),
                     "std_log_s": std(mean(l[i]), mean(l[j]))})
    got = metrics.length_bucket_stats(logp, old, mask)
    assert len(got) == 4 and all(g == pytest.approx(w, rel=1e-9) for g, w in zip(got, want))


def test_study_metrics_name_the_quartiles_from_one_and_leave_out_a_bucket_of_one_row():
    """lenbucket/q1 is the shortest quartile (claim 1's quantities read q1 and q4); five rows split 2, 1, 1, 1, and a
    bucket of one row has no spread, so only the first is logged. One sequence's mismatch has no spread: 0."""
    gen = torch.Generator().manual_seed(5)
    lengths = [3, 1, 4, 2, 5]
    mask = torch.tensor([[1.0] * n + [0.0] * (5 - n) for n in lengths], dtype=torch.float64)
    old = -torch.rand(5, 5, generator=gen, dtype=torch.float64)
    logp = old + torch.randn(5, 5, generator=gen, dtype=torch.float64) * 0.2
    buckets = metrics.length_bucket_stats(logp, old, mask)
    assert len(buckets) == 1 and buckets[0]["len"] == 1.5  # the rows of length 1 and 2
    study = metrics.study_metrics(logp, old, torch.ones(5, dtype=torch.float64), mask)
    assert sorted(k for k in study if k.startswith("lenbucket/")) == \
        ["lenbucket/q1_len", "lenbucket/q1_std_log_s", "lenbucket/q1_std_logsum"]
    assert metrics.mismatch_metrics(old[:1], logp[:1], mask[:1])["mismatch/seq_std"] == 0.0


def test_prefix_spread_of_two_long_sequences_is_their_prefix_sums_spread():
    """S_ik = sum_{t<=k} (log pi_theta - log pi_old) over the sequences of at least max(ks) tokens: two suffice for a
    spread (the sample std of two numbers, |a - b| / sqrt 2); pi_old is not 0 here, so its sign shows."""
    gen = torch.Generator().manual_seed(6)
    mask = torch.tensor([[1.0] * 4, [1.0] * 4, [1.0] * 3 + [0.0]], dtype=torch.float64)  # the third is too short
    old = -torch.rand(3, 4, generator=gen, dtype=torch.float64) * 2
    after = old + torch.randn(3, 4, generator=gen, dtype=torch.float64) * 0.3
    out = metrics.prefix_spread(after, old, mask, ks=(2, 4))
    s = [[float((after[i, :k] - old[i, :k]).sum()) for k in (2, 4)] for i in range(2)]
    assert out == pytest.approx({"prefix/n_long": 2, "prefix/std_k2": abs(s[0][0] - s[1][0]) / math.sqrt(2),
                                 "prefix/std_k4": abs(s[0][1] - s[1][1]) / math.sqrt(2),
                                 "prefix/abs_log_token": float((after[:2] - old[:2]).abs().mean())}, rel=1e-12)


def test_masked_var_is_the_population_variance_of_the_valid_entries():
    x, mask = torch.tensor([[1.0, 4.0, 100.0]]), torch.tensor([[1.0, 1.0, 0.0]])
    assert losses.masked_var(x, mask) == 2.25 and losses.masked_var(x, torch.tensor([[0.0, 1.0, 0.0]])) == 0.0


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="VmHWM is Linux's (elsewhere ru_maxrss is read)")
def test_the_resident_peak_is_this_process_not_the_one_that_started_it():
    """perf/peak_memory_gib on a CPU: a process started by one that held 1.5 GiB reports its own peak, not that one's.
    getrusage's ru_maxrss keeps the parent's peak across fork and exec (checked here too, so the test can see the
    fault); it made the update-memory test in test_gpu_path.py read 0 MiB whenever its pytest worker had peaked higher
    before."""
    held = bytearray(1536 * 2**20)
    held[::4096] = b"\x01" * len(range(0, len(held), 4096))  # every page resident
    code = ("import resource, metrics; print(metrics.resident_peak_gib(), "
            "resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20)")
    out = subprocess.run([sys.executable, "-c", code], cwd=Path(metrics.__file__).parent, capture_output=True,
                         text=True, timeout=120)
    del held
    assert out.returncode == 0, out.stderr[-2000:]
    own, inherited = (float(x) for x in out.stdout.split())
    assert inherited >= 1.5, inherited  # the fault is there to be seen
    assert 0.01 < own < 1.0, own  # python and torch, not the parent's 1.5 GiB
