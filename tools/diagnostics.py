"""The study's instrumentation, logged every step beside the objective's own statistics (losses.ratio_diagnostics):
what every paper preset would clip on the same batch, SAPO's gate, the ratio spread by response length, and the
sampler-trainer mismatch. It reads the log-probs the update already has and changes nothing that is learned.
"""

from __future__ import annotations

import torch
from torch import Tensor

from losses import PRESETS, clip_fraction_of, masked_mean, masked_seq_mean, sapo_gate_slope


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
