"""Bad input, tried as a careless user would, by class. Every case: exit code 2, exactly one `error:` line on
stderr, no traceback, and the output folder absent or byte-for-byte unchanged. Messages name a way out that works
(tested by taking it)."""

import hashlib
import json
import os
import re
import shutil
import signal
import sys
import time
from pathlib import Path

import pytest

from plumbing import checkpoint
from base import errors
import train
from plumbing import run as runs

from conftest import SMALL  # noqa: E402  the shared small run, as flags


def snapshot(folder: Path):
    """Every file under `folder` with a hash of its bytes; None when the folder does not exist."""
    if not folder.exists():
        return None
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
            for p in sorted(folder.rglob("*"))}


def refused(argv, capsys, out: Path, message: str, seconds: float | None = None) -> str:
    """Run train.main in-process; assert the bad-input contract; return the error line."""
    before = snapshot(out)
    start = time.time()
    with pytest.raises(SystemExit) as exc:
        train.main(argv)
    elapsed = time.time() - start
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert exc.value.code == 2, err
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert "Traceback" not in err
    assert message in lines[0], lines[0]
    assert snapshot(out) == before, "the output folder changed"
    if seconds is not None:
        assert elapsed < seconds, f"took {elapsed:.1f} s"
    return lines[0]


# ---------------------------------------------------------------------------------------------------------------
# Flags: non-finite numbers, names the loop cannot use, devices this torch does not have, empty names
# ---------------------------------------------------------------------------------------------------------------

FLAGS = [
    (["--entropy-target", "-1"], "--entropy-target must be > 0"),
    (["--lr", "inf"], "--lr must be a finite number"),
    (["--lr", "-inf"], "--lr must be a finite number"),
    (["--lr", "nan"], "--lr must be a finite number"),
    (["--temperature", "inf"], "--temperature must be a finite number"),
    (["--epsilon", "nan"], "--epsilon must be a finite number"),
    (["--epsilon-high", "inf"], "--epsilon-high must be a finite number"),
    (["--beta", "inf"], "--beta must be a finite number"),
    (["--format-weight", "nan"], "--format-weight must be a finite number"),
    (["--overlong-weight", "inf"], "--overlong-weight must be a finite number"),
    (["--max-grad-norm", "inf"], "--max-grad-norm must be a finite number"),
    (["--weight-decay", "nan"], "--weight-decay must be a finite number"),
    (["--lr-scheduler", "reduce_lr_on_plateau"], "cannot be used here; use one of linear, cosine"),
    (["--lr-scheduler", "cosine_with_min_lr"], "cannot be used here"),
    (["--lr-scheduler", "warmup_stable_decay"], "cannot be used here"),
    (["--lr-scheduler", "cosine_warmup_with_min_lr"], "cannot be used here"),
    (["--lr-scheduler", "nonsense"], "cannot be used here"),
    (["--device", "foo"], "--device 'foo' is not a device"),
    (["--device", "cuda"], "--device cuda: this torch has no usable CUDA device"),
    (["--device", "cuda:3"], "--device cuda:3"),
    (["--device", "mps"], "--device mps: MPS is not available"),
    (["--device", "meta"], "only cpu, cuda and mps are supported"),
    (["--output-dir", ""], "--output-dir must name a folder"),
    (["--output-dir", "   "], "--output-dir must name a folder"),
    (["--run-name", "a/b"], "--run-name 'a/b' must be a plain folder name"),
    (["--run-name", ".."], "must be a plain folder name"),
    (["--run-name", " "], "must be a plain folder name"),
    (["--model", ""], "--model must not be empty"),
    (["--dataset", ""], "--dataset must not be empty"),
    (["--lora-rank", "-1"], "--lora-rank must be >= 0"),
    (["--lora-rank", "4", "--lora-alpha", "0"], "--lora-alpha must be > 0"),
    (["--lora-rank", "4", "--lora-alpha", "nan"], "--lora-alpha must be a finite number"),
    (["--lora-rank", "4", "--lora-target-modules"], "--lora-target-modules must name at least one module"),
    (["--merge-lora"], "--merge-lora merges a LoRA adapter into the base: it needs --lora-rank > 0"),
    (["--lora-rank", "4", "--lora-target-modules", "c_attn"], "--lora-target-modules c_attn: none is a module"),
    (["--lora-rank", "4", "--lora-target-modules", "q_proj", "v_prj"], "v_prj is not a module of this model"),  # a typo
    (["--wandb-mode", "online"], "wandb online needs a login"),
    (["--total-steps", "-5"], "--total-steps must be >= 0"),
    (["--total-steps", "0", "--resume", "auto"], "--total-steps 0 evaluates --model without training"),
    (["--max-new-tokens", "-1"], "--max-new-tokens must be at least 1"),
    (["--num-prompts", "-3"], "--num-prompts must be at least 1"),
    (["--seed", "-1"], "--seed must be in [0, 2**32)"),
    (["--seed", "99999999999"], "--seed must be in [0, 2**32)"),
    (["--temperature", "1e-30"], "is greedy in all but name"),
    (["--format-weight", "-1"], "reward weights must be >= 0"),
    (["--overlong-weight", "-0.5"], "reward weights must be >= 0"),
    (["--resume", "auto", "--overwrite"], "--resume and --overwrite contradict each other"),
    (["--wandb-tags", "x" * 70], "each tag must be 1 to 64 characters"),
    (["--dtype", "float16", "--device", "cpu"], "--dtype float16 is not supported"),
    (["--dtype", "float16"], "--dtype float16 is not supported"),  # on every device (a GPU's weights turn NaN)
    (["--threads", "-1"], "--threads must be >= 0"),
    (["--algo", "gspoo"], "--algo 'gspoo' is not one of its choices; use one of gspo, "),  # the closest first
    (["--algo", "GSPO"], "--algo 'GSPO' is not one of its choices; use one of gspo, "),  # case aside
    (["--num-prompts", "abc"], "--num-prompts"),  # tyro's parse errors are one line too
    (["--no-such-flag"], "--no-such-flag"),
    (["--save-evry", "1"], "Unrecognized options: --save-evry, 1; did you mean --save-every?"),  # tyro's suggestion
    (["--epsilon-hi", "0.1"], "did you mean --epsilon-high or --epsilon?"),  # tyro's suggestions, closest first
    (["--learning-rate", "1e-6"], "--learning-rate is TRL's name; here: --lr"),
    (["--model_name_or_path", "Qwen/Qwen2.5-0.5B-Instruct"], "--model_name_or_path is TRL's name; here: --model"),
    (["--num-iterations", "2"], "--num-iterations is TRL's name; here: --num-epochs"),  # (tyro: --num-generations)
    (["--clip-ratio-high=0.28"], "--clip-ratio-high is verl's name; here: --epsilon-high"),
    (["--mask-truncated", "maybe"], "Unrecognized options: maybe"),
    (["--enable-thinking"], "--enable-thinking changes no prompt of"),  # a model without a chat template
    (["--rollout-correction", "token_mask", "--old-logprobs", "sampler"], "which is 1 when pi_old is the sampler's"),
    (["--rollout-correction", "token_mask", "--rollout-correction-max", "None"], "needs a bound"),
    (["--rollout-correction-max", "0"], "must be > 0 with min < max"),
    (["--rollout-correction-min", "4", "--rollout-correction-max", "3"], "must be > 0 with min < max"),
    (["--rollout-correction-min", "0.5"], "bound the weight of --rollout-correction, which is off"),
    (["--rollout-correction-max", "5"], "bound the weight of --rollout-correction, which is off"),
    (["--algo", "cispo", "--importance-sampling-level", "sequence"], "CISPO weights each token"),
    (["--algo", "gmpo", "--importance-sampling-level", "token"], "GMPO's weight is one per sequence"),
    (["--algo", "sapo", "--sapo-tau-pos", "0"], "SAPO's temperatures (--sapo-tau-pos, --sapo-tau-neg) must be > 0"),
    (["--algo", "grpo", "--kl-ratio-correction", "True", "--kl-in", "reward"],
     "with --kl-in reward there is no KL term"),
    (["--algo", "vespo", "--importance-sampling-level", "sequence"], "VESPO computes its own weight"),
    (["--algo", "vespo", "--vespo-lambda-neg", "0"], "VESPO's kernel needs lambda > 0 and k >= 0"),
    (["--algo", "vespo", "--vespo-k-pos", "-1"], "VESPO's kernel needs lambda > 0 and k >= 0"),
    (["--algo", "vespo", "--rollout-correction", "sequence_mask"], "VESPO folds the rollout correction's token"),
    (["--algo", "luspo", "--vespo-k-pos", "3"], "--vespo-k-pos 3.0 shapes VESPO's kernel; --surrogate clip has none"),
    (["--advantage-estimator", "rloo", "--scale-rewards", "none"],
     "--scale-rewards none is grpo's divisor; --advantage-estimator rloo has its own normalisation"),
    (["--algo", "dr_grpo", "--advantage-estimator", "maxrl", "--scale-rewards", "group"], "--scale-rewards group"),
    (["--kl-estimator", "k1"], "--kl-estimator k1 shapes the KL term, which beta 0 turns off"),  # gspo: beta 0
    (["--lora-alpha", "16"], "--lora-alpha 16.0 scales a LoRA adapter, and without --lora-rank there is none"),
    (["--algo", "grpo", "--beta", "0", "--kl-in", "reward"], "--kl-in reward shapes the KL term"),
    (["--algo", "grpo", "--sapo-tau-neg", "2"], "--sapo-tau-neg 2.0 is SAPO's gate temperature; --surrogate clip"),
    (["--eval-samples", "1000000"], "use at most 1024"),
    (["--max-new-tokens", "100000"], "leaves no room for a prompt in the model's context of 128 tokens"),
    # one home for bad flags (the lists of test_reliability.py and test_train.py joined here)
    (["--num-generations", "1"], "--num-generations must be at least 2"),
    (["--num-prompts", "0"], "--num-prompts must be at least 1"),
    (["--lr", "0"], "--lr must be > 0"),
    (["--lr", "-1e-4"], "--lr must be > 0"),
    (["--epsilon", "0"], "--epsilon must be in (0, 1)"),
    (["--epsilon", "1.5"], "--epsilon must be in (0, 1)"),
    (["--algo", "cispo", "--surrogate", "clip"], "--epsilon must be in (0, 1) with --surrogate clip (got 1.0, from "
                                                 "--epsilon or else --algo cispo"),  # CISPO's 1: PPO's clip refuses it
    (["--epsilon-high", "-0.1"], "--epsilon-high must be >= 0"),
    (["--max-new-tokens", "0"], "--max-new-tokens must be at least 1"),
    (["--temperature", "0"], "--temperature must be > 0"),
    (["--num-minibatches", "3"], "must divide the rollout's 4x4 rows; use one of 1, 2, 4, 8, 16 (or change"),
    (["--num-minibatches", "0"], "must divide the rollout's"),
    (["--num-epochs", "0"], "--num-epochs must be at least 1"),
    (["--micro-batch-size", "-2"], "--micro-batch-size must be >= 0"),
    (["--beta", "-0.1"], "--beta must be >= 0"),
    (["--max-grad-norm", "0"], "--max-grad-norm must be > 0"),
    (["--warmup-steps", "-1"], "--warmup-steps must be >= 0"),
    (["--max-sampling-rounds", "0"], "--max-sampling-rounds must be at least 1"),
    (["--algo", "dapo", "--overlong-cache", "100"], "--overlong-cache must be in [1, --max-new-tokens]"),
    (["--eval-every", "0"], "--eval-every must be at least 1"),
    (["--save-every", "-1"], "--save-every must be >= 0"),
    (["--log-completions-every", "-1"], "--log-completions-every must be >= 0"),
    (["--keep-checkpoints", "0"], "--keep-checkpoints must be at least 1"),
    (["--lr-scheduler", "sometimes"], "cannot be used here"),
    (["--output-dir", "/etc/hostname/runs"], "cannot be created"),
    (["--model", "/no/such/model"], "does not exist"),
    (["--model", "./missing.gguf"], "does not exist"),
    (["--dataset", "/no/such/data.jsonl"], "does not exist"),
    (["--resume", "/no/such/checkpoint"], "no such checkpoint"),
    # each rule at its boundary, on the refused side (test_each_rule_admits_its_boundary has the other)
    (["--logprob-chunk", "-2"], "--logprob-chunk must be a number of positions"),
    (["--algo", "dapo", "--advantage-estimator", "maxrl"], "divides by the group's mean reward"),
    (["--rollout-correction", "token_truncate", "--rollout-correction-min", "3", "--rollout-correction-max", "3"],
     "must be > 0 with min < max"),
    (["--temperature", "0.009"], "is greedy in all but name"),
]


def test_references_that_can_never_match_the_format_are_refused_when_loaded(tmp_path, capsys, tiny_policy_dir):
    path = tmp_path / "worked.jsonl"
    path.write_text('{"prompt": "7 mod 3 =", "answer": "1"}\n'
                    '{"prompt": "8 mod 3 =", "answer": "subtract 3 twice to get two"}\n' * 3)
    out = tmp_path / "out"
    line = refused(["--model", str(tiny_policy_dir), "--dataset", str(path), "--answer-format", "last-number",
                    "--output-dir", str(out)] + SMALL, capsys, out, "not a number, so it could never be matched")
    assert "row 1 ('8 mod 3 =')" in line and "'subtract 3 twice to get two'" in line


@pytest.mark.slow
def test_a_run_where_nothing_is_ever_correct_warns_once(tmp_path, capsys, tiny_policy_dir):
    path = tmp_path / "never.jsonl"
    path.write_text("".join(f'{{"prompt": "{i} mod 3 =", "answer": "no such answer"}}\n' for i in range(12)))
    train.main(["--model", str(tiny_policy_dir), "--dataset", str(path), "--output-dir", str(tmp_path / "out"),
                "--total-steps", "6", "--eval-every", "6"] + SMALL)
    out = capsys.readouterr().out
    assert out.count("warning: no completion of the first 5 steps was scored correct") == 1
    assert "--answer-format tags" in out and "'no such answer'" in out


@pytest.mark.slow
def test_completions_cut_off_for_several_steps_warn_once(tmp_path, capsys, tiny_policy_dir):
    train.main(["--model", str(tiny_policy_dir), "--output-dir", str(tmp_path), "--total-steps", "5"] + SMALL
               + ["--max-new-tokens", "3"])
    out = capsys.readouterr().out
    assert out.count("warning: more than half of the completions hit --max-new-tokens 3") == 1


@pytest.mark.parametrize("dataset,context", [("embedded", 128), ("embedded-long", 512)])
def test_a_budget_past_the_embedded_context_is_refused_before_the_warm_start(tmp_path, capsys, monkeypatch, dataset,
                                                                           context):
    """The embedded model's context is fixed by its recipe: the refusal comes before minutes of warm start, which
    would go into the (empty) cache."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    refused(["--dataset", dataset, "--max-new-tokens", "100000", "--output-dir", str(tmp_path / "out"),
             "--wandb-mode", "disabled"], capsys, tmp_path / "out", f"context of {context} tokens", seconds=10)
    # a prompt that does not fit with the budget: its own line, also before the warm start
    data = tmp_path / "long.jsonl"
    data.write_text("".join(f'{{"prompt": "{"9" * 90} mod {i} =", "answer": "0"}}\n' for i in range(3, 9)))
    refused(["--dataset", str(data), "--max-new-tokens", "64", "--output-dir", str(tmp_path / "out"),
             "--wandb-mode", "disabled"], capsys, tmp_path / "out", "exceeds the model's context of 128", seconds=10)
    assert not (tmp_path / "cache").exists()


@pytest.fixture
def no_wandb_login(monkeypatch, tmp_path):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))


@pytest.mark.parametrize("argv,message", FLAGS, ids=[" ".join(a) or "empty" for a, _ in FLAGS])
def test_bad_flags(tmp_path, capsys, tiny_policy_dir, no_wandb_login, argv, message):
    out = tmp_path / "out"
    base = ["--model", str(tiny_policy_dir), "--output-dir", str(out)] + SMALL
    argv = base + argv if "--wandb-mode" not in argv else base[:-2] + argv
    refused(argv, capsys, out, message)
    assert not out.exists()  # not even the output folder is created before the checks


def test_under_torchrun_a_flag_that_does_not_parse_is_printed_by_rank_0_alone(monkeypatch, capsys):
    """Every rank parses the same flags: each printed the same `error:` line (twice under 2 processes); the others now
    wait for rank 0 to print it and exit, as they do for a bad value found after parsing (errors.one_line_errors)."""
    waits = []
    monkeypatch.setattr(errors.time, "sleep", waits.append)
    monkeypatch.setattr(errors.signal, "signal", lambda sig, handler: None)
    for rank, printed in (("1", False), ("0", True)):
        monkeypatch.setenv("RANK", rank)
        waits.clear()
        with pytest.raises(SystemExit) as stop:
            train.main(["--rollout-correction", "truncate"])
        err = capsys.readouterr().err
        assert stop.value.code == 2 and (err.startswith("error: --rollout-correction 'truncate'") == printed)
        assert (err == "" and waits == [10.0]) if not printed else (err.count("\n") == 1 and not waits)


def test_each_rule_admits_its_boundary_and_the_prompts_must_split_over_the_processes():
    """The other side of the boundaries above: values on the edge are accepted. And under torchrun the P prompts of
    a step must divide evenly over the processes."""
    from plumbing import flags

    def args(**kw):
        return runs.resolve(train.Args(**kw))[0]

    for kw in [dict(logprob_chunk=-1), dict(temperature=0.01), dict(algo="dapo", overlong_cache=64, max_new_tokens=64),
               dict(rollout_correction="token_mask", rollout_correction_min=0.5, rollout_correction_max=0.6),
               dict(advantage_estimator="maxrl"), dict(num_prompts=8),
               dict(algo="cispo", surrogate="vespo"), dict(algo="gmpo", epsilon=1.0),  # epsilon 1: unread by VESPO
               dict(algo="grpo", kl_ratio_correction=True)]:  # (its KL term in the loss, as GRPO's)
        flags.validate(args(**kw))
    flags.validate(args(num_prompts=8, num_minibatches=1), world_size=4)
    # a KL setting with beta > 0, a preset's own value with beta 0, a SAPO temperature under SAPO, another estimator
    # (whose resolved args hold the preset's --scale-rewards): accepted, and resolving resolved args changes nothing
    for kw in [dict(algo="grpo", kl_estimator="k1"), dict(kl_estimator="k3"), dict(algo="sapo", sapo_tau_pos=2.0),
               dict(advantage_estimator="rloo"), dict(algo="dr_grpo", advantage_estimator="maxrl"),
               dict(lora_rank=8, lora_alpha=16.0), dict(lora_rank=8)]:
        assert runs.resolve(args(**kw)) == runs.resolve(train.Args(**kw))
    with pytest.raises(errors.ConfigError, match="--num-prompts 8"):
        flags.validate(args(num_prompts=8, num_minibatches=1), world_size=3)
    with pytest.raises(errors.ConfigError, match="each process's 4x8 rows; use one of 1, 2, 4, 8, 16, 32 "):
        flags.validate(args(num_prompts=8, num_minibatches=3), world_size=2)


EDGES = [  # (field, the value on the edge: accepted, the value just past it: refused, other fields)
    ("num_generations", 2, 1, {}), ("num_prompts", 1, 0, {}), ("num_minibatches", 1, 0, {}),
    ("logprob_chunk", -1, -2, {}), ("threads", 0, -1, {}), ("total_steps", 0, -1, {}),
    ("max_new_tokens", 1, 0, {}), ("max_new_tokens", 127, 128, {}),  # the embedded model's context: 128
    ("temperature", 0.01, 0.0099, {}), ("lr", 1e-12, 0.0, {}), ("warmup_steps", 0, -1, {}),
    ("max_grad_norm", 1e-12, 0.0, {}), ("weight_decay", 0.0, -1e-12, {}),
    ("epsilon", 1e-12, 0.0, {}), ("epsilon", 0.999, 1.0, {}), ("epsilon", 1.0, 1.001, dict(algo="cispo")),
    ("epsilon_high", 0.0, -1e-12, {}), ("beta", 0.0, -1e-12, {}), ("num_epochs", 1, 0, {}),
    ("micro_batch_size", 0, -1, {}), ("max_sampling_rounds", 1, 0, {}),
    ("overlong_cache", 1, 0, dict(algo="dapo")), ("overlong_cache", 64, 65, dict(algo="dapo", max_new_tokens=64)),
    ("eval_every", 1, 0, {}), ("eval_size", 0, -1, {}), ("eval_samples", 0, -1, {}),
    ("eval_samples", 1024, 1025, {}), ("save_every", 0, -1, {}), ("log_completions_every", 0, -1, {}),
    ("keep_checkpoints", 1, 0, {}), ("max_nonfinite_steps", 1, 0, {}), ("seed", 0, -1, {}),
    ("seed", 2**32 - 1, 2**32, {}), ("entropy_target", 1e-12, 0.0, {}), ("format_weight", 0.0, -1e-12, {}),
    ("overlong_weight", 0.0, -1e-12, {}), ("wandb_tags", ("x" * 64,), ("x" * 65,), {}),
    ("wandb_tags", ("x",), ("",), {}), ("lora_rank", 0, -1, {}), ("lora_alpha", 1e-12, 0.0, dict(lora_rank=4)),
    ("rollout_correction_max", 1e-12, 0.0, dict(rollout_correction="token_truncate")),
    ("rollout_correction_min", 0.999, 1.0, dict(rollout_correction="token_mask", rollout_correction_max=1.0)),
    # the objective's own bounds (losses.check_config)
    ("top_entropy_quantile", 1.0, 1.001, {}), ("top_entropy_quantile", 1e-12, 0.0, {}),
    ("clip_ratio_c", 1.001, 1.0, {}),
    ("sapo_tau_pos", 1e-12, 0.0, dict(algo="sapo")), ("sapo_tau_neg", 1e-12, 0.0, dict(algo="sapo")),
    ("vespo_lambda_pos", 1e-12, 0.0, dict(algo="vespo")), ("vespo_k_pos", 0.0, -1e-12, dict(algo="vespo")),
]


@pytest.mark.parametrize("field, edge, past, other", EDGES, ids=[f"{e[0]}={e[1]!r}" for e in EDGES])
def test_every_numeric_rule_accepts_its_edge_and_refuses_the_value_past_it(field, edge, past, other):
    """Each bound of CHECKS on both sides: the value on the edge validates, the nearest value past it is one
    ConfigError naming the flag (a rule moved by one, or < written for <=, fails here)."""
    from plumbing import flags

    flags.validate(runs.resolve(train.Args(**other, **{field: edge}))[0])
    with pytest.raises(errors.ConfigError, match="--" + field.replace("_", "-")):
        flags.validate(runs.resolve(train.Args(**other, **{field: past}))[0])


def test_the_rules_that_read_the_machine_accept_their_edge(monkeypatch):
    """The bounds that read the machine or torch, on both sides: P prompts over 2 processes, one GPU per process
    (as many processes as GPUs is fine), a cuda:N that exists, --fsdp on the CPU from torch 2.11."""
    import torch

    from plumbing import flags

    args = runs.resolve(train.Args())[0]
    with pytest.raises(errors.ConfigError, match="--num-prompts 3 is not divisible by the 2 processes"):
        flags.validate(runs.resolve(train.Args(num_prompts=3, num_minibatches=1))[0], world_size=2)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    flags.validate(args, world_size=2)  # two processes, two GPUs
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")
    with pytest.raises(errors.ConfigError, match="torchrun starts 3 processes on this machine but it has 2 GPU"):
        flags.validate(args, world_size=2)
    flags.check_device("cuda:1")
    with pytest.raises(errors.ConfigError, match="--device cuda:2: only 2 CUDA device"):
        flags.check_device("cuda:2")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch, "__version__", "2.11.0+cpu")
    flags.check_fsdp(train.Args(fsdp=True, device="cpu"))
    monkeypatch.setattr(torch, "__version__", "2.10.9+cpu")
    with pytest.raises(errors.ConfigError, match="--fsdp on the CPU needs torch 2.11"):
        flags.check_fsdp(train.Args(fsdp=True, device="cpu"))


def test_a_prompt_that_fills_the_context_with_the_budget_exactly_fits():
    """check_prompt_lengths: prompt tokens + --max-new-tokens up to the context are accepted, one more is refused
    (the embedded tokenizer: a token per character, no chat template)."""
    import model as models
    import task
    from plumbing import flags

    tokenizer, rows = models.build_tokenizer(), [task.Example("12 mod 5 =", "2"), task.Example("1 mod 1 =", "0")]
    flags.check_prompt_lengths(tokenizer, 20, rows, 10, "tags")  # the longest prompt: 10 tokens
    with pytest.raises(errors.ConfigError, match="prompt 0 .* has 10 tokens; with --max-new-tokens 11 it exceeds"):
        flags.check_prompt_lengths(tokenizer, 20, rows, 11, "tags")


@pytest.mark.parametrize("where", ["proc", "file"])
def test_an_output_folder_that_cannot_be_made_is_one_line_before_any_work(tmp_path, capsys, tiny_policy_dir, where):
    """A permission bit is not proof: /proc says writable to root yet takes no folder. The check makes and removes a
    probe folder in the nearest existing ancestor, so it refuses in a second and leaves nothing behind."""
    if where == "proc":
        out = Path("/proc/grpo-family-x/runs")
    else:
        (tmp_path / "a-file").write_text("x")
        out = tmp_path / "a-file" / "runs"
    before = sorted(p.name for p in tmp_path.iterdir())
    refused(["--model", str(tiny_policy_dir), "--output-dir", str(out)] + SMALL, capsys, out, "cannot be created",
            seconds=20)
    assert sorted(p.name for p in tmp_path.iterdir()) == before


@pytest.mark.parametrize("argv,mode", [([], "offline"), (["--wandb-mode", "online"], "online")])
def test_wandb_without_its_package_is_one_line_unless_disabled(tmp_path, capsys, tiny_policy_dir, no_wandb_login,
                                                               monkeypatch, argv, mode):
    """An image without wandb (the GPU machines' has none): offline (the default without a login) or online is refused
    before anything is written, with what to do; --wandb-mode disabled runs."""
    monkeypatch.setitem(sys.modules, "wandb", None)  # as if not installed: find_spec says None, an import fails
    base = ["--model", str(tiny_policy_dir), "--output-dir", str(tmp_path / "out")] + SMALL[:-2]
    refused(base + argv, capsys, tmp_path / "out", f"wandb {mode} needs the wandb package, which is not installed: "
            "pip install wandb (requirements.txt), or --wandb-mode disabled")
    train.main(base + ["--total-steps", "1", "--wandb-mode", "disabled"])
    assert "wandb disabled" in capsys.readouterr().out


def test_wandb_online_from_the_environment_without_login(tmp_path, capsys, tiny_policy_dir, no_wandb_login,
                                                        monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "online")
    refused(["--model", str(tiny_policy_dir), "--output-dir", str(tmp_path / "out")] + SMALL[:-2], capsys,
            tmp_path / "out", "wandb online needs a login")


# ---------------------------------------------------------------------------------------------------------------
# Datasets: wrong kinds of file, wrong values, too few rows
# ---------------------------------------------------------------------------------------------------------------

GOOD_ROW = '{"prompt": "7 mod 3 =", "answer": "1"}\n'
DATASETS = [
    ("folder", None, "is a folder; pass a JSONL file"),
    ("latin1.jsonl", '{"prompt": "caf\xe9", "answer": "1"}\n'.encode("latin-1"), "is not UTF-8 text"),
    ("binary.jsonl", b"\x89PNG\r\n\x1a\n\x00\x00\xff\xfe", "is not UTF-8 text"),
    ("array.jsonl", '[{"prompt": "7 mod 3 =", "answer": "1"}, {"prompt": "8 mod 3 =", "answer": "2"}]\n',
     "a JSON array; the file must hold one"),
    ("pretty.json", '{\n  "prompt": "7 mod 3 =",\n  "answer": "1"\n}\n', "a JSON array or pretty-printed JSON?"),
    ("null_answer.jsonl", GOOD_ROW + '{"prompt": "8 mod 3 =", "answer": null}\n', ':2: "answer" must be'),
    ("list_answer.jsonl", GOOD_ROW + '{"prompt": "8 mod 3 =", "answer": [5, 1]}\n', '"answer" must be'),
    ("dict_answer.jsonl", GOOD_ROW + '{"prompt": "8 mod 3 =", "answer": {"v": 2}}\n', '"answer" must be'),
    ("bool_answer.jsonl", GOOD_ROW + '{"prompt": "8 mod 3 =", "answer": true}\n', '"answer" must be'),
    ("empty_answer.jsonl", GOOD_ROW + '{"prompt": "8 mod 3 =", "answer": "  "}\n', '"answer" must be'),
    ("null_prompt.jsonl", GOOD_ROW + '{"prompt": null, "answer": "2"}\n', '"prompt" must be non-empty text'),
    ("number_prompt.jsonl", GOOD_ROW + '{"prompt": 8, "answer": "2"}\n', '"prompt" must be non-empty text'),
    ("chat_prompt.jsonl", GOOD_ROW + '{"prompt": [{"role": "user", "content": "8 mod 3 ="}], "answer": "2"}\n',
     "a list of chat messages is not read: give the question as text"),  # TRL's conversational format
    ("empty.jsonl", "\n\n", "has 0 row(s); it needs at least 1"),
    ("one_row.jsonl", GOOD_ROW, "has 1 row(s); it needs at least 2 (some are held out for evaluation), or pass your "
     "own held-out set with --eval-dataset"),
    ("no_answer.jsonl", GOOD_ROW + '{"prompt": "8 mod 3 ="}\n', 'needs both "prompt" and "answer"'),
    ("broken.jsonl", GOOD_ROW + '{"prompt": oops}\n', "broken.jsonl:2: not valid JSON"),
    ("scalar.jsonl", GOOD_ROW + '42\n', 'needs both "prompt" and "answer"'),
    ("missing.jsonl", "-", "does not exist"),
    ("data/missing.csv", "-", "does not exist"),
    ("fields.jsonl", '{"q": "7 mod 3 =", "a": "1"}\n' * 3, "has no prompt column (prompt or question or problem)"),
    ("empty.csv", "prompt,answer\n", "has 0 row(s); it needs at least 1"),
    ("empty.parquet", "EMPTY_PARQUET", "has 0 row(s); it needs at least 1"),
    ("not.parquet", "these are not parquet bytes\n", "is not a readable parquet file"),
    ("long.jsonl", '{"prompt": "%s", "answer": "1"}\n' % ("9" * 200) + GOOD_ROW, "exceeds the model's context of 128"),
]


@pytest.mark.parametrize("name,content,message", DATASETS, ids=[d[0] for d in DATASETS])
def test_bad_datasets(tmp_path, capsys, tiny_policy_dir, name, content, message):
    path = tmp_path / name
    if content is None:
        path.mkdir()
    elif content == "EMPTY_PARQUET":
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.table({"prompt": pa.array([], pa.string()), "answer": pa.array([], pa.string())}), path)
    elif content != "-":
        path.write_bytes(content if isinstance(content, bytes) else content.encode())
    out = tmp_path / "out"
    refused(["--model", str(tiny_policy_dir), "--dataset", str(path), "--output-dir", str(out)] + SMALL, capsys,
            out, message)
    assert not out.exists()


# ---------------------------------------------------------------------------------------------------------------
# Models and the hub: fail in seconds when the hub is unreachable
# ---------------------------------------------------------------------------------------------------------------

@pytest.fixture
def hub_unreachable(monkeypatch):
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)


# hub addresses that fail the two ways a missing network does: a refused connection (a closed port on this
# machine) and a name that does not resolve (.invalid never does)
MODELS = [
    ("someorg/no-such-model", "http://127.0.0.1:9", "the hub (http://127.0.0.1:9) is unreachable"),
    ("someorg/no-such-model", "https://hub.invalid", "the hub (https://hub.invalid) is unreachable"),
    ("no-such-model", "http://127.0.0.1:9", "is unreachable"),
    ("models/mine/checkpoint", "http://127.0.0.1:9", "does not exist"),
    ("./models/mine", "http://127.0.0.1:9", "does not exist"),
    ("weights.safetensors", "http://127.0.0.1:9", "does not exist"),
    ("missing.gguf", "http://127.0.0.1:9", "does not exist"),
]


@pytest.mark.parametrize("name,endpoint,message", MODELS, ids=[f"{m[0]}@{m[1]}" for m in MODELS])
def test_missing_models_fail_within_seconds(tmp_path, capsys, monkeypatch, hub_unreachable, name, endpoint,
                                            message):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "ENDPOINT", endpoint)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf"))  # an empty cache: nothing to fall back on
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "out"
    refused(["--model", name, "--output-dir", str(out)] + SMALL, capsys, out, message, seconds=10)


def test_hub_dataset_fails_within_seconds(tmp_path, capsys, monkeypatch, tiny_policy_dir, hub_unreachable):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "ENDPOINT", "https://hub.invalid")
    out = tmp_path / "out"
    refused(["--model", str(tiny_policy_dir), "--dataset", "someorg/no-such-data", "--output-dir", str(out)] + SMALL,
            capsys, out, "is unreachable", seconds=10)


def test_hub_dataset_without_the_datasets_package(tmp_path, capsys, monkeypatch, tiny_policy_dir):
    import builtins

    from base import network

    monkeypatch.setattr(network, "hub_offline", lambda: False)  # as if the hub answered

    real_import = builtins.__import__
    monkeypatch.setattr(builtins, "__import__", lambda name, *a, **kw: (_ for _ in ()).throw(ImportError(name))
                        if name == "datasets" else real_import(name, *a, **kw))
    out = tmp_path / "out"
    refused(["--model", str(tiny_policy_dir), "--dataset", "openai/gsm8k", "--output-dir", str(out)] + SMALL,
            capsys, out, "needs `pip install datasets`")


@pytest.mark.slow
def test_wrong_wandb_key_falls_back_offline_within_seconds(tmp_path, capsys, tiny_policy_dir, monkeypatch):
    """Not an error: the run goes on, logged offline, after one warning line, and the server is asked for 3 s."""
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    monkeypatch.setenv("WANDB_BASE_URL", "https://wandb.invalid")
    start = time.time()
    train.main(["--model", str(tiny_policy_dir), "--output-dir", str(tmp_path), "--total-steps", "1",
                "--wandb-mode", "online"] + SMALL[:-2])
    out = capsys.readouterr().out
    assert "warning: wandb server https://wandb.invalid did not answer within 3 s; logging offline" in out
    assert "; wandb offline (upload later: wandb sync " in out and "wandb online" not in out  # the run folder line
    assert (tmp_path / "gspo-s0" / "summary.json").is_file()
    assert time.time() - start < 60


# ---------------------------------------------------------------------------------------------------------------
# Run folders: a finished run is never replaced; every failure's advice gets out of it
# ---------------------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def finished(tmp_path_factory, tiny_policy_dir):
    """One finished 2-step run with its checkpoints, shared by the refusals below (a refusal leaves it as it was,
    which each of them asserts)."""
    out = tmp_path_factory.mktemp("finished")
    argv = ["--model", str(tiny_policy_dir), "--output-dir", str(out), "--total-steps", "2", "--save-every", "1"] + SMALL
    train.main(argv)
    return argv, out / "gspo-s0"


@pytest.fixture
def own_finished(finished, tmp_path):
    """A private copy of the finished run, for a test that changes it (its argv points at the copy)."""
    argv, shared = finished
    shutil.copytree(shared, tmp_path / shared.name)
    return [str(tmp_path) if a == str(shared.parent) else a for a in argv], tmp_path / shared.name


@pytest.mark.parametrize("extra", [[], ["--resume", "auto"], ["--resume", "auto", "--total-steps", "5"],
                                   ["--resume", "RUN"], ["--resume", "CKPT"], ["--eval-every", "1"]],
                         ids=["rerun", "resume-auto", "resume-auto-more-steps", "resume-run-folder",
                              "resume-its-checkpoint", "rerun-other-harmless-flag"])
def test_a_finished_run_is_never_replaced(finished, capsys, extra):
    argv, run = finished
    extra = [str(run) if e == "RUN" else str(checkpoint.all_checkpoints(run / "checkpoints")[-1]) if e == "CKPT"
             else e for e in extra]
    line = refused(argv + extra, capsys, run.parent, "is a finished run (2 steps, held-out accuracy")
    last = checkpoint.all_checkpoints(run / "checkpoints")[-1]
    assert "its results are kept. --run-name NEW_NAME starts a fresh run beside it" in line
    assert f"--resume {last} --run-name NEW_NAME --total-steps N continues it exactly" in line
    assert f"--model {run / 'final'} --run-name NEW_NAME" in line and "--overwrite replaces it" in line


def test_a_finished_evaluation_is_named_as_one(tiny_policy_dir, tmp_path, capsys):
    """--total-steps 0 again into the folder of an earlier evaluation: refused as a finished run, named as the
    evaluation it was (its one accuracy), not as '0 steps, held-out accuracy A -> A'."""
    argv = ["--model", str(tiny_policy_dir), "--output-dir", str(tmp_path), "--total-steps", "0"] + SMALL
    train.main(argv)
    capsys.readouterr()
    line = refused(argv + ["--log-completions-every", "1"], capsys, tmp_path, "is a finished run (an evaluation alone, "
                   "held-out accuracy ")
    assert "->" not in line and "0 steps" not in line and "--run-name NEW_NAME starts a fresh run" in line


@pytest.mark.parametrize("flag", ["--eval-dataset", "--dataset"])
def test_a_missing_data_file_is_named_before_the_finished_run(finished, capsys, flag):
    """Issue 50.3: the real cause first. The file does not change the run's name, so the run folder is the finished
    one; the missing file is what the error names."""
    argv, run = finished
    line = refused(argv + [flag, str(run.parent / "no-such.jsonl")], capsys, run.parent,
                   f"{flag} {run.parent / 'no-such.jsonl'}: the file does not exist")
    assert "finished run" not in line


def test_overwrite_replaces_a_finished_run(own_finished):
    """The refusal's third way out, asked for explicitly: --overwrite starts the run again in its folder."""
    argv, run = own_finished
    (run / "note.txt").write_text("from the old run")
    train.main(argv + ["--overwrite"])
    assert not (run / "note.txt").exists() and (run / "summary.json").is_file()


@pytest.mark.slow
def test_both_ways_out_of_a_finished_run_work_and_keep_it(own_finished):
    """The refusal's two advices, taken: a fresh run from its final model, and its last checkpoint continued."""
    argv, run = own_finished
    last = checkpoint.all_checkpoints(run / "checkpoints")[-1]
    kept = snapshot(run)
    train.main(argv[:1] + [str(run / "final")] + argv[2:] + ["--run-name", "further", "--total-steps", "1"])
    train.main(argv + ["--resume", str(last), "--run-name", "longer", "--total-steps", "3"])
    assert (run.parent / "further" / "summary.json").is_file()
    assert json.loads((run.parent / "longer" / "summary.json").read_text())["steps"] == 3
    assert snapshot(run) == kept


@pytest.mark.slow
def test_a_checkpoint_past_total_steps_is_refused_and_one_at_it_finishes_with_its_own_accuracy(own_finished,
                                                                                              capsys, monkeypatch):
    """A resume whose --total-steps is below the checkpoint's step trained nothing and wrote a summary with the
    accuracy before training as the accuracy after: refused. At the checkpoint's step (a run stopped by a signal
    during its last step, resumed with the same flags) it trains nothing and finishes with the trained policy's
    accuracy: the finished run's own, which evaluated that policy greedily at the same step."""
    argv, run = own_finished
    last = checkpoint.all_checkpoints(run / "checkpoints")[-1]  # step 2 of 2
    refused(argv + ["--resume", str(last), "--run-name", "shorter", "--total-steps", "1"], capsys, run.parent,
            f"--total-steps 1: the checkpoint {last} is at step 2, past it; give --total-steps 2 to finish that run")
    evaluated, real = [], train.evaluate

    def recording(*a, **kw):
        out = real(*a, **kw)
        evaluated.append((a[4], out[0]))  # (step, metrics)
        return out

    monkeypatch.setattr(train, "evaluate", recording)
    train.main(argv + ["--resume", str(last), "--run-name", "at-its-end"])  # --total-steps 2, as it was
    done, own = (json.loads((folder / "summary.json").read_text()) for folder in (run.parent / "at-its-end", run))
    assert [step for step, _ in evaluated] == [2]  # the trained policy, once (before training: from the checkpoint)
    assert done["accuracy_after"] == evaluated[0][1]["eval/accuracy"] == own["accuracy_after"]
    assert done["accuracy_before"] == own["accuracy_before"]
    assert done["steps"] == 2 and (run.parent / "at-its-end" / "final" / "config.json").is_file()


@pytest.mark.slow
def test_a_run_without_checkpoint_is_refused_with_advice_that_works(tmp_path, capsys, tiny_policy_dir, monkeypatch):
    argv = ["--model", str(tiny_policy_dir), "--output-dir", str(tmp_path), "--total-steps", "3"] + SMALL
    real = train.rl_step
    calls = []

    def crashes_in_step_2(*a, **kw):
        calls.append(1)
        if len(calls) == 2:
            raise ValueError("a bug in the second step")
        return real(*a, **kw)

    monkeypatch.setattr(train, "rl_step", crashes_in_step_2)
    with pytest.raises(ValueError):
        train.main(argv)
    monkeypatch.setattr(train, "rl_step", real)
    run = tmp_path / "gspo-s0"
    assert (run / "metrics.jsonl").is_file() and not (run / "checkpoints").exists()
    for extra in ([], ["--resume", "auto"]):
        line = refused(argv + extra, capsys, tmp_path, "holds an unfinished run with no checkpoint")
        assert "--overwrite starts it again" in line and "--resume auto" not in line
    train.main(argv + ["--overwrite"])  # the advice works
    assert (run / "summary.json").is_file()


def test_an_unfinished_run_with_checkpoints_points_to_resume(tmp_path, capsys, tiny_policy_dir):
    argv = ["--model", str(tiny_policy_dir), "--output-dir", str(tmp_path), "--save-every", "1"] + SMALL
    train.main(argv + ["--total-steps", "1", "--run-name", "r"])
    (tmp_path / "r" / "summary.json").unlink()  # as if killed after its checkpoint
    refused(argv + ["--total-steps", "2", "--run-name", "r"], capsys, tmp_path, "--resume auto continues it")
    train.main(argv + ["--total-steps", "2", "--run-name", "r", "--resume", "auto"])
    assert json.loads((tmp_path / "r" / "summary.json").read_text())["steps"] == 2


@pytest.mark.slow
def test_non_finite_stop_before_a_checkpoint_advises_overwrite(tmp_path, capsys, tiny_policy_dir, monkeypatch):
    import losses

    real = losses.policy_loss
    monkeypatch.setattr(losses, "policy_loss", lambda *a, **kw: real(*a, **kw) * float("nan"))
    argv = ["--model", str(tiny_policy_dir), "--output-dir", str(tmp_path), "--total-steps", "4",
            "--max-nonfinite-steps", "2"] + SMALL
    with pytest.raises(SystemExit) as exc:
        train.main(argv)
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "2 steps in a row" in err and err.count("\n") == 1
    assert "--overwrite" in err and "resume" not in err.split(";")[-1].replace("a resume would", "")
    monkeypatch.setattr(losses, "policy_loss", real)
    train.main(argv + ["--overwrite"])  # the advice works
    assert (tmp_path / "gspo-s0" / "summary.json").is_file()


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
@pytest.mark.parametrize("where", ["loading", "first-evaluation"])
def test_interrupt_during_start_up_leaves_nothing(tmp_path, capsys, tiny_policy_dir, monkeypatch, signum, where):
    target = train.models if where == "loading" else train
    name = "load_model" if where == "loading" else "evaluate"
    real = getattr(target, name)

    def interrupted(*a, **kw):
        os.kill(os.getpid(), signum)
        time.sleep(1)  # the handler runs as soon as the signal arrives
        return real(*a, **kw)

    monkeypatch.setattr(target, name, interrupted)
    out = tmp_path / "out"
    argv = ["--model", str(tiny_policy_dir), "--output-dir", str(out)] + SMALL
    refused(argv, capsys, out, f"interrupted by {signal.Signals(signum).name} during start-up")
    assert not out.exists()
    monkeypatch.setattr(target, name, real)
    train.main(argv + ["--total-steps", "1"])  # the advice (run the same command again) works
    assert (out / "gspo-s0" / "summary.json").is_file()


# ---------------------------------------------------------------------------------------------------------------
# Checkpoints: messages that point at what is really wrong
# ---------------------------------------------------------------------------------------------------------------

def test_resume_given_a_file_inside_a_checkpoint(own_finished, capsys):
    argv, run = own_finished
    ckpt = checkpoint.all_checkpoints(run / "checkpoints")[-1]
    (run / "summary.json").unlink()
    refused(argv + ["--resume", str(ckpt / "state.pt")], capsys, run.parent, f"pass the checkpoint folder {ckpt}")


def test_truncated_model_in_a_checkpoint_names_the_earlier_one(own_finished, capsys):
    argv, run = own_finished
    (run / "summary.json").unlink()
    first, last = checkpoint.all_checkpoints(run / "checkpoints")
    weights = last / "model" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    line = refused(argv + ["--resume", "auto"], capsys, run.parent, f"{last / 'model'} cannot be loaded")
    assert f"--resume {first}" in line


def test_resume_of_a_missing_checkpoint(tmp_path, capsys, tiny_policy_dir):
    refused(["--model", str(tiny_policy_dir), "--output-dir", str(tmp_path), "--resume", str(tmp_path / "nope")]
            + SMALL, capsys, tmp_path, "no such checkpoint")


# ---------------------------------------------------------------------------------------------------------------
# --help and the totals after a resume
# ---------------------------------------------------------------------------------------------------------------

def test_help_documents_every_flag(capsys):
    with pytest.raises(SystemExit):
        train.main(["--help"])
    text = capsys.readouterr().out
    for flag in ("--weight-decay", "--wandb-project", "--wandb-tags"):
        entry = text[text.index(flag):text.index(flag) + 300]
        assert "(default:" in entry and len(entry.split("(default:")[0].split()) > 4, entry
    flat = " ".join(text.split())
    # a field whose default comes from --algo or --dataset shows the real default, not "(default: None)"
    assert "(default from --algo: grpo 0.2, dr_grpo 0.2, dapo 0.2, gspo 0.0003, cispo 1.0, sapo 0.2, gmpo 0.4, luspo 0.0003, vespo 0.2)" in flat
    assert "(default: 64; 360 for --dataset embedded-long(-instruct); 256 for a file or hub dataset with a pretrained --model)" in flat
    assert "(default: None)" not in flat
    assert max(len(line) for line in text.split("╭")[0].splitlines()) <= 100


def test_enable_thinking_on_the_embedded_model_is_refused_before_its_warm_start(tmp_path, capsys):
    out = tmp_path / "out"
    refused(["--enable-thinking", "--output-dir", str(out), "--dataset", "embedded-long"] + SMALL, capsys, out,
            "the embedded model has no chat template", seconds=10)


def test_an_on_off_flag_also_takes_true_or_false():
    """--x / --no-x (a bool with a default), also as --x True|False and --x=false (a W&B sweep's --x_y=True): the
    same value either way; a flag whose default is None takes its value as before."""
    from plumbing import flags

    cli = flags.docstrings_as_help(train.Args)
    parsed = lambda argv: flags.parse(cli, "", argv)  # noqa: E731
    for argv, expected in ((["--mask-truncated"], True), (["--mask-truncated", "True"], True),
                           (["--mask_truncated=true"], True), (["--mask-truncated", "False"], False),
                           (["--no-mask-truncated", "false"], True), (["--no-mask-truncated"], False), ([], False)):
        assert parsed(argv).mask_truncated is expected, argv
    # a value after --x=v is not read as the switch's value too (the stray word is left for tyro to refuse)
    assert flags.switch_values(cli, ["--mask-truncated=true", "false"]) == ["--mask-truncated", "false"]
    args = parsed(["--save-model=False", "--fsdp", "TRUE", "--dynamic-sampling", "False", "--lr", "1e-5"])
    assert (args.save_model, args.fsdp, args.dynamic_sampling, args.lr) == (False, True, False, 1e-5)


def test_other_trainers_names_point_to_ours():
    """Every name in flags.OTHER_NAMES marked TRL is a field of TRL's GRPOConfig, ScriptArguments or ModelConfig (the
    installed TRL's), and every flag it points to is one of train.py's."""
    import dataclasses

    from trl import GRPOConfig, ModelConfig, ScriptArguments

    from plumbing import flags

    trl_fields = {f.name for cls in (GRPOConfig, ScriptArguments, ModelConfig) for f in dataclasses.fields(cls)}
    ours = {f.name for f in dataclasses.fields(train.Args)}
    for name, (trainer, text) in flags.OTHER_NAMES.items():
        assert trainer in ("TRL", "verl") and name not in ours, name
        assert trainer != "TRL" or name in trl_fields, name
        named = [f[2:].replace("-", "_") for f in re.findall(r"--[\w-]+", text)]
        assert named and all(n in ours for n in named), (name, text)


def test_minutes_after_a_resume_count_the_whole_run(tmp_path, tiny_policy_dir):
    argv = ["--model", str(tiny_policy_dir), "--output-dir", str(tmp_path), "--save-every", "1"] + SMALL
    train.main(argv + ["--total-steps", "2"])
    first = json.loads((tmp_path / "gspo-s0" / "summary.json").read_text())["rl_minutes"]
    (tmp_path / "gspo-s0" / "summary.json").unlink()
    state = checkpoint.load_state(checkpoint.all_checkpoints(tmp_path / "gspo-s0" / "checkpoints")[-1])
    assert 0 < state["minutes"] <= first
    train.main(argv + ["--total-steps", "3", "--resume", "auto"])
    total = json.loads((tmp_path / "gspo-s0" / "summary.json").read_text())["rl_minutes"]
    assert total > state["minutes"]
    rows = [json.loads(line) for line in (tmp_path / "gspo-s0" / "metrics.jsonl").open()]
    assert rows[-1]["perf/elapsed_min"] > state["minutes"]


def test_user_errors_are_what_main_turns_into_one_line():
    from plumbing import checkpoint
    import model
    import task

    for cls in (errors.ConfigError, errors.Interrupted, errors.NonFiniteError, errors.OutOfMemory,
                errors.DynamicSamplingError, checkpoint.CheckpointError, model.ModelError, task.TaskError):
        assert issubclass(cls, errors.UserError), cls


def test_lora_without_peft_is_one_line(tmp_path, capsys, tiny_policy_dir, monkeypatch):
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "peft" else find_spec(name, *a))
    out = tmp_path / "out"
    refused(["--model", str(tiny_policy_dir), "--output-dir", str(out), "--lora-rank", "4"] + SMALL, capsys, out,
            "--lora-rank needs the peft package: pip install peft")


@pytest.mark.parametrize("name, old", [("transformers", "4.56.2"), ("torch", "2.4.1")])
def test_a_release_older_than_its_floor_is_one_line_before_anything_loads(tmp_path, capsys, monkeypatch, name, old):
    """An environment that kept an older transformers or torch (a preinstalled image, pip install --no-deps): one line
    naming the floor, from train.py and from the memory estimate's GGUF reader, not what they gave (transformers
    4.56: generate refusing token_type_ids after the warm start; torch 2.4: transformers 5.17 turns torch off)."""
    from importlib import metadata

    import model
    from tools import memory

    version = metadata.version
    monkeypatch.setattr(metadata, "version", lambda package: old if package == name else version(package))
    out = tmp_path / "out"
    message = f"{name} {old} is older than this project's floor {model.FLOORS[name]}: upgrade it (pip install -U"
    refused(["--output-dir", str(out)] + SMALL, capsys, out, message, seconds=5)
    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    with pytest.raises(SystemExit) as exc:
        memory.main(["--model", str(tmp_path / "m.gguf")])
    assert exc.value.code == 2 and capsys.readouterr().err.startswith(f"error: {message}")


def test_the_floors_are_requirements_txts_and_this_environment_meets_them():
    import model

    text = (Path(__file__).resolve().parents[2] / "requirements.txt").read_text()
    assert re.search(r"^transformers>=([\d.]+)", text, re.M).group(1) == model.FLOORS["transformers"]
    assert re.search(r"^torch==.*elsewhere torch >= ([\d.]+)", text, re.M).group(1) == model.FLOORS["torch"]
    model.require_releases()  # the installed releases
    model.require_releases({"transformers": "5.17.0", "torch": "2.6.0"})  # a floor itself passes
    for name, before in (("transformers", "5.16.0"), ("torch", "2.5.1")):  # the release before it does not
        with pytest.raises(model.ModelError, match=f"^{name} {before} is older"):
            model.require_releases({name: before})


def test_a_release_without_metadata_is_read_from_the_package_and_a_missing_one_is_one_line(monkeypatch):
    import sys
    from importlib import metadata

    import transformers

    import model

    version = metadata.version

    def without_metadata(package):
        if package == "transformers":
            raise metadata.PackageNotFoundError(package)
        return version(package)

    monkeypatch.setattr(metadata, "version", without_metadata)
    monkeypatch.setattr(transformers, "__version__", "4.56.2")
    with pytest.raises(model.ModelError, match="^transformers 4.56.2 is older than this project's floor"):
        model.require_releases()
    monkeypatch.setitem(sys.modules, "transformers", None)  # importing it fails, as where it is not installed
    with pytest.raises(model.ModelError, match="^transformers is not installed: pip install -r requirements.txt"):
        model.require_releases()


def test_train_main_in_process_leaves_the_signal_handlers_as_it_found_them(tmp_path, tiny_policy_dir, capsys):
    """Tests call train.main in-process: a run, a refused flag and a failed start-up each restore SIGINT/SIGTERM."""
    import signal

    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    train.main(["--model", str(tiny_policy_dir), "--output-dir", str(tmp_path), "--total-steps", "1"] + SMALL)
    for argv in (["--lr", "-1"], ["--model", str(tmp_path / "no-such-model"), "--output-dir", str(tmp_path / "b")]):
        with pytest.raises(SystemExit) as exc:
            train.main(SMALL + argv)  # the bad flag last: the last of a repeated flag wins
        assert exc.value.code == 2
    assert {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)} == before


# Every other entry point, walked with what a hurried user passes: a missing path, the wrong kind of path, a
# malformed file, a number out of range, an unknown flag. Each is one `error:` line and exit 2, in-process.
def entry_points(tmp_path: Path) -> list[tuple[str, list[str], str]]:
    import json as json_

    tmp_path.mkdir()
    (tmp_path / "empty").mkdir()
    (tmp_path / "not.gguf").write_text("x")
    (tmp_path / "bad_config").mkdir()
    (tmp_path / "bad_config" / "config.json").write_text("{not json")
    (tmp_path / "partial").mkdir()
    (tmp_path / "partial" / "config.json").write_text(json_.dumps({"hidden_size": 64}))
    (tmp_path / "step").mkdir()
    (tmp_path / "step" / "state.pt").write_text("not a checkpoint")
    (tmp_path / "sharded" / "shards").mkdir(parents=True)
    return [
        ("tools.memory", ["--model", str(tmp_path / "missing")], "is neither a model folder"),
        ("tools.memory", ["--model", str(tmp_path / "empty")], "has no config.json"),
        ("tools.memory", ["--model", str(tmp_path / "not.gguf")], "not a GGUF file"),
        ("tools.memory", ["--model", str(tmp_path / "bad_config")], "cannot read"),
        ("tools.memory", ["--model", str(tmp_path / "partial")], "has no num_hidden_layers"),
        ("tools.memory", ["--max-new-tokens", "-3"], "--max-new-tokens -3: must be at least 1"),
        ("tools.memory", ["--lora-rank", "8"], "pass --model too"),
        ("tools.memory", ["--num-prompts", "abc"], "--num-prompts"),
        ("tools.memory", ["--bogus"], "--bogus"),
        ("tools.bench", ["--config", "nope"], "--config 'nope' is not one of its choices"),
        ("tools.bench", ["--steps", "-1"], "--steps -1"),
        ("tools.bench", ["--repeats", "0"], "--repeats 0"),
        ("tools.sweep", ["--parallel", "0"], "--parallel 0"),
        ("tools.sweep", ["--threshold", "2"], "--threshold 2.0"),
        ("tools.sweep", ["--algos", "ppo"], "--algos 'ppo' is not an objective"),
        ("tools.sweep", ["--report-only", "--report-dir", str(tmp_path / "missing")], "no finished runs"),
        ("tools.sweep", ["--set", "lr"], "--set"),
        ("tools.study", ["--cells", "nope"], "unknown cell nope"),
        ("tools.study", ["--parallel", "0"], "--parallel 0"),
        ("tools.study", ["--seeds", "12"], "--seeds 12"),
        ("tools.study", ["--report-only", "--data-dir", str(tmp_path / "missing")], "no runs in"),
        ("tools.step_lines", ["--bogus"], "--bogus"),
        ("tools.recipes", ["--bogus"], "--bogus"),
        ("tools.compare", ["--a", str(tmp_path / "missing"), "--b", str(tmp_path / "missing")],
         "no eval_completions.jsonl there"),
        ("tools.compare", ["--show", "-1"], "--show must be >= 0"),
        ("plumbing.checkpoint", [], "usage:"),
        ("plumbing.checkpoint", ["--convert-trusted", str(tmp_path / "missing")], "has no state.pt"),
        ("plumbing.checkpoint", ["--convert-trusted", str(tmp_path / "step")], "cannot convert"),
        ("plumbing.checkpoint", ["--export", str(tmp_path / "step")], "usage:"),
        ("plumbing.checkpoint", ["--export", str(tmp_path / "step"), str(tmp_path / "out")], "has no shards/"),
        ("plumbing.checkpoint", ["--export", str(tmp_path / "sharded"), str(tmp_path / "empty")], "exists"),
        ("plumbing.checkpoint", ["--export", str(tmp_path / "sharded"), str(tmp_path / "out")],
         "not a complete checkpoint"),
    ]


def test_every_entry_point_answers_a_bad_argument_in_one_line(tmp_path, capsys, monkeypatch):
    import importlib

    monkeypatch.chdir(tmp_path)  # whatever a tool would write lands here: nothing must
    walked = set()
    for module, argv, message in entry_points(tmp_path / "in"):
        main = importlib.import_module(module if module != "tools.study" else "tools.study.__main__").main
        before = sorted(p for p in tmp_path.rglob("*"))
        with pytest.raises(SystemExit) as exc:
            main(argv)
        err = capsys.readouterr().err
        lines = [line for line in err.splitlines() if line.strip()]
        assert exc.value.code == 2 and len(lines) == 1 and lines[0].startswith("error: "), (module, argv, err)
        assert message in lines[0], (module, argv, lines[0])
        assert sorted(p for p in tmp_path.rglob("*")) == before, (module, argv, "wrote something")
        walked.add(module)
    assert walked == {"tools.memory", "tools.bench", "tools.sweep", "tools.study", "tools.step_lines",
                      "tools.recipes", "tools.compare", "plumbing.checkpoint"}


def test_checkpoint_tool_help_is_its_usage_not_an_error(capsys):
    from plumbing import checkpoint as checkpoints

    for flag in ("-h", "--help"):
        checkpoints.main([flag])  # returns: exit 0
        out, err = capsys.readouterr()
        assert out.startswith("usage: python -m plumbing.checkpoint --convert-trusted") and not err


def test_fsdp_on_a_torch_without_fsdp2_is_one_line(tmp_path, capsys, tiny_policy_dir, monkeypatch):
    """--fsdp under torchrun on a torch without FSDP2's fully_shard (a build without torch.distributed; a release
    before 2.6 is refused earlier, by model.require_releases): refused before anything loads."""
    import torch.distributed.fsdp

    monkeypatch.setenv("WORLD_SIZE", "2")  # as torchrun sets it (no process group is joined before the checks)
    monkeypatch.delattr(torch.distributed.fsdp, "fully_shard")
    out = tmp_path / "out"
    refused(["--model", str(tiny_policy_dir), "--output-dir", str(out), "--fsdp"] + SMALL, capsys, out,
            "--fsdp needs FSDP2 (torch.distributed.fsdp.fully_shard), which this torch")
    assert not out.exists()


def test_fsdp_on_the_cpu_with_a_torch_before_2_11_is_one_line(tmp_path, capsys, tiny_policy_dir, monkeypatch):
    """torch 2.6's FSDP2 has fully_shard but fails on the CPU at its first gather (a CPU stream has no record_event;
    docs/reliability.md): refused before anything loads. On a GPU it is not refused."""
    import torch

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr(torch, "__version__", "2.6.0+cu124")
    out = tmp_path / "out"
    refused(["--model", str(tiny_policy_dir), "--output-dir", str(out), "--fsdp", "--device", "cpu"] + SMALL, capsys,
            out, "--fsdp on the CPU needs torch 2.11 or later (torch 2.6.0+cu124's FSDP2")
    from plumbing import flags

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    flags.check_fsdp(train.Args(fsdp=True, device="cuda"))  # a GPU: FSDP2 from 2.6


def test_what_load_model_reads_as_a_path_and_what_it_refuses_there(tmp_path, tiny_policy_dir):
    """A name starting with '.', or with two or more '/', is a path (a hub id has one): missing, it is one line, not
    a hub lookup. A '.gguf' that is a folder, and a folder holding a LoRA adapter alone, are refused with the way
    out."""
    import torch

    import model as models

    cpu = torch.device("cpu")
    for name in ("./no-such-model", "runs/no-such-run/final"):
        with pytest.raises(models.ModelError, match=f"model path {re.escape(name)} does not exist"):
            models.load_model(name, cpu, torch.float32)
    (tmp_path / "m.gguf").mkdir()
    with pytest.raises(models.ModelError, match="is not a file; pass the path to a .gguf model file"):
        models.load_model(str(tmp_path / "m.gguf"), cpu, torch.float32)
    (tmp_path / "adapter").mkdir()
    (tmp_path / "adapter" / "adapter_config.json").write_text("{}")
    with pytest.raises(models.ModelError, match="holds a LoRA adapter, not a whole model; train with --merge-lora"):
        models.load_model(str(tmp_path / "adapter"), cpu, torch.float32)
    broken = tmp_path / "broken"
    shutil.copytree(tiny_policy_dir, broken)
    (broken / "config.json").write_text(json.dumps({"model_type": "no_such_architecture"}))
    with pytest.raises(models.ModelError, match="could not load model .*no_such_architecture"):  # the loader's words
        models.load_model(str(broken), cpu, torch.float32)
