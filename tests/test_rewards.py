"""The verifier: the answer rule, numeric normalisation, malformed and adversarial completions, reward terms."""

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
