"""Where a run's metrics go and what it prints: metrics.jsonl and wandb (Logger), what the policy wrote (a rollout's
completions, an evaluation's answers), the step line, the evaluation lines and the start-up lines (what the metrics
are: metrics.py). Nothing here changes what is learned."""

from __future__ import annotations

import json
import math
from dataclasses import asdict
from pathlib import Path

import torch

import model as models
import task
from base import network
from plumbing import ddp
from plumbing.ddp import World


class Logger:
    """One metrics.jsonl per run (the sweep report reads it) and wandb with the same keys; rank 0 only."""

    def __init__(self, args, run_dir: Path, wandb_id: str | None = None, active: bool = True):
        self.file = self.run = None
        self.run_dir = run_dir
        if active:
            self.file = (run_dir / "metrics.jsonl").open("a")
            self.run = network.wandb_init(project=args.wandb_project, name=args.run_name, group=args.wandb_group,
                                         tags=list(args.wandb_tags), config=asdict(args), dir=str(run_dir),
                                         mode=network.wandb_mode(args.wandb_mode), id=wandb_id,
                                         resume="allow" if wandb_id else None)
        # the mode wandb runs in: online can fall back to offline (no answer, a refused login), said in a warning
        self.mode = network.wandb_mode(args.wandb_mode) if self.run is None else \
            "offline" if self.run.offline else "online"

    def log(self, metrics: dict, step: int) -> None:
        if self.file is None:
            return
        clean = {k: (v if isinstance(v, (int, float)) and math.isfinite(v) else None) for k, v in metrics.items()}
        self.file.write(json.dumps({"step": step, **clean}) + "\n")
        self.file.flush()
        if self.run is not None:  # None: --wandb-mode disabled
            self.run.log({k: v for k, v in metrics.items() if isinstance(v, (int, float))}, step=step)

    def completions(self, rows: list[dict], step: int, kind: str = "completions") -> None:
        """What the policy wrote at `step`, a line per row in <kind>.jsonl and a wandb table <kind>: a rollout's
        completions (completion_rows; kind completions) or an evaluation's greedy answers (eval_completions)."""
        if self.file is None:
            return
        with (self.run_dir / f"{kind}.jsonl").open("a") as f:
            f.writelines(json.dumps({"step": step, **row}) + "\n" for row in rows)
        if self.run is not None and rows:
            import wandb  # (a wandb run exists, so it imports)

            self.run.log({kind: wandb.Table(columns=["step", *rows[0]],
                                            data=[[step, *row.values()] for row in rows])}, step=step)

    def finish(self) -> None:
        """Close both; a second call (an error after the run's end) does nothing."""
        if self.file is not None:
            self.file.close()
        if self.run is not None:
            self.run.finish()
        self.file = self.run = None


def completion_rows(batch, group_size: int, world: World) -> list[dict]:
    """Every completion of a step's rollout (every rank's, in row order; the G of a prompt share `group`): the
    prompt as the task states it, the completion as the verifier read it, the reference, each reward term, the
    advantage the update used, the length in tokens and whether it hit --max-new-tokens."""
    mine = [{"prompt": ex.prompt, "completion": text, "reference": ex.answer,
             **{term: values[i] for term, values in batch.scores.items()},
             "advantage": float(batch.advantages[i]), "length": int(batch.ro.lengths[i]),
             "truncated": bool(batch.ro.truncated[i])}
            for i, (ex, text) in enumerate(zip(batch.examples, batch.texts))]
    return [{"group": i // group_size, **row} for i, row in enumerate(every_rank(mine, world))]


def every_rank(rows: list[dict], world: World, order: str | None = None) -> list[dict]:
    """Every rank's rows (a collective: every rank calls it), in rank order, or sorted by the field `order` (an
    evaluation's answers by "problem": each rank scored every N-th problem of the held-out set)."""
    rows = [row for part in world.gather(rows) for row in part]
    return rows if order is None else sorted(rows, key=lambda row: row[order])


def console_line(step: int, total: int, m: dict, eta_s: float, level: str = "token") -> str:
    """One step on screen; the clip fraction and the ratio variance are at the objective's own level (token ratios
    rho_it, or GSPO's sequence ratios s_i)."""
    drawn = f" | drawn {m['dynamic/drawn']} dropped {m['dynamic/dropped']}" if m.get("dynamic/dropped") else ""
    var = f"seq_ratio_var {m['ratio/seq_var']:.2e}" if level == "sequence" else f"ratio_var {m['ratio/token_var']:.2e}"
    return (f"step {step:>4}/{total} | reward {m['charts/reward']:.3f} acc {m['charts/accuracy']:.3f} | "
            f"len {m['charts/completion_len']:.1f} | loss {m['losses/policy_loss']:+.4f} | "
            f"clip {m['clip/frac']:.4f} {var}{drawn} | "
            f"{m['perf/rollout_s']:.1f}s+{m['perf/update_s']:.1f}s | eta {eta_s / 60:.1f} min")


def eval_lines(when: str, m: dict, answers: list | None, n_problems: int, step: int) -> str:
    """The held-out evaluation on screen: accuracy (and pass@k), and two greedy answers (examples_to_show) beside
    their references."""
    passes = "".join(f", {k[5:]} {v:.3f}" for k, v in m.items() if k.startswith("eval/pass@"))
    line = f"held-out accuracy {when}: {m['eval/accuracy']:.3f}{passes} ({n_problems} problem{'s' * (n_problems != 1)})"
    clip = lambda t: repr(t if len(t) <= 100 else t[:97] + "...")  # noqa: E731
    for a in examples_to_show(answers or [], step):
        line += (f"\n  e.g. {clip(a['prompt'])} -> {clip(a['completion'])} (reference {a['reference']!r}: "
                 f"{'right' if a['correct'] else 'wrong'})")
    return line


def precision(policy) -> str:
    """float32, or e.g. 'bfloat16 autocast, float32 weights' (an evaluation alone: 'bfloat16 and float32 weights')."""
    name = lambda dtype: str(dtype).removeprefix("torch.")  # noqa: E731
    compute, stored = models.compute_dtype(policy), sorted({name(p.dtype) for p in policy.parameters()})
    return name(compute) if stored == [name(compute)] else f"{name(compute)} autocast, {' and '.join(stored)} weights"


def startup_lines(args, run_dir: Path, train_set: list, test_set: list, policy, world: World,
                  held_out: int = 0, wandb_mode: str | None = None) -> list[str]:
    """Where the run's files go, what it trains on and with what: printed once before the first evaluation.
    wandb_mode: the mode the run's Logger runs wandb in (default: the one asked for)."""
    mode = wandb_mode or network.wandb_mode(args.wandb_mode)
    wandb = {"offline": f"wandb offline (upload later: wandb sync {run_dir}/wandb/offline-run-*)",
             "online": "wandb online", "disabled": "wandb disabled"}[mode]
    threads = f", threads {torch.get_num_threads()}" if policy.device.type == "cpu" else ""
    trains, samples = bool(args.total_steps), bool(args.log_completions_every)  # (--total-steps 0: evaluation only)
    written = ["config.json", "metrics.jsonl"] + ["completions.jsonl"] * (trains and samples) \
        + ["eval_completions.jsonl"] * samples + ["checkpoints/"] * (trains and args.save_every > 0) \
        + ["final/"] * (trains and args.save_model)
    lines = [f"run folder: {run_dir} ({', '.join(written)}); {wandb}",
             f"data: {args.dataset}, {len(train_set)} training and {len(test_set)} held-out problems"
             + (f" from {args.eval_dataset}" if args.eval_dataset else "")
             + (f" (--eval-size: {len(test_set)} spread over all {held_out})" if len(test_set) < held_out else "") + "; "
             f"device {policy.device}, {precision(policy)}{threads}"
             + (f", {world.size} processes" if world.size > 1 else "")]
    if world.sharded is not None:
        def size(n: int) -> str:
            return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"
        n, gathered = sum(p.numel() * p.element_size() for p in policy.parameters()), ddp.gathered_bytes(policy)
        lines.append(f"sharded (FSDP2): each of the {world.size} processes holds 1/{world.size} of the weights "
                     f"({size(n)} in all), their gradients and AdamW's moments; generation gathers the whole model "
                     f"once per rollout ({size(gathered)} on each process while it samples"
                     + (f", its layers' linear weights in {str(models.compute_dtype(policy))[6:]})" if gathered < n
                        else ")"))
    if len(test_set) < 20 and not args.eval_size:  # a small set of the user's own choosing needs no warning
        advice = f"{args.eval_dataset} holds no more" if args.eval_dataset else \
            "pass a larger set of your own with --eval-dataset FILE"  # (not to one who did)
        lines.append(f"warning: only {len(test_set)} held-out problem{'s' * (len(test_set) != 1)}: held-out accuracy "
                     f"moves in steps of 1/{len(test_set)}; {advice}")
    training_prompts = {ex.prompt for ex in train_set}  # e.g. --eval-dataset naming the --dataset file itself
    if args.total_steps and (both := sum(ex.prompt in training_prompts for ex in test_set)):
        lines.append(f"warning: {both} of the {len(test_set)} held-out problems are training problems too (the same "
                     "prompt): their accuracy is not held out; evaluate on problems the training set lacks")
    adapted = getattr(policy, "peft_config", {}).get("default")  # the modules of --lora-target-modules the model has
    named = list(args.lora_target_modules)
    adapted = sorted(adapted.target_modules, key=lambda m: (named.index(m) if m in named else len(named), m)) \
        if adapted else named
    trained = (f"LoRA r={args.lora_rank} alpha={args.lora_alpha:g} on {', '.join(adapted)}"
               if args.lora_rank else "every weight (full fine-tune)")
    trained = trained if args.total_steps else "nothing: evaluation only (--total-steps 0)"
    lines.append(f"model: {args.model}; trains {trained}"
                 + ("; gradient checkpointing on" if args.gradient_checkpointing else ""))
    if args.model == "embedded" and args.dataset not in task.EMBEDDED_TASKS:
        lines.append(f"note: the embedded model was warm-started on the remainder task only and knows nothing of "
                     f"{args.dataset}; train a pretrained model on it with --model (a hub id, a folder or a .gguf)")
    return lines


def examples_to_show(answers: list[dict], step: int) -> list[dict]:
    """For the screen, a different problem at each evaluation (the step picks where to look): of the greedy answers
    (train.evaluate's), the first one right and the first wrong from there on, when both exist."""
    n = len(answers)
    picked = {}
    for k in range(n):
        i = (step * 37 + k) % n
        picked.setdefault(bool(answers[i]["correct"]), i)
        if len(picked) == 2:
            break
    return [answers[i] for _, i in sorted(picked.items(), reverse=True)]


PI_OLD = {"on-policy": "fully on-policy (1 minibatch, 1 epoch): every ratio is exactly 1, so pi_old needs no forward "
                       "pass and nothing clips; use --num-minibatches > 1 to see the ratios move",
          "sampler": "pi_old: the sampler's own log-probs (no extra forward pass)",
          "recompute": "pi_old: recomputed by one forward pass over each rollout before its first update"}
"""Where the update's pi_old comes from (train.pi_old_source), as the start-up says it."""
