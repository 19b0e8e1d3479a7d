"""What fits on one GPU: the memory of an RL step, estimated on paper from a model's shape.

    python memory.py          # the table in docs/reference.md: Qwen2.5 0.5B / 1.5B / 3B in bf16, six set-ups each

A step holds, besides the CUDA context and the allocator's slack (not counted):
    weights         2 bytes per parameter (bf16; train.py loads the model in bf16 on a GPU that has it)
    gradients       2 bytes per trained parameter
    AdamW state     4 bytes per trained parameter (two bf16 moments: torch keeps them in the parameter's dtype)
    LoRA adapter    instead of the two lines above, 16 bytes per adapter parameter: peft keeps adapters in float32
                    under a bf16 base (weight, gradient and two moments, 4 bytes each)
    reference copy  2 bytes per parameter when β > 0 and the whole model trains (LoRA: the base, adapter off, is free)
    activations     what one micro-batch's forward keeps for its backward: per token and layer the saved inputs of
                    the attention block (~7 h + 2 kv: norm in/out, q, k, v, attention out, o_proj in; SDPA keeps no
                    T x T matrix) and of the SwiGLU MLP (~4 i: gate, up, their activation and product), in bf16;
                    with gradient checkpointing only each layer's input (h) plus one layer recomputed at a time
    logits          per completion token, the vocabulary's logits in bf16 and their float32 log-softmax
                    temporaries (~6 bytes x V): train.py keeps only completion positions (logits_to_keep)
The estimate is for one forward/backward of `rows` rows of `tokens` tokens (prompt + completion); --micro-batch-size
sets rows, and memory falls with it. Generation (KV cache, inference mode) is smaller than the update's peak here.
"""

from __future__ import annotations

from dataclasses import dataclass

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
             bytes_per: int = 2) -> dict[str, float]:
    """Bytes of each part of one update step (see the module docstring)."""
    per_layer = (7 * s.hidden + 2 * s.kv + 4 * s.intermediate) * bytes_per  # per token
    if checkpointing:
        acts = rows * tokens * (s.layers * s.hidden * bytes_per + per_layer)
    else:
        acts = rows * tokens * s.layers * per_layer
    trained = {"adapter": lora_params(s, lora_rank) * 16} if lora_rank else \
        {"gradients": s.params * bytes_per, "adamw": s.params * 2 * bytes_per}
    return {"weights": s.params * bytes_per, **trained,
            "reference": s.params * bytes_per if beta > 0 and not lora_rank else 0.0, "activations": acts,
            "logits": rows * completion * s.vocab * (bytes_per + 4)}


SETUPS = [("full fine-tune", False, 0), ("+ gradient checkpointing", True, 0), ("LoRA r=16", False, 16),
          ("LoRA r=16 + checkpointing", True, 16)]


def table(rows: int = 8, prompt: int = 150, completion: int = 256) -> str:
    lines = [f"| bf16, one micro-batch of {rows} rows x {prompt + completion} tokens ({completion} completion) | "
             + " | ".join(f"{s.name} β=0 / β=0.04" for s in QWEN) + " |", "|---|" + "---|" * len(QWEN)]
    for label, ckpt, rank in SETUPS:
        cells = []
        for s in QWEN:
            total = [sum(estimate(s, rows, prompt + completion, completion, beta, ckpt, rank).values()) / GiB
                     for beta in (0.0, 0.04)]
            cells.append(f"{total[0]:.1f} / {total[1]:.1f} GiB")
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(table())
