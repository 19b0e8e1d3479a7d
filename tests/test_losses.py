"""The numerical properties of losses.py, each against values derived by hand (see shared notes, algorithms.md)."""

import math
from dataclasses import replace

import numpy as np
import pytest
import torch

import metrics as diagnostics
import losses
from losses import PRESETS, LossConfig, StepNorm


pytestmark = pytest.mark.usefixtures("float64")  # conftest: exact comparisons in double precision

# The notes' toy batch: one group of G=4, rewards [1, 0, 0, 1], lengths [3, 5, 2, 2], max_new_tokens 8.
REWARDS = torch.tensor([1.0, 0.0, 0.0, 1.0], dtype=torch.float64)
LENGTHS = [3, 5, 2, 2]
MAX_NEW = 8
T = 6  # padded width
Z = 0.5 / (math.sqrt(1 / 3) + 1e-4)  # centred reward 0.5 over unbiased std sqrt(1/3), eps 1e-4 = 0.865875


def toy_mask(lengths=LENGTHS, width=T):
    return torch.tensor([[1.0] * n + [0.0] * (width - n) for n in lengths])


def leaf(x):
    return x.clone().requires_grad_(True)


def run(cfg, logp, old, adv, mask, ref=None, max_new=MAX_NEW):
    loss = losses.policy_loss(logp, old, adv, mask, StepNorm.of(mask, max_new), cfg, ref)
    loss.backward()
    return loss.item(), logp.grad.clone(), losses.ratio_diagnostics(logp.detach(), old, adv, mask, cfg)


def on_policy(seed=0, lengths=LENGTHS, width=T):
    mask = toy_mask(lengths, width)
    old = -torch.rand(len(lengths), width, generator=torch.Generator().manual_seed(seed)) * 3
    return leaf(old), old, mask


def no_kl(cfg):
    return replace(cfg, beta=0.0)


# ---------------------------------------------------------------------------------------------------------------
# Advantages
# ---------------------------------------------------------------------------------------------------------------


def test_group_advantages_toy_values():
    adv = losses.group_advantages(REWARDS, 4)
    assert torch.allclose(adv, torch.tensor([Z, -Z, -Z, Z]), atol=1e-9)
    assert abs(Z - 0.865875) < 1e-6
    assert torch.equal(losses.group_advantages(REWARDS, 4, scale=False), torch.tensor([0.5, -0.5, -0.5, 0.5]))
    assert torch.equal(losses.group_advantages(REWARDS, 4, scale=True), adv)  # TRL's older booleans, as LossConfig's


def test_equal_rewards_give_exactly_zero_advantage():
    rewards = torch.tensor([1.0, 1.0, 1.0, 0.3, 0.3, 0.3])
    for scale in (True, False):
        adv = losses.group_advantages(rewards, 3, scale=scale)
        assert torch.equal(adv, torch.zeros(6))


# ---------------------------------------------------------------------------------------------------------------
# 1 and 4: on-policy values, the toy batch
# ---------------------------------------------------------------------------------------------------------------


def test_toy_batch_dr_grpo_with_its_own_advantages():
    logp, old, mask = on_policy()
    adv = losses.group_advantages(REWARDS, 4, scale=PRESETS["dr_grpo"].scale_rewards)
    loss, _, _ = run(PRESETS["dr_grpo"], logp, old, adv, mask)
    assert loss == pytest.approx(0.03125, abs=1e-12)  # -(0.5*3 - 0.5*5 - 0.5*2 + 0.5*2) / (4*8)


def test_the_presets_and_a_steps_normalisers_cannot_be_changed_in_place():
    """The presets are shared by every run in a process (a sweep, the tests): a run takes a changed copy (replace),
    and a step's normalisers are fixed for its micro-batches."""
    import dataclasses

    with pytest.raises(dataclasses.FrozenInstanceError):
        PRESETS["grpo"].beta = 0.0
    with pytest.raises(dataclasses.FrozenInstanceError):
        StepNorm(4, 20, 8).num_tokens = 1


def test_a_step_of_one_token_divides_by_one():
    """The guards against an empty step (max(n, 1), clamp(min=1)) leave a count of one as it is: on-policy, DAPO's
    token-mean loss of a step with one valid token is -A, and the entropy bonus over one trained token is coef H."""
    mask, logp = torch.tensor([[1.0, 0.0, 0.0]]), torch.tensor([[-1.0, -2.0, -3.0]])
    cfg = replace(PRESETS["dapo"], entropy_coef=0.25)
    loss = losses.policy_loss(logp, logp, torch.tensor([2.0]), mask, StepNorm.of(mask, 3), cfg,
                              entropy=torch.tensor([[0.5, 0.75, 1.0]]))
    assert loss.item() == -2.0 - 0.25 * 0.5


@pytest.mark.parametrize("algo", list(PRESETS))
def test_on_policy_ratios_are_one_nothing_clips_loss_is_minus_agg_adv(algo):
    logp, old, mask = on_policy(seed=1)
    adv = torch.tensor([0.7, -1.3, 0.2, 0.4])  # not zero-mean, so -agg(A) is not 0
    cfg = PRESETS[algo]
    loss, grad, diag = run(cfg, logp, old, adv, mask, ref=old)
    # the per-token value on-policy: A for the clip and GMPO; f(1) A = (2 / tau) A for SAPO; A log pi for CISPO, VESPO
    per_token = adv.unsqueeze(-1).expand(4, T).to(torch.float64)
    if cfg.surrogate == "sapo":
        per_token = per_token * 2 / torch.where(per_token > 0, cfg.sapo_tau_pos, cfg.sapo_tau_neg)
    if cfg.surrogate in ("cispo", "vespo"):  # on-policy CISPO's weight and VESPO's kernel are 1
        per_token = per_token * old
    masked = per_token * mask
    n = mask.sum(-1)
    agg = {
        "seq-mean-token-mean": (masked.sum(-1) / n).mean(),
        "token-mean": masked.sum() / n.sum(),
        "seq-mean-token-sum-norm": masked.sum() / (4 * MAX_NEW),
        "seq-mean-token-sum": masked.sum(-1).mean(),
    }[cfg.loss_agg_mode]
    assert loss == pytest.approx(-agg.item(), abs=1e-12)
    assert diag["ratio/token_mean"] == 1.0 and diag["ratio/token_var"] == 0.0
    assert diag["ratio/seq_mean"] == 1.0 and diag["clip/frac"] == 0.0 and diag["clip/token_frac"] == 0.0
    assert all(v == 0.0 for k, v in diagnostics.study_metrics(logp.detach(), old, adv, mask).items()
               if k.startswith("clip/shadow_"))
    assert grad.abs().sum() > 0
    # the toy batch by hand: lengths 3, 5, 2, 2 with A = (Z, -Z, -Z, Z) per-sequence means cancel (GRPO, GSPO);
    # token-mean gives -Z (3 - 5 - 2 + 2) / 12 = Z / 6; Dr.GRPO's sum over B L_max = 4 x 8 gives Z / 16
    by_hand = {"grpo": 0.0, "gspo": 0.0, "dapo": Z / 6, "dr_grpo": Z / 16}
    if algo in by_hand:
        toy_logp, toy_old, toy_mask = on_policy()
        toy, _, _ = run(no_kl(cfg), toy_logp, toy_old, torch.tensor([Z, -Z, -Z, Z]), toy_mask)
        assert toy == pytest.approx(by_hand[algo], abs=1e-6)


# ---------------------------------------------------------------------------------------------------------------
# 2: GSPO-token vs GSPO everywhere (GSPO's on-policy gradient equals GRPO's: test_per_token_gradient_weights)
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("shift", [0.0, 0.01, -0.02, 0.3])  # 0 is on-policy; 0.3 clips every sequence
def test_gspo_token_equals_gspo_in_value_clipping_and_gradient(shift):
    mask = toy_mask()
    old = -torch.rand(4, T, generator=torch.Generator().manual_seed(3))
    noise = torch.randn(4, T, generator=torch.Generator().manual_seed(4)) * 0.01
    adv = torch.tensor([Z, -Z, -Z, Z])
    cfg = PRESETS["gspo"]
    seq, gs, ds = run(cfg, leaf(old + shift + noise), old, adv, mask)
    tok, gt, dt = run(replace(cfg, importance_sampling_level="sequence_token"), leaf(old + shift + noise), old, adv, mask)
    assert tok == pytest.approx(seq, abs=1e-12)
    assert dt["clip/frac"] == ds["clip/frac"]
    assert torch.allclose(gs, gt, atol=1e-12)


# ---------------------------------------------------------------------------------------------------------------
# 3: per-token gradient weights, on-policy
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("algo", ["grpo", "dapo", "dr_grpo", "cispo", "sapo", "gmpo", "gspo"])
def test_per_token_gradient_weights(algo):
    """On-policy every objective is REINFORCE with its aggregation's weights: -A / (B |y_i|), -A / sum |y|, or
    -A / (B L_max). (CISPO's weight is 1, SAPO's f'(1) = 1, GMPO's and GSPO's d s_i / d logp_it = 1 / |y_i|.)"""
    logp, old, mask = on_policy(seed=5)
    adv = torch.tensor([0.9, -0.4, -1.1, 0.6])
    _, grad, _ = run(no_kl(PRESETS[algo]), logp, old, adv, mask)
    n = torch.tensor(LENGTHS, dtype=torch.float64).unsqueeze(-1)
    a = adv.unsqueeze(-1)
    expected = {"seq-mean-token-mean": -a / (4 * n), "token-mean": -a / n.sum(),
                "seq-mean-token-sum-norm": -a / (4 * MAX_NEW)}[PRESETS[algo].loss_agg_mode] * mask
    assert torch.allclose(grad, expected, atol=1e-15)


# ---------------------------------------------------------------------------------------------------------------
# 5: clip gating
# ---------------------------------------------------------------------------------------------------------------


def test_token_clip_binds_only_on_the_side_that_matters():
    cfg = LossConfig("token", "token-mean", 0.2, 0.2)
    mask = torch.ones(4, 1)
    old = torch.zeros(4, 1)
    w = torch.tensor([[0.5], [1.5], [1.5], [0.5]])  # ratios
    adv = torch.tensor([1.0, -1.0, 1.0, -1.0])
    loss, grad, diag = run(cfg, leaf(torch.log(w)), old, adv, mask)
    # rows 0, 1: out of range on the side where min keeps the unclipped term: gradient -A w / 4 (d w/d logp = w)
    assert grad[0, 0].item() == pytest.approx(-1.0 * 0.5 / 4)
    assert grad[1, 0].item() == pytest.approx(+1.0 * 1.5 / 4)
    # rows 2, 3: clipping binds (high with A > 0, low with A < 0): no gradient
    assert grad[2, 0].item() == 0.0 and grad[3, 0].item() == 0.0
    assert diag["clip/token_high"] == 0.25 and diag["clip/token_low"] == 0.25 and diag["clip/frac"] == 0.5
    # value: -(0.5) + 1.5 - 1.2 + 0.8 = 0.6, over 4 tokens
    assert loss == pytest.approx((-0.5 + 1.5 - 1.2 + 0.8) / 4)


def test_a_zero_advantage_is_never_counted_as_clipped():
    """A unit with A = 0 (every completion of an all-right or all-wrong group) has no side to clip: its loss is 0 at
    any ratio, so however far its ratio moved it is in neither clip fraction, at token or at sequence level."""
    w = torch.tensor([0.1, 5.0, 0.1, 5.0])  # far below 1 - eps and far above 1 + eps_high
    adv = torch.tensor([0.0, 0.0, -1.0, 1.0])
    assert losses.ppo_clipped(w, adv, 0.2, 0.28).tolist() == [False, False, True, True]
    assert losses.clip_fractions(w, adv, 0.2, 0.28, torch.ones(4, dtype=torch.bool)) == (0.25, 0.25)
    logp = torch.log(torch.tensor([[0.1, 0.1], [5.0, 5.0], [0.1, 0.1], [5.0, 5.0]]))  # (B, T): w per token
    for level, unit in (("token", "token"), ("sequence", "seq")):
        diag = losses.ratio_diagnostics(logp, torch.zeros(4, 2), adv, torch.ones(4, 2), LossConfig(level))
        assert diag[f"clip/{unit}_low"] == diag[f"clip/{unit}_high"] == 0.25 and diag["clip/frac"] == 0.5


def test_clipped_gspo_sequence_passes_no_gradient_to_any_token():
    cfg = PRESETS["gspo"]
    mask = toy_mask()
    old = -torch.rand(4, T, generator=torch.Generator().manual_seed(6))
    shift = torch.tensor([[0.01], [0.0], [-0.01], [0.0]])  # s_0 = e^0.01 > 1+4e-4 with A>0; s_2 < 1-3e-4 with A<0
    adv = torch.tensor([Z, -Z, -Z, Z])
    _, grad, diag = run(cfg, leaf(old + shift), old, adv, mask)
    assert torch.equal(grad[0], torch.zeros(T)) and torch.equal(grad[2], torch.zeros(T))
    assert (grad[1, :5] != 0).all() and (grad[3, :2] != 0).all()
    assert diag["clip/seq_high"] == 0.25 and diag["clip/seq_low"] == 0.25 and diag["clip/frac"] == 0.5


# ---------------------------------------------------------------------------------------------------------------
# 6: micro-batches; 7: padding; 8: Dr.GRPO length independence
# ---------------------------------------------------------------------------------------------------------------


def off_policy_batch(b=8, width=7, seed=7):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, width + 1, (b,), generator=g)
    mask = (torch.arange(width).unsqueeze(0) < lengths.unsqueeze(1)).double()
    old = -torch.rand(b, width, generator=g) * 2
    logp = old + torch.randn(b, width, generator=g) * 0.1
    ref = old + torch.randn(b, width, generator=g) * 0.1
    adv = torch.randn(b, generator=g)
    return logp, old, ref, adv, mask


@pytest.mark.parametrize("algo", list(PRESETS) + ["gspo_token"])
def test_micro_batches_give_the_same_loss_and_gradient(algo):
    cfg = replace(PRESETS["gspo"], importance_sampling_level="sequence_token") if algo == "gspo_token" else PRESETS[algo]
    logp0, old, ref, adv, mask = off_policy_batch()
    norm = StepNorm.of(mask, 9)
    results = []
    for parts in (1, 2, 4):
        logp = leaf(logp0)
        total = 0.0
        for rows in torch.arange(8).split(8 // parts):
            loss = losses.policy_loss(logp[rows], old[rows], adv[rows], mask[rows], norm, cfg, ref[rows])
            loss.backward()
            total += loss.item()
        results.append((total, logp.grad.clone()))
    for total, grad in results[1:]:
        assert total == pytest.approx(results[0][0], abs=1e-6)
        assert torch.allclose(grad, results[0][1], atol=1e-6)


@pytest.mark.parametrize("algo", list(PRESETS))
def test_padding_columns_change_nothing(algo):
    logp0, old, ref, adv, mask = off_policy_batch()
    loss_a, grad_a, diag_a = run(PRESETS[algo], leaf(logp0), old, adv, mask, ref, max_new=9)
    pad = lambda x, v: torch.cat([x, torch.full((8, 3), v)], dim=1)  # noqa: E731
    loss_b, grad_b, diag_b = run(PRESETS[algo], leaf(pad(logp0, -5.0)), pad(old, -0.1), adv, pad(mask, 0.0),
                                 pad(ref, 3.0), max_new=9)
    assert loss_b == pytest.approx(loss_a, abs=1e-12)
    assert torch.allclose(grad_b[:, :7], grad_a, atol=1e-12) and torch.equal(grad_b[:, 7:], torch.zeros(8, 3))
    assert diag_b["ratio/seq_var"] == pytest.approx(diag_a["ratio/seq_var"], abs=1e-12)


def test_gspo_ratio_is_invariant_to_padding_and_token_order():
    logp, old, _, _, mask = off_policy_batch()
    s = losses.importance_weights(logp, old, mask, "sequence")[:, 0]
    pad = lambda x, v: torch.cat([torch.full((8, 2), v), x], dim=1)  # noqa: E731
    s_pad = losses.importance_weights(pad(logp, 9.0), pad(old, -9.0), pad(mask, 0.0), "sequence")[:, 0]
    perm = torch.randperm(7, generator=torch.Generator().manual_seed(0))
    s_perm = losses.importance_weights(logp[:, perm], old[:, perm], mask[:, perm], "sequence")[:, 0]
    expected = torch.exp(((logp - old) * mask).sum(-1) / mask.sum(-1))
    assert torch.allclose(s, expected) and torch.allclose(s_pad, expected) and torch.allclose(s_perm, expected)


def test_dr_grpo_token_weight_does_not_depend_on_any_length():
    adv = torch.tensor([0.9, -0.4, -1.1, 0.6])
    grads = []
    for lengths in ([3, 5, 2, 2], [3, 1, 6, 2], [6, 5, 1, 6]):
        logp, old, mask = on_policy(seed=8, lengths=lengths)
        _, grad, _ = run(PRESETS["dr_grpo"], logp, old, adv, mask)
        grads.append(grad[:, 0])  # every row has its first token in all three layouts
    assert torch.equal(grads[0], grads[1]) and torch.equal(grads[0], grads[2])
    assert torch.allclose(grads[0], -adv / (4 * MAX_NEW))


# ---------------------------------------------------------------------------------------------------------------
# 9: KL
# ---------------------------------------------------------------------------------------------------------------


def test_kl_term_adds_beta_times_mean_k3_and_zero_beta_needs_no_reference():
    logp0, old, ref, adv, mask = off_policy_batch()
    cfg = replace(PRESETS["grpo"], beta=0.0)
    base, _, _ = run(cfg, leaf(logp0), old, adv, mask, None)
    with_kl, _, _ = run(replace(cfg, beta=0.04), leaf(logp0), old, adv, mask, ref)
    per_seq_kl = (losses.k3_kl(logp0, ref) * mask).sum(-1) / mask.sum(-1)
    assert with_kl - base == pytest.approx(0.04 * per_seq_kl.mean().item(), abs=1e-12)
    with pytest.raises(ValueError, match="reference"):
        run(replace(cfg, beta=0.04), leaf(logp0), old, adv, mask, None)


# ---------------------------------------------------------------------------------------------------------------
# 10: the seeds' claim, measured on synthetic log-ratios
# ---------------------------------------------------------------------------------------------------------------


def test_length_buckets_show_sqrt_growth_and_shrinkage():
    sigma, lengths, per = 0.05, [4, 16, 64, 256], 4000
    g = torch.Generator().manual_seed(0)
    rows = torch.tensor([n for n in lengths for _ in range(per)])
    mask = (torch.arange(256).unsqueeze(0) < rows.unsqueeze(1)).double()
    old = torch.zeros(len(rows), 256)
    logp = torch.randn(len(rows), 256, generator=g) * sigma
    buckets = diagnostics.length_bucket_stats(logp, old, mask, num_buckets=4)
    assert [b["len"] for b in buckets] == [4.0, 16.0, 64.0, 256.0]
    for b in buckets:
        assert b["std_logsum"] == pytest.approx(sigma * math.sqrt(b["len"]), rel=0.05)
        assert b["std_log_s"] == pytest.approx(sigma / math.sqrt(b["len"]), rel=0.05)


def test_shadow_clip_fractions_use_each_presets_own_level_and_range():
    # Every token ratio is e^0.1 ~ 1.105 with A > 0: inside GRPO's 0.2 but outside GSPO's 4e-4.
    mask = toy_mask()
    old = torch.zeros(4, T)
    adv = torch.tensor([1.0, 1.0, -1.0, 1.0])
    diag = diagnostics.study_metrics(old + 0.1, old, adv, mask)
    assert diag["clip/shadow_grpo"] == 0.0 and diag["clip/shadow_dapo"] == 0.0
    assert diag["clip/shadow_gspo"] == 0.75  # three of four sequences have A > 0 and s > 1 + 4e-4


def test_prefix_spread_follows_the_same_sequences_as_k_grows():
    g = torch.Generator().manual_seed(0)
    lengths = torch.tensor([64] * 3000 + [200] * 1000 + [63] * 2000)  # the 63-token rows must be left out
    mask = (torch.arange(256).unsqueeze(0) < lengths.unsqueeze(1)).float()
    old = torch.zeros(len(lengths), 256)
    slope = lambda out: np.polyfit(np.log(diagnostics.PREFIX_K),  # noqa: E731
                                   np.log([out[f"prefix/std_k{k}"] for k in diagnostics.PREFIX_K]), 1)[0]
    iid = diagnostics.prefix_spread(torch.randn(len(lengths), 256, generator=g) * 0.1, old, mask)
    assert iid["prefix/n_long"] == 4000
    assert slope(iid) == pytest.approx(0.5, abs=0.03)  # i.i.d. token noise: sigma sqrt(k)
    assert iid["prefix/std_k16"] == pytest.approx(0.1 * 4, rel=0.05)
    assert iid["prefix/abs_log_token"] == pytest.approx(0.1 * math.sqrt(2 / math.pi), rel=0.02)
    shift = torch.randn(len(lengths), 1, generator=g) * 0.1  # every token of a sequence moves alike: k sigma
    assert slope(diagnostics.prefix_spread(shift.expand(-1, 256), old, mask)) == pytest.approx(1.0, abs=1e-4)
    # tokens that cancel (each the difference of two i.i.d. draws, so S_k = e_k - e_0): the spread stops growing
    e = torch.randn(len(lengths), 257, generator=g) * 0.1
    assert abs(slope(diagnostics.prefix_spread(e[:, 1:] - e[:, :-1], old, mask))) < 0.03
    assert diagnostics.prefix_spread(old, old, mask[:1]) == {"prefix/n_long": 1}  # one sequence has no spread
