"""The embedded default task, and loading a task from JSONL.

The default task is a remainder computed by repeated subtraction, written out step by step:

    prompt:      47 mod 13 =
    completion:   47-13=34 34-13=21 21-13=8 <answer>8</answer><eos>

Every step only needs what is a few characters back (the running value and the divisor), so a ~1M-parameter
model learns the format in a couple of minutes on a CPU. A problem takes 1 to 4 subtractions, so a completion has
10 to 42 tokens: lengths within one batch differ by more than 3x, the regime where token-level and
sequence-level importance ratios behave differently. The divisor d is 3..19 except 5, 10 (and 2): the
divisors of 10 would hide the teacher's mistake below.

Why RL, not more supervised training, improves the warm-started policy: the demonstrations come from a *noisy
teacher*. On the first step that needs a borrow (ones digit of s smaller than d's), the teacher forgets to borrow
with probability `slip_prob` (default 0.6) and writes a result 10 too large, then carries on correctly from there;
the answer is wrong. Supervised training imitates the teacher, slips included: the most likely token on a borrow
step is the wrong one, so greedy decoding fails on most problems that borrow, while sampling at temperature 1 is
right often enough that groups of G completions have mixed rewards. More imitation cannot fix that; a
verifier-driven objective can.
"""

from __future__ import annotations

import json
import math
import random
import zlib
from dataclasses import dataclass
from pathlib import Path

ANSWER_OPEN, ANSWER_CLOSE = "<answer>", "</answer>"
DIVISORS = [d for d in range(3, 20) if 10 % d != 0]
MAX_STEPS = 4



@dataclass(frozen=True)
class Example:
    prompt: str
    answer: str


class TaskError(ValueError):
    """A dataset that cannot be used; the message says what is wrong and what to do."""


# ---------------------------------------------------------------------------------------------------------------
# The generated task
# ---------------------------------------------------------------------------------------------------------------

Problem = tuple[int, int]  # (n, d): compute n mod d


def all_problems() -> list[Problem]:
    return [(n, d) for d in DIVISORS for n in range(d, (MAX_STEPS + 1) * d)]


def prompt_text(problem: Problem) -> str:
    n, d = problem
    return f"{n} mod {d} ="


def borrows(s: int, d: int) -> bool:
    return s >= 10 and s % 10 < d % 10


def solve(problem: Problem, rng: random.Random | None = None, slip_prob: float = 0.0,
          first_step_only: bool = False) -> str:
    """The worked solution; with `rng` and `slip_prob` > 0, the noisy teacher's version (see module docstring).

    The default task's teacher may slip on any borrow step until it has slipped once; with `first_step_only` (the
    long task) only on the first subtraction, so that a 30-step chain holds one decision, not thirty.
    """
    s, d = problem
    steps, slipped = [], False
    while s >= d:
        r = s - d
        may_slip = not slipped and borrows(s, d) and not (first_step_only and steps)
        if rng is not None and may_slip and rng.random() < slip_prob:
            r, slipped = r + 10, True
        steps.append(f"{s}-{d}={r}")
        s = r
    return " " + " ".join(steps) + f" {ANSWER_OPEN}{s}{ANSWER_CLOSE}"


def is_heldout(problem: Problem) -> bool:
    """A fixed 20% of all problems is held out, chosen by a hash of the prompt: disjoint, seed-independent."""
    return zlib.crc32(prompt_text(problem).encode()) % 5 == 0


def split(heldout: bool, long: bool = False) -> list[Problem]:
    return [p for p in (long_problems() if long else all_problems()) if is_heldout(p) == heldout]


def instruct_text(problem: Problem) -> str:
    """The same problem phrased for an instruct model (used with --dataset embedded-instruct)."""
    n, d = problem
    return f"What is the remainder when {n} is divided by {d}?"


def default_splits(instruct: bool = False, long: bool = False) -> tuple[list[Example], list[Example]]:
    """An embedded task as (train, held-out) lists of Examples with their correct answers."""
    text = instruct_text if instruct else prompt_text
    as_examples = lambda problems: [Example(text(p), str(p[0] % p[1])) for p in problems]  # noqa: E731
    return as_examples(split(False, long)), as_examples(split(True, long))


# ---------------------------------------------------------------------------------------------------------------
# The long variant (--dataset embedded-long): the same remainders, worked over 3 to 36 subtractions
# ---------------------------------------------------------------------------------------------------------------
#
#     prompt:      131 mod 17 =
#     completion:   131-17=114 114-17=97 97-17=80 80-17=63 63-17=46 46-17=29 29-17=12 <answer>12</answer><eos>
#
# Completions run from 30 to 300 tokens (the embedded character-level tokenizer: one token per character, one per
# tag, one for EOS), the regime where the GSPO paper expects token-level ratios to misbehave. Problems are kept
# with probability 3/k for k subtractions (chosen by a hash of the prompt, so the set is fixed), which spreads
# the lengths evenly on a log scale: in a batch of 16 prompts the longest answer is typically 8x the shortest.
# The noisy teacher slips only on the first subtraction (when it borrows), so greedy decoding of the imitation
# fails on most of the 86% of problems whose first step borrows, whatever their length.

LONG_TOKENS = (20, 300)  # completion length range, in embedded-tokenizer tokens, of the correct solution
LONG_MAX_N = 130  # long chains come from small divisors, not big numbers: the arithmetic stays that of the default
LONG_BINS, LONG_PER_BIN = 10, 60  # at most 60 problems per tenth of the log-length range: lengths spread evenly
LONG_MAX_NEW_TOKENS = 360  # leaves room for a slip's extra steps


def completion_tokens(completion: str) -> int:
    """Tokens of a completion under the embedded tokenizer (characters, each tag one token, plus EOS)."""
    return len(completion) - len(ANSWER_OPEN) - len(ANSWER_CLOSE) + 3


def long_problems() -> list[Problem]:
    """The long task's fixed problem set: 572 problems, their correct answers 20 to 295 tokens long.

    Of every (n, d) with n <= LONG_MAX_N whose answer length is in LONG_TOKENS, each tenth of the log-length range
    keeps LONG_PER_BIN problems, so short answers do not swamp long ones: in a batch of 16 prompts the longest
    answer is then typically (median) 11x the shortest. Problems whose first step borrows are kept first (86% of
    the set), then the others in the order of a hash of the prompt.
    """
    lo, hi = LONG_TOKENS
    bins: dict[int, list[Problem]] = {}
    for d in DIVISORS:
        for n in range(2 * d, LONG_MAX_N + 1):
            length = completion_tokens(solve((n, d)))
            if lo <= length <= hi:
                bins.setdefault(int(LONG_BINS * math.log(length / lo) / math.log(hi / lo + 1e-9)), []).append((n, d))
    # problems whose first subtraction borrows (the step the teacher may slip on) first, then by hash
    order = lambda p: (not borrows(*p), zlib.crc32(prompt_text(p).encode()))  # noqa: E731
    return sorted(p for members in bins.values() for p in sorted(members, key=order)[:LONG_PER_BIN])


# ---------------------------------------------------------------------------------------------------------------
# JSONL datasets: one {"prompt": ..., "answer": ...} object per line
# ---------------------------------------------------------------------------------------------------------------


def load_jsonl(path: str | Path) -> list[Example]:
    """Rows of {"prompt": text, "answer": text or number}, one JSON object per line; a TaskError names the line."""
    path = Path(path)
    if path.is_dir():
        raise TaskError(f"dataset {path} is a folder; pass a JSONL file of {{\"prompt\", \"answer\"}} rows")
    if not path.is_file():
        raise TaskError(f"dataset file {path} does not exist; pass a JSONL file of {{\"prompt\", \"answer\"}} rows")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise TaskError(f"dataset file {path} is not UTF-8 text (byte {e.start}); save it as UTF-8 JSONL")
    rows = []
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            hint = (" (a JSON array or pretty-printed JSON? write one object per line)"
                    if lineno == 1 and line.lstrip()[:1] in "[{" else "; each line must be one JSON object")
            raise TaskError(f"{path}:{lineno}: not valid JSON ({e.msg}){hint}")
        if isinstance(row, list):
            raise TaskError(f"{path}:{lineno}: a JSON array; the file must hold one {{\"prompt\", \"answer\"}} "
                            "object per line (JSONL), not an array")
        if not isinstance(row, dict) or "prompt" not in row or "answer" not in row:
            raise TaskError(f"{path}:{lineno}: a row needs both \"prompt\" and \"answer\" fields")
        prompt, answer = row["prompt"], row["answer"]
        if not isinstance(prompt, str) or not prompt.strip():
            raise TaskError(f"{path}:{lineno}: \"prompt\" must be non-empty text (got {json.dumps(prompt)[:40]})")
        if isinstance(answer, bool) or not isinstance(answer, (str, int, float)) or not str(answer).strip():
            raise TaskError(f"{path}:{lineno}: \"answer\" must be non-empty text or a number "
                            f"(got {json.dumps(answer)[:40]})")
        rows.append(Example(prompt, str(answer)))
    if len(rows) < 2:
        raise TaskError(f"dataset file {path} has {len(rows)} row(s); it needs at least 2 (some are held out for "
                        "evaluation)")
    return rows


def write_jsonl(path: str | Path, examples: list[Example]) -> None:
    with Path(path).open("w", encoding="utf-8") as f:
        for ex in examples:
            f.write(json.dumps({"prompt": ex.prompt, "answer": ex.answer}) + "\n")


def heldout_split(examples: list[Example], fraction: float = 0.1, max_heldout: int = 200) -> tuple[list, list]:
    """Split a loaded dataset into (train, held-out) by a hash of the prompt: stable across runs and seeds."""
    n = len(examples)
    if n < 2:
        raise TaskError(f"a dataset needs at least 2 rows to hold some out for evaluation, it has {n}")
    test = [ex for ex in examples if zlib.crc32(ex.prompt.encode()) % 1000 < fraction * 1000][:max_heldout]
    test = test or examples[-1:]
    test_ids = {id(ex) for ex in test}
    return [ex for ex in examples if id(ex) not in test_ids], test


def load_hub_dataset(name: str, split: str = "train") -> list[Example]:
    """A hub dataset with `prompt` (or `question`) and `answer` columns; GSM8K-style answers keep what follows
    '####'. Needs the optional `datasets` package and a reachable hub."""
    if Path(name).suffix or name.startswith((".", "/", "~")):
        raise TaskError(f"dataset file {name} does not exist; pass a JSONL file of {{\"prompt\", \"answer\"}} rows")
    import model

    if model.hub_offline():
        raise TaskError(f"dataset {name!r} is not a local file, and the hub ({model.hub_endpoint()}) is unreachable; "
                        "pass a JSONL file of {\"prompt\", \"answer\"} rows")
    try:
        import datasets
    except ImportError:
        raise TaskError(f"{name!r} is not a file; loading hub datasets needs `pip install datasets` "
                        "(or pass a JSONL file of {\"prompt\", \"answer\"} rows)")
    try:
        rows = datasets.load_dataset(name, split=split)
    except Exception as e:  # the hub client raises many types; all mean the same thing here
        raise TaskError(f"could not load dataset {name!r} ({type(e).__name__}); pass a JSONL file instead")
    key = "prompt" if "prompt" in rows.column_names else "question"
    if key not in rows.column_names or "answer" not in rows.column_names:
        raise TaskError(f"dataset {name!r} needs prompt (or question) and answer columns, has {rows.column_names}")
    return [Example(r[key], str(r["answer"]).split("####")[-1].strip()) for r in rows]
