"""docs/recipes.md's generated parts: each recipe's memory estimate and the time-per-step estimates, from the recipe's
own command. `python -m tools.recipes` rewrites them in place; the tests check the page is current.

A recipe is a `## N. ...` section of the page with one ```bash block holding a `python train.py` command; its
```text block opening with `<!-- recipe-memory:N -->` gets tools.memory's estimate for the model's shape (Qwen2.5's,
from tools.memory.QWEN) at the command's settings.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path

PAGE = Path(__file__).resolve().parents[1] / "docs" / "recipes.md"
SECTION = re.compile(r"^## (\d+)\. (.*?)$(.*?)(?=^## |\Z)", re.M | re.S)
PEAK_TFLOPS, UTILISATION = 312.0, 0.4  # an A100's dense bf16 peak, and the share of it an update is assumed to reach
DECODE_MS = (20, 40)  # HF generate's time per decode step at a batch of a few hundred rows: assumed, not measured
PROMPT_TOKENS = 150  # tools.memory's default: a GSM8K problem in Qwen's chat template with the instruction


@dataclass
class Recipe:
    number: int
    title: str
    card: int  # GiB, from the heading ("one 24 GB card")
    argv: list[str]  # train.py's arguments


def recipes(text: str) -> list[Recipe]:
    found = []
    for number, title, body in SECTION.findall(text):
        block = re.search(r"```bash\n(.*?)```", body, re.S)
        command = next(line for line in block.group(1).replace("\\\n", " ").splitlines()
                       if line.startswith("python train.py"))
        card = re.search(r"(\d+) GB card", title)
        found.append(Recipe(int(number), title, int(card.group(1)), shlex.split(command)[2:]))
    return found


def resolved(argv: list[str]):
    """train.py's Args for a recipe, the --algo preset applied, as train.py resolves them."""
    import train
    from plumbing import flags
    from plumbing import run as runs

    cli = flags.default_hints(flags.docstrings_as_help(train.Args), runs.help_defaults())
    return runs.resolve(flags.parse(cli, "", argv))


def shape(model: str):
    from tools import memory

    name = model.split("/")[-1].removesuffix("-Instruct")
    return next(s for s in memory.QWEN if s.name == name)


def memory_args(args, cfg):
    from tools import memory

    return memory.MemoryArgs(model=args.model, num_prompts=args.num_prompts, num_generations=args.num_generations,
                             num_minibatches=args.num_minibatches, micro_batch_size=args.micro_batch_size,
                             max_new_tokens=args.max_new_tokens, prompt_tokens=PROMPT_TOKENS,
                             lora_rank=args.lora_rank, gradient_checkpointing=args.gradient_checkpointing,
                             beta=cfg.beta)


def memory_text(r: Recipe) -> str:
    from tools import memory

    args, cfg = resolved(r.argv)
    return memory.for_shape(memory_args(args, cfg), shape(args.model))


def peak_gib(r: Recipe) -> float:
    from tools import memory

    args, cfg = resolved(r.argv)
    return memory.total(memory.estimate_at(memory_args(args, cfg), shape(args.model))[3]) / memory.GiB


def time_text(rs: list[Recipe]) -> str:
    """Per recipe: the update's arithmetic (forward 2N, backward 4N or, with LoRA, ~2N for the activations' gradients;
    checkpointing one more forward; pi_old recomputed under bf16 and the reference under beta > 0 one forward each,
    per token) at UTILISATION of an A100's bf16 peak, and the rollout's decode steps at DECODE_MS each."""
    lines = ["Arithmetic, not measurements: the update at 40% of an A100's 312 TFLOP/s bf16 peak, over every rollout "
             "token; generation as its decode steps at 20-40 ms each (HF generate's step at a batch of a few hundred "
             "rows, assumed); evaluation not counted. A GPU run will replace these.", "",
             "| recipe | rollout tokens | update FLOP | update | generation | per RL step |", "|---|---|---|---|---|---|"]
    for r in rs:
        args, cfg = resolved(r.argv)
        s = shape(args.model)
        tokens = args.num_prompts * args.num_generations * (PROMPT_TOKENS + args.max_new_tokens)
        per_token = 2 + (2 if args.lora_rank else 4) + 2 * args.gradient_checkpointing + 2 + \
            2 * (cfg.beta > 0 and not args.lora_rank) + 2 * (cfg.beta > 0 and bool(args.lora_rank))
        flop = per_token * s.params * tokens
        update = flop / (PEAK_TFLOPS * 1e12 * UTILISATION)
        gen = [args.max_new_tokens * ms / 1000 for ms in DECODE_MS]
        lines.append(f"| {r.number}. {r.title} | {tokens:,} | {flop:.1e} | {update:.0f} s | {gen[0]:.0f}-{gen[1]:.0f} s"
                     f" | {update + gen[0]:.0f}-{update + gen[1]:.0f} s |")
    return "\n".join(lines)


def filled(text: str) -> str:
    """The page with every generated part rewritten from its recipes."""
    rs = recipes(text)
    for r in rs:
        text = re.sub(rf"(```text\n<!-- recipe-memory:{r.number} -->\n).*?(```)",
                      lambda m, r=r: m.group(1) + memory_text(r) + "\n" + m.group(2), text, flags=re.S)
    return re.sub(r"(<!-- recipe-time -->\n).*?(?=\n## )", lambda m: m.group(1) + time_text(rs) + "\n", text,
                  flags=re.S)


@dataclass
class RecipesArgs:
    """Rewrite docs/recipes.md's generated parts (no settings)."""


def main(argv: list[str] | None = None) -> None:
    from plumbing import flags

    flags.parse(RecipesArgs, __doc__, argv, program="python -m tools.recipes")
    PAGE.write_text(filled(PAGE.read_text()))
    print(f"rewrote {PAGE}")


if __name__ == "__main__":
    main()
