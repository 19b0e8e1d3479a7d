"""How many lines a reader follows through one RL step: `python -m tools.step_lines` (a minute or two on a CPU).

Measured by running it, two ways, for `--algo gspo` (the default task, embedded model, seed 0) and for dapo:
  the core reader's path   one step (train.rl_step) under a profiler hook: every function of the core files (train,
                           rollout, rewards, losses, model, task) that core code calls. metrics.py (what the step
                           logs), plumbing/ and base/ change nothing learned and are not followed.
  the whole path           one iteration of train.py's loop, from the first rl_step to the second: every function of
                           the project that runs, whoever calls it (plumbing, the logged metrics, the loop itself).
Each function counts with all its lines (signature, docstring, comments; a nested function is part of the one around
it; a method counts alone, not its class), once. Class bodies that only declare fields (Args, Batch, Rollout's
fields) run no code and are not counted, nor are torch and transformers (as torch's internals are not part of
cleanrl's ~155). Also counted: the data-parallel calls (`world.<name>(...)`) written in the functions that run.
Each file's line lists the functions that ran in the file's order, each with its lines. The whole path's lines are
also split by role (the step, what it logs, the loop, plumbing; `roles`), which add up to it.
"""

from __future__ import annotations

import ast
import functools
import sys
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CORE = ("train", "rollout", "rewards", "losses", "model", "task")
CORE_FILES = {str(ROOT / f"{m}.py") for m in CORE}


@functools.cache
def top_level_spans(path: Path) -> list[tuple[int, int, ast.AST]]:
    """(first line, last line, node) of every top-level function and every method of a top-level class."""
    spans = []
    for node in ast.parse(path.read_text()).body:
        nodes = [n for n in node.body if isinstance(n, ast.FunctionDef)] if isinstance(node, ast.ClassDef) else [node]
        for n in nodes:
            if isinstance(n, ast.FunctionDef):
                first = n.decorator_list[0].lineno if n.decorator_list else n.lineno
                spans.append((first, n.end_lineno, n))
    return spans


def every_function(run) -> set[tuple[Path, int]]:
    """(file, first line of its code object) of every function of this repository (tests and this file aside) that
    runs in the first iteration of the loop run() runs, from the first call of train.rl_step to the second (the
    step, its metrics, its log line, its checks and checkpoint decision), whoever calls it, and the loop around it:
    the whole path, as a reader who follows every call reads it."""
    seen, steps = set(), []

    def hook(frame, event, arg):
        if event != "call":
            return
        path = Path(frame.f_code.co_filename)
        if frame.f_code.co_name == "rl_step" and path == ROOT / "train.py":
            steps.append(1)
            caller = frame.f_back  # the loop around it (train.train) is on the path too
            while len(steps) == 1 and caller is not None:
                if ours(Path(caller.f_code.co_filename)):
                    seen.add((Path(caller.f_code.co_filename), caller.f_code.co_firstlineno))
                caller = caller.f_back
        if len(steps) == 1 and ours(path):
            seen.add((path, frame.f_code.co_firstlineno))

    def ours(path: Path) -> bool:
        return path.is_relative_to(ROOT) and "tests" not in path.parts and path != Path(__file__)

    sys.setprofile(hook)
    try:
        run()
    finally:
        sys.setprofile(None)
    return seen


def executed_functions(step) -> set[tuple[Path, int]]:
    """(file, first line of its code object) of every core function that runs inside step() on the reader's path:
    called by step's own code, i.e. the nearest caller of this repository (torch's decorators in between are not)
    is on the path too, or a function nested in one on the path (update's loss, which plumbing/accumulate.py calls
    back). A core function that only plumbing calls (losses.ratio_diagnostics, for the logs) is not."""
    seen, on_path = set(), set()  # ids of the live frames on the path

    def in_repo(frame):
        path = Path(frame.f_code.co_filename)
        return path.is_relative_to(ROOT) and "tests" not in path.parts

    def hook(frame, event, arg):
        if event == "return":
            on_path.discard(id(frame))
        if event != "call" or not in_repo(frame):
            return
        caller = frame.f_back
        while caller is not None and not in_repo(caller):
            caller = caller.f_back
        closure = "<locals>" in frame.f_code.co_qualname and (Path(frame.f_code.co_filename), frame.f_code.co_qualname
                                                               .split(".<locals>")[0]) in top_level
        if frame.f_code.co_name == "rl_step" or (caller is not None and id(caller) in on_path) or closure:
            if frame.f_code.co_filename in CORE_FILES:
                on_path.add(id(frame))
                seen.add((Path(frame.f_code.co_filename), frame.f_code.co_firstlineno))
                if "<locals>" not in frame.f_code.co_qualname:
                    top_level.add((Path(frame.f_code.co_filename), frame.f_code.co_qualname))

    top_level = set()  # (file, qualified name) of the top-level functions on the path
    sys.setprofile(hook)
    try:
        step()
    finally:
        sys.setprofile(None)
    return seen


def measure(step, whole: bool = False) -> dict:
    """Lines per file of the functions that ran (a nested function's lines belong to the one around it): those on
    the core reader's path (executed_functions), or with `whole` every one (every_function)."""
    runs_in = defaultdict(set)  # file -> the top-level functions/methods that ran (by their first line)
    for path, line in (every_function if whole else executed_functions)(step):
        for first, last, node in top_level_spans(path):
            if first <= line <= last:
                runs_in[path].add((first, last, node))
    out = {}
    for path, spans in runs_in.items():
        name = path.relative_to(ROOT).with_suffix("").as_posix().replace("/", ".")
        spans = sorted(spans, key=lambda span: span[0])  # in the file's order, the same on every run
        world = [sub.func.attr for _, _, node in spans for sub in ast.walk(node) if isinstance(sub, ast.Call)
                 and isinstance(sub.func, ast.Attribute) and isinstance(sub.func.value, ast.Name)
                 and sub.func.value.id == "world"]
        out[name] = {"lines": sum(last - first + 1 for first, last, _ in spans), "functions": sorted(
            n.name for _, _, n in spans), "world_calls": world,
                     "sizes": [(n.name, last - first + 1) for first, last, n in spans],  # in the file's order
                     "firsts": {first: last - first + 1 for first, last, _ in spans}}  # first line -> lines
    return out


ROLES = ("the step", "what it logs", "the loop", "plumbing")


def roles(whole: dict, core: dict) -> dict[str, int]:
    """The whole path's lines by what they do: the step (the functions of the core reader's path), what it logs
    (metrics.py, and losses.py's functions off that path: the ratio and clip diagnostics), the loop around the step
    (the other core functions off that path: train.train, and whatever the loop calls between two steps) and
    plumbing (plumbing/, base/). The four add up to the whole path."""
    out = dict.fromkeys(ROLES, 0)
    for module, counted in whole.items():
        on_path = core.get(module, {}).get("firsts", {})
        for first, lines in counted["firsts"].items():
            role = ("the step" if first in on_path else "plumbing" if module.split(".")[0] in ("plumbing", "base")
                    else "what it logs" if module in ("metrics", "losses") else "the loop")
            out[role] += lines
    return out


def one_step(algo: str):
    """A function that runs one RL step of `python train.py --algo ALGO` from its warm start."""
    import torch
    from transformers import get_scheduler

    import train
    from plumbing import run as runs

    args, cfg = runs.resolve(train.Args(algo=algo, wandb_mode="disabled"))
    runs.seed_everything(args.seed)
    policy, tokenizer = runs.load_policy(args)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=args.lr)
    scheduler = get_scheduler(args.lr_scheduler, optimizer, num_warmup_steps=args.warmup_steps,
                              num_training_steps=args.total_steps * args.num_minibatches)
    stream, gen = runs.PromptStream(runs.load_data(args)[0], args.seed), torch.Generator().manual_seed(args.seed)
    pi_old = train.pi_old_source(args.num_minibatches, args.num_epochs, args.old_logprobs, args.rollout_correction,
                                 torch.float32)  # as train.train decides it once, before the first step
    return lambda: train.rl_step(policy, None, tokenizer, optimizer, scheduler, stream, cfg, args, gen, pi_old=pi_old)


def one_iteration(algo: str):
    """A function that runs `python train.py --algo ALGO --total-steps 2` in a temporary folder (the second step
    ends the first iteration of its loop; no evaluation between them)."""
    import tempfile

    import train

    def run():
        with tempfile.TemporaryDirectory() as out:
            train.train(train.Args(algo=algo, total_steps=2, eval_every=2, eval_size=4, output_dir=out,
                                   wandb_mode="disabled", save_model=False))
    return run


def report(title: str, counted: dict, core: dict | None = None) -> None:
    """One count's lines: the total with each file's share, then each file's functions; with `core` (the core
    reader's path of the same --algo) the total's split by role (roles)."""
    world = [w for _, c in sorted(counted.items()) for w in c["world_calls"]]  # by file, then in each file's order
    print(f"{title}: {sum(c['lines'] for c in counted.values())} lines in {len(counted)} files "
          f"({', '.join(m + ' ' + str(c['lines']) for m, c in sorted(counted.items()))}); "
          f"{sum(len(c['functions']) for c in counted.values())} functions; data-parallel calls {len(world)}"
          f"{' (' + ', '.join(world) + ')' if world else ''}")
    if core is not None:
        print("  by role: " + ", ".join(f"{role} {n}" for role, n in roles(counted, core).items()))
    for m, c in sorted(counted.items()):  # each function with its lines, so a reader sees where they go
        print(f"  {m}: {', '.join(f'{name} {lines}' for name, lines in c['sizes'])}")


@dataclass
class StepLinesArgs:
    """Count the lines one RL step reads (no settings: the default run and DAPO's, on the embedded model)."""


def main(argv: list[str] | None = None) -> None:
    import torch

    from plumbing import flags

    flags.parse(StepLinesArgs, __doc__, argv, program="python -m tools.step_lines")
    torch.set_num_threads(1)
    for algo in ("gspo", "dapo"):
        core = measure(one_step(algo))
        report(f"one RL step of --algo {algo}, the core reader's path", core)
        report(f"one iteration of the loop, --algo {algo}, the whole path", measure(one_iteration(algo), whole=True),
               core)


if __name__ == "__main__":
    main()
