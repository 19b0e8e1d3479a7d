"""Two held-out evaluations, problem by problem: `python -m tools.compare --a RUN --b RUN`.

Each RUN is a run folder written with --log-completions-every (its eval_completions.jsonl: every evaluation's greedy
answers), or that file itself. `python train.py --total-steps 0 --log-completions-every 1` evaluates a model alone, so
a base model and a trained one compare as

    python train.py --total-steps 0 --log-completions-every 1 --model Qwen/Qwen2.5-0.5B-Instruct ...
    python train.py --total-steps 0 --log-completions-every 1 --model runs/<run>/final ...
    python -m tools.compare --a runs/eval-Qwen2.5-0.5B-Instruct-...-s0 --b runs/eval-<run>-final-...-s0

Each side is its last evaluation (or --step-a / --step-b). The two must have scored the same problems (the same
places in the held-out set, the same prompts). The effect is B - A: the mean over problems of the paired difference
in correctness, with its 95% t interval over problems (the study's rule, tools/study/stats.py; cut to [-1, 1]),
beside the problems only one side answered right. The interval is over these problems: another draw of problems, or another seed of the
training run, varies more.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

from base.errors import UserError, one_line_errors


@dataclass
class CompareArgs:
    """Compare two held-out evaluations problem by problem."""

    a: str = ""
    """the first run folder (or its eval_completions.jsonl): the baseline"""
    b: str = ""
    """the second run folder (or its eval_completions.jsonl)"""
    step_a: int | None = None
    """which of A's evaluations (its step); default: the last"""
    step_b: int | None = None
    """which of B's evaluations (its step); default: the last"""
    show: int = 3
    """problems to list of each kind (right only in A, right only in B)"""


class CompareError(UserError, ValueError):
    """Two evaluations that cannot be compared; the message says why and what to do."""


def answers(where: str, step: int | None, flag: str) -> tuple[int, dict[int, dict]]:
    """(the step, {problem: answer}) of one evaluation in a run's eval_completions.jsonl."""
    if not where:
        raise CompareError(f"--{flag} names no run: pass a run folder written with --log-completions-every")
    path = Path(where)
    path = path / "eval_completions.jsonl" if path.is_dir() else path
    if not path.is_file():
        raise CompareError(f"--{flag} {where}: no eval_completions.jsonl there; run train.py with "
                           "--log-completions-every N (with --total-steps 0 to evaluate a model alone)")
    try:
        rows = [json.loads(line) for line in path.open() if line.strip()]
        steps = sorted({r["step"] for r in rows})
    except (ValueError, KeyError, TypeError) as e:
        raise CompareError(f"--{flag} {path} is not an eval_completions.jsonl of this trainer "
                           f"({type(e).__name__}: {e})")
    if not steps:
        raise CompareError(f"--{flag} {path} holds no evaluation")
    if step is None:
        step = steps[-1]
    elif step not in steps:
        raise CompareError(f"--step-{flag} {step}: {path} has evaluations at steps {', '.join(map(str, steps))}")
    return step, {r["problem"]: r for r in rows if r["step"] == step}


def main(argv: list[str] | None = None) -> None:
    from plumbing import flags

    given = sys.argv[1:] if argv is None else list(argv)
    if len(given) >= 2 and not given[0].startswith("-"):  # `tools.compare A B`: the runs are named by flag
        print(f"error: name the two runs as flags: python -m tools.compare --a {given[0]} --b {given[1]}",
              file=sys.stderr)
        sys.exit(2)
    args = flags.parse(CompareArgs, __doc__, argv, program="python -m tools.compare")
    with one_line_errors():  # a CompareError: one `error: ...` line, exit 2
        compare(args)


def compare(args: CompareArgs) -> None:
    from tools.study import stats

    if args.show < 0:
        raise CompareError(f"--show must be >= 0 (got {args.show})")
    step_a, a = answers(args.a, args.step_a, "a")
    step_b, b = answers(args.b, args.step_b, "b")
    if set(a) != set(b) or any(a[p]["prompt"] != b[p]["prompt"] for p in a):
        differ = sorted(set(a) ^ set(b)) or [p for p in sorted(a) if a[p]["prompt"] != b[p]["prompt"]]
        raise CompareError(f"A and B did not score the same problems ({len(a)} and {len(b)}; they differ at problem "
                           f"{differ[0]}): evaluate both with the same --dataset, --eval-dataset and --eval-size")
    problems = sorted(a)
    effect = stats.estimate([float(b[p]["correct"]) - float(a[p]["correct"]) for p in problems])
    only_a = [p for p in problems if a[p]["correct"] and not b[p]["correct"]]
    only_b = [p for p in problems if b[p]["correct"] and not a[p]["correct"]]
    accuracy = lambda side: sum(float(side[p]["correct"]) for p in problems) / len(problems)  # noqa: E731
    print(f"A: {args.a} at step {step_a}: accuracy {accuracy(a):.3f}")
    print(f"B: {args.b} at step {step_b}: accuracy {accuracy(b):.3f}")
    lo, hi = max(effect.lo, -1.0), min(effect.hi, 1.0)  # a difference of accuracies lies in [-1, 1]
    interval = f"[{lo:+.3f}, {hi:+.3f}]" if effect.n > 1 else "(no interval from one problem)"
    print(f"B - A: {effect.mean:+.3f} {interval}, paired over {len(problems)} problems; right only in A: "
          f"{len(only_a)}, only in B: {len(only_b)}")
    for name, side, listed in (("A", a, only_a), ("B", b, only_b)):
        for p in listed[:args.show]:
            print(f"  right only in {name}: problem {p} {side[p]['prompt'][:60]!r} -> "
                  f"{side[p]['completion'][:60]!r} (reference {side[p]['reference']!r})")


if __name__ == "__main__":
    main()
