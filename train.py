"""GRPO-family RL for language models: `python train.py --algo gspo`; torchrun for data parallel.

One RL step: draw P prompts, sample G completions each, score them with the verifier, turn the scores into group
advantages, then take `num_minibatches` optimizer steps over the P*G rollout for `num_epochs` passes, each with
the objective of `--algo` (losses.policy_loss). Only a rollout's first minibatch is on-policy (ratio 1); the later
ones see a moved policy, so the ratios, their variance and the clip fractions (the GSPO paper's subject) move.

Read top to bottom: Args, sampling, the update, the step, the held-out evaluation, the loop. `# ALGO:` marks the
algorithm; `# PLUMBING:` bookkeeping (plumbing/) that changes nothing learned.
"""

from __future__ import annotations

from base import early

if __name__ == "__main__":
    early.install()  # Ctrl-C while the libraries below load (seconds): one line, not an import traceback

import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Literal

import numpy as np
import torch

import losses
import metrics
import model as models
import rewards
import rollout
import task
from losses import LossConfig
from base import errors
from plumbing import ddp, flags, lifecycle, logs, run as runs, settings
from plumbing.accumulate import MicroBatches, StepLog, score_rows
from plumbing.ddp import SINGLE, World
from base.errors import DynamicSamplingError
from plumbing.run import PromptStream


@settings.own_fields_first
@dataclass
class Args(settings.DataSource, settings.Hardware, settings.LoRA, settings.Evaluation, settings.Logging,
           settings.SafetyNets):
    """Every flag. The fields below shape the algorithm; the groups it inherits (plumbing/settings.py) are where
    data and models come from, hardware and memory, evaluation, logging and checkpoints."""

    algo: losses.Algo = "gspo"
    """objective preset with its paper's values; any objective field below that is left unset takes them"""
    seed: int = 0
    """seed of everything (sampling, data order, warm start); the same seed repeats a run exactly"""
    model: str = "embedded"
    """'embedded' (tiny Llama, warm-started offline), a hub id, a save_pretrained directory, or a .gguf file"""
    dataset: str = "embedded"
    """embedded(-long, -instruct, -long-instruct, -add), a JSONL/JSON/parquet/CSV file, a saved folder or a hub dataset"""

    # rollout: P prompts x G completions
    total_steps: int | None = None
    """RL steps (one rollout each); 0 evaluates --model on the held-out set and trains nothing"""
    num_prompts: int = 16
    """P: prompts per rollout"""
    num_generations: int = 8
    """G: completions per prompt (the group)"""
    max_new_tokens: int | None = None
    """generation budget per completion; also Dr.GRPO's normaliser and DAPO's L_max"""
    temperature: float = 1.0
    """sampling temperature; log-probs are taken at the same temperature"""

    # the update: minibatches x epochs over each rollout
    num_minibatches: int = 4
    """optimizer steps per rollout pass (the GSPO paper uses 4); 1 with num_epochs 1 is fully on-policy"""
    num_epochs: int = 1
    """passes over each rollout"""
    old_logprobs: Literal["auto", "sampler", "recompute"] = "auto"
    """pi_old: the sampler's own log-probs or recomputed before the first update; auto: the sampler's in fp32,
    recomputed in bf16 or with --rollout-correction; 1 minibatch x 1 epoch needs neither (every ratio is 1)"""
    rollout_correction: Literal["off"] | losses.RolloutCorrection = "off"
    """weigh each unit's loss by w = pi_old / mu (mu: the sampler's), capped (truncate) or dropped (mask) outside
    [--rollout-correction-min, --rollout-correction-max]"""
    rollout_correction_max: float | None = 3.0
    """C_max of --rollout-correction (TRL's default 3); None: no upper bound"""
    rollout_correction_min: float | None = None
    """C_min of --rollout-correction; None: no lower bound (TRL's default)"""
    lr: float = 5e-5
    """AdamW learning rate"""
    lr_scheduler: str = "constant_with_warmup"
    """any transformers scheduler name (linear, cosine, constant_with_warmup, ...)"""
    warmup_steps: int = 8
    """optimizer steps of linear warmup from 0 (transformers' schedules: the first optimizer step has learning rate 0)"""
    weight_decay: float = 0.0
    """AdamW weight decay (decoupled from the gradient)"""
    max_grad_norm: float = 1.0
    """gradient clipping by global norm"""

    # the objective: None takes the --algo preset (losses.PRESETS)
    importance_sampling_level: losses.ImportanceLevel | None = None
    """token: rho_t; sequence: GSPO's s_i; sequence_token: GSPO-token"""
    loss_agg_mode: losses.AggMode | None = None
    """how per-token losses become the step's loss (losses.aggregate): seq-mean-token-mean, a mean per sequence then
    over sequences (GRPO, GSPO); token-mean, over every token of the step (DAPO); seq-mean-token-sum-norm, the sum
    divided by B x max_new_tokens (Dr.GRPO); seq-mean-token-sum, the sum over each sequence's tokens, mean over
    sequences (LUSPO)"""
    epsilon: float | None = None
    """lower clip range: w >= 1 - epsilon"""
    epsilon_high: float | None = None
    """upper clip range: w <= 1 + epsilon_high (DAPO's clip-higher when above epsilon)"""
    beta: float | None = None
    """weight of the KL to the starting policy; 0 loads no reference model"""
    kl_estimator: losses.KLEstimator | None = None
    """the KL estimate beta weighs: k1 (-d), k2 (d^2/2) or k3 (e^d - d - 1, GRPO's), d = log pi_ref - log pi"""
    kl_in: losses.KLIn | None = None
    """the KL as a loss term on every token (GRPO), or subtracted from each completion's reward (verl, PPO-RLHF)"""
    kl_ratio_correction: bool | None = None
    """weigh the loss's KL by the importance ratio pi/pi_old (TRL 1.16's use_bias_correction_kl, its default)"""
    advantage_estimator: losses.Estimator | None = None
    """how rewards become advantages: GRPO's group-relative reward, RLOO, REINFORCE++-baseline, MaxRL (losses.py)"""
    scale_rewards: losses.ScaleRewards | None = None
    """grpo's divisor: the group's reward std, the whole batch's, or none (Dr.GRPO); the other estimators ignore it"""
    clip_ratio_c: float | None = None
    """dual-clip: for A < 0, cap the clip surrogate's loss at -c A (verl's clip_ratio_c, usually 3); None: off"""
    entropy_coef: float | None = None
    """entropy bonus: the loss minus this times the mean entropy of the trained tokens (TRL's entropy_coef)"""
    entropy_target: float | None = None
    """adaptive entropy bonus (Skywork-OR1, TRL's use_adaptive_entropy): applied, and raised, below this entropy"""
    top_entropy_quantile: float | None = None
    """train the policy term only on this top fraction of tokens by entropy (0.2: the 80/20 paper); 1: all"""
    surrogate: losses.Surrogate | None = None
    """what the ratio does to the gradient: PPO's clip, CISPO, SAPO, GMPO, VESPO, or the entropy paper's Clip-Cov,
    KL-Cov"""
    sapo_tau_pos: float | None = None
    """SAPO's gate temperature for tokens with A > 0"""
    sapo_tau_neg: float | None = None
    """SAPO's gate temperature for tokens with A <= 0"""
    vespo_k_pos: float | None = None
    """VESPO's kernel phi(W) = e^lambda W^k e^(-lambda W) of each sequence's ratio W (the product of its token
    ratios): k for A >= 0"""
    vespo_lambda_pos: float | None = None
    """VESPO's kernel: lambda for A >= 0 (phi peaks at W = k / lambda)"""
    vespo_k_neg: float | None = None
    """VESPO's kernel: k for A < 0"""
    vespo_lambda_neg: float | None = None
    """VESPO's kernel: lambda for A < 0"""

    mask_truncated: bool = False
    """completions without EOS within max_new_tokens give no loss (DAPO's overlong filtering; TRL's)"""

    # rewards and DAPO's sampling
    dynamic_sampling: bool | None = None
    """DAPO: re-draw prompts until every group has mixed correctness"""
    max_sampling_rounds: int = 8
    """dynamic sampling gives up with an error after this many rollouts in one step"""
    overlong_weight: float | None = None
    """weight of DAPO's soft overlong punishment"""
    overlong_cache: int = 16
    """L_cache: the punishment ramps from 0 to -1 over the last this-many tokens before max_new_tokens"""
    format_weight: float = 0.1
    """weight of the format term (the answer where --answer-format puts it, ending the completion)"""
    answer_format: Literal["tags", "last-number", "boxed"] = "tags"
    """where the verifier reads the answer: tags (<answer>...</answer>), last-number, or boxed (math-verify)"""


# ---------------------------------------------------------------------------------------------------------------
# Sampling: G completions per prompt, scored by the rule-based verifier
# ---------------------------------------------------------------------------------------------------------------


@dataclass
class Batch:
    ro: rollout.Rollout
    examples: list[task.Example]  # one per row (each prompt repeated G times)
    scores: dict[str, list[float]]  # per row: "reward" (the sum), "correct", and each reward term
    texts: list[str]
    advantages: torch.Tensor | None = None  # (B_r,) once rl_step has computed them


def sample(policy, tokenizer, rows: list[task.Example], args: Args, greedy: bool = False) -> Batch:
    """One completion per row, decoded up to its first EOS and scored by every reward term."""
    prompts = [rollout.format_prompt(tokenizer, ex.prompt, args.answer_format, args.enable_thinking) for ex in rows]
    ro = rollout.generate(policy, tokenizer, prompts, args.max_new_tokens, args.temperature, greedy=greedy)
    texts = rollout.decode(tokenizer, ro)
    scores = rewards.score(texts, [ex.answer for ex in rows], ro.lengths.tolist(), ro.truncated.tolist(),
                           args.format_weight, args.overlong_weight, args.max_new_tokens, args.overlong_cache,
                           args.answer_format)
    return Batch(ro, rows, scores, texts)


def sample_groups(policy, tokenizer, prompts: list[task.Example], args: Args) -> Batch:
    """G completions per prompt, each group in consecutive rows."""
    return sample(policy, tokenizer, [ex for ex in prompts for _ in range(args.num_generations)], args)


def dynamic_sampling(policy, tokenizer, stream: PromptStream, args: Args, world: World) -> tuple[Batch, torch.Tensor, int]:
    """DAPO's dynamic sampling: draw P prompts at a time and keep only groups of mixed correctness (all right or all
    wrong gives every advantage 0), until P groups are kept, for at most max_sampling_rounds draws. Filtering reads
    raw correctness. Returns the batch, the correctness of every group drawn (this rank's) and the prompts drawn.
    Under torchrun every rank reads every draw (one prompt cursor) and goes on until all ranks are full."""
    g, kept, drawn, all_correct, uniform = args.num_generations, [], 0, [], []
    n_rows, n_kept, short = args.num_prompts // world.size * g, 0, True  # this rank's rows; any rank still short?
    for _ in range(args.max_sampling_rounds):
        prompts = world.shard(stream.take(args.num_prompts))
        drawn += args.num_prompts
        if n_kept < n_rows:  # a rank that is full only keeps the others company
            batch = sample_groups(policy, tokenizer, prompts, args)
            correct = torch.tensor(batch.scores["correct"]).view(-1, g)  # (P/N, G)
            all_correct.append(correct)
            is_mixed = correct.max(1).values != correct.min(1).values  # (P/N,)
            uniform += [(batch.examples[i * g].prompt, "all right" if correct[i, 0] else "all wrong")
                        for i in (~is_mixed).nonzero().flatten().tolist()]
            if is_mixed.any():
                kept.append(select_groups(batch, is_mixed.nonzero().flatten().tolist(), g))
                n_kept += int(is_mixed.sum()) * g
        short = world.any(n_kept < n_rows)
        if not short:
            break
    if short:
        found = sum(min(n, n_rows) for n in world.gather(n_kept))
        raise DynamicSamplingError(
            f"dynamic sampling found {found // g} of {args.num_prompts} prompt groups with mixed correctness after "
            f"{args.max_sampling_rounds} rounds ({drawn} prompts drawn; e.g. "
            + "; ".join(f"{p!r} {v}" for p, v in uniform[:3]) + ")")
    batch = Batch(rollout.Rollout.concat([b.ro for b in kept], tokenizer.pad_token_id),
                  [e for b in kept for e in b.examples],
                  {k: [v for b in kept for v in b.scores[k]] for k in kept[0].scores}, [t for b in kept for t in b.texts])
    batch = select_groups(batch, list(range(n_rows // g)), g) if n_kept > n_rows else batch
    return batch, torch.cat(all_correct), drawn


def select_groups(batch: Batch, groups: list[int], g: int) -> Batch:
    rows = [gi * g + j for gi in groups for j in range(g)]
    return Batch(batch.ro.select(torch.tensor(rows)), [batch.examples[r] for r in rows],
                 {k: [v[r] for r in rows] for k, v in batch.scores.items()}, [batch.texts[r] for r in rows])


# ---------------------------------------------------------------------------------------------------------------
# The update: minibatches x epochs over one rollout
# ---------------------------------------------------------------------------------------------------------------


def pi_old_source(num_minibatches: int, num_epochs: int, old_logprobs: str, rollout_correction: str,
                  compute_dtype: torch.dtype) -> Literal["on-policy", "sampler", "recompute"]:
    """Where pi_old comes from, decided here only. on-policy (1 minibatch, 1 epoch): every ratio is 1, pi_old is the
    detached log-prob. sampler: the distributions generate drew from. recompute: a forward pass before the first
    update (TRL, verl); auto recomputes in bf16 (a cached decode rounds differently) and for --rollout-correction."""
    if num_minibatches == 1 and num_epochs == 1:
        return "on-policy"
    if old_logprobs != "auto":
        return old_logprobs
    return "sampler" if compute_dtype == torch.float32 and rollout_correction == "off" else "recompute"


def update(policy, ref_policy, optimizer, scheduler, batch: Batch, adv: torch.Tensor, cfg: LossConfig, args: Args,
           gen: torch.Generator, world: World = SINGLE, pi_old: str | None = None,
           entropy_control: losses.AdaptiveEntropy | None = None) -> dict:
    """num_epochs passes over the rollout in num_minibatches shuffled minibatches, one optimizer step each.
    pi_old: pi_old_source's answer for this run (None: ask it here); entropy_control: --entropy-target's state."""
    device = next(policy.parameters()).device
    ro = batch.ro.to(device)
    adv, mask = adv.to(device), ro.completion_mask.float()  # (B,), (B, T)
    if args.mask_truncated:  # ALGO: a truncated completion's tokens leave the loss and its normalisers
        mask = mask * (1 - ro.truncated.float()).unsqueeze(-1)
    b = mask.shape[0]
    mb_size = b // args.num_minibatches
    source = pi_old or pi_old_source(args.num_minibatches, args.num_epochs, args.old_logprobs, args.rollout_correction,
                                     models.compute_dtype(policy))
    mu = None if source == "sampler" else ro.sampler_logp  # the sampler's log-probs, where pi_old is not them: (B, T)
    correction = None if args.rollout_correction == "off" else (
        args.rollout_correction, args.rollout_correction_min, args.rollout_correction_max)

    # ALGO: pi_old and the reference policy, fixed for the whole update
    old_logp = old_entropy = ref_logp = None
    everything = torch.arange(b, device=device)
    if source == "sampler":
        old_logp, old_entropy = ro.sampler_logp, ro.sampler_entropy
    elif source == "recompute":  # PLUMBING (score_rows): in micro-batches, halved after an out-of-memory error
        old_logp, old_entropy = score_rows(lambda rows: rollout.logprobs(policy, ro, rows, args.temperature, True,
                                                                         args.logprob_chunk),
                                           everything, mb_size, args.micro_batch_size, world)
    if cfg.beta > 0 and cfg.kl_in == "loss":
        with world.scored(ref_policy):  # PLUMBING: under --fsdp the reference's gathered root is freed after the pass
            ref_logp = score_rows(lambda rows: rollout.logprobs(ref_policy, ro, rows, args.temperature,
                                                                chunk=args.logprob_chunk), everything, mb_size,
                                  args.micro_batch_size, world)

    # the current policy's entropy, where the objective reads it (with gradient for the bonus)
    needs_entropy = "grad" if cfg.entropy_coef != 0.0 or entropy_control else \
        cfg.top_entropy_quantile < 1.0 or source == "on-policy"
    net = world.trainable(policy)  # PLUMBING: under torchrun the DDP wrapper, whose backward all-reduces gradients

    def loss_of(rows, norm, step_cfg):
        """The objective on some rows of an optimizer step, with the step's normalisers; and what it saw."""
        entropy = None
        if needs_entropy:
            logp, entropy = rollout.logprobs(net, ro, rows, args.temperature, needs_entropy, args.logprob_chunk)
        else:
            logp = rollout.logprobs(net, ro, rows, args.temperature, chunk=args.logprob_chunk)
        old = logp.detach() if source == "on-policy" else old_logp[rows]
        # ALGO: --rollout-correction: w = pi_old / mu reweights each unit's loss (losses.py)
        weight = None if correction is None else losses.rollout_correction_weights(old, mu[rows], mask[rows], *correction)
        loss = losses.policy_loss(logp, old, adv[rows], mask[rows], norm, step_cfg, None if ref_logp is None else
                                  ref_logp[rows], rollout_weight=weight, entropy=entropy, generator=gen)
        return loss, (rows, logp.detach(), None if entropy is None else entropy.detach())

    # ALGO: epochs x minibatches over the one rollout, one optimizer step per minibatch (PPO's inner loop)
    log = StepLog()  # PLUMBING: what each optimizer step saw, for the logs
    for _ in range(args.num_epochs):
        perm = torch.randperm(b, generator=gen).to(device)
        for mb in perm.split(mb_size):
            step_cfg = cfg if entropy_control is None else replace(cfg, entropy_coef=entropy_control.applied())
            norm = losses.StepNorm(*world.step_totals(mask[mb]), args.max_new_tokens)  # B, sum |y_i|: every rank's
            step = MicroBatches(mb, args.micro_batch_size, world, optimizer)
            for part in step:  # gradient accumulation (PLUMBING: begun again at half the rows after out-of-memory)
                with step.guard():  # PLUMBING: under torchrun DDP all-reduces on the last micro-batch only
                    loss, seen = loss_of(part, replace(norm, micro_batches=len(step.parts)), step_cfg)
                    world.backward(loss)  # loss.backward(); under torchrun x N, as DDP averages N ranks' gradients
                    step.keep(loss, seen)
            grad_norm = torch.nn.utils.clip_grad_norm_(policy.parameters(), args.max_grad_norm)
            if log.finite(step, grad_norm, world):  # PLUMBING: a non-finite loss or gradient skips the update
                optimizer.step()
                scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            if entropy_control:  # ALGO: Skywork-OR1's controller moves the coefficient after every optimizer step
                entropy_control.after_step(step.seen, mask, cfg.top_entropy_quantile, world.sum)
    on_policy = source == "on-policy"
    diag = metrics.update_metrics(log.seen, None if on_policy else old_logp, None if on_policy else old_entropy, ref_logp,
                                  adv, mask, cfg, world, mu, correction, args.log_study_metrics,
                                  entropy_control is not None)  # PLUMBING: the logs
    if args.log_prefix_spread and not on_policy:  # the study's: every row once more, under the updated policy
        after = score_rows(lambda rows: rollout.logprobs(policy, ro, rows, args.temperature, chunk=args.logprob_chunk),
                           everything, mb_size, args.micro_batch_size, world)
        diag.update(metrics.prefix_spread(*world.gather_rows(after, old_logp, mask)))
    control = {} if entropy_control is None else entropy_control.logged()  # the coefficient, the bonus it applied
    return {**log.metrics(), "losses/entropy": diag.pop("losses/entropy"), **diag, **control}


# ---------------------------------------------------------------------------------------------------------------
# One RL step: sample -> score -> advantages -> update
# ---------------------------------------------------------------------------------------------------------------


def rl_step(policy, ref_policy, tokenizer, optimizer, scheduler, stream: PromptStream, cfg: LossConfig, args: Args,
            gen: torch.Generator, world: World = SINGLE, pi_old: str | None = None,
            entropy_control: losses.AdaptiveEntropy | None = None) -> tuple[Batch, dict]:
    t0 = time.time()
    policy.eval()
    # ALGO: G completions per prompt, sampled with generate and scored by the rule-based verifier
    with world.gathered(policy):  # PLUMBING: under --fsdp the whole model, gathered once for the rollout
        if args.dynamic_sampling:
            batch, drawn_correct, drawn = dynamic_sampling(policy, tokenizer, stream, args, world)
        else:
            batch = sample_groups(policy, tokenizer, world.shard(stream.take(args.num_prompts)), args)
            drawn_correct, drawn = torch.tensor(batch.scores["correct"]).view(-1, args.num_generations), \
                args.num_prompts
    policy.train()
    t1 = time.time()
    reward = torch.tensor(batch.scores["reward"])  # (B_r,)
    if cfg.beta > 0 and cfg.kl_in == "reward":  # ALGO: r_i - beta sum_t KL_it(sampler || reference)
        on, rows = batch.ro.to(policy.device), torch.arange(len(batch.ro.lengths), device=policy.device)
        with world.scored(ref_policy):  # PLUMBING: score_rows, and under --fsdp the reference's root freed after
            ref_logp = score_rows(lambda r: rollout.logprobs(ref_policy, on, r, args.temperature,
                                                             chunk=args.logprob_chunk), rows,
                                  len(rows) // args.num_minibatches, args.micro_batch_size, world).cpu()
        reward = reward - cfg.beta * losses.kl_in_reward(batch.ro.sampler_logp, ref_logp,
                                                         batch.ro.completion_mask.float(), cfg.kl_estimator)
    # ALGO: group-relative advantages, e.g. GRPO's A_i = (r_i - mean_group) / std_group, over the whole batch
    reward, lengths = world.gather_rows(reward, batch.ro.lengths)  # (B,) all ranks
    adv_all = losses.advantages(reward, args.num_generations, cfg.advantage_estimator, cfg.scale_rewards, lengths)
    adv = batch.advantages = world.shard(adv_all)  # (B_r,) this rank's rows (kept: --log-completions-every)
    # ALGO: the policy update with the objective --algo chose (losses.policy_loss)
    logged = update(policy, ref_policy, optimizer, scheduler, batch, adv, cfg, args, gen, world, pi_old,
                     entropy_control)
    t2 = time.time()
    # PLUMBING: metrics for the logs, over every rank's rows
    logged.update(metrics.rollout_metrics(batch, adv_all, args.num_generations, drawn_correct, drawn,
                                        drawn - args.num_prompts, world, args.mask_truncated, args.log_study_metrics))
    logged.update(metrics.timing(batch, t1 - t0, t2 - t1, scheduler.get_last_lr()[0], world))
    return batch, logged


# ---------------------------------------------------------------------------------------------------------------
# The held-out evaluation: greedy accuracy (and pass@k)
# ---------------------------------------------------------------------------------------------------------------


def evaluate(policy, tokenizer, examples: list[task.Example], args: Args, step: int, world: World = SINGLE,
             chunk: int = 256) -> tuple[dict, list]:
    """Greedy held-out accuracy and mean reward; with --eval-samples N, also pass@1 and pass@N over N samples per
    problem at the training temperature, drawn from a stream of their own seeded by the step (the training run's
    stream does not move). Under torchrun each rank scores every N-th problem; the sums are shared. Returns the
    metrics and this rank's greedy answers, one dict per problem (its index in `examples`, what it was asked and
    answered, the reference, correct and reward)."""
    policy.eval()
    mine = examples[world.rank::world.size]

    def in_pieces(rows: list, greedy: bool) -> list[Batch]:  # PLUMBING: `chunk` rows at a time, halved after an
        out = []  # out-of-memory error (sampling holds no collective: under torchrun a rank halves alone)
        for i in range(0, len(rows), chunk):
            part = rows[i:i + chunk]
            out += lifecycle.shrink_on_oom(lambda n: [sample(policy, tokenizer, part[j:j + n], args, greedy=greedy)
                                                      for j in range(0, len(part), n)],
                                           len(part), 0, key=f"evaluate {greedy}")
        return out

    with world.gathered(policy):  # PLUMBING: under --fsdp the whole model, once for all of it
        correct, reward, texts = [], [], []
        for scored in in_pieces(mine, greedy=True):
            correct += scored.scores["correct"]
            reward += scored.scores["reward"]
            texts += scored.texts
        sums = [float(np.sum(correct)), float(np.sum(reward))]
        if args.eval_samples:
            n = args.eval_samples
            device = policy.device  # fork this rank's device only (fork_rng touches every GPU by default)
            with torch.random.fork_rng(devices=[] if device.type == "cpu" else [device.index or 0],
                                       device_type=device.type):
                torch.manual_seed(world.seed(args.seed * 100_003 + step))
                hits = [c for scored in in_pieces([ex for ex in mine for _ in range(n)], greedy=False)
                        for c in scored.scores["correct"]]
            per_problem = np.asarray(hits).reshape(len(mine), n).sum(1)  # (problems,) correct samples of n
            ks = sorted({1, n})
            sums += [float(np.sum([rewards.pass_at_k(n, int(c), k) for c in per_problem])) for k in ks]
    sums = world.sum(sums)
    out = {"eval/accuracy": sums[0] / len(examples), "eval/reward": sums[1] / len(examples)}
    if args.eval_samples:
        out.update({f"eval/pass@{k}": v / len(examples) for k, v in zip(ks, sums[2:])})
    policy.train()
    answers = [{"problem": world.rank + i * world.size, "prompt": ex.prompt, "completion": text, "reference": ex.answer,
                "correct": c, "reward": r} for i, (ex, text, c, r) in enumerate(zip(mine, texts, correct, reward))]
    return out, answers


# ---------------------------------------------------------------------------------------------------------------
# The loop
# ---------------------------------------------------------------------------------------------------------------


def train(args: Args) -> dict:
    args, cfg = runs.resolve(args)  # PLUMBING: the --algo preset fills every objective flag not given
    run_dir = Path(args.output_dir) / args.run_name
    # every flag, the run folder and the checkpoint to resume from, before anything is loaded or written
    resume_from, state = lifecycle.preflight(args, run_dir, ddp.world_size())
    world = ddp.setup(args.device)  # one process: the world of size 1; under torchrun: join the process group
    if args.threads:
        torch.set_num_threads(args.threads)
    # PLUMBING: Ctrl-C or SIGTERM finishes the step, saves and exits 0 (start-up, inside, keeps nothing instead)
    stop, run = lifecycle.GracefulStop(), None
    try:
        # data, policy, optimizer, a checkpoint restored; inside start-up a failure or Ctrl-C keeps nothing
        with runs.start_run(args, cfg, run_dir, resume_from, state, world) as run:
            pi_old = pi_old_source(args.num_minibatches, args.num_epochs, args.old_logprobs, args.rollout_correction,
                                   models.compute_dtype(run.policy))
            if args.total_steps:  # (--total-steps 0 only evaluates)
                print(logs.PI_OLD[pi_old])
            answers = None
            if not state:  # the held-out metrics before step 1 (a resumed run has them from its checkpoint)
                run.before, answers = evaluate(run.policy, run.tokenizer, run.test_set, args, 0, world)
                run.logger.log(run.before, step=0)
                if args.log_completions_every:  # every held-out problem's greedy answer
                    run.logger.completions(logs.every_rank(answers, world, "problem"), 0, "eval_completions")
            print(logs.eval_lines("before" if args.total_steps else "of --model", run.before, answers,
                                  len(run.test_set), 0))

        logged, run.started = run.before, time.time()
        resume_hint = f"resume with the same flags plus --resume auto (run folder {run_dir})"
        failures = lifecycle.StepFailures(run.save, run_dir, resume_hint, run.gen, run.stream, run.scheduler,
                                          world.size, run.optimizer, run.policy)
        watch = lifecycle.Watch(args.max_nonfinite_steps, args.num_minibatches * args.num_epochs, args.answer_format,
                                args.max_new_tokens, run.train_set[0].answer)  # non-finite streaks stop the run
        for step in range(run.first_step, args.total_steps + 1):
            # ALGO: one RL step
            with failures(step):
                batch, logged = rl_step(run.policy, run.ref_policy, run.tokenizer, run.optimizer, run.scheduler,
                                        run.stream, cfg, args, run.gen, world, pi_old, run.entropy_control)
            # PLUMBING: evaluation, logging, checkpoints, signals
            logged["perf/elapsed_min"] = run.minutes()
            evaluated = step % args.eval_every == 0 or step == args.total_steps
            if evaluated:
                with failures.evaluating(step):
                    held_out, answers = evaluate(run.policy, run.tokenizer, run.test_set, args, step, world)
                logged.update(held_out)
                if args.log_completions_every:
                    run.logger.completions(logs.every_rank(answers, world, "problem"), step, "eval_completions")
            run.logger.log(logged, step=step)
            if args.log_completions_every and step % args.log_completions_every == 0:  # what the policy wrote
                run.logger.completions(logs.completion_rows(batch, args.num_generations, world), step)
            eta = (time.time() - run.started) / (step - run.first_step + 1) * (args.total_steps - step)
            print(logs.console_line(step, args.total_steps, logged, eta, cfg.importance_sampling_level), flush=True)
            if evaluated:
                print(logs.eval_lines(f"at step {step}", logged, answers, len(run.test_set), step), flush=True)
            watch.check(step, logged)
            if stopped := run.checkpoint_or_stop(step, stop, resume_hint):
                return stopped
        if state and run.first_step > args.total_steps:  # resumed from its last step (a signal came before the end)
            logged, _ = evaluate(run.policy, run.tokenizer, run.test_set, args, args.total_steps, world)
        return runs.finish_run(run, logged)
    except BaseException as e:
        if run is not None:  # (start-up closes its own)
            run.logger.finish()
        if isinstance(e, KeyboardInterrupt):  # a second Ctrl-C: one line, not a traceback
            raise lifecycle.aborted(run_dir) from None
        raise
    finally:
        stop.restore()


def main(argv: list[str] | None = None) -> None:
    cli = flags.default_hints(flags.docstrings_as_help(Args), runs.help_defaults())
    args = flags.parse(cli, __doc__.split("\n\n")[0], argv)  # a parse error is one `error:` line, as every other bad input
    with errors.one_line_errors(cleanup=ddp.teardown):  # a user error: one `error: ...` line and exit code 2
        train(args)


if __name__ == "__main__":
    main()
