"""Datasets from files, save_to_disk folders and (offline) the `datasets` library: fields, splits, GSM8K/MATH answers."""

import dataclasses
import json
from pathlib import Path

import pytest
from datasets import Dataset, DatasetDict

import task
import train
from plumbing import run as runs

ROWS = [{"question": f"What is {i} + {i}?", "answer": f"{i} + {i} = {2 * i}\n#### {2 * i}", "id": i} for i in range(40)]


def ten_rows(folder: Path) -> str:
    """A training file of ten rows, "10 mod 3 =" to "19 mod 3 =", in folder/train.jsonl; its path."""
    path = folder / "train.jsonl"
    task.write_jsonl(path, [task.Example(f"{n} mod 3 =", str(n % 3)) for n in range(10, 20)])
    return str(path)


def test_parquet_file_with_gsm8k_answers(tmp_path):
    path = tmp_path / "gsm.parquet"
    Dataset.from_list(ROWS).to_parquet(str(path))
    train_set, test_set = task.load_dataset(str(path))  # question/answer found without flags
    assert len(train_set) + len(test_set) == 40 and test_set
    by_prompt = {e.prompt: e.answer for e in train_set + test_set}
    assert by_prompt["What is 7 + 7?"] == "14"  # what follows "####"


def test_csv_file_with_named_fields(tmp_path):
    path = tmp_path / "t.csv"
    path.write_text("q,a,other\n" + "".join(f"{i} mod 3 =,{i % 3},x\n" for i in range(10)))
    train_set, test_set = task.load_dataset(str(path), prompt_field="q", answer_field="a")
    assert {e.prompt: e.answer for e in train_set + test_set}["8 mod 3 ="] == "2"
    with pytest.raises(task.TaskError, match=r"no prompt column 'nope'; its columns are \['q', 'a', 'other'\]"):
        task.load_dataset(str(path), prompt_field="nope")
    with pytest.raises(task.TaskError, match="no prompt column .* name one with --prompt-field"):
        task.load_dataset(str(path))


def test_save_to_disk_folder_uses_its_test_split_and_math_solutions(tmp_path):
    math_rows = [{"problem": f"Compute {i}/2.", "solution": f"Halve it: $\\boxed{{\\frac{{{i}}}{{2}}}}$."}
                 for i in range(1, 9)]
    DatasetDict({"train": Dataset.from_list(math_rows[:6]), "test": Dataset.from_list(math_rows[6:])}) \
        .save_to_disk(str(tmp_path / "saved"))
    train_set, test_set = task.load_dataset(str(tmp_path / "saved"))
    assert [e.prompt for e in test_set] == ["Compute 7/2.", "Compute 8/2."]  # the test split is the held-out set
    assert len(train_set) == 6 and train_set[0].answer == "\\frac{1}{2}"  # MATH: the last \boxed{}
    Dataset.from_list(ROWS).save_to_disk(str(tmp_path / "single"))  # one split: held out by prompt hash
    train_set, test_set = task.load_dataset(str(tmp_path / "single"))
    assert len(train_set) + len(test_set) == 40


def test_json_array_file_and_bad_rows_named(tmp_path):
    path = tmp_path / "rows.json"
    path.write_text(json.dumps([{"prompt": "1+1=", "answer": 2}, {"prompt": "2+2=", "answer": "4"}]))
    train_set, test_set = task.load_dataset(str(path))
    assert sorted(e.answer for e in train_set + test_set) == ["2", "4"]
    path.write_text(json.dumps([{"prompt": "1+1=", "answer": 2}, {"prompt": "", "answer": "4"}]))
    with pytest.raises(task.TaskError, match=r"rows.json item 1: \"prompt\" must be non-empty text"):
        task.load_dataset(str(path))
    Dataset.from_list([{"prompt": "a", "answer": "1"}, {"prompt": "b", "answer": None}]).to_parquet(str(tmp_path / "b.parquet"))
    with pytest.raises(task.TaskError, match=r"\[train\] row 1: \"answer\" must be non-empty"):
        task.load_dataset(str(tmp_path / "b.parquet"))


def test_a_file_saved_with_a_byte_order_mark_and_windows_line_ends_reads_as_any_other(tmp_path):
    """Notepad and Excel save UTF-8 with a byte-order mark, and CRLF line ends: the JSONL and JSON readers refused the
    first line as invalid JSON. A line of nothing but spaces (an editor's indentation left at the end) is an empty
    line, skipped."""
    rows = [{"prompt": f"{n} mod 3 =", "answer": str(n % 3)} for n in range(10, 20)]
    plain = tmp_path / "plain.jsonl"
    plain.write_text("".join(json.dumps(r) + "\n" for r in rows))
    bom_jsonl = "\ufeff" + "\r\n".join(json.dumps(r) for r in rows) + "\r\n  \t\r\n"
    (tmp_path / "bom.jsonl").write_bytes(bom_jsonl.encode())
    (tmp_path / "bom.json").write_bytes(("\ufeff" + json.dumps(rows)).encode())
    for name in ("bom.jsonl", "bom.json"):
        assert task.load_dataset(str(tmp_path / name)) == task.load_dataset(str(plain)), name


@pytest.mark.parametrize("answer,reference", [
    ("Natalia sold 48/2 = 24 clips.\n#### 72", "72"), ("#### 1,234", "1,234"), ("42", "42"),
    ("so $\\boxed{\\frac{\\sqrt{3}}{2}}$", "\\frac{\\sqrt{3}}{2}"), ("\\boxed{}", "\\boxed{}"),
    ("first try #### 3\nno, redo #### 4", "4"), ("\\boxed{3}, no: \\boxed{4}", "4"),  # the last one is final
])
def test_reference_answers(answer, reference):
    assert task.reference_answer(answer) == reference


def test_train_reads_a_saved_folder_with_custom_fields(tmp_path, tiny_policy_dir):
    rows = [{"q": f"{n} mod {d} =", "a": str(n % d)} for n in range(20, 40) for d in (3, 7)]
    Dataset.from_list(rows).save_to_disk(str(tmp_path / "data"))
    args = train.Args(model=str(tiny_policy_dir), dataset=str(tmp_path / "data"), prompt_field="q", answer_field="a",
                      num_prompts=2, num_generations=2, max_new_tokens=8, total_steps=1, eval_size=4,
                      wandb_mode="disabled", output_dir=str(tmp_path / "runs"), save_model=False)
    tr, te = runs.load_data(runs.resolve(args)[0])  # the custom columns, every row in one of the two splits
    assert sorted((e.prompt, e.answer) for e in tr + te) == sorted((r["q"], r["a"]) for r in rows)
    summary = train.train(args)
    assert summary["steps"] == 1 and round(summary["accuracy_after"] * 4, 9) % 1 == 0  # over --eval-size 4 problems


def test_one_field_rule_for_every_format(tmp_path):
    """GSM8K's own release rows ({"question", "answer"}) read the same from JSONL, parquet and CSV: the same default
    fields (prompt, question, problem / answer, solution) and the same --prompt-field/--answer-field."""
    rows = [{"question": f"{i} mod 3 =", "answer": f"work\n#### {i % 3}"} for i in range(12)]
    (tmp_path / "g.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    Dataset.from_list(rows).to_parquet(str(tmp_path / "g.parquet"))
    Dataset.from_list(rows).to_csv(str(tmp_path / "g.csv"), index=False)
    loaded = [task.load_dataset(str(tmp_path / f"g.{ext}")) for ext in ("jsonl", "parquet", "csv")]
    pairs = [sorted((e.prompt, e.answer) for e in tr + te) for tr, te in loaded]
    assert pairs[0] == pairs[1] == pairs[2] and ("4 mod 3 =", "1") in pairs[0]
    named = [{"q": r["question"], "a": r["answer"]} for r in rows]
    (tmp_path / "n.jsonl").write_text("".join(json.dumps(r) + "\n" for r in named))
    tr, te = task.load_dataset(str(tmp_path / "n.jsonl"), prompt_field="q", answer_field="a")
    assert sorted((e.prompt, e.answer) for e in tr + te) == pairs[0]


def test_a_table_file_loads_without_library_noise(tmp_path, capfd):
    Dataset.from_list(ROWS).to_parquet(str(tmp_path / "gsm.parquet"))
    capfd.readouterr()
    task.load_dataset(str(tmp_path / "gsm.parquet"))
    out, err = capfd.readouterr()
    assert out == "" and err == ""  # no "Generating train split" bars


def test_your_own_held_out_set_replaces_the_split(tmp_path, tiny_policy_dir, capsys):
    """--eval-dataset: its rows are the held-out set (same formats and field rules as --dataset), and the training
    file keeps every row; a held-out set under 20 problems gets one warning, which names the file given."""
    train_rows = [{"q": f"{n} mod {d} =", "a": str(n % d)} for n in range(20, 40) for d in (3, 7)]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in train_rows))
    eval_rows = [{"q": f"{n} mod 5 =", "a": str(n % 5)} for n in range(50, 55)]
    Dataset.from_list(eval_rows).to_parquet(str(tmp_path / "mine.parquet"))
    args = train.Args(model=str(tiny_policy_dir), dataset=str(tmp_path / "train.jsonl"), prompt_field="q",
                      answer_field="a", eval_dataset=str(tmp_path / "mine.parquet"), wandb_mode="disabled")
    args = runs.resolve(args)[0]
    tr, te = runs.load_data(args)
    assert len(tr) == len(train_rows) and [e.prompt for e in te] == [r["q"] for r in eval_rows]
    summary = train.train(dataclasses.replace(args, num_prompts=2, num_generations=2, max_new_tokens=8, total_steps=1,
                                        output_dir=str(tmp_path / "runs"), save_model=False))
    out = capsys.readouterr().out
    assert "5 training" not in out and f"40 training and 5 held-out problems from {tmp_path / 'mine.parquet'}" in out
    assert out.count("warning: only 5 held-out problems") == 1 and "mine.parquet holds no more" in out
    assert "pass a larger set of your own" not in out  # (issue 50.3: not advice to do what was done)
    assert "(5 problems)" in out and round(summary["accuracy_after"] * 5, 9) % 1 == 0  # scored on those 5
    assert "are training problems too" not in out
    # a held-out file that repeats training problems: said, counted (a file naming --dataset itself: every one)
    (tmp_path / "overlap.jsonl").write_text("".join(json.dumps(r) + "\n" for r in train_rows[:2] + eval_rows[:1]))
    train.train(dataclasses.replace(args, num_prompts=2, num_generations=2, max_new_tokens=8, total_steps=1,
                                    output_dir=str(tmp_path / "runs"), run_name="overlap", save_model=False,
                                    eval_dataset=str(tmp_path / "overlap.jsonl")))
    assert "warning: 2 of the 3 held-out problems are training problems too" in capsys.readouterr().out


def test_an_embedded_task_s_held_out_split_is_a_held_out_set(tmp_path):
    """--eval-dataset embedded-long with --dataset embedded (train short, evaluate on long chains; it was looked up
    on the hub): the long task's held-out split, no prompt of which is a training prompt; and from a file too."""
    long_train, long_test = task.default_splits(long=True)
    short_train, _ = task.default_splits()
    args = runs.resolve(train.Args(eval_dataset="embedded-long"))[0]
    tr, te = runs.load_data(args)
    assert (tr, te) == (short_train, long_test) and not {e.prompt for e in te} & {e.prompt for e in tr}
    args = runs.resolve(train.Args(dataset=ten_rows(tmp_path), eval_dataset="embedded-add"))[0]
    tr, te = runs.load_data(args)
    assert len(tr) == 10 and te == task.addition_splits()[1]


def test_an_eval_dataset_with_a_test_split_is_evaluated_on_that_split(tmp_path):
    """--eval-dataset naming a dataset with train and test splits: its test split is the held-out set."""
    DatasetDict({"train": Dataset.from_list(ROWS[:30]), "test": Dataset.from_list(ROWS[30:])}) \
        .save_to_disk(str(tmp_path / "gsm"))
    args = runs.resolve(train.Args(dataset=ten_rows(tmp_path), eval_dataset=str(tmp_path / "gsm")))[0]
    tr, te = runs.load_data(args)
    assert len(tr) == 10 and [e.prompt for e in te] == [r["question"] for r in ROWS[30:]]


def test_the_additions_task_is_the_one_the_reference_describes():
    """--dataset embedded-add: every a + b with a, b <= 30, each answer the sum, split by a hash of the prompt into the
    758 training and 203 held-out problems docs/reference.md gives (the study's claim 5 ran on this split)."""
    tr, te = task.addition_splits()
    pairs = [tuple(map(int, e.prompt.removeprefix("What is ").removesuffix("?").split(" + "))) for e in tr + te]
    assert sorted(pairs) == [(a, b) for a in range(31) for b in range(31)]
    assert all(int(e.answer) == a + b for e, (a, b) in zip(tr + te, pairs))
    assert (len(tr), len(te)) == (758, 203) and te[0].prompt == "What is 0 + 4?"
    reference = (Path(__file__).parents[1] / "docs" / "reference.md").read_text()
    assert "(758 train, 203\nheld out by prompt hash)" in reference


def test_a_held_out_set_of_one_row_is_a_held_out_set(tmp_path):
    """--eval-dataset is not split, so one row is enough (a --dataset that is split needs two)."""
    (tmp_path / "one.jsonl").write_text(json.dumps({"prompt": "50 mod 7 =", "answer": "1"}) + "\n")
    args = runs.resolve(train.Args(dataset=ten_rows(tmp_path), eval_dataset=str(tmp_path / "one.jsonl")))[0]
    tr, te = runs.load_data(args)
    assert len(tr) == 10 and [(e.prompt, e.answer) for e in te] == [("50 mod 7 =", "1")]
    with pytest.raises(task.TaskError, match="has 1 row"):
        task.load_dataset(str(tmp_path / "one.jsonl"))  # split: nothing would be left to train on


def test_the_first_listed_field_a_row_has_is_the_one_read(tmp_path):
    """PROMPT_FIELDS / ANSWER_FIELDS are in order of preference: a row with several reads the first listed."""
    rows = [{"problem": "p", "question": "q", "prompt": "r", "solution": "s", "answer": "a"},
            {"problem": "p", "question": "q", "solution": "s"}]
    for i, (prompt, answer) in enumerate([("r", "a"), ("q", "s")]):
        (tmp_path / f"{i}.jsonl").write_text(json.dumps(rows[i]) + "\n")
        assert task.load_dataset(str(tmp_path / f"{i}.jsonl"), split=False)[0] == [task.Example(prompt, answer)]


def test_a_large_dataset_holds_out_a_stable_tenth_of_at_most_200_rows():
    """Whether a row is held out depends on its prompt alone (a hash), so a run and its rerun split alike; a tenth of
    the rows, at most 200."""
    examples = [task.Example(f"{i} + 1 =", str(i + 1)) for i in range(5000)]
    train_rows, test_rows = task.heldout_split(examples, "made up")
    assert len(test_rows) == 200 and len(train_rows) + len(test_rows) == 5000
    assert {e.prompt for e in train_rows}.isdisjoint(e.prompt for e in test_rows)
    small = task.heldout_split(examples[:300], "made up")[1]  # under the cap: the same rule, row by row
    assert 10 <= len(small) <= 50 and small == [e for e in test_rows if int(e.answer) <= 300]


@pytest.mark.parametrize("name,is_path", [("data/gsm8k/train", True), ("./gsm8k", True), ("gsm8k.jsonl", True),
                                          ("openai/gsm8k", False), ("gsm8k", False)])
def test_a_name_with_two_slashes_is_a_path_not_a_hub_id(name, is_path):
    assert task.names_a_path(name) == is_path
