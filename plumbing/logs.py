"""What a run logs and prints: metrics.jsonl and wandb (Logger), the rollout's and the update's metrics gathered
over ranks, the step line, the evaluation lines and the start-up lines. Nothing here changes what is learned."""

from __future__ import annotations

import json
import math
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch

import losses
import model as models
from plumbing import network
from plumbing.ddp import SINGLE, World
from tools import diagnostics

# the remainder task in its four forms: --dataset name -> (phrased for a chat model, the long task)
EMBEDDED_TASKS = {"embedded": (False, False), "embedded-instruct": (True, False), "embedded-long": (False, True),
                  "embedded-long-instruct": (True, True)}


class Logger:
    """One metrics.jsonl per run (the sweep report reads it) and wandb with the same keys; rank 0 only."""

    def __init__(self, args, run_dir: Path, wandb_id: str | None = None, active: bool = True):
        self.file = self.run = None
        if active:
            self.file = (run_dir / "metrics.jsonl").open("a")
            self.run = network.wandb_init(project=args.wandb_project, name=args.run_name, group=args.wandb_group,
                                         tags=list(args.wandb_tags), config=asdict(args), dir=str(run_dir),
                                         mode=network.wandb_mode(args.wandb_mode), id=wandb_id,
                                         resume="allow" if wandb_id else None)

    def log(self, metrics: dict, step: int) -> None:
        if self.file is None:
            return
        clean = {k: (v if isinstance(v, (int, float)) and math.isfinite(v) else None) for k, v in metrics.items()}
        self.file.write(json.dumps({"step": step, **clean}) + "\n")
        self.file.flush()
        self.run.log({k: v for k, v in metrics.items() if isinstance(v, (int, float))}, step=step)

    def finish(self) -> None:
        if self.file is not None:
            self.file.close()
            self.run.finish()


def console_line(step: int, total: int, m: dict, eta_s: float, level: str = "token") -> str:
    """One step on screen; the clip fraction and the ratio variance are at the objective's own level (token ratios
    rho_it, or GSPO's sequence ratios s_i)."""
    drawn = f" | drawn {m['dynamic/drawn']} dropped {m['dynamic/dropped']}" if m.get("dynamic/dropped") else ""
    var = f"seq_ratio_var {m['ratio/seq_var']:.2e}" if level == "sequence" else f"ratio_var {m['ratio/token_var']:.2e}"
    return (f"step {step:>4}/{total} | reward {m['charts/reward']:.3f} acc {m['charts/accuracy']:.3f} | "
            f"len {m['charts/completion_len']:.1f} | loss {m['losses/policy_loss']:+.4f} | "
            f"clip {m['clip/frac']:.4f} {var}{drawn} | "
            f"{m['perf/rollout_s']:.1f}s+{m['perf/update_s']:.1f}s | eta {eta_s / 60:.1f} min")


def eval_lines(when: str, m: dict, samples: list | None, n_problems: int) -> str:
    """The held-out evaluation on screen: accuracy (and pass@k), and greedy answers beside their references."""
    passes = "".join(f", {k[5:]} {v:.3f}" for k, v in m.items() if k.startswith("eval/pass@"))
    line = f"held-out accuracy {when}: {m['eval/accuracy']:.3f}{passes} ({n_problems} problem{'s' * (n_problems != 1)})"
    clip = lambda t: repr(t if len(t) <= 100 else t[:97] + "...")  # noqa: E731
    for prompt, text, reference, correct in samples or []:
        line += (f"\n  e.g. {clip(prompt)} -> {clip(text)} (reference {reference!r}: "
                 f"{'right' if correct else 'wrong'})")
    return line


def rollout_metrics(batch, adv: torch.Tensor, g: int, drawn_correct: torch.Tensor, drawn: int, dropped: int,
                    world: World = SINGLE, mask_truncated: bool = False) -> dict:
    """Rewards, lengths and advantages of the whole rollout (every rank's rows; adv: (B,), already every rank's),
    and the correctness of every group drawn (drawn_correct: (groups, G), this rank's; with dynamic sampling, also
    the groups it dropped)."""
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
    # the same, free of which prompts are wrong: in each group with both kinds, mean incorrect over mean correct
    # length, averaged over those groups (> 1: wrong answers run longer than right ones to the same prompt)
    by_group, right = lengths.view(-1, g), correct.view(-1, g).float()
    mixed = (right.sum(1) > 0) & (right.sum(1) < g)
    if mixed.any():
        wrong = 1 - right
        mean_wrong = (by_group * wrong).sum(1) / wrong.sum(1).clamp(min=1)  # (groups,)
        mean_right = (by_group * right).sum(1) / right.sum(1).clamp(min=1)  # (groups,)
        rel = mean_wrong / mean_right.clamp(min=1)
        m["charts/len_incorrect_rel"] = float(rel[mixed].mean())
    return m


def update_metrics(seen: list, old_logp, old_entropy, ref_logp, adv: torch.Tensor, mask: torch.Tensor,
                   cfg: losses.LossConfig, world: World = SINGLE, mu: torch.Tensor | None = None,
                   correction: tuple | None = None) -> dict:
    """The GSPO paper's diagnostics over every row scored during the update (on every rank), each against pi_old:
    the statistics of the ratios the objective actually saw. `seen`: (rows, log-probs, entropy or None) per
    micro-batch; old_logp None means on-policy (the ratio is 1; the entropy is the one scored during the update),
    else old_entropy is pi_old's over the whole rollout. With `mu` (the sampler's log-probs, where pi_old is
    recomputed) also the train-inference mismatch, and with `correction` what --rollout-correction did."""
    on_policy = old_logp is None
    rows = torch.cat([r for r, _, _ in seen])
    new = torch.cat([lp for _, lp, _ in seen])  # (n, T)
    old_all = new if on_policy else old_logp[rows]
    entropy_seen = torch.cat([e for _, _, e in seen]) if on_policy else None
    kl = None if ref_logp is None else losses.k3_kl(new, ref_logp[rows])
    new, old_all, adv_seen, mask_seen, entropy_seen, kl, mu_seen = world.gather_rows(
        new, old_all, adv[rows], mask[rows], entropy_seen, kl, None if mu is None else mu[rows])
    diag = losses.ratio_diagnostics(new, old_all, adv_seen, mask_seen, cfg)  # the card's: ratio variance, clipping
    diag.update(diagnostics.study_metrics(new, old_all, adv_seen, mask_seen))  # the study's instrumentation
    metrics = {
        "losses/entropy": losses.masked_mean(entropy_seen, mask_seen) if on_policy
        else losses.masked_mean(*world.gather_rows(old_entropy, mask)),  # pi_old's, over the whole rollout
        **{("losses/" + k if k == "approx_kl" else k): v for k, v in diag.items()},
    }
    if kl is not None:
        metrics["losses/kl_ref"] = losses.masked_mean(kl, mask_seen)
    if mu_seen is not None:
        metrics.update(diagnostics.mismatch_metrics(old_all, mu_seen, mask_seen))
    if cfg.top_entropy_quantile < 1.0 or cfg.entropy_coef != 0.0:  # what the entropy controls touched
        masked = trained = weighted = 0.0
        for part, _, e in seen:  # per micro-batch, as the loss saw them
            valid = mask[part]
            kept = losses.trained_tokens(e, valid, cfg.top_entropy_quantile)
            masked, trained, weighted = masked + float((valid - kept).sum()), trained + float(kept.sum()), \
                weighted + float((e * kept).sum())
        masked, trained, weighted, tokens = world.sum([masked, trained, weighted, float(mask[rows].sum())])
        metrics["entropy/masked_frac"] = masked / max(tokens, 1)  # the share of tokens without a policy gradient
        metrics["entropy/bonus"] = cfg.entropy_coef * weighted / max(trained, 1)  # coef x their mean entropy
    if correction is not None:  # what the correction did: the mean weight, and the units it truncated or dropped
        level, kind = correction[0].split("_")
        raw = losses.rollout_ratio(old_all, mu_seen, mask_seen, level)
        w = losses.bound_rollout_ratio(raw, kind, *correction[1:])
        units = mask_seen if w.shape == mask_seen.shape else (mask_seen.sum(-1, keepdim=True) > 0).float()
        metrics["correction/weight_mean"] = losses.masked_mean(w, units)
        metrics["correction/changed_frac"] = losses.masked_mean((w != raw).float(), units)
    return metrics


def precision(policy) -> str:
    """float32, or e.g. 'bfloat16 autocast, float32 weights'."""
    name = lambda dtype: str(dtype).removeprefix("torch.")  # noqa: E731
    compute = models.compute_dtype(policy)
    return name(compute) if compute == policy.dtype else f"{name(compute)} autocast, {name(policy.dtype)} weights"


def startup_lines(args, run_dir: Path, train_set: list, test_set: list, policy, world: World,
                  held_out: int = 0) -> list[str]:
    """Where the run's files go, what it trains on and with what: printed once before the first evaluation."""
    mode = network.wandb_mode(args.wandb_mode)
    wandb = {"offline": f"wandb offline (upload later: wandb sync {run_dir}/wandb/offline-run-*)",
             "online": "wandb online", "disabled": "wandb disabled"}[mode]
    threads = f", threads {torch.get_num_threads()}" if policy.device.type == "cpu" else ""
    lines = [f"run folder: {run_dir} (config.json, metrics.jsonl, final/); {wandb}",
             f"data: {args.dataset}, {len(train_set)} training and {len(test_set)} held-out problems"
             + (f" (--eval-size: {len(test_set)} spread over all {held_out})" if len(test_set) < held_out else "") + "; "
             f"device {policy.device}, {precision(policy)}{threads}"
             + (f", {world.size} processes" if world.size > 1 else "")]
    if len(test_set) < 20 and not args.eval_size:  # a small set of the user's own choosing needs no warning
        lines.append(f"warning: only {len(test_set)} held-out problem{'s' * (len(test_set) != 1)}: held-out accuracy "
                     f"moves in steps of 1/{len(test_set)}; pass a larger set of your own with --eval-dataset FILE")
    trained = (f"LoRA r={args.lora_rank} alpha={args.lora_alpha:g} on {', '.join(args.lora_target_modules)}"
               if args.lora_rank else "every weight (full fine-tune)")
    lines.append(f"model: {args.model}; trains {trained}"
                 + ("; gradient checkpointing on" if args.gradient_checkpointing else ""))
    if args.model == "embedded" and args.dataset not in EMBEDDED_TASKS:
        lines.append(f"note: the embedded model was warm-started on the remainder task only and knows nothing of "
                     f"{args.dataset}; train a pretrained model on it with --model (a hub id, a folder or a .gguf)")
    return lines


def timing(batch, rollout_s: float, update_s: float, lr: float, world: World = SINGLE) -> dict:
    tokens = world.sum([float(batch.ro.lengths.sum())])[0]  # generated over all ranks
    return {"charts/lr": lr, "perf/rollout_s": rollout_s, "perf/update_s": update_s,
            "perf/gen_tokens_per_s": tokens / rollout_s}
