"""The advantage estimators (losses.advantages) against the reference implementations' formulas, written here as
those codebases compute them (TRL 1.16's GRPOTrainer for grpo and its scale_rewards; verl's core_algos for RLOO and
REINFORCE++-baseline, token-level with its masked_whiten; the MaxRL formula of rlhf-book's and tunix's code), on
random rewards with all-equal groups and G = 2 among them."""

from collections import defaultdict

import pytest
import torch

import losses


def trl_grpo(rewards, g, scale):  # TRL 1.16, GRPOTrainer._generate_and_score_completions
    mean = rewards.view(-1, g).mean(dim=1).repeat_interleave(g, dim=0)
    adv = rewards - mean
    if scale == "batch":
        std = rewards.std().expand_as(rewards)
    else:
        std = rewards.view(-1, g).std(dim=1).repeat_interleave(g, dim=0)
    return adv / (std + 1e-4) if scale != "none" else adv


def verl_group_means(scores, index):
    """verl's per-prompt bookkeeping: prompt index -> its scores, and -> their mean (0 for a lone response)."""
    id2score, id2mean = defaultdict(list), {}
    for i in range(len(scores)):
        id2score[index[i]].append(scores[i])
    for idx in id2score:
        id2mean[idx] = torch.mean(torch.tensor(id2score[idx])) if len(id2score[idx]) > 1 else torch.tensor(0.0)
    return id2score, id2mean


def verl_rloo(scores, index):  # verl compute_rloo_outcome_advantage, outcome reward per response
    scores = scores.clone()
    id2score, id2mean = verl_group_means(scores, index)
    for i in range(len(scores)):
        n = len(id2score[index[i]])
        if n > 1:
            scores[i] = scores[i] * n / (n - 1) - id2mean[index[i]] * n / (n - 1)
    return scores


def verl_masked_mean(values, mask):
    return (values * mask).sum() / mask.sum()


def verl_rpp_baseline(scores, index, mask):  # verl compute_reinforce_plus_plus_baseline_outcome_advantage
    scores = scores.clone()
    _, id2mean = verl_group_means(scores, index)
    for i in range(len(scores)):
        scores[i] = scores[i] - id2mean[index[i]]
    tiled = scores.unsqueeze(-1).tile([1, mask.shape[1]]) * mask
    mean = verl_masked_mean(tiled, mask)  # masked_whiten: masked mean and unbiased masked variance
    var = verl_masked_mean((tiled - mean) ** 2, mask) * (mask.sum() / (mask.sum() - 1))
    return ((tiled - mean) * torch.rsqrt(var + 1e-8) * mask)


def reference_maxrl(rewards, g, eps=1e-6):  # per group: (r - mean) / (mean + eps), 0 when mean <= eps
    out = []
    for group in rewards.view(-1, g).tolist():
        mean = sum(group) / len(group)
        out += [0.0] * len(group) if mean <= eps else [(r - mean) / (mean + eps) for r in group]
    return torch.tensor(out, dtype=rewards.dtype)


def random_batch(seed, g, prompts=6):
    """Rewards as this project's verifier gives them (correctness 0/1 plus a 0.1 format term), the first three groups
    of equal rewards, and lengths 1-40."""
    gen = torch.Generator().manual_seed(seed)
    correct = (torch.rand(prompts, g, generator=gen) < 0.5).double()
    rewards = (correct + 0.1 * (torch.rand(prompts, g, generator=gen) < 0.7).double()).reshape(-1)
    rewards[:g], rewards[g:2 * g], rewards[2 * g:3 * g] = 1.1, 0.0, 0.1  # all right, all wrong, all formatted only
    lengths = torch.randint(1, 41, (prompts * g,), generator=gen)
    return rewards, lengths


@pytest.mark.parametrize("g", [2, 3, 8])
@pytest.mark.parametrize("seed", range(5))
def test_each_estimator_equals_its_reference(g, seed):
    rewards, lengths = random_batch(seed, g)
    index = [i // g for i in range(len(rewards))]
    for scale in ("group", "batch", "none"):
        torch.testing.assert_close(losses.advantages(rewards, g, "grpo", scale), trl_grpo(rewards, g, scale),
                                   rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(losses.advantages(rewards, g, "rloo"), verl_rloo(rewards, index), rtol=1e-12, atol=1e-12)
    mask = (torch.arange(40).unsqueeze(0) < lengths.unsqueeze(1)).double()  # (B, T)
    ours = losses.advantages(rewards, g, "reinforce_plus_plus_baseline", lengths=lengths)
    torch.testing.assert_close(ours.unsqueeze(-1) * mask, verl_rpp_baseline(rewards, index, mask), rtol=1e-10,
                               atol=1e-10)
    torch.testing.assert_close(losses.advantages(rewards, g, "maxrl"), reference_maxrl(rewards, g), rtol=1e-12,
                               atol=1e-12)


@pytest.mark.parametrize("estimator", ["grpo", "rloo", "maxrl"])
def test_an_equal_reward_group_gets_no_advantage(estimator):
    rewards, lengths = random_batch(0, 4)
    adv = losses.advantages(rewards, 4, estimator, lengths=lengths).view(-1, 4)
    assert torch.equal(adv[:3], torch.zeros(3, 4, dtype=adv.dtype))  # all right, all wrong, all 0.1


def test_maxrl_weighs_a_rare_success_by_one_over_its_rate():
    """0/1 rewards, K of G right: a right answer gets (G - K) / K, a wrong one -1 (up to eps)."""
    rewards = torch.tensor([1.0, 0, 0, 0, 1, 1, 1, 0], dtype=torch.float64)
    adv = losses.advantages(rewards, 4, "maxrl")
    torch.testing.assert_close(adv, torch.tensor([3.0, -1, -1, -1, 1 / 3, 1 / 3, 1 / 3, -1], dtype=torch.float64),
                               rtol=1e-5, atol=1e-5)


def test_rloo_is_the_leave_one_out_baseline():
    rewards = torch.tensor([1.0, 0.0, 0.5, 2.0], dtype=torch.float64)
    adv = losses.advantages(rewards, 4, "rloo")
    loo = torch.stack([rewards[i] - (rewards.sum() - rewards[i]) / 3 for i in range(4)])
    torch.testing.assert_close(adv, loo, rtol=1e-12, atol=1e-12)


def test_scale_rewards_accepts_trls_older_booleans():
    assert losses.LossConfig(scale_rewards=True).scale_rewards == "group"
    assert losses.LossConfig(scale_rewards=False).scale_rewards == "none"
