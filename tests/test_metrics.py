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
    rows = [i for i, n in enumerate(LENGTHS) if n]
    l = {i: [float(logp[i, t] - old[i, t]) for t in range(LENGTHS[i])] for i in rows}  # token log-ratios l_it
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


def test_timing_divides_generated_tokens_by_the_rollout_time():
    b = SimpleNamespace(ro=SimpleNamespace(lengths=torch.tensor([10, 30])))
    m = metrics.timing(b, rollout_s=2.0, update_s=5.0, lr=1e-5, world=SINGLE)
    assert m["perf/gen_tokens_per_s"] == 20.0 and m["perf/rollout_s"] == 2.0 and m["perf/update_s"] == 5.0
    assert m["charts/lr"] == 1e-5 and m["perf/peak_memory_gib_min"] == m["perf/peak_memory_gib_max"] > 0


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
