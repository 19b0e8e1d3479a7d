"""The rule-based verifier and the reward terms.

Where the answer is (`--answer-format`; the instruction added to chat prompts says the same):

    tags         the text between the *last* `<answer>` and the first `</answer>` after it (the embedded tasks):
                     "47-13=34 34-13=21 21-13=8 <answer>8</answer>"  ->  "8"
                     "<answer>3</answer> no, <answer>8</answer>"     ->  "8"
                     "<answer>8"                                     ->  no answer
    last-number  the last number in the completion (GSM8K-style, how users score a model that answers in prose).
                 A number is an optional sign, digits with optional thousands separators and an optional decimal
                 part, touching no letter, digit, '_' or '.' before it and no letter, digit or '_' after it:
                     "so 3 + 5 = 8."                  ->  "8"       (a sentence's full stop is not a decimal point)
                     "the total is -1,234.5 dollars"  ->  "-1,234.5"
                     "10-5"                           ->  "5"       (a minus right after a digit is subtraction)
                     "H2O costs x2 in v1.2"           ->  no answer (numbers inside words do not count)
                     "1,23"                           ->  no answer (a misplaced separator: ambiguous)
    boxed        the content of the last `\boxed{...}`, braces balanced (MATH-style):
                     "\boxed{3} or rather \boxed{\frac{1}{2}}"  ->  "\frac{1}{2}"
                     "\boxed{\frac{1}{2}"                       ->  no answer (unbalanced)
                 compared with Hugging Face's `math-verify` (optional: `pip install math-verify`), so `\frac{1}{2}`,
                 `0.5` and `1/2` agree, after the plain comparison below.

Two answers are equal when, after normalisation, they are the same number, or (for non-numbers) the same text:

    numbers    spaces removed, a leading '+' dropped, thousands separators removed when they sit every three
               digits ("1,234" but not "1,23"), any Unicode decimal digits read as digits, then compared as exact
               decimals, so "5.0" == "5" == "+5" and "-0" == "0"
    text       whitespace collapsed and case folded

Reward terms, each logged separately:

    correct   1 if the answer equals the reference, else 0
    format    tags: the completion ends with its single `<answer>...</answer>` (nothing after it); last-number: it
              ends with its last number (only spaces and closing punctuation after it); boxed: it has exactly one
              balanced `\boxed{}`. 1 if so, else 0
    overlong  DAPO's soft overlong punishment: 0 up to L_max - L_cache tokens, then falling linearly to -1 at
              L_max, -1 beyond (a truncated completion counts as over L_max)

reward = correct + format_weight * format + overlong_weight * overlong.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import math
import re
import signal
import threading
import unicodedata
from decimal import Decimal, InvalidOperation

THOUSANDS_RE = re.compile(r"^[+-]?\d{1,3}(,\d{3})+(\.\d+)?$")
NUMBER_RE = re.compile(r"^[+-]?(\d+(\.\d*)?|\.\d+)$")
MAX_NUMBER_CHARS = 200  # longer "numbers" are compared as text: Decimal arithmetic on them is not worth it
# a number in running text: not inside a word or after a '.', sign only where it cannot be a subtraction
NUMBER_IN_TEXT_RE = re.compile(
    r"(?<![\w.])(?<!\d,)(?:[+\-\u2212](?<![\w)][+\-\u2212]))?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?!\w)(?!,\d)")
CLOSING_RE = re.compile(r"[\s.!?%)\]}*_$\"']*")  # what may follow the final number under last-number's format rule
BRACE_DEPTH = {"{": 1, "}": -1}
MAX_MATH_VERIFY_CHARS = 1000  # longer boxes are compared as plain text only: symbolic parsing would take seconds

ANSWER_FORMATS = ("tags", "last-number", "boxed")
# Appended to a prompt for models with a chat template: where the verifier will look for the answer.
INSTRUCTIONS = {
    "tags": "Work step by step, then give only the final answer inside <answer></answer> tags.",
    "last-number": "Answer with the final result as a number at the end.",
    "boxed": "Work step by step, then put the final answer in \\boxed{}.",
}


class VerifierError(ValueError):
    """The verifier cannot run as asked (e.g. an optional package is missing); the message says what to do."""


def require_math_verify() -> None:
    if importlib.util.find_spec("math_verify") is None:
        raise VerifierError("--answer-format boxed compares answers with math-verify, which is not installed: "
                            "pip install math-verify")


def extract_answer(text: str, answer_format: str = "tags") -> str | None:
    """The answer the completion gives under `answer_format`, or None when it gives none."""
    if answer_format == "last-number":
        return extract_last_number(text)
    if answer_format == "boxed":
        return extract_boxed(text)
    return extract_tags(text)


def extract_tags(text: str) -> str | None:
    """The content of the last <answer>...</answer>, or None when there is none."""
    last_open = text.rfind("<answer>")
    if last_open < 0:
        return None
    close = text.find("</answer>", last_open)
    if close < 0:
        return None
    return text[last_open + len("<answer>"):close]


def last_number_match(text: str) -> re.Match | None:
    last = None
    for last in NUMBER_IN_TEXT_RE.finditer(text):
        pass
    return last


def extract_last_number(text: str) -> str | None:
    """The last number in the text (see the module docstring for what counts as one), or None."""
    found = last_number_match(text)
    return None if found is None else found.group().replace("\u2212", "-")


def boxes(text: str) -> list[str | None]:
    """The content of every `\\boxed{...}` in order; None for one whose braces never balance."""
    out, start = [], 0
    while (i := text.find("\\boxed", start)) >= 0:
        j = i + len("\\boxed")
        while j < len(text) and text[j] == " ":
            j += 1
        start = j
        if j >= len(text) or text[j] != "{":
            continue
        depth = 0
        for k in range(j, len(text)):
            depth += BRACE_DEPTH.get(text[k], 0)
            if depth == 0:
                out.append(text[j + 1:k])
                start = k + 1
                break
        else:
            out.append(None)
            break
    return out


def extract_boxed(text: str) -> str | None:
    """The content of the last `\\boxed{...}`, or None when there is none or its braces do not balance."""
    found = boxes(text)
    return found[-1] if found else None


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


def is_correct(completion: str, reference: str, answer_format: str = "tags") -> bool:
    answer = extract_answer(completion, answer_format)
    if answer is None:
        return False
    if normalize(answer) == normalize(reference):
        return True
    return answer_format == "boxed" and math_equal(answer, reference)


MATH_VERIFY_SECONDS = 1.0  # the most one completion's symbolic comparison may take (parse and verify together)
MAX_DIGITS = 10_000  # an answer that denotes a number with more digits than this is not evaluated symbolically
POWER_RE = re.compile(r"(\d+)\s*\^\s*(?:\{\s*(\d+)\s*\}|(\d+))")  # an integer to an integer power
FACTORIAL_RE = re.compile(r"(?:(?<![\w}).])(\d+)|\{\s*(\d+)\s*\}|\(\s*(\d+)\s*\))\s*(?<!\\)!")  # n!, {n}!, (n)!


def absurd_magnitude(text: str) -> bool:
    """Whether a LaTeX answer denotes a number too large to evaluate in bounded time: a tower of powers (an exponent
    that holds a power), an integer power of more than MAX_DIGITS digits, or a factorial of anything but a plain
    integer up to 1000. Such an answer is compared as text only (no reference in a math dataset is one)."""
    opened = []  # for each open brace: does it open an exponent?
    for i, ch in enumerate(text):
        if ch == "{":
            opened.append(text[:i].rstrip().endswith("^"))
        elif ch == "}" and opened:
            opened.pop()
        elif ch == "^" and any(opened):
            return True  # a '^' inside the braced exponent of another '^'
    if re.search(r"\^\s*\d+\s*\^", text):  # 9^9^9 without braces
        return True
    for m in POWER_RE.finditer(text):
        base, exp = int(m.group(1)), int(m.group(2) or m.group(3))
        if base > 1 and exp * math.log10(base) > MAX_DIGITS:
            return True
    plain = [int(next(g for g in m.groups() if g)) for m in FACTORIAL_RE.finditer(text)]
    factorials = len(re.findall(r"(?<!\\)!", text))  # '\!' is LaTeX's negative space, not a factorial
    return factorials > len(plain) or any(n > 1000 for n in plain)


class TooSlow(BaseException):
    """The symbolic comparison ran past MATH_VERIFY_SECONDS (a BaseException, as math-verify's own timeout is: the
    parser's `except Exception` must not swallow it and carry on computing)."""


@contextlib.contextmanager
def deadline(seconds: float):
    """Raise TooSlow in the main thread after `seconds` (a sub-second timer; math-verify's own is whole seconds
    and shares the same alarm, so its timeouts are switched off inside). Elsewhere: no bound."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def late(signum, frame):
        raise TooSlow

    previous = signal.signal(signal.SIGALRM, late)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


@functools.cache
def warm_math_verify() -> None:
    """math-verify's first call imports sympy's LaTeX machinery (~1 s): paid once, outside any completion's bound."""
    import logging

    from math_verify import parse, verify

    logging.getLogger("math_verify").setLevel(logging.ERROR)  # its warnings would interleave with our lines
    verify(parse("$1$", parsing_timeout=None), parse("$1$", parsing_timeout=None), timeout_seconds=None)


@functools.lru_cache(maxsize=4096)
def parse_math(text: str):
    """math-verify's parse of an answer as LaTeX (cached: references repeat G times per batch)."""
    from math_verify import parse

    return parse(f"${text}$", parsing_timeout=None)  # bounded by the caller's deadline


def math_equal(answer: str, reference: str) -> bool:
    """Mathematical equality by math-verify (`\\frac{1}{2}` == `0.5` == `1/2`); False when either does not parse,
    the answer is too long or too large to evaluate (absurd_magnitude), or the comparison takes longer than
    MATH_VERIFY_SECONDS: a policy that drifts into such outputs cannot stall training."""
    require_math_verify()
    if len(answer) > MAX_MATH_VERIFY_CHARS or absurd_magnitude(answer):
        return False
    from math_verify import verify

    warm_math_verify()
    try:
        with deadline(MATH_VERIFY_SECONDS):
            gold, pred = parse_math(reference.strip()), parse_math(answer.strip())
            return bool(gold and pred and verify(gold, pred, timeout_seconds=None))
    except TooSlow:
        return False


def format_ok(completion: str, answer_format: str = "tags") -> bool:
    """tags: exactly one answer block, and nothing but whitespace after it; last-number: the completion ends with
    its last number; boxed: exactly one balanced box."""
    if answer_format == "last-number":
        found = last_number_match(completion)
        return found is not None and CLOSING_RE.fullmatch(completion, found.end()) is not None
    if answer_format == "boxed":
        found = boxes(completion)
        return len(found) == 1 and found[0] is not None
    return completion.count("<answer>") == 1 and completion.count("</answer>") == 1 and \
        completion.rstrip().endswith("</answer>")  # its one closing tag is last, so the block opens before it


def overlong_penalty(length: int, truncated: bool, max_len: int, cache_len: int) -> float:
    """DAPO's soft overlong punishment (eq. 13) for a completion of `length` tokens, in [-1, 0]."""
    if truncated or length > max_len:
        return -1.0
    start = max_len - cache_len
    if length <= start:
        return 0.0
    return (start - length) / cache_len


def score(completions: list[str], references: list[str], lengths: list[int], truncated: list[bool],
          format_weight: float, overlong_weight: float, max_len: int, cache_len: int,
          answer_format: str = "tags") -> dict[str, list[float]]:
    """Every reward term for a batch, and their weighted sum under "reward"."""
    correct = [float(is_correct(c, r, answer_format)) for c, r in zip(completions, references)]
    fmt = [float(format_ok(c, answer_format)) for c in completions]
    over = [overlong_penalty(n, t, max_len, cache_len) if overlong_weight else 0.0
            for n, t in zip(lengths, truncated)]
    total = [c + format_weight * f + overlong_weight * o for c, f, o in zip(correct, fmt, over)]
    return {"reward": total, "correct": correct, "format": fmt, "overlong": over}


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased pass@k estimator from n samples of which c are correct: 1 - C(n-c, k) / C(n, k), the chance that
    k samples drawn without replacement from the n hold at least one correct one."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)
