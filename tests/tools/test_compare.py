"""tools.compare: two evaluations' answers paired problem by problem, the effect with the study's interval."""

import json
import sys

import pytest

from tools import compare
from tools.study import stats


def write(folder, steps: dict[int, list[float]], prompts=None):
    """An eval_completions.jsonl as train.py writes it: per step, one greedy answer per problem."""
    folder.mkdir(parents=True, exist_ok=True)
    with (folder / "eval_completions.jsonl").open("w") as f:
        for step, correct in steps.items():
            for p, c in enumerate(correct):
                prompt = prompts[p] if prompts else f"{p} mod 3 ="
                f.write(json.dumps({"step": step, "problem": p, "prompt": prompt, "completion": f"c{p}",
                                    "reference": "1", "correct": c, "reward": c}) + "\n")


def test_the_effect_is_the_paired_difference_with_its_t_interval(tmp_path, capsys):
    a = [1.0, 0.0, 0.0, 1.0, 0.0, 0.0, 1.0, 0.0]
    b = [1.0, 1.0, 0.0, 1.0, 1.0, 1.0, 0.0, 1.0]
    write(tmp_path / "a", {0: [0.0] * 8, 5: a})  # A's last evaluation (step 5) is read by default
    write(tmp_path / "b", {0: b})
    compare.main(["--a", str(tmp_path / "a"), "--b", str(tmp_path / "b" / "eval_completions.jsonl")])
    out = capsys.readouterr().out
    e = stats.estimate([y - x for x, y in zip(a, b)])
    assert f"B - A: {e.mean:+.3f} [{e.lo:+.3f}, {e.hi:+.3f}], paired over 8 problems" in out, out
    assert "right only in A: 1, only in B: 4" in out and "at step 5: accuracy 0.375" in out
    assert out.count("right only in B: problem") == 3  # --show 3
    compare.main(["--a", str(tmp_path / "a"), "--b", str(tmp_path / "b"), "--step-a", "0", "--show", "0"])
    out = capsys.readouterr().out
    assert "at step 0: accuracy 0.000" in out and "B - A: +0.750 [+0.363, +1.000]" in out  # (clipped at 1)
    assert not any(line.startswith("  right only in") for line in out.splitlines())


@pytest.mark.parametrize("case, message", [
    ("other prompts", "did not score the same problems"),
    ("fewer problems", "error: A and B did not score the same problems (3 and 2; they differ at problem 2): evaluate "
                       "both with the same --dataset, --eval-dataset and --eval-size"),
    ("missing step", "--step-b 7"),
    ("no file", "no eval_completions.jsonl there"),
    ("not json", "is not an eval_completions.jsonl"),
    ("positional", "name the two runs as flags: python -m tools.compare --a "),  # `tools.compare A B`
])
def test_what_cannot_be_paired_is_one_line(tmp_path, capsys, case, message):
    write(tmp_path / "a", {0: [1.0, 0.0, 1.0]})
    argv = ["--a", str(tmp_path / "a"), "--b", str(tmp_path / "b")]
    if case == "other prompts":
        write(tmp_path / "b", {0: [1.0, 0.0, 1.0]}, prompts=["x", "y", "z"])
    elif case == "fewer problems":
        write(tmp_path / "b", {0: [1.0, 0.0]})
    elif case == "missing step":
        write(tmp_path / "b", {0: [1.0, 0.0, 1.0]})
        argv += ["--step-b", "7"]
    elif case == "positional":
        argv = [str(tmp_path / "a"), str(tmp_path / "b")]
    elif case == "not json":
        (tmp_path / "b").mkdir()
        (tmp_path / "b" / "eval_completions.jsonl").write_text("{not json\n")
    with pytest.raises(SystemExit) as exc:
        compare.main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert exc.value.code == 2 and len(err) == 1 and err[0].startswith("error: ") and message in err[0], err


def test_runs_named_without_flags_get_the_command_and_one_stray_word_the_parsers_line(tmp_path, capsys, monkeypatch):
    """`python -m tools.compare A B`, as the shell passes it (sys.argv), is answered with the command that names both
    runs; a single word is not read as two runs: the parser refuses it in one line."""
    monkeypatch.setattr(sys, "argv", ["compare.py", "runs/base", "runs/trained"])
    told = "error: name the two runs as flags: python -m tools.compare --a runs/base --b runs/trained"
    for argv, want in ((None, told), (["runs/base"], "error: ")):
        with pytest.raises(SystemExit) as exc:
            compare.main(argv)
        err = capsys.readouterr().err.strip().splitlines()
        assert exc.value.code == 2 and len(err) == 1 and err[0].startswith(want), err


def test_one_problem_has_no_interval(tmp_path, capsys):
    write(tmp_path / "a", {0: [0.0]})
    write(tmp_path / "b", {0: [1.0]})
    compare.main(["--a", str(tmp_path / "a"), "--b", str(tmp_path / "b")])
    assert "B - A: +1.000 (no interval from one problem), paired over 1 problems" in capsys.readouterr().out
