"""What fits on one GPU: the memory of an RL step, estimated on paper from a model's shape, and checked by measuring.

    python -m tools.memory            # the tables in docs/reference.md: Qwen2.5 0.5B / 1.5B / 3B in bf16, four set-ups x β 0 /
                                # 0.04; and what fits on a 24, 48 or 80 GB card at the defaults
    python -m tools.memory --measure  # one update of a Qwen2.5-shaped model (2 layers of Qwen2.5-0.5B's widths, its
                                # vocabulary, random weights) on this machine in six set-ups (CHECKS), each measured
                                # peak beside its estimate; --device cuda on a GPU
    python -m tools.memory --measure-chunking   # whole logits against chunked log-probs (--logprob-chunk), measured
    python -m tools.memory --measure --fsdp 2   # sharded over 2 CPU processes (gloo), three shapes (SHARDED_CHECKS,
                                # one with β's reference): each rank's update and gathered model, measured beside the
                                # per-card estimate
    python -m tools.memory --fsdp 8   # per card under --fsdp over 8 processes, for 1.5B-8B models at the defaults
                                # (with --model PATH: that model's, at your settings)
    python -m tools.memory --model PATH --num-prompts 8 --lora-rank 16   # your model (a folder or its config.json: no
                                # weights are read) at your settings: each part, and the rows per forward that fit

A step holds, besides the CUDA context and the allocator's slack (not counted), in four phases whose largest is the
peak (`total`; PHASES says which parts each holds):
    resident        model.resident_bytes: fp32 weights (4 bytes per parameter), autocast's bf16 copies while a
                    forward's graph lives (2), fp32 gradients (4), AdamW's two moments (8), and with β > 0 the
                    reference (model.frozen_reference: linear layers in bf16, embeddings and norms fp32); LoRA: the
                    base in bf16 (2) and 16 bytes per adapter parameter (fp32 weight, gradient, two moments)
    activations     what one micro-batch's forward keeps for its backward, counted from what autograd saves (torch
                    2.13, transformers 5.x, a Qwen2/Llama layer with SDPA; `tests/tools/test_memory.py` counts it):
                    per token and layer, ACTS below: under bf16 autocast the residual stream and both RMSNorms'
                    inputs and outputs are fp32, and the norm's output is cast to bf16 once for each projection that
                    reads it; with gradient checkpointing, each layer's input (4 bytes x h; 2 for LoRA's bf16 base)
    recomputed layer  with gradient checkpointing, one layer's full set while the layers' backward recomputes it:
                    that phase comes after the log-prob path's backward has freed its memory, so the two do not add
    embedding gradient  a full fine-tune's input embedding makes its gradient whole (fp32, V x h) at the end of the
                    layers' backward before adding it to the weights' (counted in that phase with all activations:
                    most are freed by then, so the phase errs high)
    logits          the log-prob path. Chunked (the default wherever a micro-batch's completion logits exceed one
                    chunk, --logprob-chunk): one chunk's logits and softmax temporaries, the completion positions'
                    hidden states kept for the backward and their gradient, and the head's gradient (CHUNKED below).
                    Whole (--logprob-chunk -1, or where one chunk holds them all): the completion positions' logits
                    in the compute precision and their fp32 copies kept for the log-softmax's backward, 4 + c bytes
                    per entry (c: 2 in bf16, 4 in fp32), or early in the backward (4 rows + 16 of one row); +4 per
                    entry with an entropy bonus (the softmax its backward keeps) -- measured on a CPU: LOGITS below
    π_old pass      when π_old is recomputed, and the reference's pass: chunked, one chunk's temporaries and the
                    hidden states; whole, one micro-batch's logits without gradient (c bytes per entry) and one row's
                    two fp32 temporaries (rollout.token_logprobs goes row by row)
    optimizer step  weights, gradients and moments, and AdamW's temporaries: none for the fused AdamW on a GPU
                    (train.py uses it there); on a CPU two of the largest weight's size (the per-tensor AdamW)
The update's phase counts the gradients whole: true from a step's second micro-batch on; with one micro-batch per
step the first backward allocates them as it frees activations, and the peak can be lower by up to 4 bytes per
trained parameter. The estimate is for one forward/backward of `rows` rows of `tokens` tokens (prompt + completion);
--micro-batch-size sets rows (0: the whole minibatch, P x G / --num-minibatches, halved after each out-of-memory
error), and memory falls with it. Generation (KV cache, no gradient) is smaller than the update's peak here.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Literal

import model as models
from rollout import chunk_positions

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
    heads: int  # attention heads
    q: int  # query width: heads x head size (h for most models; Qwen3 differs)
    capped: bool = False  # soft-caps its logits after the head (Gemma 2's final_logit_softcapping)

    @property
    def linear(self) -> float:
        """Parameters of linear layers not tied to the embeddings (all but the embeddings and the norms)."""
        return self.params - self.vocab * self.hidden - (2 * self.layers + 1) * self.hidden

    @property
    def counts(self) -> models.Counts:
        """model.parameter_counts' numbers; the decoder layers' linear weights from the widths (biases left out)."""
        per_layer = self.hidden * (2 * self.q + 2 * self.kv + 3 * self.intermediate)  # q, k, v, o, the SwiGLU MLP
        return models.Counts(self.params, self.linear, self.layers * per_layer, self.vocab * self.hidden, self.layers)


# Qwen2.5 instruct models (their config.json: hidden_size, intermediate_size, num_hidden_layers, num_key_value_heads x
# head size, vocab_size, num_attention_heads; parameters as the model card gives them)
QWEN = [Shape("Qwen2.5-0.5B", 0.49e9, 24, 896, 4864, 128, 151936, 14, 896),
        Shape("Qwen2.5-1.5B", 1.54e9, 28, 1536, 8960, 256, 151936, 12, 1536),
        Shape("Qwen2.5-3B", 3.09e9, 36, 2048, 11008, 256, 151936, 16, 2048)]
PROJECTIONS = ("q", "k", "v", "o", "gate", "up", "down")  # model.LORA_TARGETS, without the _proj suffix

# Bytes autograd saves per token and layer, as coefficients of (h, q, kv, i), plus 4 per head (SDPA's log-sum-exp)
# and 8; LoRA adds c bytes x r per adapted projection. Counted by storage with saved_tensors_hooks on Qwen2 layers of
# seven shapes (the fit is exact); keyed by (LoRA?, compute bytes c).
ACTS = {(False, 2): (26, 4, 4, 8), (False, 4): (24, 8, 8, 16), (True, 2): (18, 6, 4, 8), (True, 4): (16, 8, 8, 16)}
OUTSIDE_LAYERS = {(False, 2): 8, (False, 4): 12, (True, 2): 0, (True, 4): 0}  # x h per token: embeddings, final norm
# The log-prob path's peak per vocabulary entry of the completion tokens: max(a x rows + b, a2 x rows + b2) x T x V,
# keyed by (compute bytes c, entropy bonus?). Measured on a CPU (peak RSS of rollout.completion_logprobs's forward and
# backward over a 151,936-token vocabulary, 1-16 rows): the first term is the forward's end (the logits and their
# fp32 copies), the second the backward's start, which one row's temporaries dominate at few rows.
LOGITS = {(2, False): (6, 4, 4, 16), (4, False): (8, 4, 4, 16), (2, True): (10, 4, 8, 13), (4, True): (12, 4, 8, 12)}
# The chunked path (rollout.HeadLogprobs: the default wherever a micro-batch's completion logits exceed one chunk of
# rollout.CHUNK_ENTRIES): (k, a, w) bytes per chunk entry (chunk positions x V: one chunk's z, p and gradient of z in
# fp32 and the head's output in the compute dtype; +8 for the entropy's gradient), per completion position and
# hidden unit (the hidden states kept for the backward and their gradient) and per head weight (V x h: the head's
# gradient summed in fp32, and the head cast to the compute dtype once); keyed as LOGITS. Counted from what
# HeadLogprobs allocates, and checked against measured peaks (`--measure-chunking`, docs/reference.md).
CHUNKED = {(2, False): (20, 8, 6), (4, False): (16, 8, 4), (2, True): (28, 8, 6), (4, True): (24, 8, 4)}
PI_OLD_CHUNKED = {2: (18, 8, 2), 4: (16, 8, 0)}  # the same without gradient (the π_old and reference passes)


def lora_params(s: Shape, rank: int) -> float:
    """r x (in + out) per adapted projection, over every layer."""
    shapes = {"q": (s.hidden, s.q), "k": (s.hidden, s.kv), "v": (s.hidden, s.kv), "o": (s.q, s.hidden),
              "gate": (s.hidden, s.intermediate), "up": (s.hidden, s.intermediate), "down": (s.intermediate, s.hidden)}
    return s.layers * sum(rank * (a + b) for a, b in (shapes[p] for p in PROJECTIONS))


def layer_bytes(s: Shape, compute_bytes: int, lora_rank: int) -> float:
    """What autograd saves per token in one decoder layer (ACTS), bytes."""
    a_h, a_q, a_kv, a_i = ACTS[(bool(lora_rank), compute_bytes)]
    return a_h * s.hidden + a_q * s.q + a_kv * s.kv + a_i * s.intermediate + 4 * s.heads + 8 \
        + compute_bytes * lora_rank * len(PROJECTIONS)


def activations(s: Shape, rows: int, tokens: int, compute_bytes: int, lora_rank: int, checkpointing: bool) -> float:
    """What one micro-batch's forward keeps for its backward, bytes: every layer's saved tensors (layer_bytes), or
    with checkpointing each layer's input alone, in the residual stream's precision (the layer recomputed in the
    backward is the estimate's "recomputed layer", held in the layers' backward only)."""
    kept = ((compute_bytes if lora_rank else 4) * s.hidden if checkpointing
            else layer_bytes(s, compute_bytes, lora_rank))
    return rows * tokens * (s.layers * kept + OUTSIDE_LAYERS[(bool(lora_rank), compute_bytes)] * s.hidden)


def estimate(s: Shape, rows: int, tokens: int, completion: int, beta: float, checkpointing: bool, lora_rank: int = 0,
             compute_bytes: int = 2, entropy_bonus: bool = False, device: str = "cuda", chunk: int = 0
             ) -> dict[str, float]:
    """Bytes of each part of one update step (see the module docstring). `compute_bytes`: the compute precision (2:
    bf16 autocast over fp32 weights; 4: fp32 throughout, as on this project's CPUs). `device`: cuda (the fused
    AdamW) or cpu (the per-tensor AdamW's temporaries). `chunk`: --logprob-chunk."""
    resident = models.resident_bytes(s.params, s.linear, compute_bytes, lora_params(s, lora_rank) if lora_rank else 0.0,
                                     reference=beta > 0)
    largest = lora_params(s, lora_rank) / (s.layers * len(PROJECTIONS)) if lora_rank else s.vocab * s.hidden
    return {**resident,
            "activations": activations(s, rows, tokens, compute_bytes, lora_rank, checkpointing),
            "recomputed layer": rows * tokens * layer_bytes(s, compute_bytes, lora_rank) if checkpointing else 0.0,
            "embedding gradient": 0.0 if lora_rank else 4 * s.vocab * s.hidden,
            **logits(s, rows, completion, compute_bytes, entropy_bonus, chunk),
            "optimizer step": 0.0 if device == "cuda" else 2 * 4 * largest}


def logits(s: Shape, rows: int, completion: int, compute_bytes: int, entropy_bonus: bool, chunk: int = 0) -> dict:
    """The log-prob path's peak in the update ("logits") and in the π_old / reference pass, bytes: whole logits
    (LOGITS) where rollout.completion_logprobs makes them whole (rollout.chunk_positions), else chunked (CHUNKED)."""
    n = rows * completion  # completion positions
    size = chunk_positions(n, s.vocab, chunk)
    if not size:  # a soft cap after the head (Gemma 2) keeps one more copy of the logits, tanh's output, for its
        # backward, and without gradient holds two while it divides or multiplies them (rollout.LogitMap)
        a, b, a2, b2 = LOGITS[(compute_bytes, entropy_bonus)]
        cap = compute_bytes if s.capped else 0
        return {"logits": completion * s.vocab * max((a + cap) * rows + b, (a2 + cap) * rows + b2),
                "pi_old pass": completion * s.vocab * max(compute_bytes * rows + 8, 2 * cap * rows)}
    k, a, w = CHUNKED[(compute_bytes, entropy_bonus)]
    k0, a0, w0 = PI_OLD_CHUNKED[compute_bytes]
    return {"logits": size * s.vocab * k + n * s.hidden * a + s.vocab * s.hidden * w,
            "pi_old pass": size * s.vocab * k0 + n * s.hidden * a0 + s.vocab * s.hidden * w0}


RESIDENT = ("weights", "autocast copies", "gradients", "AdamW moments", "reference", "adapter",  # while it trains
            "gathered root", "layers in flight")  # (--fsdp)
PHASES = {  # the parts each phase holds at once (model.resident_bytes' parts, and the transients here)
    "update": (*RESIDENT, "activations", "logits"),  # a micro-batch's forward and its log-prob path's backward
    "layers' backward": (*RESIDENT, "activations", "recomputed layer", "embedding gradient"),  # log-prob path freed
    "optimizer step": ("weights", "gradients", "AdamW moments", "reference", "adapter", "optimizer step"),
    "pi_old pass": ("weights", "AdamW moments", "reference", "adapter", "pi_old pass", "gathered root"),
}


def phases(e: dict[str, float]) -> dict[str, float]:
    return {name: sum(e.get(k, 0.0) for k in parts) for name, parts in PHASES.items()}


def total(e: dict[str, float]) -> float:
    """The step's peak: the largest of its phases."""
    return max(phases(e).values())


SETUPS = [("full fine-tune", False, 0), ("+ gradient checkpointing", True, 0), ("LoRA r=16", False, 16),
          ("LoRA r=16 + checkpointing", True, 16)]
MARGIN = 0.10  # of a card left to the CUDA context, the allocator's cache and the estimate's own error
TOLERANCE = 0.10  # |estimate / measured - 1| that --measure (and tests/gpu_check.py) call close


def close(ratio: float) -> bool:
    """An estimate / measured ratio within TOLERANCE of 1."""
    return abs(ratio - 1) <= TOLERANCE


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


# --fsdp: larger models (config.json numbers; untied embeddings, so the head is a linear layer of its own)
LARGE = [QWEN[1], QWEN[2], Shape("Qwen2.5-7B", 7.62e9, 28, 3584, 18944, 512, 152064, 28, 3584),
         Shape("Qwen3-8B", 8.19e9, 36, 4096, 12288, 1024, 151936, 32, 4096)]


def sharded(e: dict[str, float], n: int, s: Shape, compute_bytes: int = 2) -> dict[str, float]:
    """Per card under --fsdp over n processes: model.sharded_resident's split (the fp32 weights, gradients, AdamW
    moments and reference n ways; the root gathered whole, autocast's copy of the head; generation's gathered model,
    its layers' linear weights in the compute precision), and the optimizer step's temporaries, which follow the
    shards."""
    split = models.sharded_resident(e, n, s.counts, compute_bytes)
    return {**split, "optimizer step": e.get("optimizer step", 0.0) / n}


def sharded_total(e: dict[str, float]) -> float:
    """The largest phase per card: the update's, or generation's (model.generation_bytes)."""
    return max(total(e), models.generation_bytes(e))


def fsdp_table(n: int, minibatch: int = 32, prompt: int = 150, completion: int = 256) -> str:
    """At the defaults (32 rows per optimizer step over n processes: 32 / n rows each), per card: the peak with one
    row per forward, and the rows per forward that fit on 24, 48 and 80 GiB (MARGIN left free), full fine-tune, bf16,
    β 0, without and with gradient checkpointing."""
    rows = max(1, minibatch // n)
    lines = [f"| --fsdp over {n} processes, bf16, β=0, {rows} rows per process per optimizer step x {prompt + completion} "
             "tokens | per card at 1 row | rows that fit on 24 / 48 / 80 GiB | + gradient checkpointing: at 1 row | "
             "rows that fit |", "|---|---|---|---|---|"]
    for s in LARGE:
        cells = []
        for ckpt in (False, True):
            one = card_peak(estimate(s, 1, prompt + completion, completion, 0.0, ckpt), s, n, 2)
            fits = [str(rows_that_fit(s, card, rows, prompt + completion, completion, 0.0, ckpt, fsdp=n) or "no")
                    for card in CARDS]
            cells += [f"{one / GiB:.1f} GiB", " / ".join(fits)]
        lines.append(f"| {s.name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def card_peak(e: dict[str, float], s: Shape, fsdp: int, compute_bytes: int) -> float:
    """The largest phase on one card: total(e) in one process, or under --fsdp over `fsdp` processes the larger of
    the update's and generation's per card (sharded_total)."""
    return sharded_total(sharded(e, fsdp, s, compute_bytes)) if fsdp > 1 else total(e)


CARDS = (24, 48, 80)  # the usual single cards, in GiB as their makers count (an "80 GB" A100 holds 80 GiB)


def rows_that_fit(s: Shape, card: float, rows: int, tokens: int, completion: int, beta: float, checkpointing: bool,
                  lora_rank: int = 0, compute_bytes: int = 2, entropy_bonus: bool = False, chunk: int = 0,
                  fsdp: int = 1) -> int:
    """What --micro-batch-size 0 lands on after halving from `rows` (rows, rows/2, ..., 1) on a card of `card` GiB
    with MARGIN left free (per card under --fsdp over `fsdp` processes); 0 when even one row does not fit."""
    def peak(r: int) -> float:
        return card_peak(estimate(s, r, tokens, completion, beta, checkpointing, lora_rank, compute_bytes,
                                  entropy_bonus, chunk=chunk), s, fsdp, compute_bytes)
    while rows >= 1 and peak(rows) > (1 - MARGIN) * card * GiB:
        rows //= 2
    return rows


def fits_table(minibatch: int = 32, prompt: int = 150, completion: int = 256, beta: float = 0.0) -> str:
    """At the defaults (16 prompts x 8 completions, 4 minibatches: 32 rows per optimizer step, 256 new tokens), the
    rows per forward that fit on each card (rows_that_fit), or "no" when even one row does not fit."""
    lines = [f"| bf16, β={beta}, {minibatch} rows per optimizer step x {prompt + completion} tokens | "
             + " | ".join(f"{s.name} on {' / '.join(str(c) for c in CARDS)} GiB" for s in QWEN[:2]) + " |",
             "|---|" + "---|" * 2]
    for label, ckpt, rank in SETUPS:
        cells = [" / ".join(str(rows_that_fit(s, card, minibatch, prompt + completion, completion, beta, ckpt, rank)
                                or "no") for card in CARDS) + " rows" for s in QWEN[:2]]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------------------
# The check: one update of a Qwen2.5-shaped model (random weights, its real vocabulary), measured
# ---------------------------------------------------------------------------------------------------------------

# Qwen2.5-0.5B's layer widths and vocabulary with 2 layers (on a CPU), and Qwen2.5-1.5B whole (on a GPU): built from
# their config.json's numbers, random weights, nothing downloaded
SMALL_QWEN = dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=2, num_attention_heads=14,
                  num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True)
SHARDED_CHECKS = [(SMALL_QWEN, 0.0), (dict(SMALL_QWEN, num_hidden_layers=8, vocab_size=32000), 0.0),
                  (SMALL_QWEN, 0.04)]  # --measure --fsdp, (config, β): a root (Qwen's vocabulary) that outweighs 2
# layers, 8 layers that outweigh a 32,000-token vocabulary, and the first with β's reference sharded beside it
SMALL_GEMMA2 = dict(SMALL_QWEN, vocab_size=256000, head_dim=64, final_logit_softcapping=30.0)  # the same widths with
# Gemma 2's vocabulary and its soft cap of the logits (rollout.LogitMap)
CHUNKING_MODELS = {"qwen2": SMALL_QWEN, "gemma2": SMALL_GEMMA2}  # --measure-chunking --chunking-model (its type)
QWEN_1_5B = dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                 num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True)
CHECKS = [("full fine-tune", False, 0, 0.0, False), ("full fine-tune", False, 0, 0.04, False),
          ("+ gradient checkpointing", True, 0, 0.0, False), ("LoRA r=16", False, 16, 0.0, False),
          ("LoRA r=16 + checkpointing", True, 16, 0.0, False), ("+ entropy bonus", False, 0, 0.0, True)]

# glibc's malloc raises its mmap threshold each time a large block is freed, so later blocks of that size come from
# the heap and stay in RSS after they are freed: peak RSS then counts dead temporaries. A fixed threshold returns
# every block over 1 MiB to the system when freed, so peak RSS follows live memory; GPUs have their own allocator.
MMAP_THRESHOLD = {"MALLOC_MMAP_THRESHOLD_": str(2**20)}


def shape_of_config(c: dict, name: str = "") -> Shape:
    """A decoder's Shape from its config.json's numbers. Parameters are counted from the shapes (embeddings, once
    more when untied; per layer q, k, v, o, the SwiGLU MLP and two norms; the final norm); biases are left out
    (Qwen2's q/k/v biases are under 0.1% of its parameters)."""
    h, layers, i, vocab = c["hidden_size"], c["num_hidden_layers"], c["intermediate_size"], c["vocab_size"]
    heads = c["num_attention_heads"]
    head = c.get("head_dim") or h // heads
    kv = c.get("num_key_value_heads", heads) * head
    q = heads * head
    per_layer = h * q + 2 * h * kv + q * h + 3 * h * i + 2 * h
    embeddings = vocab * h * (1 if c.get("tie_word_embeddings", True) else 2)
    return Shape(name, float(embeddings + layers * per_layer + h), layers, h, i, kv, vocab, heads, q,
                 bool(c.get("final_logit_softcapping")))


class EstimateError(ValueError):
    """A model or a setting this estimate cannot read; the message says what to pass instead."""


def lora_of(path: str) -> tuple[str, int] | None:
    """(base model, rank) of a LoRA adapter folder (a LoRA run's final/) or of a run folder holding one; else None."""
    import json

    local = Path(path).expanduser()
    local = local / "final" if (local / "final").is_dir() else local
    if not (local / "adapter_config.json").is_file():
        return None
    try:
        adapter = json.loads((local / "adapter_config.json").read_text())
        return str(adapter["base_model_name_or_path"]), int(adapter["r"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise EstimateError(f"cannot read {local / 'adapter_config.json'} ({type(e).__name__}: {e}); pass the base "
                            "model with --lora-rank R")


def shape_of(path: str) -> Shape:
    """A decoder's Shape from its config alone, no weights read: a model folder or its config.json, a run folder
    (its final/), a .gguf file (its metadata), or a hub id (its config.json, where the hub or its cache has it)."""
    import json

    local = Path(path).expanduser()
    if (local / "final" / "config.json").is_file():  # a run folder: its config.json is the run's, final/ the model
        local = local / "final"
    if local.is_dir() and not (local / "config.json").is_file():
        raise EstimateError(f"{path} has no config.json; pass a model folder (save_pretrained), its config.json, a "
                           ".gguf file or a hub id")
    if local.is_dir() or local.suffix == ".json":
        file = local / "config.json" if local.is_dir() else local
        try:
            config, name = json.loads(file.read_text()), file.parent.name or file.stem
        except (OSError, ValueError) as e:
            raise EstimateError(f"cannot read {file}: {str(e).splitlines()[0][:160]}")
    else:
        config, name = config_of(path), Path(path).name.removesuffix(".gguf")
    missing = [k for k in ("hidden_size", "num_hidden_layers", "intermediate_size", "vocab_size",
                           "num_attention_heads") if not isinstance(config.get(k), int)]
    if missing:
        raise EstimateError(f"the config of {path} has no {', '.join(missing)}: not a decoder whose memory this "
                           "estimates (a Llama-, Qwen- or Mistral-shaped causal language model)")
    return shape_of_config(config, name)


def config_of(name: str) -> dict:
    """The config of a .gguf file (its metadata, through transformers) or of a hub id (its config.json alone)."""
    try:  # (an older transformers reads GGUF metadata differently)
        models.require_releases()
    except models.ModelError as e:
        raise EstimateError(str(e)) from None
    from transformers import AutoConfig

    from base import network

    local = Path(name).expanduser()
    if local.suffix == ".gguf" and not local.is_file():
        raise EstimateError(f"{name}: no such file")
    if local.suffix != ".gguf" and (name.startswith(("/", ".", "~")) or name.count("/") != 1):
        raise EstimateError(f"{name} is neither a model folder, a config.json, a .gguf file nor a hub id (owner/name)")
    kwargs = {"gguf_file": local.name} if local.suffix == ".gguf" else \
        {"local_files_only": True} if network.hub_offline() else {}
    try:
        return AutoConfig.from_pretrained(str(local.parent) if "gguf_file" in kwargs else name, **kwargs).to_dict()
    except Exception as e:  # loaders raise many types; all mean "cannot read it"
        where = "" if "gguf_file" in kwargs else " (the hub is unreachable and has no cached copy)" \
            if kwargs else ""
        first = str(e).strip().splitlines()[0][:160] if str(e).strip() else type(e).__name__
        raise EstimateError(f"cannot read the config of {name}{where}: {first}")


class Peak:
    """The most tensor memory in use since the last reset: CUDA's own count on a GPU; on a CPU the kernel's
    high-water mark of resident memory (VmHWM, reset through clear_refs) less what the process holds besides its
    tensors (`tensors`: the bytes of the tensors alive when the count starts)."""

    def __init__(self, device, tensors: int):
        self.cuda = device.type == "cuda"
        self.base = 0 if self.cuda else self.rss("VmRSS") - tensors

    @staticmethod
    def rss(key: str) -> int:
        for line in open("/proc/self/status"):
            if line.startswith(key):
                return int(line.split()[1]) * 1024
        raise RuntimeError(f"no {key} in /proc/self/status")

    def reset(self) -> None:
        import torch

        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        else:
            Path("/proc/self/clear_refs").write_text("5")

    def read(self) -> int:
        import torch

        if self.cuda:
            torch.cuda.synchronize()
            return torch.cuda.max_memory_allocated() - self.base
        return self.rss("VmHWM") - self.base


def random_rollout(vocab: int, n: int, prompt: int, width: int):
    """n rows of random tokens, `prompt` of prompt and `width` of completion, none truncated: what an update of the
    memory checks trains on."""
    import torch

    import rollout

    ids = torch.randint(vocab, (n, prompt + width))
    return rollout.Rollout(ids[:, :prompt], torch.ones(n, prompt, dtype=torch.long), ids[:, prompt:],
                           torch.ones(n, width, dtype=torch.long), torch.zeros(n, dtype=torch.bool))


def measure_update(config: dict, rows: int = 4, prompt: int = 64, completion: int = 512, beta: float = 0.0,
                   checkpointing: bool = False, lora_rank: int = 0, entropy_bonus: bool = False,
                   dtype: str = "bfloat16", device: str = "cpu", model_type: str = "qwen2",
                   logprob_chunk: int = 0) -> dict:
    """In this process: a `model_type` (qwen2, llama) model of `config`'s shape (random weights), a warm-up update on
    a few short rows (AdamW's moments, kernels and threads exist after it), then train.update over 4 x `rows` rows
    of `prompt` + `completion` tokens with π_old recomputed, in 2 minibatches of 2 micro-batches of `rows` (the
    gradients are whole during a step's second micro-batch), as the estimate counts. Returns the tensor memory at
    the peak of the update and of each of the estimate's phases (PHASES; hooks on the policy's forward, the decoder's
    output gradient and the optimizer step mark them) in bytes, and the estimate's."""
    import copy

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    import rollout
    import train
    from plumbing import run as runs

    dev, compute = torch.device(device), {"bfloat16": torch.bfloat16, "float32": torch.float32}[dtype]
    torch.manual_seed(0)
    policy = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **config, max_position_embeddings=4096))
    policy = models.compute_in(policy.to(compute) if lora_rank else policy, compute).to(dev)
    if lora_rank:
        policy = models.add_lora(policy, lora_rank, 2.0 * lora_rank, models.LORA_TARGETS)
    ref = None if beta == 0 else models.AdapterOff(policy) if lora_rank else \
        models.frozen_reference(copy.deepcopy(policy))
    if checkpointing:
        models.enable_checkpointing(policy)
    policy.train()
    args, cfg = runs.resolve(train.Args(algo="grpo", num_minibatches=2, micro_batch_size=rows, beta=beta,
                                        old_logprobs="recompute", max_new_tokens=completion,
                                        entropy_coef=0.01 if entropy_bonus else None, logprob_chunk=logprob_chunk))
    opt = torch.optim.AdamW([p for p in policy.parameters() if p.requires_grad], lr=1e-6, fused=dev.type == "cuda")
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0)

    def rollout_of(n: int, width: int):
        return random_rollout(config["vocab_size"], n, prompt, width)

    def update(n: int, width: int) -> None:
        ro = rollout_of(n, width)
        train.update(policy, ref, opt, sched, train.Batch(ro, [None] * n, {}, [""] * n), torch.randn(n), cfg, args,
                     torch.Generator().manual_seed(0))

    update(4, 8)  # the warm-up
    alive = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in
             [*policy.parameters(), *(ref.parameters() if isinstance(ref, torch.nn.Module) else []),
              *(v for state in opt.state.values() for v in state.values() if torch.is_tensor(v))]}
    peak, seen = Peak(dev, sum(alive.values())), []
    pi_old = rollout_of(rows, completion).to(dev)  # one micro-batch of the pi_old pass alone, as train.update runs it
    peak.reset()
    with torch.inference_mode():
        rollout.logprobs(policy, pi_old, torch.arange(rows, device=dev), 1.0, True, logprob_chunk)
    pi_old_peak = peak.read()
    del pi_old

    # the update's timeline in the estimate's phases: each mark closes the span since the last one under its phase
    phase = ["other"]  # the span being measured: a pass without gradient (pi_old's), a micro-batch's forward and its
    # log-prob path's backward ("update", up to the gradient reaching the decoder's output), the layers' backward

    def mark(name):
        seen.append((phase[0], peak.read()))
        peak.reset()
        phase[0] = name

    def at_decoder_output(_module, _args, out) -> None:  # (returns None: the output stays as it is)
        hidden = out[0] if isinstance(out, tuple) else out.last_hidden_state
        if hidden.requires_grad:
            hidden.register_hook(lambda _: mark("layers' backward"))

    policy.register_forward_pre_hook(lambda *_: mark("update" if torch.is_grad_enabled() else "pi_old pass"))
    rollout.output_layers(policy)[1].register_forward_hook(at_decoder_output)
    opt.register_step_pre_hook(lambda *_: mark("optimizer step"))
    opt.register_step_post_hook(lambda *_: mark("other"))
    peak.reset()
    update(4 * rows, completion)
    mark("other")
    s = shape_of_config(config, "Qwen2-shaped")
    e = estimate(s, rows, prompt + completion, completion, beta, checkpointing, lora_rank,
                 torch.finfo(compute).bits // 8, entropy_bonus, dev.type, logprob_chunk)
    measured = {}  # each phase's highest peak over the update
    for name, bytes_ in seen:
        measured[name] = max(measured.get(name, 0), bytes_)
    return {"phases": measured, "peak": max(measured.values()), "pi_old pass": pi_old_peak, "estimate": total(e),
            "estimated phases": phases(e), "params": sum(p.numel() for p in policy.parameters())}


def measure_sharded_update(config: dict, rows: int = 4, prompt: int = 64, completion: int = 512,
                           dtype: str = "bfloat16", beta: float = 0.0, **_) -> dict:
    """In one rank of `torchrun --nproc-per-node N python -m tools.memory --worker ...` on CPUs (gloo): measure_update's
    model sharded as train.py --fsdp shards it (ddp.shard), a warm-up update, then train.update over 4 x `rows` rows
    of this rank's in micro-batches of `rows`, and the whole model gathered as generation gathers it; with `beta`,
    the reference (a frozen copy, sharded as train.py shards it) scores each update's rows first. Returns this rank's
    measured peaks of the two (tensor memory: Peak) beside the per-card estimate's (sharded, card_peak)."""
    import copy

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    import train
    from plumbing import ddp, run as runs

    world = ddp.setup("cpu")
    compute = {"bfloat16": torch.bfloat16, "float32": torch.float32}[dtype]
    torch.manual_seed(0)
    policy = AutoModelForCausalLM.from_config(AutoConfig.for_model("qwen2", **config, max_position_embeddings=4096))
    policy = models.compute_in(policy, compute)
    ref = models.frozen_reference(copy.deepcopy(policy)) if beta else None
    world.wrap(policy, fsdp=True)
    if ref is not None:
        ddp.shard(ref, frozen=True)
    policy.train()
    args, cfg = runs.resolve(train.Args(algo="grpo", beta=beta, num_minibatches=2, micro_batch_size=rows,
                                        old_logprobs="recompute", max_new_tokens=completion))
    opt = torch.optim.AdamW(policy.parameters(), lr=1e-6)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0)

    def update(n: int, width: int) -> None:
        ro = random_rollout(config["vocab_size"], n, prompt, width)
        train.update(policy, ref, opt, sched, train.Batch(ro, [None] * n, {}, [""] * n), torch.randn(n), cfg, args,
                     torch.Generator().manual_seed(0), world)

    update(4, 8)  # the warm-up: AdamW's moments exist after it
    local = [t.to_local() if hasattr(t, "to_local") else t for t in
             [*policy.parameters(), *(ref.parameters() if ref is not None else ()),
              *(v for state in opt.state.values() for v in state.values() if torch.is_tensor(v))]]
    peak = Peak(torch.device("cpu"), sum(t.untyped_storage().nbytes() for t in local))
    peak.reset()
    update(4 * rows, completion)
    measured_update = peak.read()
    peak.reset()
    with world.gathered(policy):  # generation's model, beside the shards (the gradients freed)
        measured_generation = peak.read()
    c, s = torch.finfo(compute).bits // 8, shape_of_config(config, "Qwen2-shaped")
    card = sharded(estimate(s, rows, prompt + completion, completion, beta, False, compute_bytes=c, device="cpu"),
                   world.size, s, c)
    out = {"rank": world.rank, "processes": world.size, "update": measured_update, "generation": measured_generation,
           "update estimate": total(card), "generation estimate": models.generation_bytes(card)}
    world.barrier()
    ddp.teardown()
    return out


def measure_sharded(n: int = 2, config: dict = SMALL_QWEN, rows: int = 4, completion: int = 512,
                    dtype: str = "bfloat16", beta: float = 0.0, timeout: float = 1200) -> list[dict]:
    """measure_sharded_update under torchrun with n CPU processes (gloo); prints each rank's row."""
    import json
    import os
    import subprocess
    import sys

    job = dict(config=config, rows=rows, completion=completion, dtype=dtype, beta=beta, sharded=True)
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(n),
                           "-m", "tools.memory", "--worker", json.dumps(job)], cwd=Path(__file__).resolve().parents[1],
                          capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **MMAP_THRESHOLD, "OMP_NUM_THREADS": "1"})
    rows_out = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or len(rows_out) != n:
        raise SystemExit("error: the sharded memory check failed: "
                         f"{(proc.stderr.strip().splitlines() or ['no output'])[-1]}")
    print(sharded_header(n, config, rows, completion, dtype, beta))
    for r in sorted(rows_out, key=lambda r: r["rank"]):
        print(f"| rank {r['rank']} | {r['update'] / GiB:.2f} / {r['update estimate'] / GiB:.2f} GiB "
              f"({r['update estimate'] / r['update']:.2f}) | {r['generation'] / GiB:.2f} / "
              f"{r['generation estimate'] / GiB:.2f} GiB ({r['generation estimate'] / r['generation']:.2f}) |")
    return rows_out


def sharded_header(n: int, config: dict, rows: int, completion: int, dtype: str, beta: float = 0.0) -> str:
    return (f"| --fsdp over {n} CPU processes (gloo), {config['num_hidden_layers']} layers of h "
            f"{config['hidden_size']}, vocab {config['vocab_size']}, {dtype}{f', β {beta:g}' if beta else ''}: "
            f"2 x 2 micro-batches of {rows} rows x {64 + completion} tokens per process | update: measured / estimate "
            "| generation's gathered model: measured / estimate |\n|---|---|---|")


def measure(config: dict = SMALL_QWEN, device: str = "cpu", dtype: str = "bfloat16", rows: int = 4,
            completion: int = 512, checks=CHECKS, timeout: float = 900, logprob_chunk: int = 0,
            quiet: bool = False, model_type: str = "qwen2") -> list[dict]:
    """Each of `checks` in a process of its own (python -m tools.memory --worker): the measured peak of one update
    beside the estimate. Returns one dict per check; prints a table row as each finishes."""
    import json
    import os
    import subprocess
    import sys

    out = []
    for label, ckpt, rank, beta, bonus in checks:
        job = dict(config=config, rows=rows, completion=completion, beta=beta, checkpointing=ckpt, lora_rank=rank,
                   entropy_bonus=bonus, dtype=dtype, device=device, logprob_chunk=logprob_chunk, model_type=model_type)
        proc = subprocess.run([sys.executable, "-m", "tools.memory", "--worker", json.dumps(job)],
                              cwd=Path(__file__).resolve().parents[1], capture_output=True, text=True,
                              timeout=timeout, env={**os.environ, **MMAP_THRESHOLD})
        if proc.returncode != 0:
            raise SystemExit(f"error: the memory check '{label}' failed: "
                             f"{(proc.stderr.strip().splitlines() or ['no output'])[-1]}")
        m = {"label": label, "beta": beta, **json.loads(proc.stdout.strip().splitlines()[-1])}
        m["ratio"] = m["estimate"] / m["peak"]
        out.append(m)
        if not quiet:
            print(check_row(m), flush=True)
    return out


def measure_chunking(config: dict = SMALL_QWEN, rows: int = 8, completion: int = 512, dtype: str = "bfloat16",
                     device: str = "cpu", timeout: float = 1800, model_type: str = "qwen2") -> list[dict]:
    """Whole logits (--logprob-chunk -1) against the chunked path (0), without and with the entropy bonus, each in a
    process of its own: the update's measured peak, one π_old micro-batch's, the estimates, and the log-prob path's
    part of the update (the measured peak less the estimate's resident state and activations). Prints a table."""
    s = shape_of_config(config)
    size = chunk_positions(rows * completion, s.vocab)  # what --logprob-chunk 0 chunks by
    print(chunking_header(config, rows, completion, dtype, device), flush=True)
    out = []
    for bonus in (False, True):
        for chunk in (-1, 0):
            label = "+ entropy bonus" if bonus else "full fine-tune"
            m = measure(config, device, dtype, rows, completion, [(label, False, 0, 0.0, bonus)], timeout, chunk,
                        quiet=True, model_type=model_type)[0]
            c = 2 if dtype == "bfloat16" else 4
            e = estimate(s, rows, 64 + completion, completion, 0.0, False, 0, c, bonus, device, chunk)
            m.update(chunk=chunk, logprob_part=m["peak"] - (phases(e)["update"] - e["logits"]),
                     pi_old_estimate=phases(e)["pi_old pass"])
            out.append(m)
            setting = "-1 (whole logits)" if chunk < 0 else f"0 ({size} positions a chunk)"
            print(f"| {label} | {setting} | {m['peak'] / GiB:.2f} / {m['estimate'] / GiB:.2f} GiB | "
                  f"{m['logprob_part'] / GiB:.2f} GiB | {m['pi_old pass'] / GiB:.2f} / {m['pi_old_estimate'] / GiB:.2f} "
                  "GiB |", flush=True)
    gains = [f"{whole['label']}: the log-prob part {whole['logprob_part'] / GiB:.2f} → "
             f"{chunked['logprob_part'] / GiB:.2f} GiB ({whole['logprob_part'] / chunked['logprob_part']:.1f}x "
             f"smaller); the update's peak {whole['peak'] / chunked['peak']:.2f}x, the π_old pass's "
             f"{whole['pi_old pass'] / chunked['pi_old pass']:.2f}x" for whole, chunked in (out[:2], out[2:])]
    ratios = [r for m in out for r in (m["estimate"] / m["peak"], m["pi_old_estimate"] / m["pi_old pass"])]
    print("\n" + "; ".join(gains) + ". " + check_summary(ratios, "estimate"))
    return out


def chunking_header(config: dict, rows: int, completion: int, dtype: str, device: str) -> str:
    cap = f", logits soft-capped at {config['final_logit_softcapping']:g} (Gemma 2)" \
        if config.get("final_logit_softcapping") else ""
    return (f"| {config['num_hidden_layers']} layers of h {config['hidden_size']}, vocab {config['vocab_size']}{cap}, "
            f"{dtype}, {device}: micro-batches of {rows} rows x {64 + completion} tokens ({completion} completion) | "
            "--logprob-chunk | update: measured / estimate | log-prob part | π_old pass, one micro-batch: measured / "
            "estimate |\n|---|---|---|---|---|")


def check_header(config: dict, rows: int, completion: int, dtype: str, device: str, logprob_chunk: int) -> str:
    return (f"| {config['num_hidden_layers']} layers of h {config['hidden_size']}, vocab {config['vocab_size']}, "
            f"{dtype}, {device}: 2 x 2 micro-batches of {rows} rows x {64 + completion} tokens, --logprob-chunk "
            f"{logprob_chunk} | β | measured peak | estimate | estimate / measured | the peak's phase: measured / "
            "estimated |\n|---|---|---|---|---|---|")


def check_summary(ratios: list[float], unit: str = "set-up") -> str:
    """The sentence under a measured table: whether every estimate is within TOLERANCE of its measurement."""
    within = all(close(r) for r in ratios)
    side = "; every estimate is above it" if min(ratios) > 1 else "; every estimate is below it" if max(ratios) < 1 \
        else ""
    return (f"{'Every' if within else 'Not every'} {unit} is within {TOLERANCE:.0%} of its measurement (estimate / "
            f"measured {min(ratios):.2f}-{max(ratios):.2f}){side}.")


def peak_phase(phase_bytes: dict[str, float]) -> str:
    """The phase whose peak is the step's (PHASES' names; measure_update's spans carry the same)."""
    return max(phase_bytes, key=phase_bytes.get)


def check_row(m: dict) -> str:
    return (f"| {m['label']} | {m['beta']} | {m['peak'] / GiB:.2f} GiB | {m['estimate'] / GiB:.2f} GiB | "
            f"{m['ratio']:.2f} | {peak_phase(m['phases'])} / {peak_phase(m['estimated phases'])} |")


@dataclass
class MemoryArgs:
    """The tables of docs/reference.md, the check that measures the estimate, or the estimate for one model at your
    settings."""
    model: str = ""
    """a model folder or its config.json, a .gguf file or a hub id: print this model's estimate at the settings below
    (no weights are read)"""
    num_prompts: int = 16
    """P, as train.py's"""
    num_generations: int = 8
    """G, as train.py's"""
    num_minibatches: int = 4
    """rows per optimizer step = P x G / this"""
    micro_batch_size: int = 0
    """rows per forward/backward, as train.py's (0: a whole minibatch)"""
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
    fsdp: int = 0
    """N > 1: per card under `torchrun --nproc-per-node N train.py --fsdp` (sharded weights, gradients and AdamW state)
    for Qwen2.5-1.5B / 3B / 7B and Qwen3-8B at the defaults, or with --model for that model at these settings: the
    peak and the rows per forward that fit"""
    logprob_chunk: int = 0
    """as train.py's: completion positions whose logits are made at once (0: 2^24 / vocabulary size; -1: whole
    logits)"""
    measure: bool = False
    """measure one update of a Qwen2.5-shaped model (2 layers of Qwen2.5-0.5B's widths, its 151,936-token vocabulary)
    on this machine, each set-up beside its estimate"""
    measure_chunking: bool = False
    """measure the same model's update and π_old pass with whole logits (--logprob-chunk -1) and chunked (0), 8 rows x
    512 completion tokens, without and with the entropy bonus (docs/reference.md)"""
    chunking_model: Literal["qwen2", "gemma2"] = "qwen2"
    """with --measure-chunking: qwen2, 2 layers of Qwen2.5-0.5B's widths and its 151,936-token vocabulary; gemma2, the
    same widths with Gemma 2's 256,000-token vocabulary and its soft cap of the logits"""
    device: str = "cpu"
    """with --measure or --measure-chunking: cpu or cuda"""
    worker: str = ""
    """internal: one measurement in this process (JSON settings), printed as JSON"""


# the settings of one model's estimate (--model); the tables and checks use their own
ESTIMATE_SETTINGS = ("num_prompts", "num_generations", "num_minibatches", "micro_batch_size", "max_new_tokens",
                     "prompt_tokens", "lora_rank", "gradient_checkpointing", "beta", "entropy_bonus")


def check(a: MemoryArgs) -> None:
    """The settings of --model's estimate, as train.py would take them."""
    for name in ("num_prompts", "num_generations", "num_minibatches", "max_new_tokens"):
        if getattr(a, name) < 1:
            raise EstimateError(f"--{name.replace('_', '-')} {getattr(a, name)}: must be at least 1")
    if a.num_generations < 2:  # as train.py: a group of one has no baseline
        raise EstimateError(f"--num-generations {a.num_generations}: must be at least 2 (a group of one has no "
                           "baseline; train.py refuses it)")
    for name in ("prompt_tokens", "lora_rank", "micro_batch_size"):
        if getattr(a, name) < 0:
            raise EstimateError(f"--{name.replace('_', '-')} {getattr(a, name)}: must be 0 or more")
    if (a.num_prompts * a.num_generations) % a.num_minibatches:
        raise EstimateError(f"--num-minibatches {a.num_minibatches} does not divide the {a.num_prompts} x "
                           f"{a.num_generations} rows of a rollout")
    if a.beta < 0:
        raise EstimateError(f"--beta {a.beta}: must be 0 or more")
    if a.fsdp < 0:
        raise EstimateError(f"--fsdp {a.fsdp}: must be 0 (one device) or the number of processes")
    if a.measure and a.fsdp > 1 and a.device != "cpu":
        raise EstimateError("--measure --fsdp runs on CPU processes (gloo) only; on GPUs, tests/gpu_check.py's sharded "
                            "run prints each rank's peak")
    if a.fsdp > 1 and a.lora_rank:  # as train.py
        raise EstimateError("--fsdp with --lora-rank: train.py refuses it (a LoRA adapter is small: use data parallel, "
                            "whose estimate per card is one process's)")
    if a.fsdp > 1 and a.model and (a.num_prompts % a.fsdp or (a.num_prompts // a.fsdp * a.num_generations)
                                   % a.num_minibatches):
        raise EstimateError(f"--num-prompts {a.num_prompts} over {a.fsdp} processes: each process takes whole groups "
                            f"and splits its rows into --num-minibatches {a.num_minibatches}; use a multiple of "
                            f"{a.fsdp} that allows that")
    if a.logprob_chunk < -1:
        raise EstimateError(f"--logprob-chunk {a.logprob_chunk}: must be -1 (whole logits), 0 (sized to the "
                           "vocabulary) or a number of positions")


def for_model(a: MemoryArgs) -> str:
    """One model at the given settings: each part of the estimate, and the rows per forward that fit on each card."""
    check(a)
    lora = lora_of(a.model)
    if lora:  # a LoRA run: its base model at the adapter's rank (unless --lora-rank says otherwise)
        a = replace(a, model=lora[0], lora_rank=a.lora_rank or lora[1])
        check(a)  # (--fsdp is refused with it)
    return for_shape(a, shape_of(a.model))


def estimate_at(a: MemoryArgs, s: Shape) -> tuple[int, int, int, dict[str, float]]:
    """The settings' estimate for a Shape: (rows per forward, tokens per row, compute bytes, each part's bytes), one
    process's (under --fsdp N, each process's rows: its P/N prompts' groups)."""
    minibatch = a.num_prompts // max(a.fsdp, 1) * a.num_generations // a.num_minibatches
    rows, tokens, per = a.micro_batch_size or minibatch, a.prompt_tokens + a.max_new_tokens, \
        2 if a.dtype == "bfloat16" else 4
    return rows, tokens, per, estimate(s, rows, tokens, a.max_new_tokens, a.beta, a.gradient_checkpointing,
                                       a.lora_rank, per, a.entropy_bonus, chunk=a.logprob_chunk)


def for_shape(a: MemoryArgs, s: Shape) -> str:
    """for_model's text for a Shape at hand (docs/recipes.md quotes it for Qwen2.5's shapes)."""
    rows, tokens, per, parts = estimate_at(a, s)
    n = max(a.fsdp, 1)
    setup = (f"LoRA r={a.lora_rank}" if a.lora_rank else "full fine-tune") + \
        (" + gradient checkpointing" if a.gradient_checkpointing else "") + \
        (f", per card under --fsdp over {n} processes" if n > 1 else "")
    lines = [f"{s.name}: {s.params / 1e6:.1f}M parameters, {s.layers} layers, hidden {s.hidden}, vocab {s.vocab}; "
             f"{setup}{', entropy bonus' if a.entropy_bonus else ''}, {a.dtype}, β={a.beta}; one micro-batch of {rows} "
             f"rows x {tokens} tokens" + ("" if a.micro_batch_size else " (--micro-batch-size 0: a whole minibatch)")]
    shown = sharded(parts, n, s, per) if n > 1 else parts  # (--fsdp: one card's share)
    width = max(18, *(len(k) for k, v in shown.items() if v))  # (--fsdp: "gathered for generation")
    lines += [f"  {k:<{width}} {v / GiB:7.2f} GiB" for k, v in shown.items() if v]
    lines += [f"  phase: {k:<16} {v / GiB:7.2f} GiB" for k, v in phases(shown).items()]
    if n > 1:
        lines.append(f"  phase: {'generation':<16} {models.generation_bytes(shown) / GiB:7.2f} GiB")
    lines.append(f"  {'peak':<{width}} {card_peak(parts, s, n, per) / GiB:7.2f} GiB (the largest phase; leave "
                 f"{MARGIN:.0%} of a card for the CUDA context and the allocator's cache)")
    for card in CARDS:
        fit = rows_that_fit(s, card, rows, tokens, a.max_new_tokens, a.beta, a.gradient_checkpointing, a.lora_rank,
                            per, a.entropy_bonus, a.logprob_chunk, fsdp=n)
        lines.append(f"  on {card} GiB: " + (f"{fit} rows per forward" if fit >= 1 else "does not fit at 1 row"))
    return "\n".join(lines)


def settings(argv: list[str] | None) -> MemoryArgs:
    """The flags, parsed and checked before anything is read, measured or printed (EstimateError says what is
    wrong)."""
    from plumbing import flags

    a = flags.parse(MemoryArgs, __doc__, argv, program="python -m tools.memory")
    check(a)
    given = [f.name for f in fields(MemoryArgs) if f.name in ESTIMATE_SETTINGS and getattr(a, f.name) != f.default]
    if given and not a.model:
        raise EstimateError(f"--{given[0].replace('_', '-')} sets one model's estimate: pass --model too (the "
                            "tables use the defaults)")
    return a


def main(argv: list[str] | None = None) -> None:
    import json
    import sys

    try:  # a bad setting or model: one line, exit 2, as train.py's refusals
        a = settings(argv)
        if a.model:
            print(for_model(a))
            return
    except EstimateError as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2)
    if a.worker:
        job = json.loads(a.worker)
        if job.pop("sharded", False):  # a rank of measure_sharded's torchrun: every rank prints its own line
            result = measure_sharded_update(**job)
            sys.stdout = sys.__stdout__  # (ddp.setup sent the other ranks' stdout to /dev/null)
            print(json.dumps(result), flush=True)
        else:
            print(json.dumps(measure_update(**job)))
    elif a.measure and a.fsdp > 1:
        for config, beta in SHARDED_CHECKS:
            measure_sharded(a.fsdp, config, dtype=a.dtype, beta=beta)
            print()
    elif a.fsdp > 1:
        print(fsdp_table(a.fsdp))
    elif a.measure_chunking:
        measure_chunking(CHUNKING_MODELS[a.chunking_model], device=a.device, dtype=a.dtype, model_type=a.chunking_model)
    elif a.measure:
        print(check_header(SMALL_QWEN, 4, 512, a.dtype, a.device, a.logprob_chunk), flush=True)
        results = measure(device=a.device, dtype=a.dtype, logprob_chunk=a.logprob_chunk)
        print("\n" + check_summary([m["ratio"] for m in results]))
    else:
        print(table() + "\n\n" + fits_table())


if __name__ == "__main__":
    main()
