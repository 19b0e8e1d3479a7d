"""The embedded default task, and loading a task from a file, a saved folder or the hub.

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

from base import network
import rewards
from base.errors import UserError

ANSWER_OPEN, ANSWER_CLOSE = "<answer>", "</answer>"
DIVISORS = [d for d in range(3, 20) if 10 % d != 0]
MAX_STEPS = 4


@dataclass(frozen=True)
class Example:
    prompt: str
    answer: str


class TaskError(UserError, ValueError):
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
    """The same problem phrased for an instruct model (--dataset embedded-instruct, embedded-long-instruct)."""
    n, d = problem
    return f"What is the remainder when {n} is divided by {d}?"


# the remainder task in its four forms: --dataset name -> (phrased for a chat model, the long task)
EMBEDDED_TASKS = {"embedded": (False, False), "embedded-instruct": (True, False), "embedded-long": (False, True),
                  "embedded-long-instruct": (True, True)}


def default_splits(instruct: bool = False, long: bool = False) -> tuple[list[Example], list[Example]]:
    """An embedded task as (train, held-out) lists of Examples with their correct answers."""
    text = instruct_text if instruct else prompt_text
    as_examples = lambda problems: [Example(text(p), str(p[0] % p[1])) for p in problems]  # noqa: E731
    return as_examples(split(False, long)), as_examples(split(True, long))


# ---------------------------------------------------------------------------------------------------------------
# --dataset embedded-add: additions phrased for a real chat model, scored with --answer-format last-number
# ---------------------------------------------------------------------------------------------------------------

ADD_MAX = 30  # a + b with 0 <= a, b <= ADD_MAX: 961 problems, 20% held out by a hash of the prompt


def addition_splits() -> tuple[list[Example], list[Example]]:
    """(train, held-out) additions "What is 17 + 8?" -> "25", for pretrained instruct models (see docs/speed.md)."""
    examples = [Example(f"What is {a} + {b}?", str(a + b)) for a in range(ADD_MAX + 1) for b in range(ADD_MAX + 1)]
    heldout = lambda e: zlib.crc32(e.prompt.encode()) % 5 == 0  # noqa: E731
    return [e for e in examples if not heldout(e)], [e for e in examples if heldout(e)]


def embedded_splits(name: str) -> tuple[list[Example], list[Example]] | None:
    """(train, held-out) of an embedded task by its --dataset name, or None for any other name."""
    if name == "embedded-add":
        return addition_splits()
    if name in EMBEDDED_TASKS:
        instruct, long = EMBEDDED_TASKS[name]
        return default_splits(instruct=instruct, long=long)
    return None


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
# Datasets from files, save_to_disk folders and the hub
# ---------------------------------------------------------------------------------------------------------------
#
#   .jsonl / .txt   one {"prompt": ..., "answer": ...} object per line (read here, no extra package)
#   .json           the same, or one JSON array of such objects
#   .parquet / .csv a table with a prompt and an answer column        (through the optional `datasets` package)
#   a folder        a dataset saved with `save_to_disk`                (datasets)
#   a hub name      e.g. openai/gsm8k with --dataset-config main        (datasets, and a reachable hub)
#
# The prompt column is --prompt-field (default: the first of prompt, question, problem), the answer column
# --answer-field (default: answer, then solution). A reference answer keeps what follows the last "####"
# (GSM8K's worked answers) or, failing that, the content of its last \boxed{} (MATH's solutions). A source with
# a "test" split is evaluated on it; otherwise a fixed hash of each prompt holds out about 10% (each prompt with
# chance 1/10; at most 200).

PROMPT_FIELDS, ANSWER_FIELDS = ("prompt", "question", "problem"), ("answer", "solution")
TABLE_FILES = {".parquet": "parquet", ".csv": "csv"}
ROWS_HINT = "pass a JSONL file of {\"prompt\", \"answer\"} rows"


def reference_answer(answer: str) -> str:
    """The final answer inside a worked reference: after GSM8K's last '####', else MATH's last \\boxed{}."""
    if "####" in answer:
        return answer.rsplit("####", 1)[1].strip()
    boxed = rewards.extract_boxed(answer) if "\\boxed" in answer else None
    return boxed.strip() if boxed and boxed.strip() else answer.strip()


def pick_field(columns: list[str], chosen: str, candidates: tuple[str, ...], what: str, source: str) -> str:
    if chosen:
        if chosen not in columns:
            raise TaskError(f"dataset {source} has no {what} column {chosen!r}; its columns are {columns}")
        return chosen
    found = next((c for c in candidates if c in columns), None)
    if found is None:
        raise TaskError(f"dataset {source} has no {what} column ({' or '.join(candidates)}); its columns are "
                        f"{columns}: name one with --{what}-field")
    return found


def to_example(row, where: str, prompt_field: str, answer_field: str) -> Example:
    """One row as an Example; a TaskError naming `where` (file:line or row index) when it is not usable."""
    if not isinstance(row, dict) or prompt_field not in row or answer_field not in row:
        raise TaskError(f"{where}: a row needs both \"{prompt_field}\" and \"{answer_field}\" fields")
    prompt, answer = row[prompt_field], row[answer_field]
    if not isinstance(prompt, str) or not prompt.strip():
        chat = isinstance(prompt, list) and all(isinstance(m, dict) and "content" in m for m in prompt)  # TRL's
        raise TaskError(f"{where}: \"{prompt_field}\" must be non-empty text (got {json.dumps(prompt)[:40]})"
                        + ("; a list of chat messages is not read: give the question as text, which the model's chat "
                           "template wraps as a user turn" if chat else ""))
    if isinstance(answer, bool) or not isinstance(answer, (str, int, float)) or not str(answer).strip():
        raise TaskError(f"{where}: \"{answer_field}\" must be non-empty text or a number "
                        f"(got {json.dumps(answer, default=str)[:40]})")
    return Example(prompt, reference_answer(str(answer)))


def load_jsonl(path: str | Path, prompt_field: str = "", answer_field: str = "") -> list[Example]:
    """Rows of {"prompt": text, "answer": text or number}, one JSON object per line (a .json file may instead hold
    one array of them); a TaskError names the line. The fields are picked as for every other format: the named
    ones, else the first of PROMPT_FIELDS / ANSWER_FIELDS that the first row has (GSM8K's question/answer rows)."""
    path = Path(path)
    if not path.is_file():
        raise TaskError(f"dataset file {path} does not exist; {ROWS_HINT}")
    try:
        text = path.read_text(encoding="utf-8-sig")  # a byte-order mark (Windows editors write one) is dropped
    except UnicodeDecodeError as e:
        raise TaskError(f"dataset file {path} is not UTF-8 text (byte {e.start}); save it as UTF-8 JSONL")
    rows: list[tuple[str, object]] = []  # (where, row)
    if path.suffix == ".json" and text.lstrip().startswith("["):
        try:
            rows = [(f"{path} item {i}", row) for i, row in enumerate(json.loads(text))]
        except json.JSONDecodeError as e:
            raise TaskError(f"{path}:{e.lineno}: not valid JSON ({e.msg})")
    else:
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
            rows.append((f"{path}:{lineno}", row))
    first = next((row for _, row in rows if isinstance(row, dict)), {})
    pf = pick_field(list(first), prompt_field, PROMPT_FIELDS, "prompt", path) if first else prompt_field or "prompt"
    af = pick_field(list(first), answer_field, ANSWER_FIELDS, "answer", path) if first else answer_field or "answer"
    return not_empty([to_example(row, where, pf, af) for where, row in rows], path)


EMPTY = "has 0 row(s); it needs at least 1 (2 when some are held out for evaluation)"


def not_empty(examples: list[Example], source) -> list[Example]:
    if not examples:
        raise TaskError(f"dataset {source} {EMPTY}")
    return examples


def write_jsonl(path: str | Path, examples: list[Example]) -> None:
    with Path(path).open("w", encoding="utf-8") as f:
        for ex in examples:
            f.write(json.dumps({"prompt": ex.prompt, "answer": ex.answer}) + "\n")


def heldout_split(examples: list[Example], source, fraction: float = 0.1, max_heldout: int = 200) -> tuple[list, list]:
    """Split a loaded dataset into (train, held-out) by a hash of the prompt: stable across runs and seeds."""
    n = len(examples)
    if n < 2:
        raise TaskError(f"dataset {source} has {n} row(s); it needs at least 2 (some are held out for evaluation), "
                        "or pass your own held-out set with --eval-dataset")
    test = [ex for ex in examples if zlib.crc32(ex.prompt.encode()) % 1000 < fraction * 1000][:max_heldout]
    test = test or examples[-1:]
    test_ids = {id(ex) for ex in test}
    return [ex for ex in examples if id(ex) not in test_ids], test


def check_table(path: Path) -> None:
    """A parquet or CSV file that holds no rows, or is not that kind of file, named as such (the library's own
    message is a generic 'error while generating the dataset')."""
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        try:
            rows = pq.ParquetFile(path).metadata.num_rows
        except Exception as e:  # pyarrow's errors: not a parquet file, truncated, ...
            raise TaskError(f"dataset file {path} is not a readable parquet file ({str(e).splitlines()[0][:120]}); "
                            f"{ROWS_HINT}")
    else:
        with path.open("rb") as f:
            rows = sum(1 for line in f if line.strip()) - 1  # less the header line
    if rows < 1:
        raise TaskError(f"dataset {path} {EMPTY}")


def names_a_path(name: str) -> bool:
    """Whether a --dataset / --eval-dataset value names a file or folder (a suffix, a leading . / ~, or more than one
    '/'), not an embedded task or an owner/name hub id."""
    return bool(Path(name).suffix) or name.startswith((".", "/", "~")) or name.count("/") > 1


def load_dataset(name: str, prompt_field: str = "", answer_field: str = "", config: str = "",
                 split: bool = True) -> tuple[list, list]:
    """(train, held-out) Examples from a file, a save_to_disk folder or a hub dataset (see the table above). With
    `split` False, nothing is held out: (every row, []), or of a dataset with a test split (train, test) as it is."""
    path = Path(name).expanduser()
    if path.suffix in (".jsonl", ".json", ".txt"):
        examples = load_jsonl(path, prompt_field, answer_field)
        return heldout_split(examples, path) if split else (examples, [])
    if path.is_dir() and not any((path / f).is_file() for f in ("dataset_info.json", "state.json", "dataset_dict.json")):
        raise TaskError(f"dataset {path} is a folder; {ROWS_HINT} or a folder written by `datasets`' save_to_disk")
    looks_local = path.exists() or names_a_path(name)
    if looks_local and not path.exists():
        raise TaskError(f"dataset file {name} does not exist; {ROWS_HINT}")
    if not looks_local:
        if network.hub_offline():
            raise TaskError(f"dataset {name!r} is not a local file, and the hub ({network.hub_endpoint()}) is "
                            f"unreachable; {ROWS_HINT}")
    try:
        import datasets
    except ImportError:
        raise TaskError(f"{name!r} is not a JSONL file; reading it needs `pip install datasets` (or {ROWS_HINT})")
    datasets.disable_progress_bars()  # our one line, not the library's bars and logs around it
    datasets.logging.set_verbosity_error()
    if path.suffix in TABLE_FILES and path.is_file():
        check_table(path)
    try:
        if path.is_dir():
            data = datasets.load_from_disk(str(path))
        elif path.suffix in TABLE_FILES:
            data = datasets.load_dataset(TABLE_FILES[path.suffix], data_files=str(path))
        elif looks_local:
            raise TaskError(f"dataset file {name} is not a kind this reads (.jsonl, .json, .parquet, .csv, or a "
                            f"save_to_disk folder); {ROWS_HINT}")
        else:
            data = datasets.load_dataset(name, config or None)
    except TaskError:
        raise
    except Exception as e:  # the datasets library raises many types; all mean "cannot read this"
        first = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
        raise TaskError(f"could not load dataset {name!r}: {first}")
    splits = data if isinstance(data, datasets.DatasetDict) else {"train": data}
    train_name = "train" if "train" in splits else next(iter(splits))
    columns = splits[train_name].column_names
    pf = pick_field(columns, prompt_field, PROMPT_FIELDS, "prompt", name)
    af = pick_field(columns, answer_field, ANSWER_FIELDS, "answer", name)
    rows = lambda split: [to_example(r, f"{name} [{split}] row {i}", pf, af)  # noqa: E731
                          for i, r in enumerate(splits[split])]
    if "test" in splits and train_name != "test":
        return not_empty(rows(train_name), name), not_empty(rows("test"), f"{name} [test]")
    train = not_empty(rows(train_name), name)
    return heldout_split(train, name) if split else (train, [])
