"""The long embedded task (--dataset embedded-long): its generator, verifier, splits and warm start."""

import random

import numpy as np
import pytest
import torch

import model as models
import rewards
import task
import train
from plumbing import run as runs


def test_answers_are_right_and_verified():
    for n, d in task.long_problems():
        solution = task.solve((n, d))
        assert rewards.extract_answer(solution) == str(n % d)
        assert rewards.is_correct(solution, str(n % d)) and rewards.format_ok(solution)
        # every step is a correct subtraction
        for step in solution.split()[:-1]:
            left, r = step.split("=")
            s, dd = left.split("-")
            assert int(s) - int(dd) == int(r) and int(dd) == d


def test_lengths_span_30_to_300_and_batches_are_spread():
    lengths = [task.completion_tokens(task.solve(p)) for p in task.long_problems()]
    lo, hi = task.LONG_TOKENS
    assert min(lengths) >= lo and max(lengths) <= hi
    assert min(lengths) <= 30 and max(lengths) >= 280  # the range the study needs, in one problem set
    rng = random.Random(0)
    ratios = [max(b) / min(b) for b in (rng.sample(lengths, 16) for _ in range(500))]
    assert np.median(ratios) >= 8  # a typical 16-prompt batch: longest >= 8x shortest


def test_token_count_matches_the_embedded_tokenizer():
    tok = models.build_tokenizer()
    for p in task.long_problems()[::50]:
        text = task.solve(p)
        assert task.completion_tokens(text) == len(tok(text)["input_ids"]) + 1  # + EOS


def test_splits_are_disjoint_fixed_and_held_out_by_hash():
    train_set, test_set = task.default_splits(long=True)
    assert not {e.prompt for e in train_set} & {e.prompt for e in test_set}
    assert len(train_set) + len(test_set) == len(task.long_problems())
    assert 0.1 < len(test_set) / len(task.long_problems()) < 0.3
    assert task.default_splits(long=True) == (train_set, test_set)


def test_long_teacher_slips_only_on_the_first_step():
    rng = random.Random(0)
    problems = [p for p in task.long_problems() if task.borrows(*p)]
    slipped_first = 0
    for p in problems[:200]:
        steps = task.solve(p, rng, slip_prob=1.0, first_step_only=True).split()[:-1]
        values = [tuple(map(int, s.replace("=", "-").split("-"))) for s in steps]
        assert values[0][0] - values[0][1] == values[0][2] - 10  # the slip: 10 too many
        assert all(s - d == r for s, d, r in values[1:])  # then correct from there on
        slipped_first += 1
    assert slipped_first == 200
    # a first step that does not borrow never slips, even at slip_prob 1, nor does a later step that borrows
    calm = [p for p in task.long_problems() if not task.borrows(*p)]
    later = [p for p in calm if any(task.borrows(p[0] - k * p[1], p[1]) for k in range(1, p[0] // p[1]))]
    assert later and all(task.solve(p, rng, 1.0, first_step_only=True) == task.solve(p) for p in calm)


def test_defaults_follow_the_dataset():
    long_args, _ = runs.resolve(train.Args(dataset="embedded-long"))
    short_args, _ = runs.resolve(train.Args())
    assert long_args.max_new_tokens == task.LONG_MAX_NEW_TOKENS and short_args.max_new_tokens == 64
    assert runs.resolve(train.Args(dataset="embedded-long", max_new_tokens=100))[0].max_new_tokens == 100
    assert models.warm_start_settings("embedded-long")["task"] == "long"
    assert "task" not in models.warm_start_settings("embedded")  # the default recipe (and its cache key) unchanged


def test_the_long_task_phrased_for_a_chat_model():
    """--dataset embedded-long-instruct: the long task's problems and splits, asked as a chat model is asked; and
    --dataset embedded-instruct, the default task's."""
    args, _ = runs.resolve(train.Args(dataset="embedded-long-instruct"))
    assert args.max_new_tokens == task.LONG_MAX_NEW_TOKENS  # room for the working
    train_set, test_set = runs.load_data(args)
    long_train, long_test = task.default_splits(long=True)
    assert [e.answer for e in train_set] == [e.answer for e in long_train] and len(test_set) == len(long_test) == 102
    n, d = next(p for p in task.split(True, long=True))
    assert test_set[0].prompt == f"What is the remainder when {n} is divided by {d}?"
    _, short_test = runs.load_data(runs.resolve(train.Args(dataset="embedded-instruct"))[0])  # the default task too
    assert [e.answer for e in short_test] == [e.answer for e in task.default_splits()[1]]
    n, d = task.split(True)[0]
    assert short_test[0].prompt == f"What is the remainder when {n} is divided by {d}?"


@pytest.mark.slow
def test_warm_start_lands_in_the_accuracy_window():
    """The real long-task warm start (seed 0's ships in weights/; its recipe builds the others in a few minutes):
    greedy held-out accuracy between 15% and 50%, and sampled groups with mixed correctness, so RL has something to
    fix and a signal to fix it with."""
    path = models.warm_start(seed=0, settings=models.WARM_START_LONG, quiet=True)
    args, _ = runs.resolve(train.Args(dataset="embedded-long", model=str(path)))
    policy, tokenizer = models.load_model(str(path), torch.device("cpu"), torch.float32)
    train_set, test_set = runs.load_data(args)
    greedy = np.mean(train.sample(policy, tokenizer, test_set, args, greedy=True).scores["correct"])
    assert 0.15 <= greedy <= 0.50, greedy
    torch.manual_seed(0)
    rows = [ex for ex in train_set[::40] for _ in range(8)]  # 12 groups (24 measured 0.96 mixed, 12 1.0, in a fifth
    correct = np.array(train.sample(policy, tokenizer, rows, args).scores["correct"]).reshape(-1, 8)  # of the time)
    assert (correct.max(1) != correct.min(1)).mean() >= 0.3  # groups with mixed rewards: a learning signal
