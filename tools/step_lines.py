"""How many lines a reader follows through one RL step: `python -m tools.step_lines` (a minute or two on a CPU).

Measured by running `train.py --total-steps 2` under a profiler hook (`traced`), for `--algo gspo` (the default
task, embedded model, seed 0) and for dapo, two ways at once:
  the core reader's path   the first step (train.rl_step): every function of the core files (train, rollout, rewards,
                           losses, model, task) that core code calls. metrics.py (what the step logs), plumbing/ and
                           base/ change nothing learned and are not followed.
  the whole path           the first iteration of the loop, from the first rl_step to the second: every function of
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


def traced(run) -> tuple[set[tuple[Path, int]], set[tuple[Path, int]]]:
    """Run `run` (one_iteration) under one profiler hook and return (file, first line of its code object) of the
    functions of two paths through the first iteration of its loop, from the first call of train.rl_step to the
    second:
      the core reader's path  every core function (CORE_FILES) that runs inside that first rl_step called by the
                              step's own code: the nearest caller of this repository (torch's decorators in between
                              are not) is on the path too, or it is nested in a function on the path (update's
                              loss_of). A core function that only plumbing calls (losses.ratio_diagnostics, for the
                              logs) is not on it.
      the whole path          every function of this repository (tests and this file aside) that runs, whoever calls
                              it (the step, its metrics, its log line, its checks and checkpoint decision), and the
                              loop around it: as a reader who follows every call reads it."""
    core, whole, steps = set(), set(), []
    on_path, top_level = set(), set()  # ids of the live frames on the core path; (file, name) of its top-level ones
    train_py, this_file = str(ROOT / "train.py"), Path(__file__)

    @functools.cache
    def in_repo(filename: str) -> bool:  # (cached: the hook sees every call torch and transformers make in Python)
        path = Path(filename)
        return path.is_relative_to(ROOT) and "tests" not in path.parts

    def hook(frame, event, arg):
        if event == "return":
            on_path.discard(id(frame))
        if event != "call":
            return
        code = frame.f_code
        if code.co_name == "rl_step" and code.co_filename == train_py:
            steps.append(1)
            caller = frame.f_back  # the loop around it (train.train) is on the whole path too
            while len(steps) == 1 and caller is not None:
                if in_repo(caller.f_code.co_filename) and Path(caller.f_code.co_filename) != this_file:
                    whole.add((Path(caller.f_code.co_filename), caller.f_code.co_firstlineno))
                caller = caller.f_back
        if len(steps) != 1 or not in_repo(code.co_filename):  # (outside the first iteration: nothing to count)
            return
        path = Path(code.co_filename)
        if path != this_file:
            whole.add((path, code.co_firstlineno))
        caller = frame.f_back
        while caller is not None and not in_repo(caller.f_code.co_filename):
            caller = caller.f_back
        closure = "<locals>" in code.co_qualname and (path, code.co_qualname.split(".<locals>")[0]) in top_level
        if code.co_name == "rl_step" or (caller is not None and id(caller) in on_path) or closure:
            if code.co_filename in CORE_FILES:
                on_path.add(id(frame))
                core.add((path, code.co_firstlineno))
                if "<locals>" not in code.co_qualname:
                    top_level.add((path, code.co_qualname))

    sys.setprofile(hook)
    try:
        run()
    finally:
        sys.setprofile(None)
    return core, whole


def measure(functions: set[tuple[Path, int]]) -> dict:
    """Lines per file of the functions that ran (a nested function's lines belong to the one around it)."""
    runs_in = defaultdict(set)  # file -> the top-level functions/methods that ran (by their first line)
    for path, line in functions:
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


def both_paths(algo: str) -> tuple[dict, dict]:
    """The core reader's path and the whole path of `--algo ALGO`, counted (measure) from one run."""
    core, whole = traced(one_iteration(algo))
    return measure(core), measure(whole)


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
        core, whole = both_paths(algo)
        report(f"one RL step of --algo {algo}, the core reader's path", core)
        report(f"one iteration of the loop, --algo {algo}, the whole path", whole, core)


if __name__ == "__main__":
    main()
