"""The objectives (GRPO, Dr.GRPO, DAPO, GSPO; CISPO, SAPO, GMPO, LUSPO, VESPO), side by side, and the diagnostics
that tell them apart. The file reads in the order policy_loss computes:

    1. the configuration (LossConfig) and the papers' presets (PRESETS), the step's normalisers (StepNorm)
    2. advantages                    GRPO's group-relative reward, RLOO, REINFORCE++-baseline, MaxRL
    3. the ratio                     importance_weights: rho_it, GSPO's s_i, GSPO-token's s_it
    4. surrogates                    PPO's clip, CISPO, SAPO, GMPO, VESPO (the table's order), then dual-clip,
                                     Clip-Cov, KL-Cov; each states its clip rule once (ppo_clipped, cispo_weight, the
                                     gate's slope, gmpo_log_ratio, vespo_weight, dual_capped, clip_cov_candidates)
    5. the KL to the reference       k1 / k2 / k3, in the loss or in the reward
    6. aggregation                   the four ways per-token losses become the step's number
    7. policy_loss                   the loss of one micro-batch, all of the above
    8. options on the loss           the rollout correction (pi_old / mu), the entropy controls
    9. check_config                  the combinations the maths does not define, refused once at start-up
   10. diagnostics                   the ratio variance and clip fractions every update logs, read from the rules

Notation (one optimizer step): B sequences y_1..y_B, |y_i| valid completion tokens each (EOS included, padding
excluded), padded to T columns. For each token

    l_it = log pi_theta(y_it) - log pi_old(y_it)      token log-ratio               (B, T)
    rho_it = exp(l_it)                                 token importance ratio        (GRPO, Dr.GRPO, DAPO)
    s_i = exp( (1/|y_i|) sum_t l_it )                  GSPO sequence ratio: the geometric mean of rho_i.

A paper's objective is a choice along four independent axes, held in `LossConfig`:

    importance_sampling_level   which ratio w multiplies the advantage: rho_it ("token"), s_i ("sequence"),
                                or s_it = sg[s_i] * pi_theta(y_it) / sg[pi_theta(y_it)] ("sequence_token")
    epsilon, epsilon_high       the clip range [1 - epsilon, 1 + epsilon_high] of w
    loss_agg_mode               how per-token losses L_it become one number (see `aggregate`)
    beta                        weight of the KL estimate to the reference, added to every L_it

and one choice made before the loss, the advantage estimator. Each unit u (a token, or a whole sequence at sequence
level) has the PPO clipped surrogate

    L_u = -min( w_u A_u, clip(w_u, 1 - epsilon, 1 + epsilon_high) A_u ).

| --algo   | level    | epsilon / high | advantage          | loss_agg_mode            | beta |
| grpo     | token    | 0.2 / 0.2      | (r - mean) / std   | seq-mean-token-mean      | 0.04 |
| dr_grpo  | token    | 0.2 / 0.2      | r - mean           | seq-mean-token-sum-norm  | 0    |
| dapo     | token    | 0.2 / 0.28     | (r - mean) / std   | token-mean               | 0    |
| gspo     | sequence | 3e-4 / 4e-4    | (r - mean) / std   | seq-mean-token-mean      | 0    |

The successors keep these axes and change the surrogate itself (`surrogate`, see `surrogate_loss`; LUSPO changes
the aggregation instead; VESPO's cell is its kernel's (k, lambda) for A >= 0 / A < 0, and it has no clip range):

| cispo    | token    | 1 / 4 (cap 5)  | (r - mean) / std   | token-mean               | 0    |  -sg(clip(rho)) A log pi
| sapo     | token    | (tau 1 / 1.05) | (r - mean) / std   | seq-mean-token-mean      | 0    |  -sigmoid(tau(rho-1)) 4/tau A
| gmpo     | sequence | 0.4 / 0.4 (log)| (r - mean) / std   | seq-mean-token-mean      | 0    |  -A exp(mean_t clipped l_t)
| luspo    | sequence | 3e-4 / 4e-4    | (r - mean) / std   | seq-mean-token-sum       | 0    |  GSPO's L_i, times |y_i|
| vespo    | token    | (2, 3 / 3, 2)  | (r - mean) / std   | token-mean               | 0    |  -sg(phi(W_i)) A log pi

The options beyond the presets, each a LossConfig field (a train.py flag of the same name) unless marked:

| field                  | paper / source                                   | default        | function                    |
| advantage_estimator    | RLOO 2402.14740; REINFORCE++ 2501.03262; MaxRL   | grpo           | advantages                  |
| scale_rewards          | TRL (batch); Dr.GRPO 2503.20783 (none)           | group          | group_advantages            |
| surrogate              | the successors above; Clip-Cov, KL-Cov 2505.22617 | clip          | surrogate_loss              |
| sapo_tau_pos / _neg    | SAPO 2511.20347                                  | 1.0 / 1.05     | sapo_surrogate              |
| vespo_k_pos, _lambda_pos, vespo_k_neg, _lambda_neg | VESPO 2602.10693 | 2, 3 / 3, 2 | vespo_weight                |
| clip_ratio_c           | dual-clip PPO 1912.09729 (verl)                  | None (off)     | dual_clip                   |
| kl_estimator           | Schulman 2020 (k1, k2, k3)                       | k3             | kl_estimate                 |
| kl_in                  | GRPO (loss); PPO-RLHF, verl (reward)             | loss           | policy_loss, kl_in_reward   |
| kl_ratio_correction    | 2512.21852; TRL's use_bias_correction_kl         | False          | policy_loss                 |
| top_entropy_quantile   | the 80/20 paper 2506.01939                       | 1.0 (all)      | high_entropy_mask           |
| entropy_coef           | TRL's entropy bonus                              | 0.0            | policy_loss                 |
| --entropy-target (Args)| Skywork-OR1 2505.22312                           | off            | AdaptiveEntropy             |
| --rollout-correction   | TRL's vLLM correction (TIS, MIS / IcePop)        | off            | rollout_correction_weights  |
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Literal

import torch
from torch import Tensor


# ---------------------------------------------------------------------------------------------------------------
# 1. The objective's configuration and the papers' presets
# ---------------------------------------------------------------------------------------------------------------


ImportanceLevel = Literal["token", "sequence", "sequence_token"]
AggMode = Literal["seq-mean-token-mean", "token-mean", "seq-mean-token-sum-norm", "seq-mean-token-sum"]
Surrogate = Literal["clip", "cispo", "sapo", "gmpo", "vespo", "clip_cov", "kl_cov"]
Estimator = Literal["grpo", "rloo", "reinforce_plus_plus_baseline", "maxrl"]
KLEstimator = Literal["k1", "k2", "k3"]
KLIn = Literal["loss", "reward"]
ScaleRewards = Literal["group", "batch", "none"]
RolloutCorrection = Literal["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"]
Algo = Literal["grpo", "dr_grpo", "dapo", "gspo", "cispo", "sapo", "gmpo", "luspo", "vespo"]  # PRESETS' keys (tested)


@dataclass(frozen=True)
class LossConfig:
    importance_sampling_level: ImportanceLevel = "token"
    loss_agg_mode: AggMode = "seq-mean-token-mean"
    epsilon: float = 0.2
    epsilon_high: float = 0.2
    beta: float = 0.0
    scale_rewards: ScaleRewards = "group"  # grpo's divisor: the group's reward std, the batch's, or none (Dr.GRPO)
    surrogate: Surrogate = "clip"  # what the ratio does to the gradient: see `surrogate_loss`
    sapo_tau_pos: float = 1.0  # SAPO's gate temperature for A > 0
    sapo_tau_neg: float = 1.05  # ... and for A <= 0
    vespo_k_pos: float = 2.0  # VESPO's kernel phi(W) = e^lambda W^k e^(-lambda W) for A >= 0 (`vespo_weight`)
    vespo_lambda_pos: float = 3.0
    vespo_k_neg: float = 3.0  # ... and for A < 0
    vespo_lambda_neg: float = 2.0
    advantage_estimator: Estimator = "grpo"  # how rewards become advantages: see `advantages`
    clip_ratio_c: float | None = None  # dual-clip: for A < 0 the clip surrogate's loss is capped at -c A (`dual_clip`)
    kl_estimator: KLEstimator = "k3"  # which estimate of KL(pi_theta || pi_ref) beta weighs (`kl_estimate`)
    kl_in: KLIn = "loss"  # added to every token's loss (GRPO), or subtracted from the reward
    kl_ratio_correction: bool = False  # weigh the loss's KL by the importance ratio (TRL's use_bias_correction_kl)
    entropy_coef: float = 0.0  # entropy bonus: subtract coef x the mean entropy of the policy's tokens (`policy_loss`)
    top_entropy_quantile: float = 1.0  # train only on tokens this top fraction by entropy (`high_entropy_mask`)

    def __post_init__(self):  # TRL's older booleans: True is "group", False is "none"
        if isinstance(self.scale_rewards, bool):
            object.__setattr__(self, "scale_rewards", "group" if self.scale_rewards else "none")


OBJECTIVE_FIELDS = tuple(f.name for f in fields(LossConfig))  # the flags that make up an objective (train.Args)

PRESETS: dict[Algo, LossConfig] = {
    # DeepSeekMath (2402.03300): PPO's token ratio, per-sequence length normalisation, std-scaled advantages, KL.
    "grpo": LossConfig("token", "seq-mean-token-mean", 0.2, 0.2, beta=0.04, scale_rewards="group"),
    # Dr.GRPO (2503.20783): no 1/|y_i| and no 1/std, so neither length nor difficulty re-weights a token.
    "dr_grpo": LossConfig("token", "seq-mean-token-sum-norm", 0.2, 0.2, beta=0.0, scale_rewards="none"),
    # DAPO (2503.14476): clip-higher, every token of the step weighted equally (plus dynamic sampling and
    # overlong shaping, which act on the batch and the reward: see train.py and rewards.py).
    "dapo": LossConfig("token", "token-mean", 0.2, 0.28, beta=0.0, scale_rewards="group"),
    # GSPO (2507.18071): one length-normalised ratio per sequence, clipped as a whole, in a very narrow range.
    "gspo": LossConfig("sequence", "seq-mean-token-mean", 3e-4, 4e-4, beta=0.0, scale_rewards="group"),
    # CISPO (MiniMax-M1, 2506.13585 §3.1; ScaleRL 2510.13913): the weight is capped and carries no gradient; every
    # token keeps a REINFORCE gradient. Upper cap 1 + 4 = 5 (ScaleRL's eps_max = 5; TRL's epsilon_high = 5.0 is the
    # cap itself), no effective lower bound (1 - 1 = 0 < any ratio), token-mean like DAPO.
    "cispo": LossConfig("token", "token-mean", 1.0, 4.0, beta=0.0, scale_rewards="group", surrogate="cispo"),
    # SAPO (2511.20347): a smooth, temperature-controlled gate in place of the hard clip, tau 1.0 for A > 0 and
    # 1.05 for A <= 0 (TRL 1.16's defaults); aggregated like GRPO. The clip range is unused.
    "sapo": LossConfig("token", "seq-mean-token-mean", 0.2, 0.2, beta=0.0, scale_rewards="group", surrogate="sapo"),
    # GMPO (2507.20673): the geometric mean of the token ratios, each token's log-ratio clipped to (-0.4, 0.4)
    # (the paper's (e^-0.4, e^0.4)), sign-aware; one weight per sequence (verl's "geo_mean").
    "gmpo": LossConfig("sequence", "seq-mean-token-mean", 0.4, 0.4, beta=0.0, scale_rewards="group", surrogate="gmpo"),
    # LUSPO (2602.05261): GSPO with each sequence's loss multiplied by its length, (1/B) sum_i |y_i| L_i, so that a
    # long answer weighs no less than a short one (GSPO's 1/|y_i| shortens answers, the paper finds). GSPO's clip range
    # (the paper's own was not readable here); TRL 1.16's loss_type "luspo".
    "luspo": LossConfig("sequence", "seq-mean-token-sum", 3e-4, 4e-4, beta=0.0, scale_rewards="group"),
    # VESPO (2602.10693): a smooth kernel of the unnormalised sequence ratio W_i = prod_t rho_it in place of a clip,
    # a stop-gradient weight on every token's log pi as CISPO's; the paper's (k, lambda) 2, 3 for A >= 0 and 3, 2
    # for A < 0 (its code's and TRL 1.16's defaults), token-mean (verl's default aggregation, TRL's). No clip range.
    "vespo": LossConfig("token", "token-mean", 0.2, 0.2, beta=0.0, scale_rewards="group", surrogate="vespo"),
}


@dataclass(frozen=True)
class StepNorm:
    """Normalisers of a whole optimizer step, so that splitting it into micro-batches changes nothing.

    A micro-batch that normalised by its own counts would weight the tokens of short micro-batches more.
    """

    num_seqs: int  # B: sequences in the optimizer step
    num_tokens: int  # sum_i |y_i| over the optimizer step
    max_new_tokens: int  # Dr.GRPO's constant: the generation budget, whatever the actual lengths
    micro_batches: int = 1  # how many micro-batches the step is split into (the entropy bonus averages over them)

    @staticmethod
    def of(mask: Tensor, max_new_tokens: int) -> "StepNorm":
        return StepNorm(mask.shape[0], int(mask.sum().item()), max_new_tokens)


# ---------------------------------------------------------------------------------------------------------------
# 2. Advantages
# ---------------------------------------------------------------------------------------------------------------


def group_advantages(rewards: Tensor, group_size: int, scale: ScaleRewards | bool = "group", eps: float = 1e-4) -> Tensor:
    """GRPO (DeepSeekMath 2402.03300; TRL's scale_rewards): A_i = (r_i - mean_G(r)) / (std + eps), std the group's
    ("group"), the whole batch's ("batch", TRL's choice for a less noisy divisor), or no division at all ("none",
    Dr.GRPO 2503.20783: A_i = r_i - mean_G(r)).

    rewards: (B,) with the G completions of a prompt in consecutive rows. std is the unbiased (N-1) estimate.
    A group whose rewards are all equal gets A = 0 exactly: its numerator is exactly 0.
    """
    scale = {True: "group", False: "none"}.get(scale, scale)
    r = rewards.view(-1, group_size)  # (P, G)
    centred = r - r.mean(dim=1, keepdim=True)
    if scale == "group":
        centred = centred / (r.std(dim=1, keepdim=True) + eps)
    elif scale == "batch":
        centred = centred / (rewards.std() + eps)
    return centred.reshape(-1)  # (B,)


def rloo_advantages(rewards: Tensor, group_size: int) -> Tensor:
    """RLOO (Ahmadian et al. 2402.14740; verl's compute_rloo_outcome_advantage): each completion's baseline is the
    mean reward of the other G - 1 in its group, A_i = r_i - (1/(G-1)) sum_{j != i} r_j = G/(G-1) (r_i - mean_G(r)),
    written as verl computes it. Needs G >= 2."""
    r = rewards.view(-1, group_size)  # (P, G)
    g = group_size
    return (r * g / (g - 1) - r.mean(dim=1, keepdim=True) * g / (g - 1)).reshape(-1)  # (B,)


def reinforce_pp_baseline_advantages(rewards: Tensor, group_size: int, lengths: Tensor) -> Tensor:
    """REINFORCE++-baseline (Hu et al. 2501.03262; verl's compute_reinforce_plus_plus_baseline_outcome_advantage):
    a_i = r_i - mean_G(r), then whitened over every completion token of the batch (verl's masked_whiten of a_i
    repeated on each of y_i's |y_i| tokens): A_i = (a_i - mu) / sqrt(var + 1e-8), mu and var (unbiased, N - 1) the
    token-weighted mean and variance of a, N = sum_i |y_i|. lengths: (B,) |y_i|."""
    r = rewards.view(-1, group_size)  # (P, G)
    a = (r - r.mean(dim=1, keepdim=True)).reshape(-1)  # (B,)
    n = lengths.to(a.dtype)
    tokens = n.sum()
    mu = (a * n).sum() / tokens
    var = ((a - mu) ** 2 * n).sum() / tokens * (tokens / (tokens - 1))
    return (a - mu) * torch.rsqrt(var + 1e-8)  # (B,)


def maxrl_advantages(rewards: Tensor, group_size: int, eps: float = 1e-6) -> Tensor:
    """MaxRL (Tajwar et al. 2026; rlhf-book's policy-gradients code, tunix): A_i = (r_i - mean_G(r)) / (mean_G(r)
    + eps), 0 for a group whose mean reward is <= eps. For 0/1 rewards with K of G right: (G - K) / K for a right
    answer, -1 for a wrong one, so a hard prompt's rare success weighs most (the 1/p(x) of maximum likelihood).
    Needs rewards >= 0."""
    r = rewards.view(-1, group_size)  # (P, G)
    mean = r.mean(dim=1, keepdim=True)
    return torch.where(mean > eps, (r - mean) / (mean + eps), torch.zeros_like(r)).reshape(-1)  # (B,)


def advantages(rewards: Tensor, group_size: int, estimator: Estimator = "grpo", scale: ScaleRewards = "group",
               lengths: Tensor | None = None) -> Tensor:
    """The advantage of each completion, (B,), by `estimator`, over the whole batch (every process's rows: the
    batch-level statistics of scale "batch" and of REINFORCE++-baseline need them)."""
    if estimator == "grpo":
        return group_advantages(rewards, group_size, scale)
    if estimator == "rloo":
        return rloo_advantages(rewards, group_size)
    if estimator == "reinforce_plus_plus_baseline":
        return reinforce_pp_baseline_advantages(rewards, group_size, lengths)
    return maxrl_advantages(rewards, group_size)


# ---------------------------------------------------------------------------------------------------------------
# 3. The ratio
# ---------------------------------------------------------------------------------------------------------------


def masked_seq_mean(x: Tensor, mask: Tensor) -> Tensor:
    """(1/|y_i|) sum_t x_it over valid tokens: (B, T) -> (B,). A row with no valid token gives 0, not NaN."""
    return (x * mask).sum(-1) / mask.sum(-1).clamp(min=1)


def importance_weights(logp: Tensor, old_logp: Tensor, mask: Tensor, level: ImportanceLevel) -> Tensor:
    """The ratio w that multiplies the advantage, broadcast to (B, T).

    token:           w_it = rho_it = exp(l_it)
    sequence:        w_it = s_i = exp(mean_t l_it)                  (GSPO eq. 7; the same for every token of y_i)
    sequence_token:  w_it = sg[s_i] * exp(logp_it - sg[logp_it])   (GSPO-token eq. 13: value s_i, gradient
                                                                    per token, so A may vary along y_i)
    """
    log_ratio = (logp - old_logp) * mask  # (B, T); padding contributes nothing to any sum
    if level == "token":
        return torch.exp(log_ratio)
    log_s = masked_seq_mean(log_ratio, mask).unsqueeze(-1)  # (B, 1)
    if level == "sequence":
        return torch.exp(log_s).expand_as(logp)
    if level == "sequence_token":
        return torch.exp(log_s.detach() + logp - logp.detach())
    raise ValueError(f"unknown importance_sampling_level {level!r}; use token, sequence or sequence_token")


# ---------------------------------------------------------------------------------------------------------------
# 4. Surrogates, in the presets table's order (each states its clip rule once: the diagnostics read it)
# ---------------------------------------------------------------------------------------------------------------


def ppo_clipped(w: Tensor, adv: Tensor, eps_low: float, eps_high: float) -> Tensor:
    """PPO's clip rule: where min(w A, clip(w, 1 - eps_low, 1 + eps_high) A) takes the clipped term, so that the
    unit gets no gradient: w below 1 - eps_low with A < 0, or above 1 + eps_high with A > 0. Out of range on the
    other side (w < 1 - eps_low with A > 0, say) the min keeps w A and its gradient."""
    return ((w < 1 - eps_low) & (adv < 0)) | ((w > 1 + eps_high) & (adv > 0))


def clipped_surrogate(w: Tensor, adv: Tensor, eps_low: float, eps_high: float) -> Tensor:
    """PPO's clip (GRPO, Dr.GRPO, DAPO, GSPO): L = -min(w A, clip(w, 1 - eps_low, 1 + eps_high) A), elementwise.
    Where the min takes the clipped term (ppo_clipped), L is constant in w: that unit gives no gradient at all."""
    return -torch.minimum(w * adv, torch.clamp(w, 1 - eps_low, 1 + eps_high) * adv)


def cispo_surrogate(logp: Tensor, w: Tensor, adv: Tensor, eps_low: float, eps_high: float) -> Tensor:
    """CISPO (MiniMax-M1 eq. 4-5): L_it = -sg(clip(rho_it, 1 - eps_low, 1 + eps_high)) A_it log pi_theta(y_it).

    The clipped ratio is a constant weight (stop-gradient), so grad L_it = -w_hat A grad log pi: a capped
    importance-weighted REINFORCE in which no token ever leaves the gradient (PPO's clip drops clipped tokens)."""
    return -cispo_weight(w, eps_low, eps_high).detach() * adv * logp


def cispo_weight(w: Tensor, eps_low: float, eps_high: float) -> Tensor:
    """CISPO's capped weight clip(w, 1 - eps_low, 1 + eps_high); a token is capped where it differs from w."""
    return torch.clamp(w, 1 - eps_low, 1 + eps_high)


def sapo_gate(w: Tensor, tau: Tensor) -> Tensor:
    """SAPO's soft gate (2511.20347 eq. 5): f(w) = sigmoid(tau (w - 1)) * 4 / tau. f'(1) = 1 (the on-policy gradient
    is untouched); f'(w) = 4 sigmoid (1 - sigmoid) decays smoothly as w leaves 1, faster for larger tau, and as
    tau grows it tends to a hard window around w = 1."""
    return torch.sigmoid(tau * (w - 1)) * 4 / tau


def sapo_surrogate(w: Tensor, adv: Tensor, tau_pos: float, tau_neg: float) -> Tensor:
    """SAPO: L_it = -f(w_it) A_it, with tau_pos where A > 0 and tau_neg where A <= 0 (negative tokens, whose
    gradient spreads over the whole vocabulary, are gated a little harder)."""
    tau = torch.where(adv > 0, torch.full_like(adv, tau_pos), torch.full_like(adv, tau_neg))
    return -sapo_gate(w, tau) * adv


def sapo_gate_slope(w: Tensor, adv: Tensor, cfg: LossConfig) -> Tensor:
    """f'(w) = 4 sigmoid(tau (w - 1)) (1 - sigmoid(...)): the weight SAPO's gate leaves on a unit's gradient
    (1 on-policy, toward 0 far from w = 1)."""
    tau = torch.where(adv > 0, torch.full_like(adv, cfg.sapo_tau_pos), torch.full_like(adv, cfg.sapo_tau_neg))
    sig = torch.sigmoid(tau * (w - 1))
    return 4 * sig * (1 - sig)


def gmpo_log_ratio(log_ratio: Tensor, adv: Tensor, eps_low: float, eps_high: float) -> Tensor:
    """GMPO's per-token log-ratio (2507.20673 eq. 4): l_it clipped to [-eps_low, eps_high] only on the side that
    matters for the sign of A, as PPO's min does: sgn(A) min(sgn(A) l, sgn(A) clip(l)). A clipped token carries
    no gradient; the others are untouched."""
    sign = torch.sign(adv)
    return sign * torch.minimum(sign * log_ratio, sign * torch.clamp(log_ratio, -eps_low, eps_high))


def gmpo_surrogate(logp: Tensor, old_logp: Tensor, adv: Tensor, mask: Tensor, eps_low: float,
                   eps_high: float) -> Tensor:
    """GMPO: L_i = -A_i exp((1/|y_i|) sum_t l'_it), the geometric mean of the (clipped) token ratios times the
    sequence's advantage, broadcast to its tokens (so seq-mean-token-mean gives (1/B) sum_i L_i). With no token
    clipped, exp(mean_t l_it) is GSPO's s_i and L_i = -s_i A_i: GMPO equals GSPO wherever neither clips."""
    clipped = gmpo_log_ratio((logp - old_logp) * mask, adv, eps_low, eps_high)  # (B, T)
    return -torch.exp(masked_seq_mean(clipped, mask)).unsqueeze(-1) * adv  # (B, 1) * (B, 1) -> broadcast (B, T)


def vespo_weight(log_ratio: Tensor, adv: Tensor, mask: Tensor, k_pos: float, lambda_pos: float, k_neg: float,
                 lambda_neg: float, rollout_weight: Tensor | None = None) -> Tensor:
    """VESPO's kernel (2602.10693; TRL 1.16's get_gamma_weights): phi(W) = exp(lambda + k log W - lambda W), a gamma
    shape in the sequence's whole ratio W_i = exp(sum_t l_it) (the product of its token ratios, not GSPO's geometric
    mean), with phi(1) = 1; (k, lambda) = (k_pos, lambda_pos) where A >= 0, (k_neg, lambda_neg) where A < 0. phi
    peaks at W = k / lambda and falls toward 0 on both sides: the rule that plays the clip's part. As TRL, each l_it
    is bounded to [-20, 20] and log W to [log 1e-8, 20]. adv: (B, 1), or (B, T) per token. No gradient.

    With the token-level rollout correction, W is pi_theta / mu rather than pi_theta / pi_old: each token's bounded
    weight w_it = pi_old / mu joins the sum in log space, log w_it bounded to [log 1e-8, 20] (a masked token's w = 0
    then drops its whole sequence), as the paper's code and TRL fold it in, instead of multiplying the loss."""
    log_w = (torch.clamp(log_ratio.detach(), -20.0, 20.0) * mask).sum(-1, keepdim=True)  # (B, 1)
    if rollout_weight is not None:
        log_w = log_w + (torch.clamp(torch.log(rollout_weight), math.log(1e-8), 20.0) * mask).sum(-1, keepdim=True)
    log_w = torch.clamp(log_w, math.log(1e-8), 20.0)
    pos = adv >= 0
    k = torch.where(pos, torch.full_like(adv, k_pos), torch.full_like(adv, k_neg))
    lam = torch.where(pos, torch.full_like(adv, lambda_pos), torch.full_like(adv, lambda_neg))
    phi = torch.exp(lam + k * log_w - lam * torch.exp(log_w))  # (B, 1), or (B, T) with per-token advantages
    return torch.nan_to_num(phi, nan=0.0, posinf=0.0, neginf=0.0).detach()


def vespo_seq_weight(log_ratio: Tensor, adv_tok: Tensor, mask: Tensor, cfg: LossConfig) -> Tensor:
    """phi(W_i) of each sequence at its mean advantage, (B,): what VESPO's diagnostics read (not the rollout weight)."""
    return vespo_weight(log_ratio, masked_seq_mean(adv_tok, mask).unsqueeze(-1), mask, cfg.vespo_k_pos,
                        cfg.vespo_lambda_pos, cfg.vespo_k_neg, cfg.vespo_lambda_neg).squeeze(-1)


def vespo_surrogate(logp: Tensor, old_logp: Tensor, adv: Tensor, mask: Tensor, cfg: LossConfig,
                    rollout_weight: Tensor | None = None) -> Tensor:
    """VESPO: L_it = -sg(phi(W_i)) A_i log pi_theta(y_it), a REINFORCE gradient on every token, scaled by the kernel
    of its sequence's whole ratio (vespo_weight): near 1 close to pi_old, toward 0 as the sequence drifts either way."""
    phi = vespo_weight(logp - old_logp, adv, mask, cfg.vespo_k_pos, cfg.vespo_lambda_pos, cfg.vespo_k_neg,
                       cfg.vespo_lambda_neg, rollout_weight)
    return -phi * adv * logp


# Beyond the presets: dual-clip, and the entropy paper's Clip-Cov and KL-Cov


def dual_clip(loss: Tensor, adv: Tensor, c: float) -> Tensor:
    """Dual-clip PPO (Ye et al. 1912.09729; verl's clip_ratio_c, default 3): for A < 0 the clipped loss
    -min(w A, clip(w) A) = -A max(w, 1 - eps) grows without bound with w, the branch a stale ratio can blow up; it is
    capped there, L = min(L, -c A), and a capped unit gives no gradient. Units with A >= 0 are unchanged."""
    return torch.where(adv < 0, torch.minimum(loss, -c * adv), loss)


def dual_capped(loss: Tensor, adv: Tensor, c: float) -> Tensor:
    """Dual-clip's rule: the units whose loss it caps, A < 0 and the clipped loss above -c A."""
    return (adv < 0) & (loss > -c * adv)


COV_RATIO, CLIP_COV_LB, CLIP_COV_UB, KL_COV_COEF = 2e-4, 1.0, 5.0, 1.0  # verl's defaults for Clip-Cov and KL-Cov


def cov_tokens(n: int) -> int:
    """How many of n valid tokens the covariance rules act on: COV_RATIO of them, at least one (verl's), at most n."""
    return min(max(int(n * COV_RATIO), 1), n)


def token_covariance(logp: Tensor, adv: Tensor, mask: Tensor) -> Tensor:
    """Each token's centred covariance term (A_t - mean A)(log pi_t - mean log pi), means over the valid tokens: the
    entropy paper's (2505.22617) driver of entropy change; a few high-covariance tokens collapse entropy."""
    n = mask.sum()
    return (adv - (adv * mask).sum() / n) * (logp - (logp.detach() * mask).sum() / n)


def clip_cov_surrogate(logp: Tensor, old_logp: Tensor, adv: Tensor, mask: Tensor, eps_low: float, eps_high: float,
                       generator: torch.Generator | None = None) -> Tensor:
    """Clip-Cov (Cui et al. 2505.22617; verl's compute_policy_loss_clip_cov): PPO's clip, and in addition the
    gradient of a random COV_RATIO of the valid tokens is cut, drawn among those the clip left alone whose
    covariance lies in (CLIP_COV_LB, CLIP_COV_UB). The draw is torch.randperm's, from `generator`."""
    ratio = torch.exp(logp - old_logp)
    chosen = torch.nonzero(clip_cov_candidates(logp, old_logp, adv, mask, eps_low, eps_high))  # (k, 2)
    keep = torch.ones_like(logp)
    if len(chosen):
        picked = chosen[torch.randperm(len(chosen), generator=generator)[:cov_tokens(int(mask.sum().item()))]]
        keep[picked[:, 0], picked[:, 1]] = 0
    return clipped_surrogate(ratio, adv, eps_low, eps_high) * keep


def clip_cov_candidates(logp: Tensor, old_logp: Tensor, adv: Tensor, mask: Tensor, eps_low: float,
                        eps_high: float) -> Tensor:
    """Clip-Cov's rule: the tokens it may cut, valid ones the clip left alone (ppo_clipped) whose covariance lies
    in (CLIP_COV_LB, CLIP_COV_UB): (B, T) bool."""
    valid = mask > 0
    clipped = ppo_clipped(torch.exp(logp - old_logp), adv, eps_low, eps_high)
    cov = token_covariance(logp, adv, mask)
    return valid & ~clipped & (cov > CLIP_COV_LB) & (cov < CLIP_COV_UB)


def kl_cov_surrogate(logp: Tensor, old_logp: Tensor, adv: Tensor, mask: Tensor) -> Tensor:
    """KL-Cov (Cui et al. 2505.22617; verl's compute_policy_loss_kl_cov): no clip, L = -A rho; the top COV_RATIO of
    valid tokens by covariance get a penalty KL_COV_COEF |log rho| added, which holds them near pi_old."""
    log_ratio = logp - old_logp
    loss = -adv * torch.exp(log_ratio)
    valid = mask > 0
    a, lp = adv.expand_as(logp)[valid].detach(), logp[valid].detach()
    cov = (a - a.mean()) * (lp - lp.mean())
    top = torch.topk(cov, cov_tokens(len(cov))).indices
    flat = torch.nonzero(valid.reshape(-1), as_tuple=True)[0][top]  # positions in (B * T)
    penalty = torch.zeros(logp.numel(), dtype=logp.dtype, device=logp.device)
    penalty[flat] = 1.0
    return loss + KL_COV_COEF * log_ratio.abs() * penalty.view_as(logp)


def surrogate_loss(logp: Tensor, old_logp: Tensor, adv: Tensor, mask: Tensor, cfg: LossConfig,
                   generator: torch.Generator | None = None, rollout_weight: Tensor | None = None) -> Tensor:
    """Per-token losses (B, T) of the configured treatment of the ratio: PPO's clip, CISPO's capped stop-gradient
    weight, SAPO's soft gate, GMPO's clipped geometric mean, VESPO's kernel, or the entropy paper's Clip-Cov and
    KL-Cov. (LUSPO is PPO's clip at sequence level: it differs from GSPO in its aggregation.) rollout_weight: the
    rollout correction's w, which VESPO alone reads here (policy_loss multiplies the others' losses by it)."""
    if cfg.surrogate == "clip_cov":
        return clip_cov_surrogate(logp, old_logp, adv.expand_as(logp), mask, cfg.epsilon, cfg.epsilon_high, generator)
    if cfg.surrogate == "kl_cov":
        return kl_cov_surrogate(logp, old_logp, adv, mask)
    if cfg.surrogate == "gmpo":
        return gmpo_surrogate(logp, old_logp, adv, mask, cfg.epsilon, cfg.epsilon_high).expand_as(logp)
    if cfg.surrogate == "vespo":
        return vespo_surrogate(logp, old_logp, adv, mask, cfg, rollout_weight)
    w = importance_weights(logp, old_logp, mask, cfg.importance_sampling_level)  # (B, T)
    if cfg.surrogate == "cispo":
        return cispo_surrogate(logp, w, adv, cfg.epsilon, cfg.epsilon_high)
    if cfg.surrogate == "sapo":
        return sapo_surrogate(w, adv, cfg.sapo_tau_pos, cfg.sapo_tau_neg)
    if cfg.surrogate == "clip":
        loss = clipped_surrogate(w, adv, cfg.epsilon, cfg.epsilon_high)
        return loss if cfg.clip_ratio_c is None else dual_clip(loss, adv, cfg.clip_ratio_c)
    raise ValueError(f"unknown surrogate {cfg.surrogate!r}; use clip, cispo, sapo, gmpo, vespo, clip_cov or kl_cov")


# ---------------------------------------------------------------------------------------------------------------
# 5. The KL to the reference
# ---------------------------------------------------------------------------------------------------------------


def kl_estimate(logp: Tensor, ref_logp: Tensor, estimator: KLEstimator = "k3") -> Tensor:
    """Per-token estimates of KL(pi_theta || pi_ref) from tokens sampled by pi_theta (Schulman, "Approximating KL
    divergence", 2020), with d = log pi_ref - log pi_theta:
        k1 = -d                 unbiased, high variance, can be negative; its gradient is the score function's
        k2 = d^2 / 2            biased, low variance, >= 0
        k3 = exp(d) - d - 1     unbiased, >= 0: GRPO's (DeepSeekMath eq. 4), verl's "low_var_kl"
    As a loss term the k3 gradient is biased unless weighed by pi_theta / pi_old ("Comedy of Estimators",
    2512.21852; DeepSeek-V3.2): see policy_loss's kl_ratio_correction."""
    d = ref_logp - logp
    if estimator == "k1":
        return -d
    if estimator == "k2":
        return d ** 2 / 2
    return torch.exp(d) - d - 1


def k3_kl(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """k3 estimator of KL(pi_theta || pi_ref) per token: exp(ref - logp) - (ref - logp) - 1 >= 0."""
    return kl_estimate(logp, ref_logp, "k3")


def kl_in_reward(sampler_logp: Tensor, ref_logp: Tensor, mask: Tensor, estimator: KLEstimator) -> Tensor:
    """The KL penalty taken from each completion's reward when kl_in is "reward" (verl's use_kl_in_reward, PPO-RLHF):
    r_i <- r_i - beta * sum_t KL_it, the KL estimated on the sampled tokens under the policy that sampled them.
    Returns sum_t KL_it: (B,). It carries no gradient: it acts through the advantages."""
    return (kl_estimate(sampler_logp, ref_logp, estimator) * mask).sum(-1)


# ---------------------------------------------------------------------------------------------------------------
# 6. Aggregation
# ---------------------------------------------------------------------------------------------------------------


def aggregate(per_token: Tensor, mask: Tensor, mode: AggMode, norm: StepNorm) -> Tensor:
    """Turn per-token losses (B, T) into the step's scalar; each mode divides by step-level constants.

    seq-mean-token-mean       (1/B) sum_i (1/|y_i|) sum_t L_it     GRPO, GSPO: a long answer's tokens weigh less
    token-mean                (1/sum_i |y_i|) sum_it L_it         DAPO: every token of the step weighs the same
    seq-mean-token-sum-norm   (1/(B * max_new_tokens)) sum_it L_it Dr.GRPO: a constant; no length re-weights
    seq-mean-token-sum        (1/B) sum_i sum_t L_it              LUSPO: a sequence's L_i counts |y_i| times
    """
    masked = per_token * mask
    if mode == "seq-mean-token-mean":
        return (masked.sum(-1) / mask.sum(-1).clamp(min=1)).sum() / norm.num_seqs
    if mode == "token-mean":
        return masked.sum() / max(norm.num_tokens, 1)
    if mode == "seq-mean-token-sum-norm":
        return masked.sum() / (norm.num_seqs * norm.max_new_tokens)
    if mode == "seq-mean-token-sum":
        return masked.sum() / norm.num_seqs
    raise ValueError(f"unknown loss_agg_mode {mode!r}; use seq-mean-token-mean, token-mean, seq-mean-token-sum-norm "
                     "or seq-mean-token-sum")


# ---------------------------------------------------------------------------------------------------------------
# 7. The loss of a micro-batch
# ---------------------------------------------------------------------------------------------------------------


def policy_loss(
    logp: Tensor,  # (B, T) log pi_theta of the completion tokens, with gradient
    old_logp: Tensor,  # (B, T) log pi_old, the sampling policy before this rollout's first update
    advantages: Tensor,  # (B,) one per sequence, or (B, T) one per token
    mask: Tensor,  # (B, T) 1 for completion tokens up to and including the first EOS
    norm: StepNorm,  # normalisers of the whole optimizer step
    cfg: LossConfig,  # checked once at start-up (runs.resolve calls check_config), not here
    ref_logp: Tensor | None = None,  # (B, T) log pi_ref; needed only when cfg.beta > 0
    rollout_weight: Tensor | None = None,  # (B, T) or (B, 1): rollout_correction_weights, applied before the KL
    entropy: Tensor | None = None,  # (B, T) pi_theta's per-token entropy (with gradient for the entropy bonus)
    generator: torch.Generator | None = None,  # Clip-Cov's random draw
) -> Tensor:
    """The loss of one micro-batch: per unit the surrogate of `cfg.surrogate` (see surrogate_loss), times the
    rollout correction's weight if any, plus beta times the KL estimate on every token (with kl_in "loss"; times
    the importance ratio with kl_ratio_correction), aggregated by loss_agg_mode; with top_entropy_quantile < 1 the
    policy term only on the highest-entropy tokens; with entropy_coef, minus coef times their mean entropy (TRL 1.16's
    bonus: a mean over the micro-batch's trained tokens, divided by the step's number of micro-batches).

    clip   (GRPO, Dr.GRPO, DAPO at token level; GSPO at sequence level, where w = s_i and L_it = L_i on every token)
        L_u = -min(w_u A_u, clip(w_u, 1-eps, 1+eps_high) A_u)
    cispo  L_it = -sg(clip(rho_it, 1-eps, 1+eps_high)) A_i log pi_theta(y_it)
    sapo   L_it = -f(rho_it) A_i,  f(rho) = sigmoid(tau (rho - 1)) 4 / tau,  tau = tau_pos if A > 0 else tau_neg
    gmpo   L_i = -A_i exp((1/|y_i|) sum_t l'_it),  l'_it = l_it clipped to [-eps, eps_high] on the side A's sign picks
    luspo  GSPO's L_i, aggregated by seq-mean-token-sum: (1/B) sum_i |y_i| L_i
    vespo  L_it = -sg(phi(W_i)) A_i log pi_theta(y_it),  W_i = prod_t rho_it,  phi(W) = e^lambda W^k e^(-lambda W)

    Summing the returned losses of the micro-batches of a step (each with the step's `norm`) gives exactly the
    loss of the whole step. The ratio and clip statistics of the update are `ratio_diagnostics`, computed once per
    update over every row it scored.
    """
    mask = mask.to(logp.dtype)
    adv = advantages if advantages.dim() == 2 else advantages.unsqueeze(-1)  # (B, T) or (B, 1)
    per_token = surrogate_loss(logp, old_logp, adv, mask, cfg, generator, rollout_weight)  # (B, T)
    effective = trained_tokens(entropy, mask, cfg.top_entropy_quantile)  # (B, T)
    if cfg.top_entropy_quantile < 1.0:  # only the highest-entropy tokens keep their policy loss (not the KL)
        per_token = per_token * effective
    if rollout_weight is not None and cfg.surrogate != "vespo":  # L_it <- w L_it (not the KL below, as in TRL;
        # VESPO folded w into its kernel)
        per_token = per_token * rollout_weight
    if cfg.beta > 0 and cfg.kl_in == "loss":
        if ref_logp is None:
            raise ValueError("beta > 0 needs reference log-probs (ref_logp); set beta=0 to train without KL")
        kl = kl_estimate(logp, ref_logp, cfg.kl_estimator)  # (B, T)
        if cfg.kl_ratio_correction:  # KL_it * w_it, w the (unclipped, differentiable) ratio at the objective's level
            kl = kl * importance_weights(logp, old_logp, mask, cfg.importance_sampling_level)
        per_token = per_token + cfg.beta * kl
    loss = aggregate(per_token, mask, cfg.loss_agg_mode, norm)
    if cfg.entropy_coef != 0.0:  # L - coef H, H the mean entropy over the trained tokens of each micro-batch (TRL's)
        loss = loss - cfg.entropy_coef * (entropy * effective).sum() / effective.sum().clamp(min=1) / norm.micro_batches
    return loss


# ---------------------------------------------------------------------------------------------------------------
# 8. Options that act on the loss: the rollout correction, the entropy controls
# ---------------------------------------------------------------------------------------------------------------


def rollout_correction_weights(old_logp: Tensor, sampler_logp: Tensor, mask: Tensor, mode: str,
                               c_min: float | None = None, c_max: float | None = 3.0) -> Tensor:
    """Train-inference mismatch correction: w = pi_old / mu, mu the distribution the sampler drew from (a cached
    bf16 decode, an inference engine), pi_old the trainer's recomputed one; the per-token loss is multiplied by w.
    As TRL 1.16's vLLM importance-sampling correction (GRPOTrainer._generate_and_score_completions):

        token_*     w_it = exp(log pi_old(y_it) - log mu(y_it))                  (B, T)
        sequence_*  w_i = exp(sum_t (log pi_old(y_it) - log mu(y_it)))           (B, 1), the product of token ratios
        *_truncate  w <- clamp(w, c_min, c_max)                                  truncated IS (TIS)
        *_mask      w <- 0 where w < c_min or w > c_max                          masked IS (MIS; IcePop per token)

    No gradient flows through w (both log-probs are fixed for the update)."""
    level, kind = mode.split("_")
    return bound_rollout_ratio(rollout_ratio(old_logp, sampler_logp, mask, level), kind, c_min, c_max)


def rollout_ratio(old_logp: Tensor, sampler_logp: Tensor, mask: Tensor, level: str) -> Tensor:
    """w = pi_old / mu, unbounded: per token (B, T), or per sequence (B, 1) as the product of its token ratios."""
    diff = (old_logp - sampler_logp) * mask  # (B, T)
    return torch.exp(diff.sum(-1, keepdim=True) if level == "sequence" else diff)


def bound_rollout_ratio(w: Tensor, kind: str, c_min: float | None, c_max: float | None) -> Tensor:
    """truncate: w clamped to [c_min, c_max]; mask: 0 where w lies outside it (a missing bound is no bound)."""
    if kind == "truncate":
        return torch.clamp(w, min=c_min, max=c_max)
    low = -math.inf if c_min is None else c_min
    high = math.inf if c_max is None else c_max
    return w.masked_fill((w < low) | (w > high), 0.0)


def high_entropy_mask(entropy: Tensor, mask: Tensor, quantile: float) -> Tensor:
    """The "80/20" token selection (Wang et al. 2506.01939; TRL's top_entropy_quantile): 1 for the valid tokens whose
    entropy is at least the (1 - quantile) quantile of the valid tokens' entropies (linear interpolation, torch's),
    0 elsewhere; the policy term then trains on the highest-entropy `quantile` of tokens, the "forks" of reasoning.
    entropy, mask: (B, T) -> (B, T) in {0, 1}."""
    valid = entropy[mask.bool()].float()
    if valid.numel() == 0:
        return torch.zeros_like(mask)
    threshold = torch.quantile(valid, 1 - quantile)
    return ((entropy * mask >= threshold) & mask.bool()).to(mask.dtype)


def trained_tokens(entropy: Tensor | None, mask: Tensor, quantile: float) -> Tensor:
    """The tokens the policy term trains on: every valid one, or with quantile < 1 the high-entropy ones."""
    return mask if quantile >= 1.0 else mask * high_entropy_mask(entropy.detach(), mask, quantile)


@dataclass
class AdaptiveEntropy:
    """Skywork-OR1's adaptive entropy control (2505.22312; TRL 1.16's use_adaptive_entropy, its defaults): the bonus
    coefficient c applies only while the last optimizer step's mean entropy H (over the trained tokens of every
    micro-batch and process) is at or below `target`; after each step c += delta if H <= target else c -= delta,
    kept in [low, high]. State, kept in checkpoints: c and the last H (inf before the first step: no bonus yet)."""
    coef: float
    target: float
    last_entropy: float = math.inf
    delta: float = 0.005
    low: float = 0.0
    high: float = 1.0
    window: tuple = (0.0, 0.0)  # this step's (sum of H over trained tokens, their count), so far
    bonus: tuple = (0.0, 0.0)  # since the last logs: (sum over optimizer steps of applied c x entropy sum, tokens)

    def applied(self) -> float:
        return self.coef if self.last_entropy <= self.target else 0.0

    def observe(self, entropy: Tensor, trained: Tensor) -> None:
        self.window = (self.window[0] + float((entropy * trained).sum()), self.window[1] + float(trained.sum()))

    def after_step(self, records: list, mask: Tensor, quantile: float, total=lambda v: v) -> None:
        """Observe one optimizer step's micro-batches, records of (rows, log-probs, entropy), then end it."""
        for rows, _, entropy in records:
            self.observe(entropy, trained_tokens(entropy, mask[rows], quantile))
        self.end_step(total)

    def end_step(self, total=lambda v: v) -> None:
        """After an optimizer step; `total` sums a list over processes (World.sum)."""
        entropy_sum, count = total(list(self.window))
        self.bonus = (self.bonus[0] + self.applied() * entropy_sum, self.bonus[1] + count)  # what this step's loss added
        self.last_entropy, self.window = entropy_sum / max(count, 1.0), (0.0, 0.0)
        step = self.delta if self.last_entropy <= self.target else -self.delta
        self.coef = min(max(self.coef + step, self.low), self.high)

    def logged(self) -> dict[str, float]:
        """For the logs after an update: the coefficient now, and the bonus its optimizer steps applied (each step's
        applied c times its trained tokens' entropy, over all their tokens: entropy/bonus, as with a fixed
        --entropy-coef); the bonus's sums start again."""
        (weighted, tokens), self.bonus = self.bonus, (0.0, 0.0)
        return {"entropy/coef": self.coef, "entropy/bonus": weighted / max(tokens, 1.0)}


# ---------------------------------------------------------------------------------------------------------------
# 9. The config check (once, at start-up)
# ---------------------------------------------------------------------------------------------------------------


def check_config(cfg: LossConfig, per_token_advantages: bool = False) -> None:
    """Combinations the maths does not define, each as a ValueError that says what to use instead."""
    if cfg.surrogate == "cispo" and cfg.importance_sampling_level != "token":
        raise ValueError("CISPO weights each token's log-probability by its own capped ratio; a sequence-level "
                         "weight is not defined for it (TRL refuses it too): use --importance-sampling-level token")
    if cfg.surrogate == "vespo" and cfg.importance_sampling_level != "token":
        raise ValueError("VESPO computes its own weight from the product of each sequence's token ratios; another "
                         "ratio level is not defined for it: use --importance-sampling-level token (TRL's setting)")
    if cfg.surrogate == "vespo" and (min(cfg.vespo_lambda_pos, cfg.vespo_lambda_neg) <= 0
                                     or min(cfg.vespo_k_pos, cfg.vespo_k_neg) < 0):
        raise ValueError("VESPO's kernel needs lambda > 0 and k >= 0 (--vespo-lambda-pos/-neg, --vespo-k-pos/-neg; "
                         "the paper's 3, 2 and 2, 3)")
    if cfg.surrogate == "gmpo" and cfg.importance_sampling_level != "sequence":
        raise ValueError("GMPO's weight is one per sequence (the geometric mean of its clipped token ratios): use "
                         "--importance-sampling-level sequence")
    if per_token_advantages and (cfg.importance_sampling_level == "sequence"):
        raise ValueError("sequence-level importance sampling needs one advantage per sequence; "
                         "use importance_sampling_level='sequence_token' for per-token advantages")
    if cfg.surrogate in ("clip_cov", "kl_cov") and cfg.importance_sampling_level != "token":
        raise ValueError(f"{cfg.surrogate} acts on single tokens (their covariance with the advantage): use "
                         "--importance-sampling-level token")
    if cfg.clip_ratio_c is not None and cfg.surrogate != "clip":
        raise ValueError(f"dual-clip (--clip-ratio-c) caps PPO's clip surrogate; {cfg.surrogate} bounds its ratio its "
                         "own way: drop --clip-ratio-c (or use --surrogate clip)")
    if cfg.clip_ratio_c is not None and cfg.clip_ratio_c <= 1:
        raise ValueError(f"--clip-ratio-c must be above 1 (got {cfg.clip_ratio_c:g}; verl's default is 3): the cap "
                         "-c A must lie above the clip's own -A (1 - epsilon)")
    if not 0.0 < cfg.top_entropy_quantile <= 1.0:
        raise ValueError(f"--top-entropy-quantile is the fraction of tokens kept, in (0, 1] (got "
                         f"{cfg.top_entropy_quantile:g}; the 80/20 paper keeps 0.2)")
    if cfg.kl_ratio_correction and cfg.kl_in == "reward":
        raise ValueError("--kl-ratio-correction weighs the loss's KL term by the importance ratio; with --kl-in "
                         "reward there is no KL term in the loss: drop one of the two")
    if cfg.surrogate == "sapo" and min(cfg.sapo_tau_pos, cfg.sapo_tau_neg) <= 0:
        raise ValueError("SAPO's temperatures (--sapo-tau-pos, --sapo-tau-neg) must be > 0")


# ---------------------------------------------------------------------------------------------------------------
# 10. Diagnostics: what the GSPO paper is about, read from the rules above
# ---------------------------------------------------------------------------------------------------------------


def masked_mean(x: Tensor, mask: Tensor) -> float:
    return float((x * mask).sum() / mask.sum().clamp(min=1))


def masked_var(x: Tensor, mask: Tensor) -> float:
    """Population variance over valid entries (0 when fewer than two)."""
    n = mask.sum()
    if n < 2:
        return 0.0
    mean = (x * mask).sum() / n
    return float((((x - mean) * mask) ** 2).sum() / n)


def clip_fractions(w: Tensor, adv: Tensor, eps_low: float, eps_high: float, valid: Tensor) -> tuple[float, float]:
    """Fractions of valid units where PPO's clip binds (ppo_clipped), on the low side (A < 0) and the high (A > 0)."""
    clipped = ppo_clipped(w, adv, eps_low, eps_high) & valid
    n = valid.sum().clamp(min=1)
    return float((clipped & (adv < 0)).sum() / n), float((clipped & (adv > 0)).sum() / n)


def dual_clip_fraction(w: Tensor, adv: Tensor, cfg: LossConfig, mask: Tensor) -> float:
    """Fraction of the units (tokens; all of a sequence's at sequence level) whose loss dual-clip capped: A < 0 and
    the clip surrogate above -c A. w, adv and mask broadcast to (B, T)."""
    loss = clipped_surrogate(w, adv, cfg.epsilon, cfg.epsilon_high)
    return masked_mean(dual_capped(loss, adv, cfg.clip_ratio_c).float().expand_as(mask), mask)


def cov_fraction(logp: Tensor, old_logp: Tensor, adv: Tensor, mask: Tensor, cfg: LossConfig) -> float:
    """The share of valid tokens Clip-Cov cuts (min(COV_RATIO n, the candidates)) or KL-Cov penalises: a count,
    whichever tokens the draw picks."""
    n = int(mask.sum())
    if cfg.surrogate == "kl_cov":
        return cov_tokens(n) / max(n, 1)
    candidates = int(clip_cov_candidates(logp, old_logp, adv, mask, cfg.epsilon, cfg.epsilon_high).sum())
    return min(cov_tokens(n), candidates) / max(n, 1)


def clip_fraction_of(cfg: LossConfig, log_ratio: Tensor, adv_tok: Tensor, mask: Tensor) -> float:
    """The fraction of units that `cfg` would clip: tokens at token level, sequences at sequence level. For the
    successors, what plays the clip's part: CISPO's capped weights, the units SAPO's gate leaves under half their
    gradient (f'(w) < 0.5), GMPO's clipped token log-ratios, the sequences VESPO's kernel leaves under half their
    gradient (phi(W) < 0.5; sequences at any level)."""
    valid = mask > 0
    if cfg.surrogate == "kl_cov":  # no clip: the share of tokens it penalises
        return cov_tokens(int(valid.sum())) / max(int(valid.sum()), 1)
    if cfg.surrogate == "cispo":
        rho = torch.exp(log_ratio)
        capped = (cispo_weight(rho, cfg.epsilon, cfg.epsilon_high) != rho) & valid
        return float(capped.sum() / valid.sum().clamp(min=1))
    if cfg.surrogate == "gmpo":  # sign-aware like PPO's: a token with A = 0 has no side to clip (sgn(0) = 0 would
        # zero its l'_it, a change that carries no gradient, so it is not counted)
        changed = gmpo_log_ratio(log_ratio, adv_tok, cfg.epsilon, cfg.epsilon_high) != log_ratio
        clipped = changed & (adv_tok != 0) & valid
        return float(clipped.sum() / valid.sum().clamp(min=1))
    if cfg.surrogate == "vespo":
        seqs = mask.sum(-1) > 0
        return float(((vespo_seq_weight(log_ratio, adv_tok, mask, cfg) < 0.5) & seqs).sum() / seqs.sum().clamp(min=1))
    if cfg.surrogate == "sapo":
        if cfg.importance_sampling_level == "token":
            low = (sapo_gate_slope(torch.exp(log_ratio), adv_tok, cfg) < 0.5) & valid
            return float(low.sum() / valid.sum().clamp(min=1))
        s, a = torch.exp(masked_seq_mean(log_ratio, mask)), masked_seq_mean(adv_tok, mask)  # (B,)
        seqs = mask.sum(-1) > 0
        return float(((sapo_gate_slope(s, a, cfg) < 0.5) & seqs).sum() / seqs.sum().clamp(min=1))
    if cfg.importance_sampling_level == "token":
        low, high = clip_fractions(torch.exp(log_ratio), adv_tok, cfg.epsilon, cfg.epsilon_high, mask > 0)
    else:
        s = torch.exp(masked_seq_mean(log_ratio, mask))  # (B,)
        a = masked_seq_mean(adv_tok, mask)  # (B,) the sequence's advantage
        low, high = clip_fractions(s, a, cfg.epsilon, cfg.epsilon_high, mask.sum(-1) > 0)
    return low + high


def ratio_diagnostics(logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor, cfg: LossConfig) -> dict:
    """Ratio statistics and clip fractions of a batch, whatever objective trains on it.

    ratio/token_*        rho_it over valid tokens
    ratio/seq_*          GSPO's s_i over sequences
    ratio/seq_logsum_var variance over sequences of sum_t l_it, the log of the unnormalised product of token
                         ratios: it grows with length (as |y| sigma^2 for i.i.d. token noise), log s_i shrinks.
    ratio/abs_log_token  mean |l_it| over tokens, ratio/abs_log_seq mean |log s_i| over sequences: how far the
                         ratios have left 1 (the study's manipulation check for staleness)
    clip/token_*         clip fractions over tokens with the run's epsilon; clip/seq_* over sequences
    clip/seq_token_frac  the sequence-level clip in the GSPO paper's unit: the share of tokens that lie in the
                         sequences it clips (a clipped sequence clips all its tokens)
    clip/frac            the fraction the trained objective actually clips (token or sequence units; for CISPO,
                         SAPO, GMPO and VESPO what plays the clip's part: see clip_fraction_of)
    approx_kl            k3 estimate of KL(pi_old || pi_theta) per token
    clip/dual_frac       with dual-clip (clip_ratio_c): the fraction of tokens whose loss it capped
    clip/cov_frac        with Clip-Cov / KL-Cov: the fraction of tokens whose gradient it cut / that it penalised
    clip/vespo_phi_mean  with VESPO: its kernel phi(W_i), the weight on each sequence's gradient, mean over sequences
    The study's own instrumentation (what every preset would clip, SAPO's gate, length buckets) is in metrics.py.
    """
    mask = mask.to(logp.dtype)
    valid_tok, valid_seq = mask > 0, mask.sum(-1) > 0
    log_ratio = (logp - old_logp) * mask  # (B, T)
    adv_tok = (advantages if advantages.dim() == 2 else advantages.unsqueeze(-1)).expand_as(logp)  # (B, T)
    rho = torch.exp(log_ratio)  # (B, T)
    log_s = masked_seq_mean(log_ratio, mask)  # (B,)
    seq_mask = valid_seq.to(logp.dtype)
    a_seq = masked_seq_mean(adv_tok, mask)  # (B,)
    tok_low, tok_high = clip_fractions(rho, adv_tok, cfg.epsilon, cfg.epsilon_high, valid_tok)
    seq_low, seq_high = clip_fractions(torch.exp(log_s), a_seq, cfg.epsilon, cfg.epsilon_high, valid_seq)
    diag = {
        "ratio/token_mean": masked_mean(rho, mask),
        "ratio/token_var": masked_var(rho, mask),
        "ratio/seq_mean": masked_mean(torch.exp(log_s), seq_mask),
        "ratio/seq_var": masked_var(torch.exp(log_s), seq_mask),
        "ratio/seq_logsum_var": masked_var(log_ratio.sum(-1), seq_mask),
        "ratio/abs_log_token": masked_mean(log_ratio.abs(), mask),
        "ratio/abs_log_seq": masked_mean(log_s.abs(), seq_mask),
        "clip/token_low": tok_low,
        "clip/token_high": tok_high,
        "clip/token_frac": tok_low + tok_high,
        "clip/seq_low": seq_low,
        "clip/seq_high": seq_high,
        "clip/seq_frac": seq_low + seq_high,
        "clip/seq_token_frac": masked_mean((ppo_clipped(torch.exp(log_s), a_seq, cfg.epsilon, cfg.epsilon_high)
                                            & valid_seq).to(mask.dtype).unsqueeze(-1).expand_as(mask), mask),
        "clip/frac": clip_fraction_of(cfg, log_ratio, adv_tok, mask),
        "approx_kl": masked_mean(torch.exp(log_ratio) - 1 - log_ratio, mask),
    }
    if cfg.surrogate in ("clip_cov", "kl_cov"):  # the tokens the covariance rule cut (Clip-Cov) or penalised (KL-Cov)
        diag["clip/cov_frac"] = cov_fraction(logp, old_logp, adv_tok, mask, cfg)
    if cfg.surrogate == "vespo":  # the kernel's weight on each sequence (1 on-policy)
        diag["clip/vespo_phi_mean"] = masked_mean(vespo_seq_weight(log_ratio, adv_tok, mask, cfg), seq_mask)
    if cfg.clip_ratio_c is not None:  # what dual-clip capped: the units with A < 0 whose loss it bounded
        w = importance_weights(logp, old_logp, mask, cfg.importance_sampling_level)
        diag["clip/dual_frac"] = dual_clip_fraction(w, adv_tok, cfg, mask)
    return diag
