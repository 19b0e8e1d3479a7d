"""GRPO-family RL for language models, one process: `python train.py --algo gspo`.

Each step: draw P prompts -> sample G completions each -> verify -> group advantages -> split the P*G rollout into
`num_minibatches` optimizer steps for `num_epochs` passes, each step one of the four objectives in losses.py.
Only the first minibatch of a rollout is on-policy (ratio exactly 1); the later ones see a moved policy, which is
what makes the ratios, their variance and the clip fractions (the GSPO paper's subject) non-trivial.
"""

from __future__ import annotations

import copy
import json
import math
import os
import random
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Literal

import numpy as np
import torch
import tyro
from transformers import get_scheduler

import losses
import model as models
import rewards
import rollout
import task
from losses import LossConfig, StepNorm


@dataclass
class Args:
    algo: Literal["grpo", "dr_grpo", "dapo", "gspo"] = "gspo"
    """objective preset with its paper's values; any objective field below that is left unset takes them"""
    seed: int = 0
    """seed of everything (sampling, data order, warm start); the same seed repeats a run exactly"""

    # model and data
    model: str = "embedded"
    """'embedded' (tiny Llama, warm-started offline), a hub id, a save_pretrained directory, or a .gguf file"""
    dataset: str = "embedded"
    """'embedded' (the generated remainder task), a JSONL file of {"prompt", "answer"} rows, or a hub dataset"""
    device: str = "auto"
    """cuda, mps or cpu; auto picks the first available"""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """auto: bf16 on GPUs that support it, else fp32"""

    # rollout
    total_steps: int = 100
    """RL steps (one rollout each)"""
    num_prompts: int = 16
    """P: prompts per rollout"""
    num_generations: int = 8
    """G: completions per prompt (the group)"""
    max_new_tokens: int = 64
    """generation budget per completion; also Dr.GRPO's normaliser and DAPO's L_max"""
    temperature: float = 1.0
    """sampling temperature; log-probs are taken at the same temperature"""

    # optimisation
    num_minibatches: int = 4
    """optimizer steps per rollout pass (the GSPO paper uses 4); 1 with num_epochs 1 is fully on-policy"""
    num_epochs: int = 1
    """passes over each rollout"""
    micro_batch_size: int = 0
    """rows per forward/backward (gradient accumulation); 0: a whole minibatch at once"""
    lr: float = 5e-5
    """AdamW learning rate"""
    lr_scheduler: str = "constant_with_warmup"
    """any transformers scheduler name (linear, cosine, constant_with_warmup, ...)"""
    warmup_steps: int = 8
    """optimizer steps of linear warmup"""
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    """gradient clipping by global norm"""

    # objective: None takes the --algo preset (see losses.PRESETS)
    importance_sampling_level: Literal["token", "sequence", "sequence_token"] | None = None
    """token: rho_t (GRPO, Dr.GRPO, DAPO); sequence: GSPO's s_i; sequence_token: GSPO-token"""
    loss_agg_mode: Literal["seq-mean-token-mean", "token-mean", "seq-mean-token-sum-norm"] | None = None
    """how per-token losses are summed (GRPO/GSPO, DAPO, Dr.GRPO respectively)"""
    epsilon: float | None = None
    """lower clip range: w >= 1 - epsilon"""
    epsilon_high: float | None = None
    """upper clip range: w <= 1 + epsilon_high (DAPO's clip-higher when above epsilon)"""
    beta: float | None = None
    """weight of the k3 KL to the starting policy (GRPO 0.04, else 0); 0 loads no reference model"""
    scale_rewards: bool | None = None
    """divide group advantages by the group's reward std (off for Dr.GRPO)"""
    dynamic_sampling: bool | None = None
    """DAPO: re-draw prompts until every group has mixed correctness"""
    max_sampling_rounds: int = 8
    """dynamic sampling gives up with an error after this many rollouts in one step"""
    overlong_weight: float | None = None
    """weight of DAPO's soft overlong punishment (DAPO 1, else 0)"""
    overlong_cache: int = 16
    """L_cache: the punishment ramps from 0 to -1 over the last this-many tokens before max_new_tokens"""
    format_weight: float = 0.1
    """weight of the format term (a single <answer>...</answer> ending the completion)"""

    # evaluation and logging
    eval_every: int = 25
    """held-out greedy evaluation every this many steps (and before and after training)"""
    eval_size: int = 0
    """held-out problems to evaluate; 0: all"""
    output_dir: str = "runs"
    """each run writes <output_dir>/<run_name>/ (metrics.jsonl, final model, wandb files)"""
    run_name: str | None = None
    """default: <algo>-s<seed>"""
    wandb_mode: Literal["online", "offline", "disabled"] | None = None
    """default: online when a W&B API key or login exists, else offline; never prompts"""
    wandb_project: str = "grpo-family"
    wandb_group: str | None = None
    """groups the runs of a sweep"""
    wandb_tags: tuple[str, ...] = ()
    save_model: bool = True
    """save the final policy with save_pretrained"""


OBJECTIVE_FIELDS = ("importance_sampling_level", "loss_agg_mode", "epsilon", "epsilon_high", "beta", "scale_rewards")


def resolve(args: Args) -> tuple[Args, LossConfig]:
    """Fill every unset objective field from the --algo preset."""
    preset = losses.PRESETS[args.algo]
    filled = {f: getattr(preset, f) if getattr(args, f) is None else getattr(args, f) for f in OBJECTIVE_FIELDS}
    is_dapo = args.algo == "dapo"
    args = replace(
        args, **filled,
        dynamic_sampling=is_dapo if args.dynamic_sampling is None else args.dynamic_sampling,
        overlong_weight=(1.0 if is_dapo else 0.0) if args.overlong_weight is None else args.overlong_weight,
        run_name=args.run_name or f"{args.algo}-s{args.seed}",
    )
    return args, LossConfig(**filled)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


# ---------------------------------------------------------------------------------------------------------------
# Set-up: policy and data
# ---------------------------------------------------------------------------------------------------------------


def load_policy(args: Args):
    device = models.pick_device(args.device)
    dtype = models.pick_dtype(device, args.dtype)
    name = args.model
    if name == "embedded":
        name = str(models.warm_start(seed=args.seed))
    return models.load_model(name, device, dtype)


def load_data(args: Args) -> tuple[list[task.Example], list[task.Example]]:
    if args.dataset == "embedded":
        return task.default_splits()
    if Path(args.dataset).suffix in (".jsonl", ".json") or Path(args.dataset).exists():
        return task.heldout_split(task.load_jsonl(args.dataset))
    return task.heldout_split(task.load_hub_dataset(args.dataset))


class PromptStream:
    """Training prompts in a seeded random order, reshuffled each pass; `cursor` says how far it has read."""

    def __init__(self, examples: list[task.Example], seed: int):
        self.examples, self.seed, self.cursor = examples, seed, 0

    def take(self, n: int) -> list[task.Example]:
        out = []
        for _ in range(n):
            epoch, i = divmod(self.cursor, len(self.examples))
            order = np.random.default_rng([self.seed, epoch]).permutation(len(self.examples))
            out.append(self.examples[order[i]])
            self.cursor += 1
        return out


# ---------------------------------------------------------------------------------------------------------------
# One rollout: sample, verify, advantages
# ---------------------------------------------------------------------------------------------------------------


@dataclass
class Batch:
    ro: rollout.Rollout
    examples: list[task.Example]  # one per row (each prompt repeated G times)
    scores: dict[str, list[float]]
    texts: list[str]


def sample_batch(policy, tokenizer, examples: list[task.Example], args: Args) -> Batch:
    rows = [ex for ex in examples for _ in range(args.num_generations)]
    prompts = [models.format_prompt(tokenizer, ex.prompt) for ex in rows]
    ro = rollout.generate(policy, tokenizer, prompts, args.max_new_tokens, args.temperature)
    texts = tokenizer.batch_decode(ro.completion_ids * ro.completion_mask + tokenizer.pad_token_id *
                                   (1 - ro.completion_mask), skip_special_tokens=True)
    scores = rewards.score(texts, [ex.answer for ex in rows], ro.lengths.tolist(), ro.truncated.tolist(),
                           args.format_weight, args.overlong_weight, args.max_new_tokens, args.overlong_cache)
    return Batch(ro, rows, scores, texts)


def join(parts: list[Batch], pad_id: int) -> Batch:
    return Batch(rollout.Rollout.concat([p.ro for p in parts], pad_id), [e for p in parts for e in p.examples],
                 {k: [v for p in parts for v in p.scores[k]] for k in parts[0].scores}, [t for p in parts for t in p.texts])


def select_groups(batch: Batch, groups: list[int], g: int) -> Batch:
    rows = [gi * g + j for gi in groups for j in range(g)]
    return Batch(batch.ro.select(torch.tensor(rows)), [batch.examples[r] for r in rows],
                 {k: [v[r] for r in rows] for k, v in batch.scores.items()}, [batch.texts[r] for r in rows])


class DynamicSamplingError(RuntimeError):
    """Dynamic sampling could not fill a batch with informative groups."""


class ConfigError(ValueError):
    """A flag value that cannot work; the message says which and what to do."""


def collect_rollout(policy, tokenizer, stream: PromptStream, args: Args) -> tuple[Batch, dict]:
    """P groups of G completions. With dynamic sampling (DAPO), groups whose correctness is all 0 or all 1 are
    dropped and more prompts drawn, up to max_sampling_rounds rollouts; filtering uses raw correctness."""
    g, kept, drawn, all_correct = args.num_generations, [], 0, []
    for _ in range(args.max_sampling_rounds if args.dynamic_sampling else 1):
        batch = sample_batch(policy, tokenizer, stream.take(args.num_prompts), args)
        drawn += args.num_prompts
        correct = torch.tensor(batch.scores["correct"]).view(-1, g)  # (P, G)
        all_correct.append(correct)
        if not args.dynamic_sampling:
            kept.append(batch)
            break
        mixed = (correct.max(1).values != correct.min(1).values).nonzero().flatten().tolist()
        if mixed:
            kept.append(select_groups(batch, mixed, g))
        if sum(len(b.examples) for b in kept) >= args.num_prompts * g:
            break
    batch = join(kept, tokenizer.pad_token_id)
    n_rows = args.num_prompts * g
    if len(batch.examples) < n_rows:
        raise DynamicSamplingError(
            f"dynamic sampling found {len(batch.examples) // g} of {args.num_prompts} prompt groups with mixed "
            f"correctness after {args.max_sampling_rounds} rounds ({drawn} prompts drawn); raise "
            f"--max-sampling-rounds, raise --num-generations, or turn it off with --no-dynamic-sampling")
    batch = select_groups(batch, list(range(args.num_prompts)), g) if len(batch.examples) > n_rows else batch
    correct = torch.cat(all_correct)
    stats = {"dynamic/drawn": drawn, "dynamic/dropped": drawn - args.num_prompts if args.dynamic_sampling else 0,
             "charts/all_wrong_group_frac": float((correct.max(1).values == 0).float().mean()),
             "charts/all_right_group_frac": float((correct.min(1).values == 1).float().mean())}
    return batch, stats


def rollout_metrics(batch: Batch, adv: torch.Tensor, g: int) -> dict:
    reward = torch.tensor(batch.scores["reward"])
    correct = torch.tensor(batch.scores["correct"]).bool()
    lengths = batch.ro.lengths.float()
    m = {
        "charts/reward": float(reward.mean()),
        "charts/reward_std": float(reward.std()),
        "charts/accuracy": float(correct.float().mean()),
        "charts/zero_std_group_frac": float((reward.view(-1, g).std(1) == 0).float().mean()),
        "charts/completion_len": float(lengths.mean()),
        "charts/completion_len_min": float(lengths.min()),
        "charts/completion_len_max": float(lengths.max()),
        "charts/truncated_frac": float(batch.ro.truncated.float().mean()),
        "charts/advantage_abs": float(adv.abs().mean()),
    }
    m.update({f"rewards/{k}": float(np.mean(v)) for k, v in batch.scores.items() if k != "reward"})
    # Dr.GRPO's length-bias claim is about these two; a key is left out when its set is empty
    if correct.any():
        m["charts/len_correct"] = float(lengths[correct].mean())
    if (~correct).any():
        m["charts/len_incorrect"] = float(lengths[~correct].mean())
    return m


# ---------------------------------------------------------------------------------------------------------------
# The update: minibatches x epochs over one rollout
# ---------------------------------------------------------------------------------------------------------------


def logprobs_of(policy, ro: rollout.Rollout, rows: torch.Tensor, args: Args, with_entropy: bool = False):
    return rollout.completion_logprobs(policy, ro.input_ids[rows], ro.attention_mask[rows],
                                       ro.completion_ids.shape[1], args.temperature, with_entropy)


def update(policy, ref_policy, optimizer, scheduler, batch: Batch, adv: torch.Tensor, cfg: LossConfig,
           args: Args, gen: torch.Generator) -> dict:
    ro = batch.ro
    device = next(policy.parameters()).device
    ro = rollout.Rollout(*(t.to(device) for t in (ro.prompt_ids, ro.prompt_mask, ro.completion_ids,
                                                     ro.completion_mask, ro.truncated)))
    adv, mask = adv.to(device), ro.completion_mask.float()
    b = mask.shape[0]
    everything = torch.arange(b, device=device)
    on_policy = args.num_minibatches == 1 and args.num_epochs == 1
    old_logp = ref_logp = None
    with torch.inference_mode():
        if not on_policy:  # pi_old: once, before the first update; skipped when the ratio is 1 by construction
            old_logp, entropy = logprobs_of(policy, ro, everything, args, with_entropy=True)
        if cfg.beta > 0:
            ref_logp = logprobs_of(ref_policy, ro, everything, args)
    mb_size = b // args.num_minibatches
    micro = args.micro_batch_size or mb_size
    seen_logp, seen_rows, seen_entropy, step_losses, grad_norms, skipped = [], [], [], [], [], 0
    for _ in range(args.num_epochs):
        perm = torch.randperm(b, generator=gen).to(device)
        for mb in perm.split(mb_size):
            norm = StepNorm.of(mask[mb], args.max_new_tokens)  # normalisers of the whole optimizer step
            total = 0.0
            for rows in mb.split(micro):
                if on_policy:
                    logp, entropy = logprobs_of(policy, ro, rows, args, with_entropy=True)
                    old = logp.detach()
                    seen_entropy.append(entropy)
                else:
                    logp, old = logprobs_of(policy, ro, rows, args), old_logp[rows]
                loss, _ = losses.policy_loss(logp, old, adv[rows], mask[rows], norm, cfg,
                                             None if ref_logp is None else ref_logp[rows])
                loss.backward()
                total += loss.item()
                seen_logp.append(logp.detach())
                seen_rows.append(rows)
            grad_norm = torch.nn.utils.clip_grad_norm_(policy.parameters(), args.max_grad_norm)
            if math.isfinite(total) and torch.isfinite(grad_norm):
                optimizer.step()
                step_losses.append(total)
                grad_norms.append(float(grad_norm))
            else:  # a non-finite loss or gradient would poison the weights: skip this update
                skipped += 1
            optimizer.zero_grad(set_to_none=True)
            scheduler.step()
    # Diagnostics over every row scored during the update, each against pi_old: the statistics of the ratios
    # that the objective actually saw.
    rows = torch.cat(seen_rows)
    new = torch.cat([torch.zeros(0, mask.shape[1], device=device)] + seen_logp)
    old_all = new if on_policy else old_logp[rows]
    diag = losses.ratio_diagnostics(new, old_all, adv[rows], mask[rows], cfg)
    buckets = losses.length_bucket_stats(new, old_all, mask[rows])
    metrics = {
        "losses/policy_loss": float(np.mean(step_losses)) if step_losses else float("nan"),
        "losses/grad_norm": float(np.mean(grad_norms)) if grad_norms else float("nan"),
        "losses/entropy": losses.masked_mean(torch.cat(seen_entropy), mask[rows]) if on_policy
        else losses.masked_mean(entropy, mask),
        "losses/skipped_updates": skipped,
        **{("losses/" + k if k == "approx_kl" else k): v for k, v in diag.items()},
    }
    if ref_logp is not None:
        metrics["losses/kl_ref"] = losses.masked_mean(losses.k3_kl(new, ref_logp[rows]), mask[rows])
    for q, bucket in enumerate(buckets, 1):
        metrics.update({f"lenbucket/q{q}_{k}": v for k, v in bucket.items()})
    return metrics


# ---------------------------------------------------------------------------------------------------------------
# Evaluation
# ---------------------------------------------------------------------------------------------------------------


def evaluate(policy, tokenizer, examples: list[task.Example], args: Args, chunk: int = 256) -> dict:
    """Greedy held-out accuracy and mean reward."""
    policy.eval()
    correct, reward = [], []
    for i in range(0, len(examples), chunk):
        part = examples[i:i + chunk]
        ro = rollout.generate(policy, tokenizer, [models.format_prompt(tokenizer, e.prompt) for e in part],
                              args.max_new_tokens, greedy=True)
        texts = tokenizer.batch_decode(ro.completion_ids * ro.completion_mask + tokenizer.pad_token_id *
                                       (1 - ro.completion_mask), skip_special_tokens=True)
        s = rewards.score(texts, [e.answer for e in part], ro.lengths.tolist(), ro.truncated.tolist(),
                          args.format_weight, args.overlong_weight, args.max_new_tokens, args.overlong_cache)
        correct += s["correct"]
        reward += s["reward"]
    policy.train()
    return {"eval/accuracy": float(np.mean(correct)), "eval/reward": float(np.mean(reward))}


# ---------------------------------------------------------------------------------------------------------------
# Logging
# ---------------------------------------------------------------------------------------------------------------


def wandb_mode(requested: str | None) -> str:
    """online only when credentials exist; never an interactive login prompt."""
    if requested:
        return requested
    if os.environ.get("WANDB_MODE") in ("online", "offline", "disabled"):
        return os.environ["WANDB_MODE"]
    netrc = Path(os.environ.get("NETRC", Path.home() / ".netrc"))
    has_login = netrc.is_file() and "api.wandb.ai" in netrc.read_text(errors="ignore")
    return "online" if os.environ.get("WANDB_API_KEY") or has_login else "offline"


class Logger:
    """One metrics.jsonl per run (the sweep report reads it) and wandb with the same keys."""

    def __init__(self, args: Args, run_dir: Path):
        import wandb

        self.file = (run_dir / "metrics.jsonl").open("a")
        self.run = wandb.init(project=args.wandb_project, name=args.run_name, group=args.wandb_group,
                              tags=list(args.wandb_tags), config=asdict(args), dir=str(run_dir),
                              mode=wandb_mode(args.wandb_mode), settings=wandb.Settings(console="off", silent=True))

    def log(self, metrics: dict, step: int) -> None:
        clean = {k: (v if isinstance(v, (int, float)) and math.isfinite(v) else None) for k, v in metrics.items()}
        self.file.write(json.dumps({"step": step, **clean}) + "\n")
        self.file.flush()
        self.run.log({k: v for k, v in metrics.items() if isinstance(v, (int, float))}, step=step)

    def finish(self) -> None:
        self.file.close()
        self.run.finish()


def console_line(step: int, total: int, m: dict) -> str:
    return (f"step {step:>4}/{total} | reward {m['charts/reward']:.3f} acc {m['charts/accuracy']:.3f} | "
            f"len {m['charts/completion_len']:.1f} | loss {m['losses/policy_loss']:+.4f} | "
            f"clip {m['clip/frac']:.4f} ratio_var {m['ratio/token_var']:.2e} | "
            f"{m['perf/rollout_s']:.1f}s+{m['perf/update_s']:.1f}s")


# ---------------------------------------------------------------------------------------------------------------
# The loop
# ---------------------------------------------------------------------------------------------------------------


def validate(args: Args) -> None:
    if args.num_generations < 2:
        raise ConfigError(f"--num-generations must be at least 2 (got {args.num_generations}): "
                         "a group advantage compares completions of the same prompt")
    rows = args.num_prompts * args.num_generations
    if args.num_minibatches < 1 or rows % args.num_minibatches:
        raise ConfigError(f"--num-minibatches {args.num_minibatches} must divide the rollout's "
                         f"{args.num_prompts}x{args.num_generations}={rows} rows")


def train(args: Args) -> dict:
    args, cfg = resolve(args)
    validate(args)
    seed_everything(args.seed)
    run_dir = Path(args.output_dir) / args.run_name
    run_dir.mkdir(parents=True, exist_ok=True)
    policy, tokenizer = load_policy(args)
    train_set, test_set = load_data(args)
    test_set = test_set[: args.eval_size or None]
    ref_policy = None
    if cfg.beta > 0:  # a frozen copy of the starting policy, for the KL term
        ref_policy = copy.deepcopy(policy).eval().requires_grad_(False)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    optimizer_steps = args.total_steps * args.num_minibatches * args.num_epochs
    scheduler = get_scheduler(args.lr_scheduler, optimizer, num_warmup_steps=args.warmup_steps,
                              num_training_steps=optimizer_steps)
    stream = PromptStream(train_set, args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    logger = Logger(args, run_dir)
    if args.num_minibatches == 1 and args.num_epochs == 1:
        print("fully on-policy (1 minibatch, 1 epoch): every ratio is exactly 1, so pi_old needs no forward pass "
              "and nothing clips; use --num-minibatches > 1 to see the ratios move")
    print(f"{args.algo}: {cfg}")
    policy.train()
    before = evaluate(policy, tokenizer, test_set, args)
    logger.log(before, step=0)
    print(f"held-out accuracy before: {before['eval/accuracy']:.3f} ({len(test_set)} problems)")
    start = time.time()
    for step in range(1, args.total_steps + 1):
        t0 = time.time()
        policy.eval()
        batch, stats = collect_rollout(policy, tokenizer, stream, args)
        policy.train()
        t1 = time.time()
        reward = torch.tensor(batch.scores["reward"])
        adv = losses.group_advantages(reward, args.num_generations, scale=cfg.scale_rewards)  # (B,)
        metrics = update(policy, ref_policy, optimizer, scheduler, batch, adv, cfg, args, gen)
        t2 = time.time()
        metrics.update(stats)
        metrics.update(rollout_metrics(batch, adv, args.num_generations))
        metrics.update({"charts/lr": scheduler.get_last_lr()[0], "perf/rollout_s": t1 - t0, "perf/update_s": t2 - t1,
                        "perf/gen_tokens_per_s": float(batch.ro.lengths.sum()) / (t1 - t0),
                        "perf/elapsed_min": (time.time() - start) / 60})
        if step % args.eval_every == 0 or step == args.total_steps:
            metrics.update(evaluate(policy, tokenizer, test_set, args))
        logger.log(metrics, step=step)
        print(console_line(step, args.total_steps, metrics), flush=True)
    after = metrics
    minutes = (time.time() - start) / 60
    summary = {"algo": args.algo, "seed": args.seed, "accuracy_before": before["eval/accuracy"],
               "accuracy_after": after["eval/accuracy"], "rl_minutes": minutes}
    print(f"held-out accuracy: {before['eval/accuracy']:.3f} -> {after['eval/accuracy']:.3f} "
          f"({args.algo}, seed {args.seed}, {args.total_steps} steps, {minutes:.1f} min)")
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    if args.save_model:
        policy.save_pretrained(run_dir / "final")
        tokenizer.save_pretrained(run_dir / "final")
    logger.finish()
    return summary


def main() -> None:
    args = tyro.cli(Args, description=__doc__)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    try:
        train(args)
    except (ConfigError, task.TaskError, models.ModelError, DynamicSamplingError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
