"""The four objectives (GRPO, Dr.GRPO, DAPO, GSPO), side by side, and the diagnostics that tell them apart.

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
    beta                        weight of the k3 estimate of KL(pi_theta || pi_ref), added to every L_it

and one choice made before the loss, in `group_advantages`: divide by the group's reward std or not.

Each unit u (a token, or a whole sequence at sequence level) has the PPO clipped surrogate

    L_u = -min( w_u A_u, clip(w_u, 1 - epsilon, 1 + epsilon_high) A_u ).

| --algo   | level    | epsilon / high | advantage          | loss_agg_mode            | beta |
| grpo     | token    | 0.2 / 0.2      | (r - mean) / std   | seq-mean-token-mean      | 0.04 |
| dr_grpo  | token    | 0.2 / 0.2      | r - mean           | seq-mean-token-sum-norm  | 0    |
| dapo     | token    | 0.2 / 0.28     | (r - mean) / std   | token-mean               | 0    |
| gspo     | sequence | 3e-4 / 4e-4    | (r - mean) / std   | seq-mean-token-mean      | 0    |
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

ImportanceLevel = Literal["token", "sequence", "sequence_token"]
AggMode = Literal["seq-mean-token-mean", "token-mean", "seq-mean-token-sum-norm"]


@dataclass(frozen=True)
class LossConfig:
    importance_sampling_level: ImportanceLevel = "token"
    loss_agg_mode: AggMode = "seq-mean-token-mean"
    epsilon: float = 0.2
    epsilon_high: float = 0.2
    beta: float = 0.0
    scale_rewards: bool = True  # divide advantages by the group's reward std (False: Dr.GRPO)


PRESETS: dict[str, LossConfig] = {
    # DeepSeekMath (2402.03300): PPO's token ratio, per-sequence length normalisation, std-scaled advantages, KL.
    "grpo": LossConfig("token", "seq-mean-token-mean", 0.2, 0.2, beta=0.04, scale_rewards=True),
    # Dr.GRPO (2503.20783): no 1/|y_i| and no 1/std, so neither length nor difficulty re-weights a token.
    "dr_grpo": LossConfig("token", "seq-mean-token-sum-norm", 0.2, 0.2, beta=0.0, scale_rewards=False),
    # DAPO (2503.14476): clip-higher, every token of the step weighted equally (plus dynamic sampling and
    # overlong shaping, which act on the batch and the reward: see train.py and rewards.py).
    "dapo": LossConfig("token", "token-mean", 0.2, 0.28, beta=0.0, scale_rewards=True),
    # GSPO (2507.18071): one length-normalised ratio per sequence, clipped as a whole, in a very narrow range.
    "gspo": LossConfig("sequence", "seq-mean-token-mean", 3e-4, 4e-4, beta=0.0, scale_rewards=True),
}


@dataclass(frozen=True)
class StepNorm:
    """Normalisers of a whole optimizer step, so that splitting it into micro-batches changes nothing.

    A micro-batch that normalised by its own counts would weight the tokens of short micro-batches more.
    """

    num_seqs: int  # B: sequences in the optimizer step
    num_tokens: int  # sum_i |y_i| over the optimizer step
    max_new_tokens: int  # Dr.GRPO's constant: the generation budget, whatever the actual lengths

    @staticmethod
    def of(mask: Tensor, max_new_tokens: int) -> "StepNorm":
        return StepNorm(mask.shape[0], int(mask.sum().item()), max_new_tokens)


# ---------------------------------------------------------------------------------------------------------------
# Advantages
# ---------------------------------------------------------------------------------------------------------------


def group_advantages(rewards: Tensor, group_size: int, scale: bool = True, eps: float = 1e-4) -> Tensor:
    """A_i = (r_i - mean_G(r)) / (std_G(r) + eps), or r_i - mean_G(r) when `scale` is False (Dr.GRPO).

    rewards: (B,) with the G completions of a prompt in consecutive rows. std is the unbiased (N-1) estimate.
    A group whose rewards are all equal gets A = 0 exactly: its numerator is exactly 0.
    """
    r = rewards.view(-1, group_size)  # (P, G)
    centred = r - r.mean(dim=1, keepdim=True)
    if scale:
        centred = centred / (r.std(dim=1, keepdim=True) + eps)
    return centred.reshape(-1)  # (B,)


# ---------------------------------------------------------------------------------------------------------------
# Ratios, surrogate, aggregation
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


def clipped_surrogate(w: Tensor, adv: Tensor, eps_low: float, eps_high: float) -> Tensor:
    """L = -min(w A, clip(w, 1 - eps_low, 1 + eps_high) A), elementwise."""
    return -torch.minimum(w * adv, torch.clamp(w, 1 - eps_low, 1 + eps_high) * adv)


def k3_kl(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """k3 estimator of KL(pi_theta || pi_ref) per token: exp(ref - logp) - (ref - logp) - 1 >= 0."""
    d = ref_logp - logp
    return torch.exp(d) - d - 1


def aggregate(per_token: Tensor, mask: Tensor, mode: AggMode, norm: StepNorm) -> Tensor:
    """Turn per-token losses (B, T) into the step's scalar; each mode divides by step-level constants.

    seq-mean-token-mean       (1/B) sum_i (1/|y_i|) sum_t L_it     GRPO, GSPO: a long answer's tokens weigh less
    token-mean                (1/sum_i |y_i|) sum_it L_it         DAPO: every token of the step weighs the same
    seq-mean-token-sum-norm   (1/(B * max_new_tokens)) sum_it L_it Dr.GRPO: a constant; no length re-weights
    """
    masked = per_token * mask
    if mode == "seq-mean-token-mean":
        return (masked.sum(-1) / mask.sum(-1).clamp(min=1)).sum() / norm.num_seqs
    if mode == "token-mean":
        return masked.sum() / max(norm.num_tokens, 1)
    if mode == "seq-mean-token-sum-norm":
        return masked.sum() / (norm.num_seqs * norm.max_new_tokens)
    raise ValueError(f"unknown loss_agg_mode {mode!r}; use seq-mean-token-mean, token-mean or seq-mean-token-sum-norm")


def policy_loss(
    logp: Tensor,  # (B, T) log pi_theta of the completion tokens, with gradient
    old_logp: Tensor,  # (B, T) log pi_old, the sampling policy before this rollout's first update
    advantages: Tensor,  # (B,) one per sequence, or (B, T) one per token
    mask: Tensor,  # (B, T) 1 for completion tokens up to and including the first EOS
    norm: StepNorm,  # normalisers of the whole optimizer step
    cfg: LossConfig,
    ref_logp: Tensor | None = None,  # (B, T) log pi_ref; needed only when cfg.beta > 0
    diagnostics: bool = True,  # False skips them (the training loop computes them once over the whole update)
) -> tuple[Tensor, dict[str, float]]:
    """The clipped policy-gradient loss of one micro-batch, and its diagnostics.

    token level (GRPO, Dr.GRPO, DAPO):
        L_it = -min(rho_it A_it, clip(rho_it, 1-eps, 1+eps_high) A_it) + beta KL_it,   aggregated by loss_agg_mode
    sequence level (GSPO):
        L_i = -min(s_i A_i, clip(s_i, 1-eps, 1+eps_high) A_i) + beta mean_t KL_it, as L_it = L_i on every token,
        so "seq-mean-token-mean" gives GSPO's (1/B) sum_i L_i.

    Summing the returned losses of the micro-batches of a step (each with the step's `norm`) gives exactly the
    loss of the whole step.
    """
    mask = mask.to(logp.dtype)
    adv = advantages if advantages.dim() == 2 else advantages.unsqueeze(-1)  # (B, T) or (B, 1)
    if cfg.importance_sampling_level == "sequence" and advantages.dim() == 2:
        raise ValueError("sequence-level importance sampling needs one advantage per sequence; "
                         "use importance_sampling_level='sequence_token' for per-token advantages")
    w = importance_weights(logp, old_logp, mask, cfg.importance_sampling_level)  # (B, T)
    per_token = clipped_surrogate(w, adv, cfg.epsilon, cfg.epsilon_high)  # (B, T)
    if cfg.beta > 0:
        if ref_logp is None:
            raise ValueError("beta > 0 needs reference log-probs (ref_logp); set beta=0 to train without KL")
        per_token = per_token + cfg.beta * k3_kl(logp, ref_logp)
    loss = aggregate(per_token, mask, cfg.loss_agg_mode, norm)
    if not diagnostics:
        return loss, {}
    with torch.no_grad():
        diag = ratio_diagnostics(logp.detach(), old_logp, advantages, mask, cfg)
        if cfg.beta > 0:
            diag["kl_ref"] = masked_mean(k3_kl(logp.detach(), ref_logp), mask)
    return loss, diag


# ---------------------------------------------------------------------------------------------------------------
# Diagnostics: what the GSPO paper is about
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
    """Fractions of valid units where clipping binds, i.e. changes the gradient (low, high).

    low binds when w < 1 - eps_low and A < 0; high when w > 1 + eps_high and A > 0. A ratio out of range on the
    other side (w < 1 - eps with A > 0, say) is not clipped: the min keeps the unclipped term and its gradient.
    """
    low = (w < 1 - eps_low) & (adv < 0) & valid
    high = (w > 1 + eps_high) & (adv > 0) & valid
    n = valid.sum().clamp(min=1)
    return float(low.sum() / n), float(high.sum() / n)


def clip_fraction_of(cfg: LossConfig, log_ratio: Tensor, adv_tok: Tensor, mask: Tensor) -> float:
    """The fraction of units that `cfg` would clip: tokens at token level, sequences at sequence level."""
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
    clip/frac            the fraction the trained objective actually clips (token or sequence units)
    clip/shadow_<algo>   the fraction each paper preset would clip on this same batch
    approx_kl            k3 estimate of KL(pi_old || pi_theta) per token
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
    at_token = cfg.importance_sampling_level == "token"
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
        "clip/frac": tok_low + tok_high if at_token else seq_low + seq_high,
        "approx_kl": masked_mean(torch.exp(log_ratio) - 1 - log_ratio, mask),
    }
    for name, preset in PRESETS.items():
        diag[f"clip/shadow_{name}"] = clip_fraction_of(preset, log_ratio, adv_tok, mask)
    return diag


def length_bucket_stats(logp: Tensor, old_logp: Tensor, mask: Tensor, num_buckets: int = 4) -> list[dict]:
    """Per response-length bucket (quantiles of |y|): mean length, std of sum_t l_it and of log s_i.

    For i.i.d. token log-ratio noise of std sigma, std(sum_t l_it) = sigma sqrt(|y|) grows with length while
    std(log s_i) = sigma / sqrt(|y|) shrinks: the two quantities the GSPO argument is about.
    """
    mask = mask.to(logp.dtype)
    lengths = mask.sum(-1)  # (B,)
    log_ratio = (logp - old_logp) * mask
    sums, log_s = log_ratio.sum(-1), masked_seq_mean(log_ratio, mask)  # (B,), (B,)
    order = torch.argsort(lengths, stable=True)
    out = []
    for idx in torch.tensor_split(order, num_buckets):
        if len(idx) < 2:
            continue
        out.append({
            "len": float(lengths[idx].mean()),
            "std_logsum": float(sums[idx].std()),
            "std_log_s": float(log_s[idx].std()),
        })
    return out
