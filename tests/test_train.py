"""The loop end to end on tiny models: every objective trains, metrics stay finite, runs repeat, wandb reads back."""

import glob
import json
import math
import struct
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from base import errors
from plumbing import lifecycle
from base import network
import losses
import metrics
import model as models
import rewards
import rollout
import train
from plumbing import run as runs

from conftest import SMALL_ARGS  # noqa: E402

SMALL = {**SMALL_ARGS, "total_steps": 2}


def run(tmp_path, model_dir, **kw):
    args = train.Args(**{**SMALL, "model": str(model_dir), "output_dir": str(tmp_path), **kw})
    summary = train.train(args)
    name = runs.resolve(args)[0].run_name
    metrics = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").open()]
    return summary, metrics, tmp_path / name


def listed(out: str) -> set[str]:
    """The files the start-up's `run folder: DIR (a, b, c/); wandb ...` line says the run writes."""
    line = next(ln for ln in out.splitlines() if ln.startswith("run folder: "))
    return {name.rstrip("/") for name in line.split(" (", 1)[1].split(");")[0].split(", ")}


@pytest.mark.parametrize("algo", ["grpo", "dr_grpo", pytest.param("dapo", marks=pytest.mark.slow), "gspo",
                                  "cispo", "sapo", "gmpo"])  # dapo: dynamic sampling redraws, ~1.5 s
def test_two_steps_change_parameters_and_keep_metrics_finite(tmp_path, tiny_policy_dir, algo):
    # DAPO's dynamic sampling may need a few rounds on a barely trained model
    summary, metrics, run_dir = run(tmp_path, tiny_policy_dir, algo=algo, max_sampling_rounds=30)
    before = load_file(tiny_policy_dir / "model.safetensors")
    after = load_file(run_dir / "final" / "model.safetensors")
    assert any(not torch.equal(before[k], after[k]) for k in before)
    steps = [m for m in metrics if m["step"] > 0]
    assert len(steps) == 2
    for m in steps:
        for key in ("losses/policy_loss", "losses/grad_norm", "losses/entropy", "ratio/token_var", "ratio/seq_var",
                    "ratio/seq_logsum_var", "ratio/abs_log_token", "ratio/abs_log_seq", "clip/frac", "clip/token_frac",
                    "clip/seq_frac", "charts/reward"):
            assert m[key] is not None and math.isfinite(m[key]), key
        assert all(v is None or math.isfinite(v) for k, v in m.items() if isinstance(v, float))
        assert m["losses/skipped_updates"] == 0
    assert (metrics[-1].get("losses/kl_ref") is not None) == (algo == "grpo")
    if algo == "dapo":
        assert metrics[-1]["dynamic/drawn"] >= 4
        assert all(m["dynamic/dropped"] == m["dynamic/drawn"] - 4 for m in steps)  # 4 prompts per step


def test_length_gap_compares_wrong_and_right_answers_within_each_mixed_group():
    """charts/len_incorrect_rel (--log-study-metrics): per group with both kinds, mean wrong over mean right length,
    averaged over those groups; groups all right or all wrong say nothing."""
    lengths = torch.tensor([10.0, 30.0, 20.0, 5.0, 5.0, 5.0, 8.0, 8.0, 2.0, 7.0, 9.0, 4.0])  # 4 groups of 3
    correct = torch.tensor([True, False, False, True, True, True, True, False, True, False, False, False])
    gap = metrics.length_gap(lengths, correct, 3)  # groups 1 and 3: (25 / 10 + 8 / 5) / 2
    assert gap == {"charts/len_incorrect_rel": pytest.approx((25 / 10 + 8 / 5) / 2)}
    assert metrics.length_gap(lengths[3:6], correct[3:6], 3) == {}


def test_same_seed_same_metrics(tmp_path, tiny_policy_dir):
    _, a, _ = run(tmp_path / "a", tiny_policy_dir, algo="gspo", save_model=False)
    _, b, _ = run(tmp_path / "b", tiny_policy_dir, algo="gspo", save_model=False)
    drop = lambda ms: [{k: v for k, v in m.items() if not k.startswith("perf/")} for m in ms]  # noqa: E731
    assert drop(a) == drop(b)


def test_the_schedule_spans_every_optimizer_step_of_the_run(tmp_path, tiny_policy_dir):
    """--lr-scheduler's length is total_steps x num_minibatches x num_epochs optimizer steps: a linear decay over two
    RL steps of 2 minibatches x 2 epochs is half way down after the first and at 0 after the second."""
    train.train(train.Args(**{**SMALL, "model": str(tiny_policy_dir), "output_dir": str(tmp_path), "num_epochs": 2,
                              "lr_scheduler": "linear", "save_model": False}))
    rows = [json.loads(line) for line in (tmp_path / "gspo-s0" / "metrics.jsonl").open()]
    assert [r["charts/lr"] for r in rows if "charts/lr" in r] == [pytest.approx(SMALL["lr"] / 2), 0.0]


def test_on_policy_run_skips_pi_old_and_nothing_clips(tmp_path, tiny_policy_dir, capsys):
    _, metrics, _ = run(tmp_path, tiny_policy_dir, algo="grpo", num_minibatches=1, save_model=False)
    assert "fully on-policy" in capsys.readouterr().out
    assert all(m["clip/frac"] == 0.0 and m["ratio/token_var"] == 0.0 for m in metrics if m["step"] > 0)


def test_pi_old_from_the_sampler_matches_a_recomputed_pi_old(tmp_path, tiny_policy_dir, capsys):
    _, kept, _ = run(tmp_path / "a", tiny_policy_dir, algo="gspo", old_logprobs="sampler", save_model=False)
    assert "pi_old: the sampler's own log-probs" in capsys.readouterr().out
    _, recomputed, _ = run(tmp_path / "b", tiny_policy_dir, algo="gspo", old_logprobs="recompute", save_model=False)
    assert "pi_old: recomputed" in capsys.readouterr().out
    for a, b in zip(kept, recomputed):
        assert a["step"] == b["step"] and a.get("charts/reward") == b.get("charts/reward")  # same samples
        for key in ("losses/policy_loss", "losses/entropy", "clip/seq_frac", "eval/accuracy"):
            if key in a:
                assert a[key] == pytest.approx(b[key], abs=1e-4), key


def test_out_of_memory_halves_the_micro_batch_and_redoes_the_step(tmp_path, tiny_policy_dir, monkeypatch, capsys):
    """--micro-batch-size 0 starts with a whole minibatch (8 rows here); a device that only fits 2 rows per
    forward/backward gets there by halving, without losing a step, and computes what --micro-batch-size 2 does."""
    _, fixed, _ = run(tmp_path / "fixed", tiny_policy_dir, algo="gspo", micro_batch_size=2, save_model=False)
    real = train.rollout.completion_logprobs

    def small_device(policy, input_ids, *args):
        if torch.is_grad_enabled() and len(input_ids) > 2:
            raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 9 GB")  # as on CPU
        return real(policy, input_ids, *args)

    monkeypatch.setattr(train.rollout, "completion_logprobs", small_device)
    monkeypatch.setattr(lifecycle, "AUTO_MICRO_BATCH", {})
    _, auto, _ = run(tmp_path / "auto", tiny_policy_dir, algo="gspo", save_model=False)
    out = capsys.readouterr().out
    assert "out of memory at 8 rows" in out and "out of memory at 4 rows" in out
    assert out.count("out of memory") == 2  # remembered after the first step, not searched again
    assert lifecycle.AUTO_MICRO_BATCH == {8: 2}
    for a, b in zip(auto, fixed):
        assert a.keys() == b.keys()
        for key in a:
            if not key.startswith("perf/"):
                assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-7), key


class FakePolicy:
    def __init__(self, vocab_size, dtype):
        self.config, self.dtype = type("Config", (), {"vocab_size": vocab_size}), dtype


@pytest.mark.parametrize("flags, dtype, expected", [
    ({}, torch.float32, "sampler"),
    ({}, torch.bfloat16, "recompute"),  # a cached bf16 decode rounds differently from training's pass
    ({"rollout_correction": "token_mask"}, torch.float32, "recompute"),  # w = pi_old / mu needs both
    ({"old_logprobs": "sampler"}, torch.bfloat16, "sampler"),
    ({"old_logprobs": "recompute"}, torch.float32, "recompute"),
    ({"num_minibatches": 1}, torch.float32, "on-policy"),  # pi_old is never needed
    ({"num_minibatches": 1, "num_epochs": 2}, torch.float32, "sampler"),  # the second pass sees a moved policy
])
def test_where_pi_old_comes_from(flags, dtype, expected):
    args = runs.resolve(train.Args(**flags))[0]
    assert train.pi_old_source(args.num_minibatches, args.num_epochs, args.old_logprobs, args.rollout_correction,
                               dtype) == expected


def prompts_seen(monkeypatch) -> list[str]:
    """Every prompt string that reaches generate, from here on."""
    seen, real = [], rollout.generate
    monkeypatch.setattr(rollout, "generate", lambda model, tok, prompts, *a, **kw: seen.extend(prompts) or
                        real(model, tok, prompts, *a, **kw))
    return seen


def test_real_model_path_with_chat_template_and_jsonl(tmp_path, random_chat_model_dir, jsonl_dataset, monkeypatch):
    # a randomly initialised model saved with save_pretrained, pad == eos, a chat template, a JSONL dataset
    seen = prompts_seen(monkeypatch)
    summary, metrics, run_dir = run(tmp_path, random_chat_model_dir, algo="gspo", dataset=str(jsonl_dataset),
                                    total_steps=1, max_new_tokens=8)
    problems = {json.loads(line)["prompt"] for line in jsonl_dataset.open()}
    assert seen and all(p.startswith("<|user|>") and p.split("\n")[0].removeprefix("<|user|>") in problems
                        for p in seen)  # the template reached every prompt, training's and evaluation's
    assert (run_dir / "final" / "config.json").is_file()
    import model as models
    tok = models.load_model(str(random_chat_model_dir), torch.device("cpu"), torch.float32)[1]
    assert rollout.format_prompt(tok, "2 mod 3 =").startswith("<|user|>2 mod 3 =")


def read_wandb_history(path: Path, timeout: float = 60.0) -> list[dict]:
    """History rows of an offline .wandb file (a LevelDB-style log of protobuf records).

    wandb's service process writes the file asynchronously, after `finish()` has returned: wait for the run's
    exit record."""
    deadline = time.time() + timeout
    while True:
        kinds, rows = parse_wandb_records(path)
        if "exit" in kinds or time.time() > deadline:
            return rows
        time.sleep(0.2)


def parse_wandb_records(path: Path) -> tuple[list[str], list[dict]]:
    from wandb.proto import wandb_internal_pb2 as pb

    data, block, pos, buf, records = path.read_bytes(), 32768, 7, b"", []  # 7-byte file header
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0 and length == 0:
            break
        buf, pos = buf + data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind in (1, 4):  # a full record, or the last piece of one
            records.append(buf)
            buf = b""
    kinds, rows = [], []
    for raw in records:
        rec = pb.Record()
        rec.ParseFromString(raw)
        kinds.append(rec.WhichOneof("record_type"))
        if kinds[-1] == "history":
            rows.append({i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in rec.history.item})
    return kinds, rows


@pytest.mark.slow
def test_offline_wandb_run_has_ratio_variance_and_clip_fraction(tmp_path, tiny_policy_dir, monkeypatch):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))
    monkeypatch.delenv("WANDB_MODE", raising=False)
    assert network.wandb_mode(None) == "offline"
    run(tmp_path, tiny_policy_dir, algo="gspo", wandb_mode=None, save_model=False, log_study_metrics=True)
    files = glob.glob(str(tmp_path / "gspo-s0" / "wandb" / "offline-run-*" / "run-*.wandb"))
    assert len(files) == 1
    rows = [r for r in read_wandb_history(Path(files[0])) if r.get("_step", 0) > 0]
    assert len(rows) == 2
    for key in ("ratio/token_var", "ratio/seq_var", "ratio/seq_logsum_var", "clip/frac", "clip/token_frac",
                "clip/seq_frac", "clip/shadow_grpo", "clip/shadow_gspo", "lenbucket/q1_std_logsum"):
        assert all(isinstance(r[key], (int, float)) for r in rows), key


def test_eval_samples_and_study_metrics_log_more_and_leave_training_unchanged(tmp_path, tiny_policy_dir):
    """--eval-samples (pass@k) and --log-study-metrics (shadow clip fractions, length buckets) add keys to the log and
    change nothing else."""
    _, plain, _ = run(tmp_path / "a", tiny_policy_dir, algo="gspo", save_model=False)
    _, more, _ = run(tmp_path / "b", tiny_policy_dir, algo="gspo", save_model=False, eval_samples=4,
                     log_study_metrics=True)
    evals = [m for m in more if "eval/accuracy" in m]
    assert len(evals) == 2  # before training and at the last step
    for m in evals:
        assert 0.0 <= m["eval/pass@1"] <= m["eval/pass@4"] <= 1.0
        assert "eval/pass@1" not in plain[0]
    study = ("clip/shadow_", "clip/sapo_gate_mean", "lenbucket/", "charts/len_incorrect_rel")
    assert all(any(k.startswith(study) for k in m) == (m["step"] > 0) for m in more)
    assert not any(k.startswith(study) for m in plain for k in m)
    # the samples come from their own random stream: the training run is the same run with or without them
    keep = lambda ms: [{k: v for k, v in m.items() if not k.startswith(("perf/", "eval/pass", *study))}  # noqa: E731
                       for m in ms]
    assert keep(plain) == keep(more)


def test_log_completions_writes_a_steps_rollout_with_the_advantages_the_update_used(tmp_path, tiny_policy_dir,
                                                                                     capsys):
    """--log-completions-every 2: completions.jsonl holds step 2's whole rollout, each completion with its reward
    terms and the advantage GRPO gave it (recomputed here from the rows' rewards), eval_completions.jsonl each
    evaluation's greedy answers, and the run is the same run."""
    _, plain, plain_dir = run(tmp_path / "a", tiny_policy_dir, algo="grpo", save_model=False)
    capsys.readouterr()
    _, logged, folder = run(tmp_path / "b", tiny_policy_dir, algo="grpo", save_model=False, log_completions_every=2)
    written = {"config.json", "metrics.jsonl", "completions.jsonl", "eval_completions.jsonl"}  # (and summary.json)
    assert listed(capsys.readouterr().out) == written == {f.name for f in folder.iterdir()} - {"summary.json"}
    keep = lambda ms: [{k: v for k, v in m.items() if not k.startswith("perf/")} for m in ms]  # noqa: E731
    assert keep(plain) == keep(logged)
    assert not (plain_dir / "completions.jsonl").exists()
    rows = [json.loads(line) for line in (folder / "completions.jsonl").open()]
    p, g = SMALL["num_prompts"], SMALL["num_generations"]
    assert len(rows) == p * g and {r["step"] for r in rows} == {2}
    step = next(m for m in logged if m["step"] == 2)
    assert sum(r["reward"] for r in rows) / len(rows) == pytest.approx(step["charts/reward"], abs=1e-6)
    assert sum(r["length"] for r in rows) / len(rows) == pytest.approx(step["charts/completion_len"], abs=1e-6)
    for r in rows:  # the verifier's reading of the completion as written, and the reward as its terms' sum
        assert rewards.is_correct(r["completion"], r["reference"]) == bool(r["correct"])
        assert r["reward"] == pytest.approx(r["correct"] + 0.1 * r["format"] + 0.0 * r["overlong"])
    for group in range(p):
        rs = [r for r in rows if r["group"] == group]
        assert len(rs) == g and len({r["prompt"] for r in rs}) == 1
        reward = torch.tensor([r["reward"] for r in rs])
        expected = (reward - reward.mean()) / (reward.std() + 1e-4)  # GRPO's A_i, the group's std
        assert torch.allclose(torch.tensor([r["advantage"] for r in rs]), expected, atol=1e-5)
    assert any(r["advantage"] != 0 for r in rows)  # (a rollout of uniform groups would check nothing)
    # every evaluation's greedy answers, one per held-out problem: what its accuracy counted
    answers = [json.loads(line) for line in (folder / "eval_completions.jsonl").open()]
    for m in (m for m in logged if "eval/accuracy" in m):
        mine = [a for a in answers if a["step"] == m["step"]]
        assert [a["problem"] for a in mine] == list(range(SMALL["eval_size"]))
        assert sum(a["correct"] for a in mine) / len(mine) == pytest.approx(m["eval/accuracy"])
        assert all(rewards.is_correct(a["completion"], a["reference"]) == bool(a["correct"]) for a in mine)
    assert {a["step"] for a in answers} == {0, 2}


def test_total_steps_0_logs_what_a_run_logs_before_step_1_and_trains_nothing(tmp_path, tiny_policy_dir, monkeypatch,
                                                                             capsys):
    """--total-steps 0: the held-out metrics (pass@k too) that a training run logs before its step 1, in a folder of
    its own, with no reference model loaded (GRPO's beta > 0) and no copy of the model saved; a trained run's final/
    scores as that run's last evaluation did."""
    _, trained, trained_dir = run(tmp_path, tiny_policy_dir, algo="grpo", eval_samples=4)
    monkeypatch.setattr(models, "frozen_reference", lambda *a: pytest.fail("an evaluation alone loaded a reference"))
    steps, evaluate = [], train.evaluate
    monkeypatch.setattr(train, "evaluate", lambda policy, tok, ex, args, step, *a, **kw: steps.append(step) or
                        evaluate(policy, tok, ex, args, step, *a, **kw))
    capsys.readouterr()
    summary, only, folder = run(tmp_path, tiny_policy_dir, algo="grpo", eval_samples=4, total_steps=0,
                                log_completions_every=1)
    out = capsys.readouterr().out
    written = {"config.json", "metrics.jsonl", "eval_completions.jsonl"}  # no rollout, no final/ (and summary.json)
    assert listed(out) == written == {f.name for f in folder.iterdir()} - {"summary.json"}
    assert "held-out accuracy of --model: " in out and "accuracy before" not in out  # nothing comes after it
    assert steps == [0]  # one evaluation, of the model as given
    monkeypatch.setattr(train, "evaluate", evaluate)
    assert folder.name == "eval-s0" and only == [trained[0]] and "eval/pass@4" in only[0]
    assert summary["steps"] == 0 and summary["accuracy_before"] == summary["accuracy_after"] == only[0]["eval/accuracy"]
    assert not (folder / "final").exists()
    # the trained run's final/ scores greedily as the run's last evaluation did
    _, final, _ = run(tmp_path, trained_dir / "final", algo="grpo", total_steps=0)
    assert {k: final[0][k] for k in ("eval/accuracy", "eval/reward")} == \
        {k: trained[-1][k] for k in ("eval/accuracy", "eval/reward")}


@pytest.mark.slow
def test_an_evaluation_alone_in_bf16_stores_its_linear_layers_in_bf16_and_scores_as_a_training_run(
        tmp_path, tiny_policy_dir, monkeypatch):
    """--total-steps 0 updates nothing: no DDP wrapper (its gradient buckets), and under bf16 autocast the linear
    layers held in bf16 (no fp32 master copy), which scores bit for bit as a training run's fp32 weights under the
    same autocast: its row equals that run's step 0 (pass@k's sampling included)."""
    kw = dict(algo="gspo", dtype="bfloat16", eval_samples=4, eval_size=8)
    _, trained, _ = run(tmp_path, tiny_policy_dir, total_steps=1, **kw)
    dtypes, evaluate = [], train.evaluate

    def spy(policy, *a, **k):  # the dtype of each linear layer's weight, the head (tied to the embeddings) aside
        tied = policy.get_input_embeddings().weight
        dtypes.append({m.weight.dtype for m in policy.modules() if isinstance(m, torch.nn.Linear) and m.weight is not tied})
        return evaluate(policy, *a, **k)
    monkeypatch.setattr(train, "evaluate", spy)
    monkeypatch.setattr(runs.World, "wrap", lambda *a: pytest.fail("an evaluation alone wrapped the policy"))
    _, only, _ = run(tmp_path, tiny_policy_dir, total_steps=0, **kw)
    assert only == [trained[0]] and "eval/pass@4" in only[0]
    assert dtypes == [{torch.bfloat16}]


def test_a_folder_saved_from_a_gguf_model_trains_checkpoints_and_saves(tmp_path, tiny_policy_dir, capsys):
    """transformers loads a .gguf file dequantised but flagged as quantised and writes the flag (a gguf
    quantization_config) into every folder saved from it; such a folder then loaded flagged, and its first checkpoint
    or final/ raised save_pretrained's "quantized with gguf and is not serializable" after the steps had run. Now the
    flag is dropped on load: a flagged folder (planted here) trains, checkpoints and saves, and nothing it writes
    carries the flag on."""
    import shutil

    folder = tmp_path / "from-gguf"
    shutil.copytree(tiny_policy_dir, folder)
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "gguf", "gguf_file": "model.gguf", "dequantize": False}
    (folder / "config.json").write_text(json.dumps(config))
    policy, _ = models.load_model(str(folder), torch.device("cpu"), torch.float32)
    assert not policy.is_quantized and policy.hf_quantizer is None
    capsys.readouterr()
    _, _, run_dir = run(tmp_path, folder, total_steps=1, save_every=1)
    written = {"config.json", "metrics.jsonl", "checkpoints", "final"}  # as the start-up said (and summary.json)
    assert listed(capsys.readouterr().out) == written == {f.name for f in run_dir.iterdir()} - {"summary.json"}
    for saved in (run_dir / "final", run_dir / "checkpoints" / "step-000001" / "model"):
        assert "quantization_config" not in json.loads((saved / "config.json").read_text()), saved
    # a checkpoint's model/ starts a new run with other settings (what a refused resume advises)
    summary, _, again = run(tmp_path, run_dir / "checkpoints" / "step-000001" / "model", total_steps=1, lr=1e-4)
    assert summary["steps"] == 1 and again.name == "gspo-step-000001-model-s0"


def test_answer_format_sets_the_chat_instruction_and_the_verifier(tmp_path, random_chat_model_dir, jsonl_dataset,
                                                                   monkeypatch):
    import model as models
    tok = models.load_model(str(random_chat_model_dir), torch.device("cpu"), torch.float32)[1]
    assert r"\boxed{}" in rollout.format_prompt(tok, "1+1?", "boxed")
    assert "<answer>" not in rollout.format_prompt(tok, "1+1?", "last-number")
    seen = prompts_seen(monkeypatch)
    summary, metrics, _ = run(tmp_path, random_chat_model_dir, algo="gspo", dataset=str(jsonl_dataset),
                              total_steps=1, max_new_tokens=8, answer_format="last-number")
    assert seen and all(rewards.INSTRUCTIONS["last-number"] in p for p in seen) and "rewards/format" in metrics[-1]


def test_boxed_without_math_verify_is_one_line_error(tmp_path, monkeypatch):
    import importlib.util
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "math_verify" else real(name, *a))
    with pytest.raises(errors.ConfigError, match="pip install math-verify"):
        train.train(train.Args(**{**SMALL, "answer_format": "boxed", "output_dir": str(tmp_path)}))
    assert not any(tmp_path.iterdir())  # refused before any folder was made


def test_gradient_checkpointing_leaves_loss_and_gradient_unchanged(tiny_policy_dir):
    """float64, the update's own forward (train mode, left padding, logits_to_keep): the same log-probs and the same
    gradient with activations recomputed in the backward pass."""
    import model as models
    import rollout

    torch.manual_seed(0)
    grads, values = [], []
    for checkpointing in (False, True):
        policy, _ = models.load_model(str(tiny_policy_dir), torch.device("cpu"), torch.float64)
        if checkpointing:
            models.enable_checkpointing(policy)
        policy.train()
        calls = []
        for layer in policy.model.layers if checkpointing else []:  # count the layers that go through checkpoint()
            inner = layer._gradient_checkpointing_func
            layer._gradient_checkpointing_func = lambda *a, inner=inner, **kw: calls.append(1) or inner(*a, **kw)
        gen = torch.Generator().manual_seed(1)
        ids = torch.randint(3, policy.config.vocab_size, (6, 20), generator=gen)
        mask = torch.ones_like(ids)
        mask[:3, :4] = 0  # left padding on half the rows
        weights = torch.randn(6, 12, generator=gen, dtype=torch.float64)
        logp = rollout.completion_logprobs(policy, ids, mask, 12)
        loss = (logp * weights).sum()
        loss.backward()
        values.append(loss.item())
        grads.append(torch.cat([p.grad.flatten() for p in policy.parameters() if p.grad is not None]))
        assert models.is_checkpointing(policy) == checkpointing
        assert len(calls) == (len(policy.model.layers) if checkpointing else 0)  # every layer checkpointed
    assert values[0] == pytest.approx(values[1], rel=1e-12)
    assert torch.allclose(grads[0], grads[1], rtol=1e-10, atol=1e-12)


def test_gradient_checkpointing_run_has_the_same_metrics(tmp_path, tiny_policy_dir):
    _, plain, _ = run(tmp_path / "a", tiny_policy_dir, algo="grpo", save_model=False)
    _, ckpt, _ = run(tmp_path / "b", tiny_policy_dir, algo="grpo", save_model=False, gradient_checkpointing=True)
    drop = lambda rows: [{k: v for k, v in r.items() if not k.startswith("perf/")} for r in rows]  # noqa: E731
    a, b = drop(plain), drop(ckpt)
    assert [r["step"] for r in a] == [r["step"] for r in b]
    for ra, rb in zip(a, b):  # fp32: recomputation may round differently in the last bits
        for k, v in ra.items():
            if isinstance(v, float):
                assert rb[k] == pytest.approx(v, rel=1e-4, abs=1e-6), k


@pytest.mark.parametrize("dataset", ["embedded", "embedded-long"])
def test_the_default_warm_starts_ship_with_the_code(tmp_path, monkeypatch, dataset):
    """Seed 0 of each embedded recipe (the default task's and the long task's) is committed in weights/: found
    without building (seconds, not minutes) and without the cache, and it is a loadable model of the recipe's shape."""
    import model as models

    settings = models.warm_start_settings(dataset)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "empty-cache"))
    start = time.time()
    path = models.warm_start(seed=0, settings=settings)
    assert path.parent == models.SHIPPED and time.time() - start < 5
    policy, _ = models.load_model(str(path), torch.device("cpu"), torch.float32)
    assert policy.config.hidden_size == settings["hidden"]
    assert policy.config.max_position_embeddings == settings.get("max_positions", 128)
    assert not (tmp_path / "empty-cache").exists()
    assert models.warm_start_path(1, settings).parent != models.SHIPPED  # other seeds are built


@pytest.mark.parametrize("mode", ["token_mask", "sequence_truncate"])
def test_bf16_run_with_rollout_correction_logs_the_mismatch_and_what_it_corrected(tmp_path, tiny_policy_dir, mode):
    """bf16 autocast recomputes pi_old (auto), so the sampler's mu and pi_old both exist: every step logs their
    mismatch, and the correction's mean weight and changed fraction; the run trains (weights move, all finite)."""
    summary, metrics, run_dir = run(tmp_path, tiny_policy_dir, algo="gspo", dtype="bfloat16", rollout_correction=mode,
                                    rollout_correction_min=0.5)
    steps = [m for m in metrics if m["step"] > 0]
    for m in steps:
        for key in ("mismatch/abs_mean", "mismatch/abs_max", "mismatch/kl_k3", "mismatch/seq_std",
                    "mismatch/token_frac", "mismatch/seq_frac", "correction/weight_mean", "correction/changed_frac"):
            assert m[key] is not None and math.isfinite(m[key]), key
        assert m["mismatch/abs_max"] > 0  # bf16: a cached decode and a full forward round differently
        assert 0 <= m["correction/changed_frac"] <= 1 and m["losses/skipped_updates"] == 0
    before = load_file(tiny_policy_dir / "model.safetensors")
    after = load_file(run_dir / "final" / "model.safetensors")
    assert any(not torch.equal(before[k], after[k]) for k in before)


def test_fp32_run_takes_pi_old_from_the_sampler_and_logs_no_mismatch(tmp_path, tiny_policy_dir):
    _, metrics, _ = run(tmp_path, tiny_policy_dir, algo="gspo", save_model=False)
    assert not any(k.startswith(("mismatch/", "correction/")) for m in metrics for k in m)


def test_eval_size_takes_a_subset_spread_over_the_held_out_set():
    """--eval-size N: every len/N-th problem, the same in every run; the embedded held-out set is sorted by divisor,
    so a spread subset covers every divisor its first N would miss."""
    test = runs.load_data(runs.resolve(train.Args())[0])[1]
    sub = runs.spread(test, 16)
    assert len(sub) == 16 and sub == runs.spread(test, 16) and sub[0] is test[0]
    divisor = lambda ex: ex.prompt.split(" mod ")[1]  # noqa: E731
    assert len({divisor(ex) for ex in sub}) > len({divisor(ex) for ex in test[:16]})
    assert runs.spread(test, 0) is test and runs.spread(test, 10_000) is test


def test_prefix_spread_is_logged_after_the_update_and_changes_nothing_learned(tmp_path, tiny_policy_dir, monkeypatch):
    import metrics

    monkeypatch.setattr(metrics.prefix_spread, "__defaults__", ((2, 4, 8),))  # the tiny model's answers are short
    kw = dict(algo="grpo", beta=0.0, save_model=False)
    _, plain, _ = run(tmp_path / "a", tiny_policy_dir, **kw)
    _, logged, _ = run(tmp_path / "b", tiny_policy_dir, log_prefix_spread=True, **kw)
    steps = [m for m in logged if m["step"] > 0]
    assert all(m["prefix/n_long"] >= 2 and m["prefix/std_k8"] > m["prefix/std_k2"] > 0 for m in steps)
    # the update moved the ratios, and the policy it is scored under is the updated one, not pi_old
    assert all(m["prefix/abs_log_token"] > 0 for m in steps)
    keep = lambda ms: [{k: v for k, v in m.items() if not k.startswith(("perf/", "prefix/"))} for m in ms]  # noqa
    assert keep(plain) == keep(logged)


def fake_sampler(correct_by_prompt: dict[str, list[float]]):
    """train.sample_groups without a model: G completions per prompt, of length 2 + the prompt's index, scored
    correct as `correct_by_prompt` says."""
    def sample_groups(policy, tokenizer, prompts, args):
        rows = [(ex, c) for ex in prompts for c in correct_by_prompt[ex.prompt]]
        n, width = len(rows), 6
        lengths = torch.tensor([2 + int(ex.prompt[1:]) % 4 for ex, _ in rows])
        mask = (torch.arange(width) < lengths.unsqueeze(1)).long()
        ro = rollout.Rollout(torch.ones(n, 3, dtype=torch.long), torch.ones(n, 3, dtype=torch.long),
                             torch.arange(n).unsqueeze(1).repeat(1, width), mask, torch.zeros(n, dtype=torch.bool),
                             -torch.rand(n, width), torch.rand(n, width))
        scores = {"reward": [c for _, c in rows], "correct": [c for _, c in rows]}
        return train.Batch(ro, [ex for ex, _ in rows], scores, [ex.prompt for ex, _ in rows])
    return sample_groups


def test_dynamic_sampling_keeps_the_mixed_groups_in_draw_order_and_counts_every_draw(monkeypatch):
    """DAPO's filter: groups all right or all wrong are dropped, draws go on until P mixed groups are kept, the
    batch is cut to P groups (rows stay with their prompt), and every group drawn is counted."""
    import task
    from plumbing.ddp import SINGLE

    g = 3
    table = {f"p{i}": c for i, c in enumerate([[1, 0, 0], [1, 1, 1], [0, 0, 0], [0, 1, 1], [0, 1, 0], [1, 0, 1],
                                                [0, 1, 0], [1, 1, 1]])}
    monkeypatch.setattr(train, "sample_groups", fake_sampler(table))
    examples = [task.Example(p, "1") for p in table]
    stream = runs.PromptStream(examples, seed=0)
    order = [ex.prompt for ex in runs.PromptStream(examples, seed=0).take(8)]
    args = train.Args(num_prompts=2, num_generations=g, max_sampling_rounds=4)
    tokenizer = SimpleNamespace(pad_token_id=0)
    batch, drawn_correct, drawn = train.dynamic_sampling(None, tokenizer, stream, args, SINGLE)
    mixed = [p for p in order if 0 < sum(table[p]) < g]
    rounds = next(r for r in range(1, 5) if len([p for p in order[:2 * r] if p in mixed]) >= 2)
    assert drawn == 2 * rounds and drawn_correct.tolist() == [table[p] for p in order[:drawn]]
    assert rounds == 2 and len([p for p in order[:4] if p in mixed]) == 3  # two draws joined, one group cut
    assert [ex.prompt for ex in batch.examples] == [p for p in mixed[:2] for _ in range(g)]
    assert batch.scores["correct"] == [c for p in mixed[:2] for c in table[p]]
    assert batch.ro.completion_mask.sum(-1).tolist() == [2 + int(p[1:]) % 4 for p in mixed[:2] for _ in range(g)]
    stream = runs.PromptStream([examples[1], examples[2]], seed=0)  # only uniform groups: refused after the rounds
    with pytest.raises(errors.DynamicSamplingError, match="found 0 of 2 prompt groups .* after 4 rounds"):
        train.dynamic_sampling(None, tokenizer, stream, args, SINGLE)


@pytest.mark.slow
def test_each_epoch_splits_the_rollout_into_minibatches_of_a_new_shuffle(tmp_path, tiny_policy_dir, monkeypatch):
    """PPO's inner loop: every epoch takes every row once, in minibatches of B / num_minibatches rows, in an order
    drawn anew from the run's generator (not the rows' order, not the last epoch's)."""
    seen, real = [], train.MicroBatches

    def recording(rows, *a, **kw):
        seen.append(rows.tolist())
        return real(rows, *a, **kw)

    monkeypatch.setattr(train, "MicroBatches", recording)
    run(tmp_path, tiny_policy_dir, num_epochs=2, total_steps=1, save_model=False)  # 16 rows, 2 minibatches, 2 epochs
    assert [len(rows) for rows in seen] == [8, 8, 8, 8]
    epochs = [seen[0] + seen[1], seen[2] + seen[3]]
    assert all(sorted(e) == list(range(16)) for e in epochs)
    assert epochs[0] != epochs[1] and list(range(16)) not in epochs


@pytest.mark.slow
def test_the_update_hands_each_micro_batch_its_optimizer_steps_normalisers(tmp_path, tiny_policy_dir, monkeypatch):
    """The wiring of one update: every micro-batch's loss gets the whole optimizer step's B, sum |y_i|, the budget
    --max-new-tokens (Dr.GRPO's constant, not the rollout's width) and the number of micro-batches (the entropy
    bonus averages over them); the gradient is clipped at --max-grad-norm before each optimizer step."""
    calls, clips = [], []
    real_loss, real_clip = losses.policy_loss, torch.nn.utils.clip_grad_norm_

    def recording_loss(logp, old, adv, mask, norm, *a, **kw):
        calls.append((len(mask), float(mask.sum()), norm, mask.shape[1]))
        return real_loss(logp, old, adv, mask, norm, *a, **kw)

    def recording_clip(params, max_norm, *a, **kw):
        clips.append(max_norm)
        return real_clip(params, max_norm, *a, **kw)

    monkeypatch.setattr(losses, "policy_loss", recording_loss)
    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", recording_clip)
    run(tmp_path, tiny_policy_dir, algo="dr_grpo", total_steps=1, micro_batch_size=3, max_new_tokens=90,
        max_grad_norm=0.7, entropy_coef=0.01, save_model=False)  # 16 rows: 2 minibatches of 8, as 3 + 3 + 2
    assert [rows for rows, _, _, _ in calls] == [3, 3, 2, 3, 3, 2] and clips == [0.7, 0.7]
    assert calls[0][3] < 90  # every completion ended before the budget: the width is not the budget
    for step in (calls[:3], calls[3:]):
        tokens = sum(t for _, t, _, _ in step)
        assert all(n == losses.StepNorm(8, tokens, 90, micro_batches=3) for _, _, n, _ in step)


@pytest.mark.slow
def test_kl_in_reward_lowers_each_reward_by_beta_times_its_kl_before_the_advantages(tmp_path, tiny_policy_dir,
                                                                                   monkeypatch):
    """--kl-in reward: the estimator receives r_i - beta sum_t KL_it (k3 >= 0: every reward goes down, by more where
    the policy has left the reference), with every completion's length (REINFORCE++-baseline whitens over tokens)."""
    batches, calls = [], []
    real_sample, real_adv = train.sample_groups, losses.advantages

    def recording_sample(*a, **kw):
        batches.append(real_sample(*a, **kw))
        return batches[-1]

    def recording_adv(reward, g, estimator, scale, lengths):
        calls.append((reward.clone(), lengths.clone(), estimator))
        return real_adv(reward, g, estimator, scale, lengths)

    monkeypatch.setattr(train, "sample_groups", recording_sample)
    monkeypatch.setattr(losses, "advantages", recording_adv)
    run(tmp_path, tiny_policy_dir, algo="grpo", kl_in="reward", beta=0.5,
        advantage_estimator="reinforce_plus_plus_baseline", save_model=False)
    assert len(calls) == 2 and all(e == "reinforce_plus_plus_baseline" for _, _, e in calls)
    for batch, (reward, lengths, _) in zip(batches, calls):
        raw = torch.tensor(batch.scores["reward"])
        assert torch.equal(lengths, batch.ro.lengths)
        assert (reward <= raw + 1e-6).all()
    penalty = torch.tensor(batches[1].scores["reward"]) - calls[1][0]  # after one update the policy has moved
    assert penalty.min() >= -1e-6 and penalty.max() > 1e-4


def test_warm_start_recipes_caches_and_chunks(tmp_path):
    """The long task alone has its own recipe (embedded-long; its instruct phrasing takes the default's, as every
    other embedded dataset); a cache given is where the warm start goes even when one is shipped; and the long
    recipe's length-sorted chunks weigh each by its tokens: two steps in chunks of 2 train the same weights as in one
    padded batch of 4."""
    assert models.warm_start_settings("embedded-long") is models.WARM_START_LONG
    for name in ("embedded", "embedded-instruct", "embedded-long-instruct", "embedded-add"):
        assert models.warm_start_settings(name) is models.WARM_START
    shipped = models.warm_start_path(0, models.WARM_START)
    assert shipped.parent == models.SHIPPED
    assert models.warm_start_path(0, models.WARM_START, cache=tmp_path) == tmp_path / shipped.name
    recipe = dict(version=1, task="long", steps=2, batch_size=4, lr=1e-2, slip_prob=0.6, hidden=16, layers=1,
                  max_positions=512)
    whole = models.warm_start(0, recipe, cache=tmp_path / "whole", quiet=True)
    chunked = models.warm_start(0, {**recipe, "sft_chunk": 2}, cache=tmp_path / "chunked", quiet=True)
    a, b = load_file(whole / "model.safetensors"), load_file(chunked / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.allclose(a[k], b[k], atol=1e-5) for k in a)
