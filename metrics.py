"""What a step logs, in one place: the rollout's metrics (rewards, correctness, lengths), the update's (the card's
ratio variance and clip fractions, losses.ratio_diagnostics, over every row the update scored; the sampler-trainer
mismatch where pi_old is recomputed), and the study's instrumentation beside them, with --log-study-metrics (what
every paper preset would clip on the same batch, SAPO's gate, the ratio spread by response length, the length gap of
wrong answers). Everything here reads what the step already computed and changes nothing that is learned. `world` is
plumbing.ddp's World: a logged statistic is that of the whole rollout, every rank's rows.
"""

from __future__ import annotations

import sys

import numpy as np
import torch
from torch import Tensor

import losses
from losses import PRESETS, clip_fraction_of, masked_mean, masked_seq_mean, sapo_gate_slope


# ---------------------------------------------------------------------------------------------------------------
# The step's metrics
# ---------------------------------------------------------------------------------------------------------------


def rollout_metrics(batch, adv: torch.Tensor, g: int, drawn_correct: torch.Tensor, drawn: int, dropped: int, world,
                    mask_truncated: bool = False, study: bool = False) -> dict:
    """Rewards, lengths and advantages of the whole rollout (every rank's rows; adv: (B,), already every rank's),
    and the correctness of every group drawn (drawn_correct: (groups, G), this rank's; with dynamic sampling, also
    the groups it dropped); with `study` (--log-study-metrics) the study's length gap (length_gap)."""
    correct_drawn = torch.cat(world.gather_rows(drawn_correct))  # (groups drawn, G) over all ranks
    scores = {k: [v for part in world.gather(batch.scores) for v in part[k]] for k in batch.scores}
    lengths, truncated = world.gather_rows(batch.ro.lengths.float(), batch.ro.truncated.float())
    reward = torch.tensor(scores["reward"])
    correct = torch.tensor(scores["correct"]).bool()
    m = {
        "dynamic/drawn": drawn, "dynamic/dropped": dropped,
        "charts/all_wrong_group_frac": float((correct_drawn.max(1).values == 0).float().mean()),
        "charts/all_right_group_frac": float((correct_drawn.min(1).values == 1).float().mean()),
        "charts/reward": float(reward.mean()),
        "charts/reward_std": float(reward.std()),
        "charts/accuracy": float(correct.float().mean()),
        "charts/zero_std_group_frac": float((reward.view(-1, g).std(1) == 0).float().mean()),
        "charts/completion_len": float(lengths.mean()),
        "charts/completion_len_min": float(lengths.min()),
        "charts/completion_len_max": float(lengths.max()),
        "charts/truncated_frac": float(truncated.mean()),
        "charts/advantage_abs": float(adv.abs().mean()),
    }
    m.update({f"rewards/{k}": float(np.mean(v)) for k, v in scores.items() if k != "reward"})
    if mask_truncated:  # --mask-truncated: the completions the loss left out
        m["charts/masked_frac"] = float(truncated.mean())
    # Dr.GRPO's length-bias claim is about these two; a key is left out when its set is empty
    if correct.any():
        m["charts/len_correct"] = float(lengths[correct].mean())
    if (~correct).any():
        m["charts/len_incorrect"] = float(lengths[~correct].mean())
    if study:
        m.update(length_gap(lengths, correct, g))
    return m


def update_metrics(seen: list, old_logp, old_entropy, ref_logp, adv: torch.Tensor, mask: torch.Tensor,
                   cfg: losses.LossConfig, world, mu: torch.Tensor | None = None,
                   correction: tuple | None = None, study: bool = False, adaptive_entropy: bool = False) -> dict:
    """The GSPO paper's diagnostics over every row scored during the update (on every rank), each against pi_old:
    the statistics of the ratios the objective actually saw. `seen`: (rows, log-probs, entropy or None) per
    micro-batch; old_logp None means on-policy (the ratio is 1; the entropy is the one scored during the update),
    else old_entropy is pi_old's over the whole rollout. With `mu` (the sampler's log-probs, where pi_old is
    recomputed) also the train-inference mismatch, with `correction` what --rollout-correction did, and with `study`
    (--log-study-metrics) the study's instrumentation."""
    on_policy = old_logp is None
    rows = torch.cat([r for r, _, _ in seen])
    new = torch.cat([lp for _, lp, _ in seen])  # (n, T)
    old_all = new if on_policy else old_logp[rows]
    entropy_seen = torch.cat([e for _, _, e in seen]) if on_policy else None
    kl = None if ref_logp is None else losses.k3_kl(new, ref_logp[rows])
    new, old_all, adv_seen, mask_seen, entropy_seen, kl, mu_seen = world.gather_rows(
        new, old_all, adv[rows], mask[rows], entropy_seen, kl, None if mu is None else mu[rows])
    diag = losses.ratio_diagnostics(new, old_all, adv_seen, mask_seen, cfg)  # the card's: ratio variance, clipping
    if study:
        diag.update(study_metrics(new, old_all, adv_seen, mask_seen))
    metrics = {
        "losses/entropy": losses.masked_mean(entropy_seen, mask_seen) if on_policy
        else losses.masked_mean(*world.gather_rows(old_entropy, mask)),  # pi_old's, over the whole rollout
        **{("losses/" + k if k == "approx_kl" else k): v for k, v in diag.items()},
    }
    if kl is not None:
        metrics["losses/kl_ref"] = losses.masked_mean(kl, mask_seen)
    if mu_seen is not None:
        metrics.update(mismatch_metrics(old_all, mu_seen, mask_seen))
    fixed_coef = None if adaptive_entropy else cfg.entropy_coef  # --entropy-target's bonus: AdaptiveEntropy.logged
    if cfg.top_entropy_quantile < 1.0 or fixed_coef:
        metrics.update(entropy_control_metrics(seen, mask, cfg.top_entropy_quantile, fixed_coef, world))
    if correction is not None:
        metrics.update(correction_metrics(old_all, mu_seen, mask_seen, correction))
    return metrics


def entropy_control_metrics(seen: list, mask: Tensor, quantile: float, coef: float | None, world) -> dict[str, float]:
    """What the entropy controls touched, per micro-batch as the loss saw them (`seen`, as update_metrics's; mask:
    the whole rollout's (B, T)): the share of valid tokens --top-entropy-quantile left without a policy gradient
    (entropy/masked_frac) and, with a fixed coefficient (`coef` not None), the bonus: coef times the trained tokens'
    mean entropy (entropy/bonus)."""
    masked = trained = weighted = tokens = 0.0
    for part, _, e in seen:
        valid = mask[part]
        kept = losses.trained_tokens(e, valid, quantile)
        masked, trained, weighted, tokens = masked + float((valid - kept).sum()), trained + float(kept.sum()), \
            weighted + float((e * kept).sum()), tokens + float(valid.sum())
    masked, trained, weighted, tokens = world.sum([masked, trained, weighted, tokens])
    logged = {"entropy/masked_frac": masked / max(tokens, 1)}
    return logged if coef is None else {**logged, "entropy/bonus": coef * weighted / max(trained, 1)}


def correction_metrics(old_logp: Tensor, sampler_logp: Tensor, mask: Tensor, correction: tuple) -> dict[str, float]:
    """What --rollout-correction did (correction: its mode, C_min, C_max): the mean weight w = pi_old / mu over its
    units (tokens, or sequences) and the share it truncated or dropped."""
    level, kind = correction[0].split("_")
    raw = losses.rollout_ratio(old_logp, sampler_logp, mask, level)
    w = losses.bound_rollout_ratio(raw, kind, *correction[1:])
    units = mask if w.shape == mask.shape else (mask.sum(-1, keepdim=True) > 0).float()
    return {"correction/weight_mean": losses.masked_mean(w, units),
            "correction/changed_frac": losses.masked_mean((w != raw).float(), units)}


def timing(batch, rollout_s: float, update_s: float, lr: float, world) -> dict:
    tokens = world.sum([float(batch.ro.lengths.sum())])[0]  # generated over all ranks
    peaks = world.gather(peak_memory_gib())  # each rank's, so a sharded run shows every card's
    return {"charts/lr": lr, "perf/rollout_s": rollout_s, "perf/update_s": update_s,
            "perf/gen_tokens_per_s": tokens / rollout_s, "perf/peak_memory_gib_max": max(peaks),
            "perf/peak_memory_gib_min": min(peaks)}


def peak_memory_gib() -> float:
    """This process's peak so far: CUDA's allocated high-water mark where CUDA is in use, else the resident set's."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return torch.cuda.max_memory_allocated() / 2**30
    return resident_peak_gib()


def resident_peak_gib() -> float:
    """The high-water mark of this process's resident memory: Linux's VmHWM (getrusage's ru_maxrss keeps the peak of
    the process that started this one, across fork and exec); elsewhere ru_maxrss, which macOS counts in bytes."""
    try:
        with open("/proc/self/status") as status:
            return next(int(line.split()[1]) for line in status if line.startswith("VmHWM:")) / 2**20  # kB
    except (OSError, StopIteration):
        import resource

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak / 2**30 if sys.platform == "darwin" else peak / 2**20


# ---------------------------------------------------------------------------------------------------------------
# The study's instrumentation
# ---------------------------------------------------------------------------------------------------------------


def study_metrics(logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor) -> dict[str, float]:
    """Per update, over the rows it scored (all against pi_old):
    clip/shadow_<algo>       the fraction each paper preset would clip on this same batch (losses.clip_fraction_of)
    clip/sapo_gate_mean      mean over tokens of SAPO's gradient weight f'(rho) at SAPO's temperatures (1 on-policy)
    lenbucket/q<k>_<stat>    per quartile of response length: mean length, std of sum_t l_it and of log s_i
    """
    mask = mask.to(logp.dtype)
    log_ratio = (logp - old_logp) * mask  # (B, T)
    adv_tok = (advantages if advantages.dim() == 2 else advantages.unsqueeze(-1)).expand_as(logp)  # (B, T)
    out = {f"clip/shadow_{name}": clip_fraction_of(preset, log_ratio, adv_tok, mask) for name, preset in PRESETS.items()}
    out["clip/sapo_gate_mean"] = masked_mean(sapo_gate_slope(torch.exp(log_ratio), adv_tok, PRESETS["sapo"]), mask)
    for q, bucket in enumerate(length_bucket_stats(logp, old_logp, mask), 1):
        out.update({f"lenbucket/q{q}_{k}": v for k, v in bucket.items()})
    return out


def length_gap(lengths: Tensor, correct: Tensor, g: int) -> dict[str, float]:
    """charts/len_incorrect_rel: Dr.GRPO's length bias free of which prompts are wrong. In each group with both
    kinds, mean incorrect over mean correct length, averaged over those groups (> 1: wrong answers run longer than
    right ones to the same prompt); absent when no group has both. lengths, correct: (B,) in groups of g rows."""
    by_group, right = lengths.view(-1, g), correct.view(-1, g).float()
    mixed = (right.sum(1) > 0) & (right.sum(1) < g)
    if not mixed.any():
        return {}
    wrong = 1 - right
    mean_wrong = (by_group * wrong).sum(1) / wrong.sum(1).clamp(min=1)  # (groups,)
    mean_right = (by_group * right).sum(1) / right.sum(1).clamp(min=1)  # (groups,)
    return {"charts/len_incorrect_rel": float((mean_wrong / mean_right.clamp(min=1))[mixed].mean())}


MISMATCH_TOKEN = 0.2  # |log pi_old - log mu| beyond GRPO's clip range, roughly (log 1.2 = 0.18, -log 0.8 = 0.22)
MISMATCH_SEQ = 3e-4  # |mean_t log pi_old - log mu| beyond GSPO's clip range: clipped at theta = theta_old


def mismatch_metrics(old_logp: Tensor, sampler_logp: Tensor, mask: Tensor) -> dict[str, float]:
    """Train-inference mismatch, d_it = log pi_old(y_it) - log mu(y_it) over valid tokens: mean and max |d|, the k3
    estimate of KL(mu || pi_old) (tokens are drawn from mu: E_mu[(r - 1) - log r], r = pi_old / mu), the spread of
    the sequences' mean d (GSPO's log s_i at theta = theta_old), and the fractions beyond the thresholds above."""
    d = (old_logp - sampler_logp) * mask  # (B, T)
    valid = mask > 0
    seq = d.sum(-1) / mask.sum(-1).clamp(min=1)  # (B,)
    return {"mismatch/abs_mean": masked_mean(d.abs(), mask), "mismatch/abs_max": float(d.abs().max()),
            "mismatch/kl_k3": masked_mean(torch.expm1(d) - d, mask),
            "mismatch/seq_std": float(seq.std()) if seq.numel() > 1 else 0.0,
            "mismatch/seq_abs_max": float(seq.abs().max()),
            "mismatch/token_frac": float((d.abs() > MISMATCH_TOKEN)[valid].float().mean()),
            "mismatch/seq_frac": float((seq.abs() > MISMATCH_SEQ).float().mean())}


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


PREFIX_K = (4, 8, 16, 32, 64)  # the prefix lengths of the within-sequence thesis (study claim 1-within)


def prefix_spread(logp_after: Tensor, old_logp: Tensor, mask: Tensor, ks: tuple[int, ...] = PREFIX_K) -> dict:
    """The seed note's thesis inside each sequence (--log-prefix-spread). With l_it = log pi_theta(y_it) -
    log pi_old(y_it), pi_theta the policy after the step's update (every row scored once by it, so every row is
    equally stale), and S_ik = sum_{t<=k} l_it the log of the first k tokens' joint ratio, over the sequences of at
    least max(ks) tokens (the same sequences at every k):

        prefix/std_k<k>       std_i S_ik: for i.i.d. token noise of std sigma, sigma sqrt(k) (slope 0.5 in log k);
                              tokens that move together give more (up to 1), tokens that cancel give less
        prefix/n_long         how many sequences were long enough (the stds need two)
        prefix/abs_log_token  mean |l_it| over their first max(ks) tokens: whether the ratios moved at all
    Unlike length_bucket_stats, which compares different sequences by length (and length is the policy's choice),
    this follows the same sequences as k grows."""
    mask = mask.to(logp_after.dtype)
    long = mask.sum(-1) >= max(ks)  # (B,) the mask runs from the first completion token, so these prefixes are whole
    out = {"prefix/n_long": int(long.sum())}
    if out["prefix/n_long"] >= 2:
        log_ratio = ((logp_after - old_logp) * mask)[long][:, :max(ks)]  # (n, K)
        sums = log_ratio.cumsum(-1)  # (n, K): S_ik at k = column + 1
        out.update({f"prefix/std_k{k}": float(sums[:, k - 1].std()) for k in ks})
        out["prefix/abs_log_token"] = float(log_ratio.abs().mean())
    return out
