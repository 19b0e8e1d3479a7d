"""The rule-based verifier and the reward terms.

The answer rule: the answer is the text between the *last* `<answer>` and the first `</answer>` after it. A
completion without such a pair has no answer. Two answers are equal when, after normalisation, they are the same
number, or (for non-numbers) the same text:

    numbers    spaces removed, a leading '+' dropped, thousands separators removed when they sit every three
               digits ("1,234" but not "1,23"), any Unicode decimal digits read as digits, then compared as exact
               decimals, so "5.0" == "5" == "+5" and "-0" == "0"
    text       whitespace collapsed and case folded

Reward terms, each logged separately:

    correct   1 if the answer equals the reference, else 0
    format    1 if the completion ends with its single `<answer>...</answer>` (nothing after it), else 0
    overlong  DAPO's soft overlong punishment: 0 up to L_max - L_cache tokens, then falling linearly to -1 at
              L_max, -1 beyond (a truncated completion counts as over L_max)

reward = correct + format_weight * format + overlong_weight * overlong.
"""

from __future__ import annotations

import re
import unicodedata
from decimal import Decimal, InvalidOperation

THOUSANDS_RE = re.compile(r"^[+-]?\d{1,3}(,\d{3})+(\.\d+)?$")
NUMBER_RE = re.compile(r"^[+-]?(\d+(\.\d*)?|\.\d+)$")
MAX_NUMBER_CHARS = 200  # longer "numbers" are compared as text: Decimal arithmetic on them is not worth it


def extract_answer(text: str) -> str | None:
    """The content of the last <answer>...</answer>, or None when there is none."""
    last_open = text.rfind("<answer>")
    if last_open < 0:
        return None
    close = text.find("</answer>", last_open)
    if close < 0:
        return None
    return text[last_open + len("<answer>"):close]


def normalize(answer: str) -> Decimal | str:
    """A Decimal for numeric answers, else a case-folded, whitespace-collapsed string."""
    digits = "".join(str(unicodedata.digit(c)) if c.isdecimal() else c for c in answer)
    compact = "".join(digits.split())
    if len(compact) <= MAX_NUMBER_CHARS:
        if THOUSANDS_RE.match(compact):
            compact = compact.replace(",", "")
        if NUMBER_RE.match(compact):
            try:
                return Decimal(compact)  # Decimal equality is numeric: 5.0 == 5, +5 == 5, -0 == 0
            except InvalidOperation:
                pass
    return " ".join(answer.split()).casefold()


def is_correct(completion: str, reference: str) -> bool:
    answer = extract_answer(completion)
    return answer is not None and normalize(answer) == normalize(reference)


def format_ok(completion: str) -> bool:
    """Exactly one answer block, and nothing but whitespace after it."""
    return completion.count("<answer>") == 1 and completion.count("</answer>") == 1 and \
        completion.rstrip().endswith("</answer>") and completion.find("<answer>") < completion.find("</answer>")


def overlong_penalty(length: int, truncated: bool, max_len: int, cache_len: int) -> float:
    """DAPO's soft overlong punishment (eq. 13) for a completion of `length` tokens, in [-1, 0]."""
    if truncated or length > max_len:
        return -1.0
    start = max_len - cache_len
    if length <= start:
        return 0.0
    return (start - length) / cache_len


def score(completions: list[str], references: list[str], lengths: list[int], truncated: list[bool],
          format_weight: float, overlong_weight: float, max_len: int, cache_len: int) -> dict[str, list[float]]:
    """Every reward term for a batch, and their weighted sum under "reward"."""
    correct = [float(is_correct(c, r)) for c, r in zip(completions, references)]
    fmt = [float(format_ok(c)) for c in completions]
    over = [overlong_penalty(n, t, max_len, cache_len) if overlong_weight else 0.0
            for n, t in zip(lengths, truncated)]
    total = [c + format_weight * f + overlong_weight * o for c, f, o in zip(correct, fmt, over)]
    return {"reward": total, "correct": correct, "format": fmt, "overlong": over}
