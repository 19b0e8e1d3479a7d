"""Dual-clip and overlong masking (issue 37.3) against the references: verl's compute_policy_loss with clip_ratio_c,
and TRL 1.16's mask_truncated_completions (the completion mask times "not truncated", then each loss type's own
normaliser), on random batches; and both end to end, with what they touched logged."""

import json
from dataclasses import replace

import pytest
import torch

import losses
import train
from conftest import SMALL_ARGS
from losses import PRESETS, StepNorm
from test_estimators import verl_masked_mean


def batch(seed, b=6, t=7):
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, t + 1, (b,), generator=gen)
    mask = (torch.arange(t).unsqueeze(0) < lengths.unsqueeze(1)).double()
    old = -torch.rand(b, t, generator=gen, dtype=torch.float64) * 2
    logp = (old + torch.randn(b, t, generator=gen, dtype=torch.float64) * 1.5).requires_grad_(True)  # stale
    adv = torch.randn(b, generator=gen, dtype=torch.float64)
    return logp, old, adv, mask


def verl_dual_clip_loss(old, logp, adv, mask, eps_low, eps_high, c):  # verl core_algos.compute_policy_loss, token-mean
    ratio = torch.exp(torch.clamp(logp - old, -20.0, 20.0))
    losses1 = -adv * ratio
    losses2 = -adv * torch.clamp(ratio, 1 - eps_low, 1 + eps_high)
    clip1 = torch.maximum(losses1, losses2)
    losses3 = -adv * c
    clip2 = torch.min(losses3, clip1)
    per_token = torch.where(adv < 0, clip2, clip1)
    lower = ((clip1 > losses3) * (adv < 0)).double()
    return (per_token * mask).sum() / mask.sum(), (lower * mask).sum() / mask.sum()


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("c", [1.5, 3.0])
def test_dual_clip_equals_verl_in_loss_gradient_and_fraction(seed, c):
    logp, old, adv, mask = batch(seed)
    cfg = replace(PRESETS["dapo"], clip_ratio_c=c)  # token-mean, as verl's default aggregation
    ours = losses.policy_loss(logp, old, adv, mask, StepNorm.of(mask, 7), cfg)
    (g_ours,) = torch.autograd.grad(ours, logp)
    a = adv.unsqueeze(-1).expand_as(logp)
    ref, frac = verl_dual_clip_loss(old, logp, a, mask, cfg.epsilon, cfg.epsilon_high, c)
    (g_ref,) = torch.autograd.grad(ref, logp)
    torch.testing.assert_close(ours, ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(g_ours, g_ref, rtol=1e-12, atol=1e-12)
    diag = losses.ratio_diagnostics(logp.detach(), old, adv, mask, cfg)
    assert diag["clip/dual_frac"] == pytest.approx(float(frac), abs=1e-12) and diag["clip/dual_frac"] > 0


def test_dual_clip_changes_only_negative_advantages_beyond_the_cap():
    logp, old, adv, mask = batch(0)
    plain, capped = PRESETS["grpo"], replace(PRESETS["grpo"], clip_ratio_c=3.0)
    w = torch.exp(logp.detach() - old)
    a = adv.unsqueeze(-1).expand_as(w)
    l_plain = losses.surrogate_loss(logp.detach(), old, a, mask, plain)
    l_capped = losses.surrogate_loss(logp.detach(), old, a, mask, capped)
    changed = l_plain != l_capped
    assert changed.any() and torch.equal(changed, (a < 0) & (w > 3.0) & (mask > 0))  # A < 0 units with w above c
    assert torch.equal(l_capped[changed], -3.0 * a[changed])


def trl_masked_loss(per_token, mask, truncated, loss_type, max_len):  # TRL 1.16 _compute_loss after masking
    mask = mask * (~truncated).unsqueeze(1).double()
    if loss_type == "grpo":
        return ((per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
    if loss_type == "dapo":
        return (per_token * mask).sum() / mask.sum().clamp(min=1.0)
    return (per_token * mask).sum() / (per_token.size(0) * max_len)  # dr_grpo


@pytest.mark.parametrize("algo,loss_type", [("grpo", "grpo"), ("dapo", "dapo"), ("dr_grpo", "dr_grpo")])
@pytest.mark.parametrize("seed", range(3))
def test_masking_truncated_completions_equals_trl(algo, loss_type, seed):
    """Their tokens leave every normaliser (TRL multiplies the completion mask); the sequence count B stays."""
    logp, old, adv, mask = batch(seed)
    truncated = torch.arange(6) % 3 == 0
    cfg = replace(PRESETS[algo], beta=0.0)
    masked = mask * (1 - truncated.double()).unsqueeze(-1)
    ours = losses.policy_loss(logp, old, adv, masked, StepNorm.of(masked, 7), cfg)
    per_token = losses.surrogate_loss(logp, old, adv.unsqueeze(-1), mask, cfg)
    torch.testing.assert_close(ours, trl_masked_loss(per_token, mask, truncated, loss_type, 7), rtol=1e-12,
                               atol=1e-12)
    (grad,) = torch.autograd.grad(ours, logp)
    assert torch.equal(grad[truncated], torch.zeros_like(grad[truncated]))  # a truncated row gets no gradient


def test_both_end_to_end_masking_reaches_the_loss(tmp_path, tiny_policy_dir):
    """One new token each: every completion is truncated and no reward can differ, so every advantage is 0 and the
    gradient is the entropy bonus's (the KL to a reference equal to the policy gives rounding's at most: 0 on some
    CPUs). With --mask-truncated nothing is left to train, the bonus included (loss and gradient exactly 0 in every
    step whose completions were all masked); without it the same run trains. Dual-clip's fraction is logged beside."""
    common = {**SMALL_ARGS, "model": str(tiny_policy_dir), "output_dir": str(tmp_path), "algo": "grpo",
              "max_new_tokens": 1, "clip_ratio_c": 1.5, "entropy_coef": 0.01, "lr": 1e-2, "save_model": False,
              "total_steps": 2}
    rows = {}
    for masked in (True, False):
        train.train(train.Args(**common, mask_truncated=masked, run_name=f"masked-{masked}"))
        rows[masked] = [json.loads(line) for line in (tmp_path / f"masked-{masked}" / "metrics.jsonl").open()][1:]
    all_masked = [r for r in rows[True] if r["charts/masked_frac"] == 1.0]
    assert all_masked, rows[True]
    assert all(r["losses/policy_loss"] == 0.0 and r["losses/grad_norm"] == 0.0 for r in all_masked)
    assert all(r["losses/grad_norm"] > 0 and "charts/masked_frac" not in r for r in rows[False])
    assert all(0 <= r["clip/dual_frac"] <= 1 for r in rows[False])


# ---------------------------------------------------------------------------------------------------------------
# KL estimators, their placement and the ratio correction (issue 37.2)
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_kl_estimators_equal_their_closed_forms_in_value_and_gradient(estimator):
    gen = torch.Generator().manual_seed(0)
    ref = -torch.rand(4, 5, generator=gen, dtype=torch.float64) * 3
    logp = (ref + torch.randn(4, 5, generator=gen, dtype=torch.float64)).requires_grad_(True)
    d = (ref - logp).detach()
    value = losses.kl_estimate(logp, ref, estimator)
    (grad,) = torch.autograd.grad(value.sum(), logp)
    expected_value = {"k1": -d, "k2": d ** 2 / 2, "k3": torch.exp(d) - d - 1}[estimator]
    expected_grad = {"k1": torch.ones_like(d), "k2": -d, "k3": 1 - torch.exp(d)}[estimator]  # d/dlogp, d = ref - logp
    torch.testing.assert_close(value, expected_value, rtol=1e-14, atol=1e-14)
    torch.testing.assert_close(grad, expected_grad, rtol=1e-14, atol=1e-14)


@pytest.mark.usefixtures("float64")  # conftest: exact comparisons in double precision
@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("correction", [False, True])
@pytest.mark.parametrize("shift", [0.0, 0.3])  # on-policy (the correction still moves the gradient) and stale
def test_kl_in_the_loss_equals_trl_with_and_without_its_bias_correction(level, correction, shift):
    from test_successors import T as T_TRL, batch as trl_batch, trl

    logp, old, adv, mask = trl_batch(shift, seed=4)
    ref = old - 0.2 * torch.randn(old.shape, generator=torch.Generator().manual_seed(5), dtype=old.dtype)
    cfg = replace(PRESETS["grpo"], importance_sampling_level=level, kl_ratio_correction=correction)
    x = logp.clone().requires_grad_(True)
    loss = losses.policy_loss(x, old, adv, mask, StepNorm.of(mask, T_TRL), cfg, ref_logp=ref)
    loss.backward()
    theirs = trl("grpo", logp, old, adv, mask, _level=level, _bias_correction_kl=correction, epsilon_low=0.2,
                 epsilon_high=0.2, beta=cfg.beta, _extra_inputs={"ref_per_token_logps": ref})
    assert loss.item() == pytest.approx(theirs[0], rel=1e-12, abs=1e-14)
    assert torch.allclose(x.grad, theirs[1], rtol=1e-10, atol=1e-14)
    if shift == 0.0 and correction:  # on-policy, the ratio's value is 1 but its gradient is not: TRL's documented point
        plain = replace(cfg, kl_ratio_correction=False)
        y = logp.clone().requires_grad_(True)
        losses.policy_loss(y, old, adv, mask, StepNorm.of(mask, T_TRL), plain, ref_logp=ref).backward()
        assert not torch.allclose(x.grad, y.grad)


def test_kl_in_the_reward_is_the_sampled_tokens_kl_summed_and_the_loss_has_none(tmp_path, tiny_policy_dir,
                                                                                  monkeypatch):
    gen = torch.Generator().manual_seed(1)
    sampler = -torch.rand(3, 4, generator=gen, dtype=torch.float64)
    ref = sampler - 0.3 * torch.rand(3, 4, generator=gen, dtype=torch.float64)
    mask = torch.tensor([[1.0, 1, 1, 0], [1, 0, 0, 0], [1, 1, 1, 1]], dtype=torch.float64)
    d = ref - sampler
    torch.testing.assert_close(losses.kl_in_reward(sampler, ref, mask, "k1"), (-d * mask).sum(-1))
    logp, old, adv, mask6 = batch(0)
    in_reward = replace(PRESETS["grpo"], kl_in="reward")
    no_kl = replace(PRESETS["grpo"], beta=0.0)
    a = losses.policy_loss(logp, old, adv, mask6, StepNorm.of(mask6, 7), in_reward)  # no reference needed
    assert a.item() == losses.policy_loss(logp, old, adv, mask6, StepNorm.of(mask6, 7), no_kl).item()
    # end to end: the reference scores the rollout and the reward the advantages see is the verifier's less beta KL,
    # 0 while the policy is the reference (step 1), not once it has moved (step 2)
    seen, verifier, real_advantages, real_score = [], [], losses.advantages, train.rewards.score

    def advantages(reward, *a, **k):  # what the advantages are computed from
        seen.append(reward.clone())
        return real_advantages(reward, *a, **k)

    def score(*a, **k):  # what the verifier gave
        out = real_score(*a, **k)
        verifier.append(out["reward"])
        return out

    monkeypatch.setattr(losses, "advantages", advantages)
    monkeypatch.setattr(train.rewards, "score", score)
    args = train.Args(**{**SMALL_ARGS, "model": str(tiny_policy_dir), "output_dir": str(tmp_path), "algo": "grpo",
                         "kl_in": "reward", "kl_estimator": "k1", "beta": 0.5, "total_steps": 2, "save_model": False,
                         "eval_every": 10})
    train.train(args)
    verifier = [torch.tensor(r) for r in verifier if len(r) == len(seen[0])]  # the rollouts' (not the evaluations')
    shift = [(s - v).abs().max().item() for s, v in zip(seen, verifier)]
    assert len(shift) == 2 and shift[0] < 1e-4 < 1e-3 < shift[1], shift
    rows = [json.loads(line) for line in (tmp_path / "grpo-s0" / "metrics.jsonl").open()]
    assert "losses/kl_ref" not in rows[-1] and rows[-1]["charts/reward"] is not None


# ---------------------------------------------------------------------------------------------------------------
# Entropy control: the top-entropy token mask and the entropy bonus (issue 37.4)
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.usefixtures("float64")
@pytest.mark.parametrize("algo", ["grpo", "dapo"])
@pytest.mark.parametrize("quantile,coef", [(0.2, 0.0), (1.0, 0.05), (0.5, 0.05)])
def test_top_entropy_mask_and_entropy_bonus_equal_trl(algo, quantile, coef):
    from test_successors import T as T_TRL, batch as trl_batch, trl

    logp, old, adv, mask = trl_batch(0.3, seed=6)
    entropy_of = lambda x: torch.nn.functional.softplus(0.7 * x + 1.3)  # noqa: E731  a differentiable stand-in
    cfg = replace(PRESETS[algo], beta=0.0, top_entropy_quantile=quantile, entropy_coef=coef)
    x = logp.clone().requires_grad_(True)
    loss = losses.policy_loss(x, old, adv, mask, StepNorm.of(mask, T_TRL), cfg, entropy=entropy_of(x))
    loss.backward()
    theirs = trl(algo, logp, old, adv, mask, _entropy_fn=entropy_of, top_entropy_quantile=quantile,
                 entropy_coef=coef, _entropy_bonus_enabled=coef != 0.0, epsilon_low=cfg.epsilon,
                 epsilon_high=cfg.epsilon_high)
    assert loss.item() == pytest.approx(theirs[0], rel=1e-12, abs=1e-14)
    assert torch.allclose(x.grad, theirs[1], rtol=1e-10, atol=1e-14)


def test_high_entropy_mask_keeps_the_top_fraction_of_valid_tokens():
    entropy = torch.tensor([[0.1, 0.9, 0.5, 7.0], [0.3, 0.8, 0.2, 0.6]])
    mask = torch.tensor([[1.0, 1, 1, 0], [1, 1, 1, 1]])  # the 7.0 is padding: never kept, never counted
    kept = losses.high_entropy_mask(entropy, mask, 0.3)  # top 30% of 7 valid tokens: the quantile is at 0.7
    assert kept.tolist() == [[0, 1, 0, 0], [0, 1, 0, 0]]
    # a token at the threshold itself is kept (TRL's >=): the median of 1..5 is 3, so 3, 4 and 5 train
    kept = losses.high_entropy_mask(torch.tensor([[5.0, 1, 4, 2, 3]]), torch.ones(1, 5), 0.5)
    assert kept.tolist() == [[1, 0, 1, 0, 1]]
    # one valid token is its own quantile: kept (only a micro-batch with none keeps none)
    assert losses.high_entropy_mask(torch.tensor([[0.4, 9.0]]), torch.tensor([[1.0, 0]]), 0.2).tolist() == [[1, 0]]
    assert losses.high_entropy_mask(torch.tensor([[0.4, 9.0]]), torch.zeros(1, 2), 0.2).tolist() == [[0, 0]]


def test_the_entropy_bonus_of_a_step_is_the_mean_of_its_micro_batches_bonuses():
    """policy_loss subtracts coef x the micro-batch's mean entropy over its trained tokens, divided by the step's
    number of micro-batches (TRL's): summed over a step's micro-batches, coef x the mean of their means."""
    cfg = replace(PRESETS["dapo"], entropy_coef=0.1)
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    entropy = torch.tensor([[1.0, 3.0, 50.0], [4.0, 5.0, 6.0]])  # means over valid tokens: 2 and 5
    zero, norm = torch.zeros(1, 3), StepNorm(2, 5, 3, micro_batches=2)  # A = 0: the policy term is 0
    step = sum(losses.policy_loss(zero, zero, torch.zeros(1), mask[i:i + 1], norm, cfg, entropy=entropy[i:i + 1])
               for i in range(2))
    assert float(step) == pytest.approx(-0.1 * (2 + 5) / 2)


def test_entropy_controls_end_to_end(tmp_path, tiny_policy_dir):
    args = train.Args(**{**SMALL_ARGS, "model": str(tiny_policy_dir), "output_dir": str(tmp_path), "algo": "dapo",
                         "top_entropy_quantile": 0.2, "entropy_coef": 0.01, "total_steps": 1, "save_model": False,
                         "max_sampling_rounds": 30})
    train.train(args)
    row = [json.loads(line) for line in (tmp_path / "dapo-s0" / "metrics.jsonl").open()][-1]
    assert 0.7 < row["entropy/masked_frac"] < 0.85 and row["entropy/bonus"] > 0  # ~80% of tokens left out


# Clip-Cov and KL-Cov, as verl computes them (core_algos.compute_policy_loss_clip_cov / _kl_cov, token-mean)

def verl_clip_cov(old, logp, adv, mask, eps_low, eps_high, ratio_c=2e-4, lb=1.0, ub=5.0):
    ratio = torch.exp(logp - old)
    pg1 = -adv * ratio
    corr = torch.ones_like(adv)
    pg2 = -adv * torch.clamp(ratio, 1 - eps_low, 1 + eps_high)
    clip_by_origin = (pg2 > pg1) & (mask > 0)
    cov_all = (adv - verl_masked_mean(adv, mask)) * (logp - verl_masked_mean(logp.detach(), mask))
    cov_all[mask == 0] = -torch.inf
    cov_all[clip_by_origin] = -torch.inf
    clip_num = max(int(ratio_c * mask.sum().item()), 1)
    idx = torch.nonzero((cov_all < ub) & (cov_all > lb) & (mask > 0))
    if len(idx) > 0:
        perm = torch.randperm(len(idx))  # verl draws from the global generator
        idx = idx[perm[: min(clip_num, len(idx))]]
    corr[idx[:, 0], idx[:, 1]] = 0
    losses_ = torch.maximum(pg1, pg2) * corr
    return (losses_ * mask).sum() / mask.sum()


def verl_kl_cov(old, logp, adv, mask, ratio_k=2e-4, coef=1.0):
    neg_kl = logp - old
    ratio = torch.exp(neg_kl)
    pg = -adv * ratio
    pg_kl = -adv * ratio + coef * neg_kl.abs()
    valid = mask > 0
    valid_idx = torch.nonzero(valid.reshape(-1), as_tuple=True)[0]
    a, lp = adv[valid].detach().reshape(-1), logp[valid].detach().reshape(-1)
    cov = (a - a.mean()) * (lp - lp.mean())
    top = valid_idx[torch.topk(cov, max(1, int(len(cov) * ratio_k)), largest=True).indices]
    pg = pg.clone()
    pg[top // adv.shape[1], top % adv.shape[1]] = pg_kl[top // adv.shape[1], top % adv.shape[1]]
    return (pg * mask).sum() / mask.sum()


@pytest.mark.usefixtures("float64")
@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("surrogate", ["clip_cov", "kl_cov"])
def test_clip_cov_and_kl_cov_equal_verl(surrogate, seed):
    """On a batch of ~6,000 tokens (so 2e-4 of them is more than one) with large covariances, loss and gradient equal
    verl's; Clip-Cov's random draw is the same permutation (our generator, verl's global one, the same seed)."""
    gen = torch.Generator().manual_seed(seed)
    b, t = 60, 100
    lengths = torch.randint(40, t + 1, (b,), generator=gen)
    mask = (torch.arange(t).unsqueeze(0) < lengths.unsqueeze(1)).double()
    old = -torch.rand(b, t, generator=gen) * 6
    logp = old + 0.05 * torch.randn(b, t, generator=gen)
    adv = (torch.randn(b, generator=gen) * 2).unsqueeze(-1).expand(b, t)
    cfg = replace(PRESETS["dapo"], surrogate=surrogate)
    x = logp.clone().requires_grad_(True)
    ours = losses.policy_loss(x, old, adv, mask, StepNorm.of(mask, t), cfg,
                              generator=torch.Generator().manual_seed(100 + seed))
    ours.backward()
    y = logp.clone().requires_grad_(True)
    torch.manual_seed(100 + seed)
    ref = verl_clip_cov(old, y, adv, mask, cfg.epsilon, cfg.epsilon_high) if surrogate == "clip_cov" else \
        verl_kl_cov(old, y, adv, mask)
    ref.backward()
    torch.testing.assert_close(ours, ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(x.grad, y.grad, rtol=1e-12, atol=1e-12)
    diag = losses.ratio_diagnostics(logp, old, adv, mask, cfg)
    frac = diag["clip/cov_frac"]
    assert 0 < frac <= 2e-4 + 1 / mask.sum()  # the rule touched at least one token, and no more than its share
    if surrogate == "kl_cov":  # no clip: what clip/frac reads is the share it penalises, verl's top-k count
        assert diag["clip/frac"] == frac == max(1, int(mask.sum() * 2e-4)) / float(mask.sum())


def test_the_covariance_rules_act_on_their_share_of_tokens_at_least_one_and_none_of_none():
    """Clip-Cov and KL-Cov act on COV_RATIO (2e-4) of the valid tokens, at least one (verl's), none when none."""
    assert [losses.cov_tokens(n) for n in (0, 1, 4999, 10_000)] == [0, 1, 1, 2]


@pytest.mark.usefixtures("float64")
def test_clip_cov_cuts_only_tokens_strictly_between_its_bounds():
    """verl's open interval: a token whose covariance is exactly CLIP_COV_LB (1) or CLIP_COV_UB (5) is never cut."""
    logp, mask = torch.tensor([[-1.0, -3.0]]), torch.ones(1, 2)  # centred log-probs +-1; ratio 1: nothing clipped
    for a, candidate in ((1.0, False), (3.0, True), (5.0, False)):
        adv = torch.tensor([[a, -a]])  # a covariance of exactly a on both tokens
        assert losses.token_covariance(logp, adv, mask).tolist() == [[a, a]]
        assert losses.clip_cov_candidates(logp, logp, adv, mask, 0.2, 0.28).tolist() == [[candidate] * 2]


@pytest.mark.parametrize("surrogate", ["clip_cov", "kl_cov"])
def test_cov_surrogates_end_to_end_with_their_fraction_logged(tmp_path, tiny_policy_dir, surrogate):
    args = train.Args(**{**SMALL_ARGS, "model": str(tiny_policy_dir), "output_dir": str(tmp_path), "algo": "grpo",
                         "beta": 0.0, "surrogate": surrogate, "total_steps": 1, "save_model": False})
    train.train(args)
    row = [json.loads(line) for line in (tmp_path / "grpo-s0" / "metrics.jsonl").open()][-1]
    assert 0 < row["clip/cov_frac"] < 0.05 and row["losses/skipped_updates"] == 0  # it acted, on few tokens


@pytest.mark.usefixtures("float64")
def test_adaptive_entropy_control_equals_trl_step_by_step():
    """Four optimizer steps of TRL 1.16's use_adaptive_entropy (one micro-batch each, so every _compute_loss call
    ends a step) against losses.AdaptiveEntropy: the same loss, gradient and coefficient at every step, with the
    entropy crossing the target both ways."""
    from test_successors import T as T_TRL, batch as trl_batch, trl_loss, trl_stand_in

    logp, old, adv, mask = trl_batch(0.3, seed=7)
    target, coef0 = 0.9, 0.05
    fake = trl_stand_in("dapo", args=dict(entropy_target=target, entropy_coef_delta=0.02, entropy_coef_min=0.0,
                                          entropy_coef_max=1.0), _entropy_bonus_enabled=True, use_adaptive_entropy=True,
                        entropy_coef=coef0, _last_world_entropy=float("inf"), _entropy_window_stats=None,
                        epsilon_low=0.2, epsilon_high=0.28)
    control = losses.AdaptiveEntropy(coef0, target, delta=0.02)
    cfg = replace(PRESETS["dapo"], beta=0.0)
    for level in (0.5, 1.4, 0.3, 0.2):  # mean entropies below, above, below, below the target
        entropy_of = lambda x, level=level: level * torch.sigmoid(x + 2.0) * 2  # noqa: E731
        theirs, their_grad = trl_loss(fake, logp, old, adv, mask, entropy_fn=entropy_of)
        y = logp.clone().requires_grad_(True)
        entropy = entropy_of(y)
        mine = losses.policy_loss(y, old, adv, mask, StepNorm.of(mask, T_TRL),
                                  replace(cfg, entropy_coef=control.applied()), entropy=entropy)
        mine.backward()
        control.observe(entropy.detach(), mask)
        control.end_step()
        assert mine.item() == pytest.approx(theirs, rel=1e-12, abs=1e-14)
        assert torch.allclose(y.grad, their_grad, rtol=1e-10, atol=1e-14)
        assert control.coef == pytest.approx(fake.entropy_coef, abs=1e-15)
        assert control.last_entropy == pytest.approx(fake._last_world_entropy, rel=1e-12)
    assert control.coef != coef0


def test_adaptive_entropy_logs_the_bonus_its_steps_applied():
    """entropy/bonus under --entropy-target: each optimizer step's applied coefficient (0 at the first: no entropy seen
    yet) times its trained tokens' entropy, over all their tokens; the sums start again after each log."""
    control = losses.AdaptiveEntropy(0.1, target=1.0, delta=0.02)
    trained = torch.ones(2, 3)
    for level in (0.5, 0.8):  # both below the target: the bonus applies from the second step, at 0.1 + 0.02
        control.observe(torch.full((2, 3), level), trained)
        control.end_step()
    assert control.logged() == {"entropy/coef": pytest.approx(0.14), "entropy/bonus": pytest.approx(0.12 * 0.8 * 6 / 12)}
    assert control.logged()["entropy/bonus"] == 0.0  # nothing since the last log
    control.observe(torch.tensor([[0.5, 3.0]]), torch.tensor([[1.0, 0.0]]))  # one trained token: its own mean
    control.end_step()
    assert control.logged()["entropy/bonus"] == pytest.approx(0.14 * 0.5, rel=1e-12, abs=0)  # c as the step began


def test_adaptive_entropy_at_the_target_applies_the_bonus_and_keeps_the_coefficient_in_its_range():
    """The bonus applies while H <= target (equality included), and c stays within [low, high] however long the
    entropy stays on one side."""
    control = losses.AdaptiveEntropy(0.95, target=1.0, delta=0.02)
    for _ in range(5):  # at the target exactly: the coefficient rises, capped at high = 1
        control.observe(torch.full((2, 3), 1.0), torch.ones(2, 3))
        control.end_step()
        assert control.applied() == control.coef
    assert control.coef == 1.0
    for _ in range(60):  # above the target: no bonus, and the coefficient falls to low = 0, not below
        control.observe(torch.full((2, 3), 2.0), torch.ones(2, 3))
        control.end_step()
    assert control.applied() == 0.0 and control.coef == 0.0


def test_the_rollout_corrections_bounds_keep_weights_equal_to_them():
    """[C_min, C_max] is closed, in both modes: a weight equal to a bound is kept (mask) or unchanged (truncate)."""
    w = torch.tensor([0.25, 0.5, 1.0, 3.0, 3.5])
    assert losses.bound_rollout_ratio(w, "mask", 0.5, 3.0).tolist() == [0.0, 0.5, 1.0, 3.0, 0.0]
    assert losses.bound_rollout_ratio(w, "truncate", 0.5, 3.0).tolist() == [0.5, 0.5, 1.0, 3.0, 3.0]
    assert losses.bound_rollout_ratio(w, "mask", None, 3.0).tolist() == [0.25, 0.5, 1.0, 3.0, 0.0]


def test_update_metrics_leave_the_adaptive_bonus_to_the_controller():
    """With a fixed --entropy-coef the update's metrics log its bonus; under --entropy-target the coefficient moves
    every optimizer step, so they log none of their own (the controller's is AdaptiveEntropy.logged's)."""
    import metrics
    from plumbing.ddp import SINGLE

    gen = torch.Generator().manual_seed(0)
    logp, mask = -torch.rand(4, 5, generator=gen), torch.ones(4, 5)
    seen = [(torch.arange(4), logp, torch.rand(4, 5, generator=gen))]
    cfg = replace(PRESETS["dapo"], entropy_coef=0.1)
    for adaptive in (False, True):
        m = metrics.update_metrics(seen, logp, torch.rand(4, 5), None, torch.randn(4), mask, cfg, SINGLE,
                                   adaptive_entropy=adaptive)
        assert ("entropy/bonus" in m) != adaptive and (m.get("entropy/bonus", 1.0) > 0)


def test_the_logged_bonus_is_the_coefficient_times_the_trained_tokens_mean_entropy():
    """With --top-entropy-quantile and a fixed --entropy-coef, entropy/bonus averages the entropy over the tokens the
    loss trained (each micro-batch keeps its own top share), not over every valid token; entropy/masked_frac is the
    share left out."""
    import metrics
    from plumbing.ddp import SINGLE

    mask = torch.tensor([[1.0, 1.0, 1.0, 1.0, 0.0]] * 2)  # the last column: padding
    seen = [(torch.tensor([0]), None, torch.tensor([[1.0, 2.0, 3.0, 4.0, 99.0]])),
            (torch.tensor([1]), None, torch.tensor([[10.0, 20.0, 30.0, 40.0, 99.0]]))]
    m = metrics.entropy_control_metrics(seen, mask, 0.5, 0.1, SINGLE)  # keeps 3, 4 and 30, 40
    assert m == {"entropy/masked_frac": 0.5, "entropy/bonus": pytest.approx(0.1 * (3 + 4 + 30 + 40) / 4)}


def test_adaptive_entropy_state_survives_a_resume(tmp_path, tiny_policy_dir):
    """--entropy-target: a run stopped after step 1 and resumed logs what the uninterrupted run logs (the controller's
    coefficient and last entropy are in the checkpoint)."""
    common = {**SMALL_ARGS, "model": str(tiny_policy_dir), "algo": "dapo", "entropy_target": 5.0,
              "max_sampling_rounds": 30, "save_model": False}
    train.train(train.Args(**{**common, "output_dir": str(tmp_path / "whole"), "total_steps": 2}))
    train.train(train.Args(**{**common, "output_dir": str(tmp_path / "cut"), "total_steps": 1, "save_every": 1}))
    (tmp_path / "cut" / "dapo-s0" / "summary.json").unlink()
    train.train(train.Args(**{**common, "output_dir": str(tmp_path / "cut"), "total_steps": 2, "resume": "auto"}))
    rows = [[json.loads(line) for line in (tmp_path / d / "dapo-s0" / "metrics.jsonl").open()] for d in ("whole", "cut")]
    assert [(r.get("entropy/coef"), r.get("entropy/bonus")) for r in rows[0]] == \
        [(r.get("entropy/coef"), r.get("entropy/bonus")) for r in rows[1]]
    assert rows[0][-1]["entropy/coef"] > 0 and rows[0][-1]["entropy/bonus"] > 0  # the controller moved and applied
