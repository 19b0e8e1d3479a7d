"""The verifier: the answer rule, numeric normalisation, malformed and adversarial completions, reward terms."""

import time

import pytest

import rewards

CASES = [
    # (completion, reference, correct)
    ("<answer>7</answer>", "7", True),
    (" 47-13=34 34-13=21 21-13=8 <answer>8</answer>", "8", True),
    ("<answer> 7 </answer>", "7", True),  # spaces inside
    ("<answer>+7</answer>", "7", True),  # leading plus
    ("<answer>5.0</answer>", "5", True),  # 5.0 == 5
    ("<answer>5.</answer>", "5", True),
    ("<answer>1,234</answer>", "1234", True),  # thousands separator
    ("<answer>1,234,567.50</answer>", "1234567.5", True),
    ("<answer>1 234</answer>", "1234", True),  # space as a separator
    ("<answer>-0</answer>", "0", True),
    ("<answer>٧</answer>", "7", True),  # Arabic-Indic seven
    ("<answer>７</answer>", "7", True),  # full-width seven
    ("<answer>0.5</answer>", ".5", True),
    ("<answer>Paris</answer>", "paris", True),  # text: case folded
    ("<answer>New   York</answer>", "new york", True),  # text: whitespace collapsed
    ("<answer>3</answer> then <answer>8</answer>", "8", True),  # the last answer counts
    ("<answer>8</answer> then <answer>3</answer>", "8", False),
    ("<answer>1,23</answer>", "123", False),  # misplaced separator is not a thousands separator
    ("<answer>12</answer>", "1", False),
    ("<answer>-7</answer>", "7", False),
    ("<answer>7.01</answer>", "7", False),
    ("the answer is 7", "7", False),  # no tags
    ("<answer>7", "7", False),  # unclosed
    ("7</answer>", "7", False),  # no opening tag
    ("</answer>7<answer>", "7", False),  # tags reversed
    ("<answer></answer>", "7", False),  # empty
    ("<answer>7</answer", "7", False),  # broken closing tag
    ("<ANSWER>7</ANSWER>", "7", False),  # tags are case-sensitive
    ("<answer><answer>7</answer></answer>", "7", True),  # nested: innermost last <answer>
    ("<answer>7e0</answer>", "7", False),  # exponents are text, not numbers
    ("<answer>NaN</answer>", "nan", True),  # text comparison, no float NaN semantics
    ("<answer>Infinity</answer>", "7", False),
    ("<answer>" + "9" * 5000 + "</answer>", "9" * 5000, True),  # huge number: compared as text, no crash
    ("<answer>1" + "0" * 150 + "</answer>", "1" + "0" * 150, True),
    ("\x00<answer>\u202e7</answer>", "7", False),  # control characters are not ignored
    ("", "7", False),
]


@pytest.mark.parametrize("completion,reference,correct", CASES)
def test_verifier(completion, reference, correct):
    assert rewards.is_correct(completion, reference) is correct


def test_extract_answer_rule():
    assert rewards.extract_answer("a <answer>1</answer> b <answer>2</answer> c") == "2"
    assert rewards.extract_answer("<answer>1</answer><answer>2") is None  # the last <answer> is unclosed
    assert rewards.extract_answer("no answer") is None


@pytest.mark.parametrize("completion,ok", [
    (" 4-3=1 <answer>1</answer>", True),
    (" 4-3=1 <answer>1</answer>  \n", True),
    (" 4-3=1 <answer>1</answer> and more", False),
    ("<answer>1</answer><answer>1</answer>", False),
    ("</answer><answer>", False),
    ("1", False),
])
def test_format_term(completion, ok):
    assert rewards.format_ok(completion) is ok


def test_overlong_punishment_matches_dapo():
    # L_max 20, L_cache 4: free up to 16 tokens, then -1/4 per token, -1 at 20 and beyond or when truncated.
    assert [rewards.overlong_penalty(n, False, 20, 4) for n in (10, 16, 17, 18, 20, 21)] == [0, 0, -0.25, -0.5, -1, -1]
    assert rewards.overlong_penalty(5, True, 20, 4) == -1.0


def test_score_combines_weighted_terms():
    s = rewards.score(["<answer>1</answer>", "<answer>2</answer> x", "nothing"], ["1", "2", "3"],
                      lengths=[5, 19, 30], truncated=[False, False, True], format_weight=0.1,
                      overlong_weight=1.0, max_len=20, cache_len=4)
    assert s["correct"] == [1.0, 1.0, 0.0]
    assert s["format"] == [1.0, 0.0, 0.0]
    assert s["overlong"] == [0.0, -0.75, -1.0]
    assert s["reward"] == pytest.approx([1.1, 0.25, -1.0])
    half = rewards.score(["<answer>2</answer> x", "nothing"], ["2", "3"], lengths=[19, 30], truncated=[False, True],
                         format_weight=0.1, overlong_weight=0.5, max_len=20, cache_len=4)
    assert half["overlong"] == [-0.75, -1.0] and half["reward"] == pytest.approx([1 - 0.375, -0.5])  # weighted


# --answer-format last-number: the last number in prose (GSM8K-style)
LAST_NUMBER_CASES = [
    ("3 + 5 = 8", "8", True),
    ("So the answer is 8.", "8", True),  # a full stop is not a decimal point
    ("The answer is 8!", "8", True),
    ("-5", "-5", True),
    ("x = -5", "-5", True),
    ("(−5)", "-5", True),  # Unicode minus sign
    ("10-5", "-5", False),  # subtraction, not a sign: the last number is 5
    ("10-5", "5", True),
    ("+7", "7", True),
    ("It costs 1,234 dollars in all: 1,234", "1234", True),  # thousands separators
    ("1,234,567.50", "1234567.5", True),
    ("3.14", "3.14", True),
    ("0.50", "0.5", True),
    ("5.0", "5", True),
    ("12%", "12", True),
    ("$12", "12", True),
    ("**12**", "12", True),  # markdown bold
    ("first 3, then 4, finally 8", "8", True),
    ("8 is the answer, not 3", "8", False),  # the last number counts, not the first
    ("What is 47 mod 13? Let me think.", "8", False),  # only the prompt echoed: 13 is its last number
    ("What is 47 mod 13? 47-13=34 34-13=21 21-13=8", "8", True),  # echo then the work
    ("H2O", "2", False),  # numbers inside words are not numbers
    ("x2", "2", False),
    ("5th", "5", False),
    ("v1.2", "2", False),
    ("1,23", "23", False),  # misplaced separator: ambiguous, no answer
    ("no numbers here", "0", False),
    ("", "0", False),
    ("1.2.3", "1.2", True),
    ("<answer>8</answer>", "8", True),  # tags are just text here
    ("7" * 5000, "7" * 5000, True),  # a huge number is compared as text
    ("word " * 20000 + "42", "42", True),  # a very long output
    ("٨", "8", True),  # Unicode digits are digits, as in the tags format
]


@pytest.mark.parametrize("completion,reference,correct", LAST_NUMBER_CASES)
def test_last_number_verifier(completion, reference, correct):
    assert rewards.is_correct(completion, reference, "last-number") is correct


@pytest.mark.parametrize("completion,ok", [
    ("so the answer is 8.", True), ("8", True), ("**8**\n", True), ("(8)", True), ("12%", True),
    ("8 apples", False), ("8 then 9 words", False), ("no number", False), ("", False),
])
def test_last_number_format_term(completion, ok):
    assert rewards.format_ok(completion, "last-number") is ok


# --answer-format boxed: the last \boxed{}, compared plainly and then by math-verify
BOXED_CASES = [
    (r"\boxed{8}", "8", True),
    (r"so the answer is $\boxed{8}$.", "8", True),
    (r"\boxed{ 8 }", "8", True),
    (r"\boxed {8}", "8", True),  # a space before the brace
    (r"\boxed{\frac{1}{2}}", "0.5", True),  # math-verify: fraction == decimal
    (r"\boxed{1/2}", r"\frac{1}{2}", True),
    (r"\boxed{0.5}", "1/2", True),
    (r"\boxed{\dfrac{1}{2}}", r"\frac12", True),
    (r"\boxed{2}", "0.5", False),
    (r"\boxed{1,234}", "1234", True),
    (r"\boxed{-3}", "-3", True),
    (r"\boxed{3}", "-3", False),
    (r"\boxed{\sqrt{4}}", "2", True),
    (r"\boxed{x = 5}", "5", True),
    (r"\boxed{Paris}", "paris", True),  # text: case folded
    (r"\boxed{3} no wait \boxed{8}", "8", True),  # several boxes: the last one counts
    (r"\boxed{8} no wait \boxed{3}", "8", False),
    (r"\boxed{\frac{1}{2}", "0.5", False),  # unbalanced braces: no answer
    (r"\boxed{{8}}", "8", True),  # nested braces
    (r"\boxed{}", "8", False),  # empty
    (r"\boxed8", "8", False),  # no braces
    ("8", "8", False),  # no box
    (r"\fbox{8}", "8", False),  # only \boxed counts
    (r"Find \boxed{x}: x = 8", "8", False),  # a box in an echoed prompt is still the last box
    (r"\boxed{" + "9" * 5000 + "}", "9" * 5000, True),  # huge: compared as plain text, no symbolic parse
    (r"\boxed{" + "9" * 5000 + "}", "8", False),
    (r"\boxed{9^{9^{9}}}", "42", False),  # absurd: text only, and not the reference's text
    ("lorem " * 20000 + r"\boxed{42}", "42", True),  # a very long output
    (r"\boxed{\text{(A)}}", "(A)", True),  # math-verify reads both as the choice A
    (r"\boxed{\text{(A)}}", "(B)", False),
]


@pytest.mark.parametrize("completion,reference,correct", BOXED_CASES)
def test_boxed_verifier(completion, reference, correct):
    assert rewards.is_correct(completion, reference, "boxed") is correct


ADVERSARIAL = [r"\boxed{9^{9^{9^{9}}}}", r"\boxed{10^{10^{10}}!}", r"\boxed{(10^{100})!}", r"\boxed{9^{9^9}}",
               r"\boxed{99999999^{99999999}}", r"\boxed{100000!}", r"\boxed{\binom{10^{9}}{10^{8}}}",
               r"\boxed{{{{9}}}^{{9}^{9}}}", r"\boxed{2^{2^{2^{2^{2^{2}}}}}}", r"\boxed{\exp(\exp(\exp(100)))}"]


@pytest.mark.slow
def test_the_verifier_cannot_stall_on_absurd_answers():
    """A policy that drifts into towers of powers or huge factorials: each completion scores in at most a second
    (math-verify's own limit was 5 s each), a whole batch of them in bounded time, every one wrong."""
    rewards.warm_math_verify()  # the library's one-time import cost is not a completion's
    for completion in ADVERSARIAL:
        start = time.perf_counter()
        assert not rewards.is_correct(completion, "42", "boxed"), completion
        # the deadline is 1 s and math-verify's own 5 s: 3 s tells them apart with slack for a busy CPU (a full CI
        # run on a slow hour took 1.52 s for one completion)
        assert time.perf_counter() - start < 3.0, completion
    start = time.perf_counter()
    scores = rewards.score(ADVERSARIAL * 4, ["42"] * 40, [10] * 40, [False] * 40, 0.1, 0.0, 64, 16, "boxed")
    assert sum(scores["correct"]) == 0 and time.perf_counter() - start < 45


@pytest.mark.parametrize("answer,absurd", [("2^{10}", False), ("5!", False), ("(5)!", False), ("1000!", False),
                                           ("x^{2}+1", False), ("3\\!+\\!2", False), ("e^{i\\pi}", False),
                                           ("9^{9^9}", True), ("1001!", True), ("(10^{100})!", True),
                                           ("10^{20000}", True), ("x!", True), ("9^9^9", True), ("2^10", False),
                                           ("10^20000", True)])
def test_absurd_magnitude(answer, absurd):
    assert rewards.absurd_magnitude(answer) is absurd


def test_boxes_finds_every_box_in_order():
    """Adjacent boxes, a space before a brace, an unbalanced last one: every box in order (format_ok counts them)."""
    assert rewards.boxes(r"\boxed{1}\boxed{2}") == ["1", "2"]
    assert rewards.boxes(r"\boxed {3} and \boxed{4") == ["3", None]


def test_a_number_of_max_number_chars_characters_is_still_a_number():
    """Up to MAX_NUMBER_CHARS characters an answer compares as a number (1e199 written out); past it, as text."""
    from decimal import Decimal

    edge = "1" + "0" * (rewards.MAX_NUMBER_CHARS - 1)
    assert rewards.normalize(edge) == Decimal(10) ** 199 and rewards.normalize(edge + "0") == edge + "0"


def test_a_long_answer_never_reaches_the_parser(monkeypatch):
    """An answer over MAX_MATH_VERIFY_CHARS is compared as text only: math-verify's parser (seconds of sympy on it)
    is never called."""
    def parse(text):
        raise AssertionError(f"parsed {len(text)} characters")

    monkeypatch.setattr(rewards, "parse_math", parse)
    long = "1+" * 600 + "1"
    assert rewards.math_equal(long, "601") is False
    assert not rewards.is_correct(r"\boxed{" + long + "}", "601", "boxed")


def test_boxed_format_term():
    assert rewards.format_ok(r"work... \boxed{8}", "boxed")
    assert not rewards.format_ok(r"\boxed{8} \boxed{8}", "boxed")  # exactly one box
    assert not rewards.format_ok(r"\boxed{8", "boxed") and not rewards.format_ok("8", "boxed")


def test_instruction_matches_the_format():
    assert "<answer></answer>" in rewards.INSTRUCTIONS["tags"]
    assert r"\boxed{}" in rewards.INSTRUCTIONS["boxed"] and "number" in rewards.INSTRUCTIONS["last-number"]
    assert set(rewards.INSTRUCTIONS) == set(rewards.ANSWER_FORMATS)


def test_score_reads_the_chosen_format():
    s = rewards.score(["so it is 8.", "8 apples", "<answer>8</answer> 9"], ["8", "8", "8"], [5, 5, 5],
                      [False] * 3, 0.1, 0.0, 20, 4, answer_format="last-number")
    assert s["correct"] == [1.0, 1.0, 0.0] and s["format"] == [1.0, 0.0, 1.0]
    assert s["reward"] == pytest.approx([1.1, 1.0, 0.1])


@pytest.mark.parametrize("n,c,k,expected", [
    (10, 0, 1, 0.0), (10, 10, 5, 1.0), (10, 3, 1, 0.3),  # pass@1 is the fraction correct
    (4, 1, 2, 0.5),  # 1 - C(3,2)/C(4,2) = 1 - 3/6
    (5, 2, 3, 0.9),  # 1 - C(3,3)/C(5,3) = 1 - 1/10
    (8, 1, 8, 1.0), (8, 0, 8, 0.0),
    (6, 2, 2, 1 - 6 / 15),  # 1 - C(4,2)/C(6,2)
])
def test_pass_at_k_unbiased_estimator(n, c, k, expected):
    assert rewards.pass_at_k(n, c, k) == pytest.approx(expected)


def test_pass_at_k_rejects_impossible_counts():
    with pytest.raises(ValueError):
        rewards.pass_at_k(4, 5, 1)
    with pytest.raises(ValueError):
        rewards.pass_at_k(4, 1, 5)
