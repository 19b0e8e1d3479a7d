"""GRPO-family RL for language models: `python train.py --algo gspo`.

Data parallel over N processes: `torchrun --nproc-per-node N train.py --algo gspo` (see ddp.py).

Each step: draw P prompts, sample G completions each, verify them, compute group advantages.

The P*G rollout then feeds `num_minibatches` optimizer steps per pass, for `num_epochs` passes;

each optimizer step is one of the seven objectives in losses.py.

Only a rollout's first minibatch is on-policy (ratio 1); the later ones see a moved policy,

so the ratios, their variance and the clip fractions (the GSPO paper's subject) are non-trivial.

Reading the code: `# ALGO:` marks the algorithm (change an objective or the loop there);

`# PLUMBING:` marks bookkeeping (devices, logs, checkpoints, failures) that changes nothing learned.
"""

from __future__ import annotations

import signal
import sys

if __name__ == "__main__" and signal.getsignal(signal.SIGINT) is signal.default_int_handler:
    # Ctrl-C while the libraries below load (seconds): one line, not an import traceback
    signal.signal(signal.SIGINT, lambda *_: sys.exit("interrupted before start-up; nothing was written"))

import copy
import json
import math
import random
import re
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Literal

import numpy as np
import torch

from plumbing import checkpoint
from plumbing import ddp
from tools import diagnostics
from plumbing import errors
from plumbing import flags
from plumbing import lifecycle
import losses
import model as models
from plumbing import network
import rewards
import rollout
import task
from plumbing.ddp import SINGLE, World
from plumbing.errors import DynamicSamplingError
from losses import LossConfig


@dataclass
class Args:
    algo: Literal["grpo", "dr_grpo", "dapo", "gspo", "cispo", "sapo", "gmpo"] = "gspo"
    """objective preset with its paper's values; any objective field below that is left unset takes them"""
    seed: int = 0
    """seed of everything (sampling, data order, warm start); the same seed repeats a run exactly"""

    # model and data
    model: str = "embedded"
    """'embedded' (tiny Llama, warm-started offline), a hub id, a save_pretrained directory, or a .gguf file"""
    dataset: str = "embedded"
    """'embedded' (the generated remainder task, 11-42-token answers), 'embedded-long' (the same, worked over up to 36
    subtractions: 20-295-token answers), 'embedded-instruct' (the default phrased for instruct models), 'embedded-add'
    (additions a + b <= 30 + 30 phrased for chat models, for --answer-format last-number), a JSONL, JSON,
    parquet or CSV file, a save_to_disk folder, or a hub dataset (all but JSONL/JSON need `pip install datasets`)"""
    prompt_field: str = ""
    """a file's or hub dataset's prompt column; default: prompt, question or problem"""
    answer_field: str = ""
    """its answer column; default: answer or solution (GSM8K's '#### 42' and MATH's \\boxed{} are cut to the answer)"""
    dataset_config: str = ""
    """a hub dataset's configuration (e.g. main for openai/gsm8k)"""
    device: str = "auto"
    """cuda, mps or cpu; auto picks the first available"""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """the precision forwards compute in: bf16 runs under autocast and trained weights, gradients and AdamW's moments
    stay fp32 (LoRA: a bf16 base, fp32 adapters). auto: bf16 on GPUs with native bf16, else fp32; float16 is refused"""
    threads: int = 0
    """CPU threads torch uses (0: its default, OMP_NUM_THREADS or one per core). On a busy or shared machine 1 is
    often faster; metrics repeat exactly for the same seed and thread count"""

    # rollout
    total_steps: int | None = None
    """RL steps (one rollout each)"""
    num_prompts: int = 16
    """P: prompts per rollout"""
    num_generations: int = 8
    """G: completions per prompt (the group)"""
    max_new_tokens: int | None = None
    """generation budget per completion; also Dr.GRPO's normaliser and DAPO's L_max"""
    temperature: float = 1.0
    """sampling temperature; log-probs are taken at the same temperature"""

    # optimisation
    num_minibatches: int = 4
    """optimizer steps per rollout pass (the GSPO paper uses 4); 1 with num_epochs 1 is fully on-policy"""
    num_epochs: int = 1
    """passes over each rollout"""
    old_logprobs: Literal["auto", "sampler", "recompute"] = "auto"
    """where pi_old comes from when a rollout feeds several updates. sampler: the log-probs of the distributions
    generate drew from (no extra forward pass); recompute: forward passes over the rollout before the first update
    (as TRL and verl do), then compared with the sampler's every step (mismatch/ metrics); auto: sampler in fp32,
    recompute in bf16 (a cached decode and a full forward round differently by more than GSPO's clip range: 23% of
    the default rollout's sequences, measured) and with --rollout-correction"""
    rollout_correction: Literal["off", "token_truncate", "token_mask", "sequence_truncate", "sequence_mask"] = "off"
    """reweight each token's loss by w = pi_old / mu, mu the sampler's distribution (TRL's vLLM importance-sampling
    correction): per token or per sequence (the product over its tokens); truncate caps w to [min, max], mask
    drops a unit whose w is outside it (IcePop/MIS). Needs pi_old recomputed"""
    rollout_correction_max: float | None = 3.0
    """C_max of --rollout-correction (TRL's default 3); None: no upper bound"""
    rollout_correction_min: float | None = None
    """C_min of --rollout-correction; None: no lower bound (TRL's default)"""
    micro_batch_size: int = 0
    """rows per forward/backward (gradient accumulation); 0: sized to the machine (a whole minibatch, halved on
    each out-of-memory error)"""
    gradient_checkpointing: bool = False
    """recompute activations in the backward pass instead of keeping them (transformers' own, non-reentrant): less
    memory for long completions at the cost of a second forward per layer; the same loss and gradient. Acts in the
    update only"""
    lora_rank: int = 0
    """LoRA rank r: train only low-rank adapters on --lora-target-modules (needs `pip install peft`); the reference
    policy of β > 0 is then the same model with its adapter off, not a second copy. 0: train every weight"""
    lora_alpha: float | None = None
    """LoRA scale α: each adapted layer adds (α / r) B A x"""
    lora_target_modules: tuple[str, ...] = models.LORA_TARGETS
    """the projections that get adapters (by module name)"""
    merge_lora: bool = False
    """with --lora-rank: also save the base with the adapter merged in (final/merged/, a plain model --model loads)"""
    lr: float = 5e-5
    """AdamW learning rate"""
    lr_scheduler: str = "constant_with_warmup"
    """any transformers scheduler name (linear, cosine, constant_with_warmup, ...)"""
    warmup_steps: int = 8
    """optimizer steps of linear warmup"""
    weight_decay: float = 0.0
    """AdamW weight decay (decoupled from the gradient)"""
    max_grad_norm: float = 1.0
    """gradient clipping by global norm"""

    # objective: None takes the --algo preset (see losses.PRESETS)
    importance_sampling_level: Literal["token", "sequence", "sequence_token"] | None = None
    """token: rho_t; sequence: GSPO's s_i; sequence_token: GSPO-token"""
    loss_agg_mode: Literal["seq-mean-token-mean", "token-mean", "seq-mean-token-sum-norm"] | None = None
    """how per-token losses are summed (losses.aggregate)"""
    epsilon: float | None = None
    """lower clip range: w >= 1 - epsilon"""
    epsilon_high: float | None = None
    """upper clip range: w <= 1 + epsilon_high (DAPO's clip-higher when above epsilon)"""
    beta: float | None = None
    """weight of the k3 KL to the starting policy; 0 loads no reference model"""
    scale_rewards: bool | None = None
    """divide group advantages by the group's reward std"""
    surrogate: Literal["clip", "cispo", "sapo", "gmpo"] | None = None
    """what the ratio does to the gradient (losses.surrogate_loss): PPO's clip; CISPO's capped, stop-gradient
    weight; SAPO's soft gate; GMPO's clipped geometric mean (epsilon and epsilon_high then bound log-ratios)"""
    sapo_tau_pos: float | None = None
    """SAPO's gate temperature for tokens with A > 0"""
    sapo_tau_neg: float | None = None
    """SAPO's gate temperature for tokens with A <= 0"""
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
    enable_thinking: bool = False
    """let a chat template that can think (Qwen3) open a thinking block; off, as most budgets here are too short"""
    answer_format: Literal["tags", "last-number", "boxed"] = "tags"
    """where the verifier reads the answer: tags (<answer>...</answer>, the embedded tasks), last-number (the last
    number, GSM8K-style prose), boxed (the last \\boxed{}, compared by math-verify); chat prompts are told the same"""

    # evaluation and logging
    eval_every: int = 25
    """held-out greedy evaluation every this many steps (and before and after training)"""
    eval_size: int = 0
    """held-out problems to evaluate, spread evenly over the held-out set (the same ones in every run); 0: all"""
    eval_dataset: str = ""
    """your own held-out set, read as --dataset is (formats, --prompt-field/--answer-field): its test split if it has
    one, else every row; a file or hub --dataset then trains on all its rows. Default: a split of --dataset"""
    eval_samples: int = 0
    """also draw this many samples per held-out problem at --temperature and log eval/pass@1 and eval/pass@N
    (unbiased estimator); 0: greedy accuracy only"""
    output_dir: str = "runs"
    """each run writes <output_dir>/<run_name>/ (metrics.jsonl, final model, wandb files)"""
    run_name: str | None = None
    """the run's folder and wandb name"""
    wandb_mode: Literal["online", "offline", "disabled"] | None = None
    """W&B logging; never prompts"""
    wandb_project: str = "grpo-family"
    """W&B project the run is logged to"""
    wandb_group: str | None = None
    """groups the runs of a sweep"""
    wandb_tags: tuple[str, ...] = ()
    """W&B tags of the run (sweeps add 'sweep' and the algo)"""
    save_model: bool = True
    """save the final policy with save_pretrained"""

    # checkpoints and the run's safety nets (lifecycle.py)
    save_every: int = 0
    """write a checkpoint every this many steps (0: only when stopped by a signal or an error)"""
    keep_checkpoints: int = 2
    """how many of the newest checkpoints to keep"""
    resume: str | None = None
    """'auto' (this run's latest checkpoint, if any), a checkpoint folder, or a run folder"""
    overwrite: bool = False
    """replace an existing run folder of the same name instead of refusing"""
    max_nonfinite_steps: int = 3
    """stop after this many steps in a row whose every update had a non-finite loss or gradient"""


# Defaults that depend on --dataset: the long task needs room for 300-token answers, and its steps cost ~7x more.
DATASET_DEFAULTS = {"embedded-long": dict(max_new_tokens=task.LONG_MAX_NEW_TOKENS, total_steps=60),
                    "*": dict(max_new_tokens=64, total_steps=100),
                    # a pretrained model on a file or hub dataset: room for a chain of thought (TRL 1.16's GRPOConfig: 512)
                    "a file or hub dataset with a pretrained --model": dict(max_new_tokens=256, total_steps=100)}
OBJECTIVE_FIELDS = losses.OBJECTIVE_FIELDS


def dataset_defaults(dataset: str, model: str) -> dict:
    """The defaults that depend on --dataset (the embedded model, whose context is 128 tokens, keeps 64 anywhere)."""
    if dataset in DATASET_DEFAULTS:
        return DATASET_DEFAULTS[dataset]
    pretrained = not dataset.startswith("embedded") and model != "embedded"
    return DATASET_DEFAULTS["a file or hub dataset with a pretrained --model" if pretrained else "*"]


def resolve(args: Args) -> tuple[Args, LossConfig]:
    """Fill every unset objective field from the --algo preset."""
    preset = losses.PRESETS[args.algo]
    filled = {f: getattr(preset, f) if getattr(args, f) is None else getattr(args, f) for f in OBJECTIVE_FIELDS}
    is_dapo = args.algo == "dapo"
    args = replace(
        args, **filled,
        dynamic_sampling=is_dapo if args.dynamic_sampling is None else args.dynamic_sampling,
        overlong_weight=(1.0 if is_dapo else 0.0) if args.overlong_weight is None else args.overlong_weight,
        lora_alpha=2.0 * args.lora_rank if args.lora_alpha is None else args.lora_alpha,
        run_name=args.run_name or default_run_name(args),
        **{k: v if getattr(args, k) is None else getattr(args, k)
           for k, v in dataset_defaults(args.dataset, args.model).items()},
    )
    return args, LossConfig(**filled)


def default_run_name(args: Args) -> str:
    """<algo>[-<model>][-lora<r>][-<dataset>][-np<N>]-s<seed>: runs of the documented commands (another model, LoRA,
    dataset, torchrun) get folders of their own. The embedded model (or one of its warm starts, `warm-start-*`), the default
    dataset and one process add nothing (gspo-s0); a model adds its folder or file name (Qwen/Qwen2.5-0.5B-Instruct
    -> Qwen2.5-0.5B-Instruct, ./m.Q4_1.gguf -> m.Q4_1)."""
    parts = [args.algo]
    model = Path(args.model.rstrip("/")).name.removesuffix(".gguf")
    if args.model != "embedded" and not model.startswith("warm-start-"):
        parts.append(model)
    if args.lora_rank:
        parts.append(f"lora{args.lora_rank}")
    if args.dataset != "embedded":
        name = Path(args.dataset.rstrip("/")).name
        name = name.split(".")[0] if Path(args.dataset).suffix else name  # data/gsm8k.jsonl -> gsm8k
        parts.append(name + (f"-{args.dataset_config}" if args.dataset_config else ""))
    if ddp.world_size() > 1:
        parts.append(f"np{ddp.world_size()}")
    return "-".join([re.sub(r"[^A-Za-z0-9_.-]+", "-", p) for p in parts] + [f"s{args.seed}"])


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


# ---------------------------------------------------------------------------------------------------------------
# Set-up: policy and data
# ---------------------------------------------------------------------------------------------------------------


def load_policy(args: Args, path: Path | None = None):
    """The starting policy of --model, or the model saved at `path` (a checkpoint), on the chosen device."""
    device = models.pick_device(args.device)
    dtype = models.pick_dtype(device, args.dtype)  # what forwards compute in; a full fine-tune keeps fp32 weights
    name = str(path) if path else args.model
    if name == "embedded":
        settings = models.warm_start_settings(args.dataset)
        if not models.warm_start_path(args.seed, settings).is_dir():
            print(f"building the embedded model's warm start for seed {args.seed} (supervised, a few minutes, once; "
                  f"cached in {models.cache_root()})", flush=True)
        name = str(models.warm_start(seed=args.seed, settings=settings))
    try:
        policy, tokenizer = models.load_model(name, device, dtype if args.lora_rank else torch.float32)
        return models.compute_in(policy, dtype), tokenizer  # LoRA: a bf16 base (its fp32 adapter is what trains)
    except models.ModelError as e:
        if path is None:
            raise
        raise checkpoint.CheckpointError(f"{path} cannot be loaded ({e}); {checkpoint.earlier_hint(path.parent)}")


EMBEDDED_TASKS = ("embedded", "embedded-instruct", "embedded-long")  # the remainder task, in three forms


def spread(examples: list, n: int) -> list:
    """n problems drawn evenly across the list (every len/n-th), the same in every run: a representative subset of
    a held-out set that is sorted (the embedded tasks' are, by divisor), where its first n would not be. 0: all."""
    if not n or n >= len(examples):
        return examples
    return [examples[i * len(examples) // n] for i in range(n)]


def load_data(args: Args) -> tuple[list[task.Example], list[task.Example]]:
    """(training, held-out) problems. With --eval-dataset, its rows (its test split, if it has one) are the held-out
    set, and a file or hub --dataset keeps every row for training (an embedded task keeps its training split)."""
    if args.dataset == "embedded-add":
        train, test = task.addition_splits()
    elif args.dataset in EMBEDDED_TASKS:
        train, test = task.default_splits(instruct=args.dataset == "embedded-instruct",
                                          long=args.dataset == "embedded-long")
    else:
        train, test = task.load_dataset(args.dataset, args.prompt_field, args.answer_field, args.dataset_config,
                                        split=not args.eval_dataset)
    if args.eval_dataset:
        rows, held = task.load_dataset(args.eval_dataset, args.prompt_field, args.answer_field, split=False)
        test = held or rows
    return train, test


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


def generate_and_score(policy, tokenizer, rows: list[task.Example], args: Args, greedy: bool = False) -> Batch:
    """One completion per row, decoded up to its first EOS and scored by every reward term."""
    prompts = [models.format_prompt(tokenizer, ex.prompt, args.answer_format, args.enable_thinking) for ex in rows]
    ro = rollout.generate(policy, tokenizer, prompts, args.max_new_tokens, args.temperature, greedy=greedy)
    valid = ro.completion_ids * ro.completion_mask + tokenizer.pad_token_id * (1 - ro.completion_mask)
    texts = tokenizer.batch_decode(valid, skip_special_tokens=True)
    scores = rewards.score(texts, [ex.answer for ex in rows], ro.lengths.tolist(), ro.truncated.tolist(),
                           args.format_weight, args.overlong_weight, args.max_new_tokens, args.overlong_cache,
                           args.answer_format)
    return Batch(ro, rows, scores, texts)


def sample_batch(policy, tokenizer, examples: list[task.Example], args: Args) -> Batch:
    """G sampled completions per prompt, each group in consecutive rows."""
    return generate_and_score(policy, tokenizer, [ex for ex in examples for _ in range(args.num_generations)], args)


def is_on_policy(args: Args) -> bool:
    """One minibatch, one epoch: every update sees the policy that sampled, so every ratio is exactly 1."""
    return args.num_minibatches == 1 and args.num_epochs == 1


def old_from_sampler(policy, args: Args) -> bool:
    """Whether pi_old is the sampler's own log-probs instead of recomputed (see Args.old_logprobs)."""
    if is_on_policy(args):
        return False  # pi_old is never needed
    if args.old_logprobs != "auto":
        return args.old_logprobs == "sampler"
    return models.compute_dtype(policy) == torch.float32 and args.rollout_correction == "off"


def join(parts: list[Batch], pad_id: int) -> Batch:
    return Batch(rollout.Rollout.concat([p.ro for p in parts], pad_id), [e for p in parts for e in p.examples],
                 {k: [v for p in parts for v in p.scores[k]] for k in parts[0].scores}, [t for p in parts for t in p.texts])


def select_groups(batch: Batch, groups: list[int], g: int) -> Batch:
    rows = [gi * g + j for gi in groups for j in range(g)]
    return Batch(batch.ro.select(torch.tensor(rows)), [batch.examples[r] for r in rows],
                 {k: [v[r] for r in rows] for k, v in batch.scores.items()}, [batch.texts[r] for r in rows])


def collect_rollout(policy, tokenizer, stream: PromptStream, args: Args, world: World = SINGLE) -> tuple[Batch, dict]:
    """P groups of G completions (this rank's P/N of them). With dynamic sampling (DAPO), groups whose correctness
    is all 0 or all 1 are dropped and more prompts drawn, up to max_sampling_rounds rollouts; filtering uses raw
    correctness. Every rank reads every global draw (one prompt cursor) and goes on until all ranks are full."""
    g, kept, drawn, all_correct, uniform = args.num_generations, [], 0, [], []
    n_rows, n_kept, short = args.num_prompts // world.size * g, 0, True  # this rank's rows; any rank still short?
    for _ in range(args.max_sampling_rounds if args.dynamic_sampling else 1):
        examples = world.shard(stream.take(args.num_prompts))
        drawn += args.num_prompts
        if n_kept < n_rows:  # a rank that is full only keeps the others company
            batch = sample_batch(policy, tokenizer, examples, args)
            correct = torch.tensor(batch.scores["correct"]).view(-1, g)  # (P/N, G)
            all_correct.append(correct)
            if not args.dynamic_sampling:
                kept.append(batch)
                n_kept, short = n_rows, False
                break
            is_mixed = correct.max(1).values != correct.min(1).values  # (P/N,)
            mixed = is_mixed.nonzero().flatten().tolist()
            uniform += [(batch.examples[i * g].prompt, "all right" if correct[i, 0] else "all wrong")
                        for i in (~is_mixed).nonzero().flatten().tolist()]
            if mixed:
                kept.append(select_groups(batch, mixed, g))
                n_kept += len(mixed) * g
        short = world.any(n_kept < n_rows)
        if not short:
            break
    if short:
        found = sum(min(n, n_rows) for n in world.gather(n_kept))
        raise DynamicSamplingError(
            f"dynamic sampling found {found // g} of {args.num_prompts} prompt groups with mixed "
            f"correctness after {args.max_sampling_rounds} rounds ({drawn} prompts drawn; e.g. "
            + "; ".join(f"{p!r} {v}" for p, v in uniform[:3]) + ")")
    batch = join(kept, tokenizer.pad_token_id)
    batch = select_groups(batch, list(range(n_rows // g)), g) if n_kept > n_rows else batch
    correct = torch.cat(world.gather_rows(torch.cat(all_correct)))  # (groups drawn, G) over all ranks
    stats = {"dynamic/drawn": drawn, "dynamic/dropped": drawn - args.num_prompts if args.dynamic_sampling else 0,
             "charts/all_wrong_group_frac": float((correct.max(1).values == 0).float().mean()),
             "charts/all_right_group_frac": float((correct.min(1).values == 1).float().mean())}
    return batch, stats


def rollout_metrics(batch: Batch, adv: torch.Tensor, g: int, world: World = SINGLE) -> dict:
    """Rewards, lengths and advantages of the whole rollout (every rank's rows)."""
    scores = {k: [v for part in world.gather(batch.scores) for v in part[k]] for k in batch.scores}
    lengths, truncated, adv = world.gather_rows(batch.ro.lengths.float(), batch.ro.truncated.float(), adv)
    reward = torch.tensor(scores["reward"])
    correct = torch.tensor(scores["correct"]).bool()
    m = {
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


# ---------------------------------------------------------------------------------------------------------------
# The update: minibatches x epochs over one rollout
# ---------------------------------------------------------------------------------------------------------------


def logprobs_of(policy, ro: rollout.Rollout, rows: torch.Tensor, args: Args, with_entropy: bool = False):
    return rollout.completion_logprobs(policy, ro.input_ids[rows], ro.attention_mask[rows],
                                       ro.completion_ids.shape[1], args.temperature, with_entropy)


def update(policy, ref_policy, optimizer, scheduler, batch: Batch, adv: torch.Tensor, cfg: LossConfig,
           args: Args, gen: torch.Generator, world: World = SINGLE) -> dict:
    device = next(policy.parameters()).device
    ro = batch.ro.to(device)
    adv, mask = adv.to(device), ro.completion_mask.float()
    b = mask.shape[0]
    everything = torch.arange(b, device=device)
    on_policy = is_on_policy(args)
    mb_size = b // args.num_minibatches
    old_logp = ref_logp = None
    from_sampler = old_from_sampler(policy, args)
    mu = None if from_sampler else ro.sampler_logp  # the sampler's log-probs, where pi_old is not them: (B, T)
    correction = None if args.rollout_correction == "off" else (
        args.rollout_correction, args.rollout_correction_min, args.rollout_correction_max)

    @torch.inference_mode()
    def score_all(model, micro: int, with_entropy: bool = False):
        """log-probs (and entropies) of every row, `micro` rows per forward: memory grows with the micro-batch."""
        parts = [logprobs_of(model, ro, rows, args, with_entropy) for rows in everything.split(micro)]
        return tuple(torch.cat(p) for p in zip(*parts)) if with_entropy else torch.cat(parts)

    # ALGO: pi_old and the reference policy, fixed for the whole update
    if from_sampler:  # pi_old as the sampler saw it
        old_logp, entropy = ro.sampler_logp, ro.sampler_entropy
    elif not on_policy:  # pi_old recomputed once, before the first update (on-policy: the ratio is 1 anyway)
        old_logp, entropy = lifecycle.shrink_on_oom(  # PLUMBING: in micro-batches, halved after out-of-memory
            lambda micro: score_all(policy, micro, with_entropy=True), mb_size, args.micro_batch_size,
            lambda: None, world.size)
    if cfg.beta > 0:
        ref_logp = lifecycle.shrink_on_oom(lambda micro: score_all(ref_policy, micro), mb_size,
                                           args.micro_batch_size, lambda: None, world.size)
    net = world.trainable(policy)  # the DDP wrapper under torchrun: its backward all-reduces the gradients

    def accumulate(mb: torch.Tensor, micro: int) -> tuple[float, list]:
        """Forward/backward over one optimizer step's rows, `micro` rows at a time (gradient accumulation);
        returns the summed loss and, per micro-batch, (rows, log-probs, entropy or None) for the diagnostics."""
        norm = world.step_norm(mask[mb], args.max_new_tokens)  # normalisers of the whole optimizer step, all ranks
        total, scored = 0.0, []
        parts = mb.split(micro)
        for i, rows in enumerate(parts):
            entropy_now = None
            with world.sync_gradients(last=i == len(parts) - 1):
                if on_policy:
                    logp, entropy_now = logprobs_of(net, ro, rows, args, with_entropy=True)
                    old = logp.detach()
                else:
                    logp, old = logprobs_of(net, ro, rows, args), old_logp[rows]
                # ALGO: --rollout-correction: w = pi_old / mu reweights each token's loss (losses.py)
                weight = None if correction is None else losses.rollout_correction_weights(
                    old, mu[rows], mask[rows], *correction)
                loss = losses.policy_loss(logp, old, adv[rows], mask[rows], norm, cfg,
                                          None if ref_logp is None else ref_logp[rows], rollout_weight=weight)
                world.backward(loss)  # under torchrun: scaled so that DDP's average over ranks is the sum
            total += loss.item()
            scored.append((rows, logp.detach(), entropy_now))
        return total, scored

    # ALGO: epochs x minibatches over the one rollout, one optimizer step per minibatch (PPO's inner loop)
    seen, step_losses, grad_norms, skipped = [], [], [], 0
    for _ in range(args.num_epochs):
        perm = torch.randperm(b, generator=gen).to(device)
        for mb in perm.split(mb_size):
            total, scored = lifecycle.shrink_on_oom(  # PLUMBING: micro-batches, halved after an out-of-memory error
                lambda micro: accumulate(mb, micro), mb_size, args.micro_batch_size,
                lambda: optimizer.zero_grad(set_to_none=True), world.size)
            total = world.sum([total])[0]  # the whole step's loss: every rank takes the same decision below
            seen += scored
            grad_norm = torch.nn.utils.clip_grad_norm_(policy.parameters(), args.max_grad_norm)
            if math.isfinite(total) and torch.isfinite(grad_norm):
                optimizer.step()
                scheduler.step()
                step_losses.append(total)
                grad_norms.append(float(grad_norm))
            else:  # a non-finite loss or gradient would poison the weights: skip this update
                skipped += 1
            optimizer.zero_grad(set_to_none=True)
    diag = update_metrics(seen, None if on_policy else old_logp, None if on_policy else entropy, ref_logp, adv, mask,
                          cfg, world, mu, correction)  # PLUMBING: what the update saw, for the logs
    return {"losses/policy_loss": float(np.mean(step_losses)) if step_losses else float("nan"),
            "losses/grad_norm": float(np.mean(grad_norms)) if grad_norms else float("nan"),
            "losses/entropy": diag.pop("losses/entropy"), "losses/skipped_updates": skipped, **diag}


def update_metrics(seen: list, old_logp, old_entropy, ref_logp, adv: torch.Tensor, mask: torch.Tensor,
                   cfg: LossConfig, world: World = SINGLE, mu: torch.Tensor | None = None,
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
    if correction is not None:  # what the correction did: the mean weight, and the units it truncated or dropped
        level, kind = correction[0].split("_")
        raw = losses.rollout_ratio(old_all, mu_seen, mask_seen, level)
        w = losses.bound_rollout_ratio(raw, kind, *correction[1:])
        units = mask_seen if w.shape == mask_seen.shape else (mask_seen.sum(-1, keepdim=True) > 0).float()
        metrics["correction/weight_mean"] = losses.masked_mean(w, units)
        metrics["correction/changed_frac"] = losses.masked_mean((w != raw).float(), units)
    return metrics


def rl_step(policy, ref_policy, tokenizer, optimizer, scheduler, stream: PromptStream, cfg: LossConfig, args: Args,
            gen: torch.Generator, world: World = SINGLE) -> tuple[Batch, dict]:
    """One RL step: a rollout, its group advantages, the minibatch updates; returns the batch and its metrics."""
    t0 = time.time()
    policy.eval()
    # ALGO: G completions per prompt, sampled with generate and scored by the rule-based verifier
    batch, stats = collect_rollout(policy, tokenizer, stream, args, world)
    policy.train()
    t1 = time.time()
    # ALGO: group-relative advantages, A_i = (r_i - mean_group) [/ std_group]
    reward = torch.tensor(batch.scores["reward"])
    adv = losses.group_advantages(reward, args.num_generations, scale=cfg.scale_rewards)  # (B,) whole groups: local
    # ALGO: the policy update with the objective --algo chose (losses.policy_loss)
    metrics = update(policy, ref_policy, optimizer, scheduler, batch, adv, cfg, args, gen, world)
    t2 = time.time()
    # PLUMBING: metrics for the logs
    metrics.update(stats)
    metrics.update(rollout_metrics(batch, adv, args.num_generations, world))
    tokens = world.sum([float(batch.ro.lengths.sum())])[0]
    metrics.update({"charts/lr": scheduler.get_last_lr()[0], "perf/rollout_s": t1 - t0, "perf/update_s": t2 - t1,
                    "perf/gen_tokens_per_s": tokens / (t1 - t0)})
    return batch, metrics


# ---------------------------------------------------------------------------------------------------------------
# Evaluation
# ---------------------------------------------------------------------------------------------------------------


def evaluate(policy, tokenizer, examples: list[task.Example], args: Args, step: int = 0, chunk: int = 256,
             world: World = SINGLE) -> dict:
    """Greedy held-out accuracy and mean reward; with --eval-samples N, also pass@1 and pass@N over N samples per
    problem at the training temperature. Under torchrun each rank scores every N-th problem; the sums are shared.
    Returns the metrics and the greedy answers to show (examples_to_show)."""
    policy.eval()
    mine = examples[world.rank::world.size]
    correct, reward, texts = [], [], []
    for i in range(0, len(mine), chunk):
        rows = mine[i:i + chunk]
        parts = lifecycle.shrink_on_oom(  # PLUMBING: in smaller pieces after an out-of-memory error
            lambda n: [generate_and_score(policy, tokenizer, rows[j:j + n], args, greedy=True)
                       for j in range(0, len(rows), n)], len(rows), 0, lambda: None, world.size, key="evaluate")
        for scored in parts:
            correct += scored.scores["correct"]
            reward += scored.scores["reward"]
            texts += scored.texts
    sums = [float(np.sum(correct)), float(np.sum(reward))]
    if args.eval_samples:
        n = args.eval_samples
        rows = [ex for ex in mine for _ in range(n)]
        # its own random stream, seeded by the step: sampling here must not move the training run's stream
        device = policy.device  # fork this rank's device only (by default fork_rng touches every GPU of the machine)
        devices = [] if device.type == "cpu" else [device.index or 0]
        with torch.random.fork_rng(devices=devices, device_type=device.type):
            torch.manual_seed(world.seed(args.seed * 100_003 + step))
            hits = [c for i in range(0, len(rows), chunk)
                    for c in generate_and_score(policy, tokenizer, rows[i:i + chunk], args).scores["correct"]]
        per_problem = np.asarray(hits).reshape(len(mine), n).sum(1)  # (problems,) correct samples of n
        ks = sorted({1, n})
        sums += [float(np.sum([rewards.pass_at_k(n, int(c), k) for c in per_problem])) for k in ks]
    sums = world.sum(sums)
    out = {"eval/accuracy": sums[0] / len(examples), "eval/reward": sums[1] / len(examples)}
    if args.eval_samples:
        out.update({f"eval/pass@{k}": v / len(examples) for k, v in zip(ks, sums[2:])})
    policy.train()
    return out, examples_to_show(mine, texts, correct, step)


def examples_to_show(examples: list, texts: list, correct: list, step: int) -> list[tuple]:
    """For the screen, a different problem at each evaluation (the step picks where to look): the first one
    answered right and the first answered wrong from there on, when both exist. (prompt, completion, reference,
    correct) each."""
    n = len(texts)
    picked = {}
    for k in range(n):
        i = (step * 37 + k) % n
        picked.setdefault(bool(correct[i]), i)
        if len(picked) == 2:
            break
    return [(examples[i].prompt, texts[i], examples[i].answer, ok) for ok, i in sorted(picked.items(), reverse=True)]


# ---------------------------------------------------------------------------------------------------------------
# Logging
# ---------------------------------------------------------------------------------------------------------------


class Logger:
    """One metrics.jsonl per run (the sweep report reads it) and wandb with the same keys; rank 0 only."""

    def __init__(self, args: Args, run_dir: Path, wandb_id: str | None = None, active: bool = True):
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


def precision(policy) -> str:
    """float32, or e.g. 'bfloat16 autocast, float32 weights'."""
    name = lambda dtype: str(dtype).removeprefix("torch.")  # noqa: E731
    compute = models.compute_dtype(policy)
    return name(compute) if compute == policy.dtype else f"{name(compute)} autocast, {name(policy.dtype)} weights"


def startup_lines(args: Args, run_dir: Path, train_set: list, test_set: list, policy, world: World,
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


# ---------------------------------------------------------------------------------------------------------------
# Start-up and the end of a run (plumbing: nothing here changes what is learned)
# ---------------------------------------------------------------------------------------------------------------


@dataclass
class Run:
    """What the loop works on, made by start_run: the policy and its optimizer, the data, the logger, and where a
    resumed run picks up (first_step, the minutes already spent, the held-out metrics before step 1)."""
    args: Args
    run_dir: Path
    world: World
    policy: object
    ref_policy: object
    tokenizer: object
    optimizer: torch.optim.Optimizer
    scheduler: object
    stream: PromptStream
    gen: torch.Generator
    logger: Logger
    train_set: list
    test_set: list
    before: dict
    first_step: int = 1
    minutes_before: float = 0.0
    started: float = 0.0  # wall clock when the loop began

    def minutes(self) -> float:
        return self.minutes_before + (time.time() - self.started) / 60

    def save(self, step: int, rng: dict | None = None, cursor: int | None = None) -> Path:
        """A checkpoint of the state after `step` (all ranks call it: each rank's RNG streams are kept)."""
        rngs = self.world.gather(rng or checkpoint.rng_state(self.gen))
        if self.world.main:
            checkpoint.save(self.run_dir / "checkpoints", step, self.policy, self.tokenizer, {
                "step": step, "cursor": self.stream.cursor if cursor is None else cursor, "config": asdict(self.args),
                "optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict(), "rng_ranks": rngs,
                "wandb_id": self.logger.run.id, "before": self.before, "minutes": self.minutes(),
            }, self.args.keep_checkpoints)
        self.world.barrier()
        return checkpoint.path_of(self.run_dir / "checkpoints", step)


def start_run(args: Args, cfg: LossConfig, run_dir: Path, resume_from: Path | None, state: dict | None,
              world: World) -> Run:
    """Load and check the data and the policy, write config.json, restore a checkpoint, evaluate before step 1.
    A failure or Ctrl-C in here removes the run folder this call created, nothing else."""
    with lifecycle.Startup(), lifecycle.NewRunFolder(run_dir, replace=args.overwrite and not state) as folder:
        # Everything that can fail on bad input is loaded before anything is written.
        with world.main_first():  # rank 0 builds any cache (warm start, download) before the others read it
            train_set, test_set = load_data(args)
            held_out = len(test_set)
            test_set = spread(test_set, args.eval_size)
            flags.check_references(train_set + test_set, args.answer_format)
            if args.model == "embedded":  # its tokenizer and context are known before any warm start is built
                flags.check_prompt_lengths(models.build_tokenizer(), models.context_without_loading(
                    args.model, args.dataset), train_set + test_set, args.max_new_tokens, args.answer_format)
            policy, tokenizer = load_policy(args, resume_from / "model" if state and not args.lora_rank else None)
            if args.lora_rank:  # only the adapter trains; a checkpoint holds the adapter, over --model's weights
                policy = models.add_lora(policy, args.lora_rank, args.lora_alpha, args.lora_target_modules,
                                         adapter=resume_from / "model" if state else None, seed=args.seed)
        if args.model != "embedded":  # (the embedded model's prompts were checked above, before its warm start)
            flags.check_prompt_lengths(tokenizer, getattr(policy.config, "max_position_embeddings", None),
                                       train_set + test_set, args.max_new_tokens, args.answer_format)
        ref_policy = None
        if cfg.beta > 0 and args.lora_rank:  # the starting policy, for the KL term: the base, adapter off
            ref_policy = models.AdapterOff(policy)
        elif cfg.beta > 0:  # a frozen copy of the starting policy (not of a checkpoint)
            ref = load_policy(args)[0] if state else copy.deepcopy(policy)
            ref_policy = ref.eval().requires_grad_(False)
        world.barrier()  # every rank has checked the run folder before rank 0 writes into it
        if world.main:
            folder.create()
            (run_dir / "config.json").write_text(json.dumps(asdict(args), indent=2))

        if args.gradient_checkpointing:  # transformers applies it in train mode only: never during generate
            models.enable_checkpointing(policy)
        seed_everything(world.seed(args.seed))  # after loading: a warm start built just now must not shift the RNG
        world.wrap(policy)  # under torchrun: DistributedDataParallel (it checks every rank holds the same weights)
        trainable = [p for p in policy.parameters() if p.requires_grad]  # every weight, or the LoRA adapter
        optimizer = torch.optim.AdamW(trainable, lr=args.lr, weight_decay=args.weight_decay)
        optimizer_steps = args.total_steps * args.num_minibatches * args.num_epochs
        from transformers import get_scheduler  # here, not at the top: it imports peft (~5 s), which a refusal skips
        scheduler = get_scheduler(args.lr_scheduler, optimizer, num_warmup_steps=args.warmup_steps,
                                  num_training_steps=optimizer_steps)
        stream = PromptStream(train_set, args.seed)  # the same order on every rank: each takes its share of a draw
        gen = torch.Generator().manual_seed(world.seed(args.seed))
        first_step, minutes_before = 1, 0.0
        if state:
            first_step, minutes_before = checkpoint.restore(state, optimizer, scheduler, gen, stream, world.rank)
            if world.main:  # the one writer of the run folder
                checkpoint.keep_metrics_up_to(run_dir / "metrics.jsonl", state["step"])
            print(f"resumed from {resume_from} at step {state['step']}")
        logger = folder.logger = Logger(args, run_dir, state["wandb_id"] if state else None, active=world.main)
        if is_on_policy(args):
            print("fully on-policy (1 minibatch, 1 epoch): every ratio is exactly 1, so pi_old needs no forward "
                  "pass and nothing clips; use --num-minibatches > 1 to see the ratios move")
        else:
            print("pi_old: " + ("the sampler's own log-probs (no extra forward pass)" if old_from_sampler(policy, args)
                                else "recomputed by one forward pass over each rollout before its first update"))
        print(f"{args.algo}: {cfg}")
        print("\n".join(startup_lines(args, run_dir, train_set, test_set, policy, world, held_out)))
        policy.train()
        if state:
            before = state["before"]
        else:
            before, sample = evaluate(policy, tokenizer, test_set, args, step=0, world=world)
            logger.log(before, step=0)
        print(eval_lines("before", before, None if state else sample, len(test_set)))
    return Run(args, run_dir, world, policy, ref_policy, tokenizer, optimizer, scheduler, stream, gen, logger,
               train_set, test_set, before, first_step, minutes_before)


def finish_run(run: Run, metrics: dict) -> dict:
    """Print the before -> after line, save the final policy, write summary.json (last: it marks the run finished)."""
    args, before, minutes = run.args, run.before, run.minutes()
    summary = {"algo": args.algo, "seed": args.seed, "steps": args.total_steps,
               "accuracy_before": before["eval/accuracy"], "accuracy_after": metrics["eval/accuracy"],
               "rl_minutes": minutes}
    print(f"held-out accuracy: {before['eval/accuracy']:.3f} -> {metrics['eval/accuracy']:.3f} "
          f"({args.algo}, seed {args.seed}, {args.total_steps} steps, {minutes:.1f} min)")
    if run.world.main:
        if args.save_model:  # the policy, or its LoRA adapter (and with --merge-lora the merged model)
            models.save_final(run.policy, run.tokenizer, run.run_dir / "final", args.merge_lora)
        (run.run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    run.logger.finish()
    run.world.barrier()
    return summary


# ---------------------------------------------------------------------------------------------------------------
# The loop
# ---------------------------------------------------------------------------------------------------------------


def train(args: Args) -> dict:
    args, cfg = resolve(args)  # PLUMBING: the --algo preset fills every objective flag not given
    run_dir = Path(args.output_dir) / args.run_name
    # every flag, the run folder and the checkpoint to resume from, before anything is loaded or written
    resume_from, state = lifecycle.preflight(args, run_dir, ddp.world_size())
    world = ddp.setup(args.device)  # one process: the world of size 1; under torchrun: join the process group
    if args.threads:
        torch.set_num_threads(args.threads)
    run = start_run(args, cfg, run_dir, resume_from, state, world)  # data, policy, optimizer, the first evaluation

    stop, metrics, run.started = lifecycle.GracefulStop(), run.before, time.time()
    resume_hint = f"resume with the same flags plus --resume auto (run folder {run_dir})"
    failures = lifecycle.StepFailures(run.save, run_dir, resume_hint, run.gen, run.stream, run.scheduler, world.size)
    watch = lifecycle.Watch(args, run.train_set[0].answer)  # non-finite streaks stop the run; others warn once
    try:
        for step in range(run.first_step, args.total_steps + 1):
            # ALGO: one RL step: G samples per prompt, verifier rewards, group advantages, the minibatch updates
            with failures(step):
                _, metrics = rl_step(run.policy, run.ref_policy, run.tokenizer, run.optimizer, run.scheduler,
                                     run.stream, cfg, args, run.gen, world)
            # PLUMBING: evaluation, logging, checkpoints, signals
            metrics["perf/elapsed_min"] = run.minutes()
            evaluated = step % args.eval_every == 0 or step == args.total_steps
            if evaluated:
                held_out, sample = evaluate(run.policy, run.tokenizer, run.test_set, args, step, world=world)
                metrics.update(held_out)
            run.logger.log(metrics, step=step)
            eta = (time.time() - run.started) / (step - run.first_step + 1) * (args.total_steps - step)
            print(console_line(step, args.total_steps, metrics, eta, cfg.importance_sampling_level), flush=True)
            if evaluated:
                print(eval_lines(f"at step {step}", metrics, sample, len(run.test_set)), flush=True)
            watch.check(step, metrics)
            stopping = world.any(stop.signal is not None)  # a signal to any rank stops them all after this step
            if (args.save_every and step % args.save_every == 0) or stopping:
                path = run.save(step)
            if stopping:
                print(f"stopped by {stop.signal or 'a signal to another rank'} after step {step}; saved {path}; "
                      f"{resume_hint}")
                run.logger.finish()
                return {"stopped_at": step, "checkpoint": str(path)}
    except BaseException:
        run.logger.finish()
        raise
    finally:
        stop.restore()
    return finish_run(run, metrics)


def help_defaults() -> dict[str, str]:
    """--help's default for each field whose None means 'from --algo' or 'from --dataset' (from the code)."""
    def per_algo(field):
        return "(default from --algo: " + ", ".join(f"{a} {getattr(c, field)}" for a, c in losses.PRESETS.items()) + ")"
    def per_dataset(field):
        return "(default: " + "; ".join(f"{v[field]}" + ("" if d == "*" else f" for {d}" if " " in d else
                                                        f" for --dataset {d}")
                                        for d, v in sorted(DATASET_DEFAULTS.items(), key=lambda kv: kv[0] != "*")) + ")"
    return {**{f: per_algo(f) for f in OBJECTIVE_FIELDS}, **{f: per_dataset(f) for f in DATASET_DEFAULTS["*"]},
            "dynamic_sampling": "(default from --algo: on for dapo, off for the others)",
            "overlong_weight": "(default from --algo: 1 for dapo, 0 for the others)",
            "lora_alpha": "(default: 2 x --lora-rank)",
            "run_name": "(default: <algo>[-<model>][-lora<r>][-<dataset>][-np<processes>]-s<seed>, e.g. gspo-s0)",
            "wandb_mode": "(default: online when a W&B API key or login exists, else offline)",
            "resume": "(default: start a new run)", "wandb_group": "(default: none)",
            "rollout_correction_min": "(default: no lower bound)",
            "eval_dataset": "(default: a split of --dataset)"}


def main(argv: list[str] | None = None) -> None:
    cli = flags.default_hints(flags.docstrings_as_help(Args), help_defaults())
    args = flags.parse(cli, __doc__, argv)  # a parse error is one `error:` line, as every other bad input
    with errors.one_line_errors():  # a user error is one `error: ...` line and exit code 2, not a traceback
        train(args)


if __name__ == "__main__":
    main()
