"""A run's set-up and end: the flags resolved from the --algo preset and the dataset's defaults, the run's name,
the data and the policy loaded and checked before anything is written, a checkpoint restored, and the final save.
Nothing here changes what is learned."""

from __future__ import annotations

import contextlib
import copy
import json
import random
import re
import shutil
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np
import torch

import losses
import model as models
import task
from losses import LossConfig
from plumbing import checkpoint, ddp, flags, lifecycle, logs
from base.errors import ConfigError
from plumbing.ddp import World


# Defaults that depend on --dataset: the long task needs room for 300-token answers, and its steps cost ~7x more.
DATASET_DEFAULTS = {"embedded-long(-instruct)": dict(max_new_tokens=task.LONG_MAX_NEW_TOKENS, total_steps=60),
                    "*": dict(max_new_tokens=64, total_steps=100),
                    # a pretrained model on a file or hub dataset: room for a chain of thought (TRL 1.16's GRPOConfig: 512)
                    "a file or hub dataset with a pretrained --model": dict(max_new_tokens=256, total_steps=100)}


def dataset_defaults(dataset: str, model: str) -> dict:
    """The defaults that depend on --dataset (the embedded model, whose context is 128 tokens, keeps 64 anywhere)."""
    if task.EMBEDDED_TASKS.get(dataset, (False, False))[1]:  # the long task, in either phrasing
        return DATASET_DEFAULTS["embedded-long(-instruct)"]
    pretrained = not dataset.startswith("embedded") and model != "embedded"
    return DATASET_DEFAULTS["a file or hub dataset with a pretrained --model" if pretrained else "*"]


def resolve(args) -> tuple[object, LossConfig]:
    """Fill every unset objective field from the --algo preset (config.json records the objective a run trained
    with), and make the objective's LossConfig, once, checked (losses.check_config)."""
    preset = losses.PRESETS[args.algo]
    filled = {f: getattr(preset, f) if getattr(args, f) is None else getattr(args, f) for f in losses.OBJECTIVE_FIELDS}
    # a setting the objective then never reads (an ablation over it would compare the same runs); its preset's own
    # value passes, so resolving resolved args again changes nothing
    no_kl, no_gate, estimator = filled["beta"] == 0, filled["surrogate"] != "sapo", filled["advantage_estimator"]
    no_kl_why = "shapes the KL term, which beta 0 turns off: set --beta > 0 (GRPO's 0.04)"
    no_gate_why = f"is SAPO's gate temperature; --surrogate {filled['surrogate']} has no gate: use --algo sapo"
    no_kernel = filled["surrogate"] != "vespo"
    no_kernel_why = f"shapes VESPO's kernel; --surrogate {filled['surrogate']} has none: use --algo vespo"
    for field, unread, why in (
            ("scale_rewards", estimator != "grpo", f"is grpo's divisor; --advantage-estimator {estimator} has its own "
                                                   "normalisation: use --advantage-estimator grpo"),
            ("kl_estimator", no_kl, no_kl_why), ("kl_in", no_kl, no_kl_why), ("kl_ratio_correction", no_kl, no_kl_why),
            ("sapo_tau_pos", no_gate, no_gate_why), ("sapo_tau_neg", no_gate, no_gate_why),
            *((f, no_kernel, no_kernel_why) for f in ("vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg",
                                                      "vespo_lambda_neg"))):
        if unread and getattr(args, field) not in (None, getattr(preset, field)):
            flag = "--" + field.replace("_", "-")
            raise ConfigError(f"{flag} {getattr(args, field)} {why}, or drop {flag} (--algo {args.algo})")
    if args.lora_alpha not in (None, 0.0) and not args.lora_rank:  # (resolved args hold 2 x 0 = 0.0)
        raise ConfigError(f"--lora-alpha {args.lora_alpha} scales a LoRA adapter, and without --lora-rank there is "
                          "none (every weight trains): add --lora-rank R > 0, or drop --lora-alpha")
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
    cfg = LossConfig(**filled)
    try:  # objective fields that do not go together (CISPO at sequence level, GMPO at token level, ...)
        losses.check_config(cfg)
    except ValueError as e:
        raise ConfigError(f"--algo {args.algo}: {e}")
    return args, cfg


def default_run_name(args) -> str:
    """<algo>[-<model>][-lora<r>][-<dataset>][-np<N>]-s<seed>: runs of the documented commands (another model, LoRA,
    dataset, torchrun) get folders of their own. The embedded model (or one of its warm starts, `warm-start-*`), the default
    dataset and one process add nothing (gspo-s0); a model adds its folder or file name (Qwen/Qwen2.5-0.5B-Instruct
    -> Qwen2.5-0.5B-Instruct, ./m.Q4_1.gguf -> m.Q4_1), a run's final/ (or a checkpoint's model/) its run's too
    (runs/gspo-s0/final -> gspo-s0-final). An evaluation alone (--total-steps 0) is eval-...: no objective trains."""
    parts = [args.algo if args.total_steps != 0 else "eval"]
    path = Path(args.model.rstrip("/"))
    model = path.name.removesuffix(".gguf")
    if model in ("final", "model", "merged") and path.parent.name:  # a run's final model, a checkpoint's
        model = f"{path.parent.name}-{model}"
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


def help_defaults() -> dict[str, str]:
    """--help's default for each field whose None means 'from --algo' or 'from --dataset' (from the code)."""
    def per_algo(field):
        return "(default from --algo: " + ", ".join(f"{a} {getattr(c, field)}" for a, c in losses.PRESETS.items()) + ")"
    def per_dataset(field):
        return "(default: " + "; ".join(f"{v[field]}" + ("" if d == "*" else f" for {d}" if " " in d else
                                                        f" for --dataset {d}")
                                        for d, v in sorted(DATASET_DEFAULTS.items(), key=lambda kv: kv[0] != "*")) + ")"
    return {**{f: per_algo(f) for f in losses.OBJECTIVE_FIELDS}, **{f: per_dataset(f) for f in DATASET_DEFAULTS["*"]},
            "dynamic_sampling": "(default from --algo: on for dapo, off for the others)",
            "overlong_weight": "(default from --algo: 1 for dapo, 0 for the others)",
            "lora_alpha": "(default: 2 x --lora-rank)",
            "run_name": "(default: <algo>[-<model>][-lora<r>][-<dataset>][-np<processes>]-s<seed>, e.g. gspo-s0)",
            "wandb_mode": "(default: online when a W&B API key or login exists, else offline)",
            "resume": "(default: start a new run)", "wandb_group": "(default: none)", "wandb_tags": "(default: none)",
            "rollout_correction_min": "(default: no lower bound)",
            "entropy_target": "(default: off; a fixed --entropy-coef)",
            "eval_dataset": "(default: a split of --dataset)"}


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def load_policy(args, path: Path | None = None, host: bool = False):
    """The starting policy of --model, or the model saved at `path` (a checkpoint), on the chosen device (`host`: on
    the CPU, for ddp.shard to take to the device one unit at a time)."""
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
        policy, tokenizer = models.load_model(name, torch.device("cpu") if host else device,
                                              dtype if args.lora_rank else torch.float32)
        policy = models.compute_in(policy, dtype)  # LoRA: a bf16 base (its fp32 adapter is what trains)
        return (models.head_in_fp32(policy) if args.cast_lm_head_to_fp32 else policy), tokenizer
    except models.ModelError as e:
        if path is None:
            raise
        raise checkpoint.CheckpointError(f"{path} cannot be loaded ({e}); {checkpoint.earlier_hint(path.parent)}")


def spread(examples: list, n: int) -> list:
    """n problems drawn evenly across the list (every len/n-th), the same in every run: a representative subset of
    a held-out set that is sorted (the embedded tasks' are, by divisor), where its first n would not be. 0: all."""
    if not n or n >= len(examples):
        return examples
    return [examples[i * len(examples) // n] for i in range(n)]


def load_data(args) -> tuple[list[task.Example], list[task.Example]]:
    """(training, held-out) problems. With --eval-dataset, its rows (its test split, if it has one; an embedded
    task's held-out split) are the held-out set, and a file or hub --dataset keeps every row for training (an
    embedded task keeps its training split)."""
    train, test = task.embedded_splits(args.dataset) or task.load_dataset(
        args.dataset, args.prompt_field, args.answer_field, args.dataset_config, split=not args.eval_dataset)
    if args.eval_dataset and (embedded := task.embedded_splits(args.eval_dataset)):
        test = embedded[1]  # an embedded task's held-out split, e.g. the long task's to see length generalise
    elif args.eval_dataset:
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


@dataclass
class Run:
    """What the loop works on, made by start_run: the policy and its optimizer, the data, the logger, and where a
    resumed run picks up (first_step, the minutes already spent, the held-out metrics before step 1: None until
    train.py's first evaluation)."""
    args: object  # train.Args
    run_dir: Path
    world: World
    policy: object
    ref_policy: object
    tokenizer: object
    optimizer: torch.optim.Optimizer
    scheduler: object
    stream: PromptStream
    gen: torch.Generator
    logger: logs.Logger
    train_set: list
    test_set: list
    before: dict | None
    first_step: int = 1
    minutes_before: float = 0.0
    entropy_control: losses.AdaptiveEntropy | None = None  # --entropy-target's state, kept in checkpoints
    started: float = 0.0  # wall clock when the loop began

    def checkpoint_or_stop(self, step: int, stop: lifecycle.GracefulStop, resume_hint: str) -> dict | None:
        """After `step`: a checkpoint every --save-every steps; after a signal to any rank, a checkpoint and the
        run's end (all ranks stop after the same step)."""
        stopping = self.world.any(stop.signal is not None)
        if (self.args.save_every and step % self.args.save_every == 0) or stopping:
            path = self.save(step)
        if not stopping:
            return None
        print(f"stopped by {stop.signal or 'a signal to another rank'} after step {step}; saved {path}; {resume_hint}")
        self.logger.finish()
        return {"stopped_at": step, "checkpoint": str(path)}

    def minutes(self) -> float:
        return self.minutes_before + (time.time() - self.started) / 60

    def save(self, step: int, rng: dict | None = None, cursor: int | None = None) -> Path:
        """A checkpoint of the state after `step` (all ranks call it: each rank's RNG streams are kept; under --fsdp
        each rank writes its shards of the weights and AdamW's moments, and rank 0 the rest)."""
        rngs = self.world.gather(rng or checkpoint.rng_state(self.gen))
        root, sharded = self.run_dir / "checkpoints", self.world.sharded is not None
        if sharded:  # every rank writes its shards into the temp folder, then rank 0 the rest (checkpoint.save)
            if self.world.main:  # a temp folder left by a kill mid-save goes before any rank writes into it
                shutil.rmtree(checkpoint.temp_path(root, step), ignore_errors=True)
            self.world.barrier()
            optimizer = {"param_groups": checkpoint.save_shards(checkpoint.temp_path(root, step) / "shards",
                                                                ddp.resharded(self.policy), self.optimizer)}
        else:
            optimizer = self.optimizer.state_dict()
        if self.world.main:
            checkpoint.save(root, step, self.policy, self.tokenizer, {
                "step": step, "cursor": self.stream.cursor if cursor is None else cursor, "config": asdict(self.args),
                "optimizer": optimizer, "sharded": sharded,
                "scheduler": self.scheduler.state_dict(), "rng_ranks": rngs,
                "wandb_id": getattr(self.logger.run, "id", None), "before": self.before, "minutes": self.minutes(),
                "entropy_control": None if self.entropy_control is None else vars(self.entropy_control),
            }, self.args.keep_checkpoints, sharded)
        self.world.barrier()
        return checkpoint.path_of(self.run_dir / "checkpoints", step)


@contextlib.contextmanager
def start_run(args, cfg: LossConfig, run_dir: Path, resume_from: Path | None, state: dict | None, world: World):
    """Load and check the data and the policy, write config.json, restore a checkpoint; yield the Run, still inside
    start-up: until the with-block ends (train.py evaluates before step 1 there), a failure or Ctrl-C removes the run
    folder this call created, nothing else."""
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
            if not args.lora_rank and args.total_steps:  # a full fine-tune whose weights and AdamW state cannot fit:
                # refused before loading (an evaluation alone, --total-steps 0, holds neither gradients nor moments)
                device = models.pick_device(args.device)
                models.refuse_what_cannot_fit(args.model, device, models.pick_dtype(device, args.dtype), cfg.beta > 0,
                                              world.size if args.fsdp else 1)
            # a checkpoint's model, or --model's (under LoRA the adapter goes on top; under --fsdp the shards do)
            whole = state and not args.lora_rank and not state.get("sharded")
            host = bool(args.fsdp and world.distributed and args.total_steps)  # sharded below, a unit at a time
            path = resume_from / "model" if whole else None
            if not host:  # (under --fsdp below: World.from_main is a collective, which every rank runs at once)
                policy, tokenizer = load_policy(args, path)
            if args.lora_rank:  # only the adapter trains; a checkpoint holds the adapter, over --model's weights
                policy = models.add_lora(policy, args.lora_rank, args.lora_alpha, args.lora_target_modules,
                                         adapter=resume_from / "model" if state else None, seed=args.seed)
        if host:  # --fsdp: rank 0 alone reads the weights, into host memory; the others get the model's skeleton
            # and, as ddp.shard takes it to the devices, their shards from rank 0
            policy, tokenizer = world.from_main(lambda: load_policy(args, path, host=True))
        if args.model != "embedded":  # (the embedded model's prompts were checked above, before its warm start)
            if args.enable_thinking:
                flags.check_thinking(tokenizer, args.model)
            flags.check_prompt_lengths(tokenizer, getattr(policy.config, "max_position_embeddings", None),
                                       train_set + test_set, args.max_new_tokens, args.answer_format,
                                       args.enable_thinking)
        ref_policy = None
        reference = cfg.beta > 0 and args.total_steps > 0  # (an evaluation alone, --total-steps 0, needs none)
        if reference and args.lora_rank:  # the starting policy, for the KL term: the base, adapter off
            ref_policy = models.AdapterOff(policy)
        elif reference:  # a frozen copy of the starting policy (not of a checkpoint), its linear layers in bf16
            ref_policy = models.frozen_reference(load_policy(args)[0] if whole else copy.deepcopy(policy))
        world.barrier()  # every rank has checked the run folder before rank 0 writes into it
        if world.main:
            folder.create()
            (run_dir / "config.json").write_text(json.dumps(asdict(args), indent=2))

        if args.gradient_checkpointing:  # transformers applies it in train mode only: never during generate
            models.enable_checkpointing(policy)
        seed_everything(world.seed(args.seed))  # after loading: a warm start built just now must not shift the RNG
        if args.total_steps:  # torchrun: DDP (it checks every rank holds the same weights); --fsdp: sharded
            world.wrap(policy, args.fsdp, from_rank0=host)
        elif not args.lora_rank:  # an evaluation alone: no DDP gradient buckets (4 bytes a weight) and no fp32
            models.linears_as_computed(policy)  # master copy (bf16: half the memory, the same scores); each rank
            # holds the whole model, as --fsdp's generation gathers it anyway
        if world.sharded is not None and ref_policy is not None:
            ddp.shard(ref_policy, frozen=True, device=world.device, from_rank0=host)
        trainable = [p for p in policy.parameters() if p.requires_grad]  # every weight, or the LoRA adapter
        # on a GPU the fused AdamW (transformers' default optimizer too): one kernel, no temporaries of the weights' size
        optimizer = torch.optim.AdamW(trainable, lr=args.lr, weight_decay=args.weight_decay,
                                      fused=trainable[0].device.type == "cuda")
        optimizer_steps = args.total_steps * args.num_minibatches * args.num_epochs
        from transformers import get_scheduler  # here, not at the top: it imports peft (~5 s), which a refusal skips
        scheduler = get_scheduler(args.lr_scheduler, optimizer, num_warmup_steps=args.warmup_steps,
                                  num_training_steps=optimizer_steps)
        stream = PromptStream(train_set, args.seed)  # the same order on every rank: each takes its share of a draw
        gen = torch.Generator().manual_seed(world.seed(args.seed))
        first_step, minutes_before = 1, 0.0
        if state:
            first_step, minutes_before = checkpoint.restore(state, optimizer, scheduler, gen, stream, world.rank,
                                                            world.sharded, resume_from)
            if world.main:  # the one writer of the run folder
                for logged in ("metrics.jsonl", "completions.jsonl", "eval_completions.jsonl"):
                    checkpoint.keep_steps_up_to(run_dir / logged, state["step"])
            print(f"resumed from {resume_from} at step {state['step']}")
            if len(checkpoint.rank_rngs(state)) != world.size:  # (only a sharded checkpoint gets here)
                print(f"note: written by {len(checkpoint.rank_rngs(state))} processes, resumed by {world.size}: the "
                      "same weights and AdamW state, resharded; new sampling streams, so not the uninterrupted run")
        logger = folder.logger = logs.Logger(args, run_dir, state["wandb_id"] if state else None, active=world.main)
        print(f"{args.algo}: {cfg}")
        print("\n".join(logs.startup_lines(args, run_dir, train_set, test_set, policy, world, held_out, logger.mode)))
        policy.train()
        control = None if args.entropy_target is None else losses.AdaptiveEntropy(cfg.entropy_coef,
                                                                                  args.entropy_target)
        if control is not None and state and state.get("entropy_control"):  # a resumed run goes on where it stood
            control = losses.AdaptiveEntropy(**{**state["entropy_control"], "window": (0.0, 0.0)})
        yield Run(args, run_dir, world, policy, ref_policy, tokenizer, optimizer, scheduler, stream, gen, logger,
                  train_set, test_set, state["before"] if state else None, first_step, minutes_before,
                  entropy_control=control)


def finish_run(run: Run, metrics: dict) -> dict:
    """Print the before -> after line, save the final policy, write summary.json (last: it marks the run finished).
    After an evaluation alone (--total-steps 0) the one accuracy, and no copy of the untrained model."""
    args, before, minutes = run.args, run.before, run.minutes()
    summary = {"algo": args.algo, "seed": args.seed, "steps": args.total_steps,
               "accuracy_before": before["eval/accuracy"], "accuracy_after": metrics["eval/accuracy"],
               "rl_minutes": minutes}
    if args.total_steps:
        print(f"held-out accuracy: {before['eval/accuracy']:.3f} -> {metrics['eval/accuracy']:.3f} "
              f"({args.algo}, seed {args.seed}, {args.total_steps} step{'s' * (args.total_steps > 1)}, {minutes:.1f} min)")
    else:
        print(f"held-out accuracy: {before['eval/accuracy']:.3f} ({args.model}, seed {args.seed}, evaluation only)")
    save = args.save_model and args.total_steps > 0  # the policy, or its LoRA adapter (--merge-lora: the merged model)
    # under --fsdp every rank sends its shards to rank 0, which writes them as one ordinary model
    whole = ddp.full_state_dict(run.policy) if run.world.sharded is not None and save else None
    if run.world.main:
        if save:
            models.save_final(run.policy, run.tokenizer, run.run_dir / "final", args.merge_lora, whole)
        (run.run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    run.logger.finish()
    run.world.barrier()
    return summary
