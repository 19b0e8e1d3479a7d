"""Bad input fails fast with one line and exit code 2; checkpoints resume exactly; guards keep metrics finite."""

import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from plumbing import checkpoint
import metrics as diagnostics
from plumbing import lifecycle
import losses
import rewards
import rollout
import train
from losses import PRESETS, StepNorm

ROOT = Path(__file__).resolve().parents[2]
from conftest import SMALL, final_weights, metrics_without_timing  # noqa: E402  the shared small run, as flags


def cli(argv, capsys):
    """Run train.main in-process; return (exit code, stderr)."""
    with pytest.raises(SystemExit) as exc:
        train.main(argv)
    return exc.value.code, capsys.readouterr().err


# ---------------------------------------------------------------------------------------------------------------
# Bad input beyond test_bad_input.py's catalogue: models, failures during a run
# ---------------------------------------------------------------------------------------------------------------

def test_model_errors(tmp_path, capsys, tiny_policy_dir):
    import model as models

    not_a_model = tmp_path / "empty_dir"
    not_a_model.mkdir()
    garbage = tmp_path / "broken.gguf"
    garbage.write_bytes(b"not a gguf file at all")
    no_eos = tmp_path / "no_eos"
    tok = models.build_tokenizer()
    tok.eos_token = None
    models.build_tiny_model(models.build_tokenizer(), hidden=32, layers=1).save_pretrained(no_eos)
    tok.save_pretrained(no_eos)
    for path, message in [(not_a_model, "is not a model directory"), (garbage, "could not load model"),
                          (no_eos, "has no EOS token")]:
        code, err = cli(["--model", str(path), "--output-dir", str(tmp_path / "out")] + SMALL, capsys)
        assert code == 2 and message in err and err.count("\n") == 1, err


def test_dynamic_sampling_failure_names_prompts_and_saves(tmp_path, capsys, random_chat_model_dir, jsonl_dataset):
    argv = ["--algo", "dapo", "--model", str(random_chat_model_dir), "--dataset", str(jsonl_dataset),
            "--output-dir", str(tmp_path), "--max-sampling-rounds", "2", "--max-new-tokens", "8",
            "--overlong-cache", "4"] + SMALL
    code, err = cli(argv, capsys)
    assert code == 2 and err.count("\n") == 1
    assert "0 of 4 prompt groups with mixed correctness after 2 rounds" in err and "all wrong" in err
    assert "--max-sampling-rounds" in err and "--resume auto" in err
    assert "--dynamic-sampling False" in err  # the spelling the parser takes (--no-dynamic-sampling is refused)
    assert (tmp_path / f"dapo-{random_chat_model_dir.name}-task-s0" / "checkpoints" / "step-000000" / "state.pt").is_file()


def test_out_of_memory_is_recognised_on_every_device():
    assert lifecycle.is_out_of_memory(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    assert lifecycle.is_out_of_memory(RuntimeError("MPS backend out of memory (MPS allocated: 8.00 GB)"))
    assert lifecycle.is_out_of_memory(RuntimeError("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: "
                                                "can't allocate memory: you tried to allocate 80000000000000 bytes"))
    assert not lifecycle.is_out_of_memory(RuntimeError("mat1 and mat2 shapes cannot be multiplied (4x8 and 9x2)"))
    assert not lifecycle.is_out_of_memory(ValueError("out of memory"))


def test_out_of_memory_is_one_line_and_saves_the_step_it_started_from(tmp_path, capsys, tiny_policy_dir, monkeypatch):
    real, calls = train.rollout.generate, []

    def fails_on_the_third_rollout(*a, **kw):
        calls.append(1)
        if len(calls) == 3:  # 1: the eval before training, 2: step 1's rollout, 3: step 2's rollout
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB\nmore details")
        return real(*a, **kw)

    base = ["--model", str(tiny_policy_dir), "--output-dir", str(tmp_path), "--total-steps", "3"] + SMALL
    monkeypatch.setattr(train.rollout, "generate", fails_on_the_third_rollout)
    code, err = cli(base, capsys)
    assert code == 2 and err.count("\n") == 1
    assert "out of memory in step 2 (CUDA out of memory. Tried to allocate 2.00 GiB)" in err
    assert "--micro-batch-size" in err and "--resume auto" in err
    assert (tmp_path / "gspo-s0" / "checkpoints" / "step-000001" / "state.pt").is_file()
    monkeypatch.setattr(train.rollout, "generate", real)
    train.main(base + ["--resume", "auto", "--micro-batch-size", "4"])  # a smaller micro-batch may resume
    assert "resumed from" in capsys.readouterr().out
    assert json.loads((tmp_path / "gspo-s0" / "summary.json").read_text())["steps"] == 3
    logged = [json.loads(line)["step"] for line in (tmp_path / "gspo-s0" / "metrics.jsonl").open()]
    assert logged == [0, 1, 2, 3]  # the resumed run repeats step 2 and goes on; no row twice, none missing


def test_a_full_fine_tune_that_cannot_fit_is_refused_before_loading(tmp_path, capsys, tiny_policy_dir, monkeypatch):
    """Issue 45.4: weights, autocast copies, gradients and AdamW moments that are larger than the device's free
    memory failed at the first optimizer step, after a checkpoint, with advice about batch sizes. Refused now before a
    weight is read, with both numbers and what helps; the device's free memory is stated by a stand-in."""
    import model as models

    params, linear, *_ = models.parameter_counts(str(tiny_policy_dir))
    need = sum(models.resident_bytes(params, linear, compute_bytes=2, reference=True).values())
    assert need == params * 18 + (params - linear) * 4 + linear * 2
    monkeypatch.setattr(models, "free_memory", lambda device: need - 1)
    monkeypatch.setattr(models, "load_model", lambda *a, **k: pytest.fail("loaded a model that cannot fit"))
    argv = ["--model", str(tiny_policy_dir), "--output-dir", str(tmp_path / "out"), "--dtype", "bfloat16",
            "--algo", "grpo"] + SMALL
    code, err = cli(argv, capsys)
    assert code == 2 and err.count("\n") == 1 and not (tmp_path / "out").exists(), err
    assert f"keeps {need / 2**30:.1f} GiB" in err and f"has {(need - 1) / 2**30:.1f} GiB free" in err
    assert "--lora-rank" in err and "smaller model" in err
    monkeypatch.setattr(models, "free_memory", lambda device: need)  # it fits exactly: not refused by the check
    with pytest.raises(BaseException, match="loaded a model"):
        train.main(argv)


def test_under_fsdp_the_refusal_counts_one_card_s_share(monkeypatch):
    """--fsdp over N processes: the fp32 weights, gradients, AdamW moments and reference are split N ways; the root
    (embeddings, head, norms) is gathered in fp32 for the update beside autocast's bf16 copy of the head; generation
    gathers the whole model, its layers' linear weights in bf16 and the rest in fp32, beside the weights' and
    moments' shards, and the root's all-gather buffer. A Qwen2.5-7B-shaped model (bf16, β 0) over 4 cards: the larger
    of the update's 16P/4 + 2 head + 4 rest + 12 bytes a layer's weight (the layers in flight) and generation's 12P/4
    + 4 rest + 2 layer_linear + 4 rest, not one card's 18P."""
    import model as models

    counts = models.Counts(params=7.62e9, linear=7.07e9, layer_linear=6.52e9, head=0.545e9, layers=28)
    rest = counts.params - counts.layer_linear
    update = 4 * counts.params + 2 * counts.head + 4 * rest + counts.layer_linear / 28 * (4 * 2 + 4)
    generation = 3 * counts.params + 4 * rest + 2 * counts.layer_linear + 4 * rest
    assert generation > update
    monkeypatch.setattr(models, "parameter_counts", lambda name: counts)
    cuda = torch.device("cuda")
    monkeypatch.setattr(models, "free_memory", lambda device: generation)
    models.refuse_what_cannot_fit("some/7b", cuda, torch.bfloat16, False, shards=4)  # fits: not refused
    with pytest.raises(models.ModelError, match=f"keeps {18 * counts.params / 2**30:.1f} GiB on the device"):
        models.refuse_what_cannot_fit("some/7b", cuda, torch.bfloat16, False)  # one card: refused
    monkeypatch.setattr(models, "free_memory", lambda device: generation - 1)
    with pytest.raises(models.ModelError, match=f"keeps {generation / 2**30:.1f} GiB per card under --fsdp over 4 "
                                                "processes") as refused:
        models.refuse_what_cannot_fit("some/7b", cuda, torch.bfloat16, False, shards=4)
    gathered = (4 * rest + 2 * counts.layer_linear) / 2**30
    assert f"gathered for generation {gathered:.1f}" in str(refused.value) and "--fsdp" in str(refused.value)


def test_the_embedded_model_is_never_looked_up_for_the_refusal(monkeypatch):
    """"embedded" is the project's own model, not a hub id: the refusal asks no loader (or network) for its count."""
    import model as models

    monkeypatch.setattr(models, "free_memory", lambda device: 0)
    monkeypatch.setattr(models, "parameter_counts", lambda name: pytest.fail(f"looked up {name}"))
    models.refuse_what_cannot_fit("embedded", torch.device("cuda"), torch.bfloat16, True)
    with pytest.raises(BaseException, match="looked up some/model"):
        models.refuse_what_cannot_fit("some/model", torch.device("cuda"), torch.bfloat16, True)


def test_parameter_counts_are_read_from_the_config_alone(tmp_path):
    """A Qwen2-shaped model (q/k/v biases, tied embeddings) and a Llama-shaped one with its own head."""
    import model as models
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

    for config in (Qwen2Config(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True),
                   LlamaConfig(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)):
        model = AutoModelForCausalLM.from_config(config)
        folder = tmp_path / config.model_type
        config.save_pretrained(folder)  # the config alone: no weights in the folder
        linear = sum(p.numel() for m in model.modules() if isinstance(m, torch.nn.Linear) for p in m.parameters()
                     if not (config.tie_word_embeddings and m is model.lm_head))
        head = 300 * 32 * (1 if config.tie_word_embeddings else 2)  # embeddings; an untied head, a linear layer
        layer_linear = linear - (0 if config.tie_word_embeddings else 300 * 32)
        assert models.parameter_counts(str(folder)) == (sum(p.numel() for p in model.parameters()), linear,
                                                         layer_linear, 300 * 32, 2)
        assert sum(p.numel() for p in model.parameters()) - layer_linear == head + 32 * (2 * 2 + 1)  # and the norms
    assert models.parameter_counts(str(tmp_path / "nothing-here")) is None


def test_out_of_memory_in_the_optimizer_step_names_the_resident_state_and_saves_nothing(tmp_path, capsys,
                                                                                       tiny_policy_dir, monkeypatch):
    """Issue 45.4: AdamW allocates its moments at the first step; running out there was reported as a batch-size
    problem and a checkpoint of the step it started from was written, which would only fail again."""
    def no_room(self, *a, **kw):
        raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 6291456 bytes")

    monkeypatch.setattr(torch.optim.AdamW, "step", no_room)
    code, err = cli(["--model", str(tiny_policy_dir), "--output-dir", str(tmp_path), "--total-steps", "2"] + SMALL,
                    capsys)
    assert code == 2 and err.count("\n") == 1, err
    assert "out of memory in the optimizer step of step 1" in err and "AdamW's two moments" in err
    assert "--lora-rank" in err and "no checkpoint of this step was written" in err
    assert "--micro-batch-size" not in err
    assert not (tmp_path / "gspo-s0" / "checkpoints").exists()


def test_the_bf16_reference_scores_bit_for_bit_as_an_fp32_copy_at_half_the_bytes(tiny_policy_dir):
    """Issue 45.7: the reference of a full fine-tune only runs forwards under autocast, which casts its linear
    weights to bf16 at every forward; stored in bf16 they give the same bits (embeddings and norms stay fp32)."""
    import copy

    import model as models

    policy, tok = models.load_model(str(tiny_policy_dir), torch.device("cpu"), torch.float32)
    policy = models.compute_in(policy, torch.bfloat16)
    ref = models.frozen_reference(copy.deepcopy(policy))
    ids = torch.randint(5, len(tok), (4, 20))
    mask = torch.ones_like(ids)
    with torch.no_grad():
        a = rollout.completion_logprobs(policy, ids, mask, 12)
        b = rollout.completion_logprobs(ref, ids, mask, 12)
    assert torch.equal(a, b)
    size = lambda m: sum(p.numel() * p.element_size() for p in m.parameters())  # noqa: E731
    params, linear, *_ = models.parameter_counts(str(tiny_policy_dir))
    assert size(ref) == (params - linear) * 4 + linear * 2 < size(policy)
    assert not any(p.requires_grad for p in ref.parameters())
    fp32 = models.frozen_reference(models.load_model(str(tiny_policy_dir), torch.device("cpu"), torch.float32)[0])
    assert {p.dtype for p in fp32.parameters()} == {torch.float32}  # in fp32 the reference is a plain copy


# ---------------------------------------------------------------------------------------------------------------
# Checkpoints
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_resume_continues_exactly_and_refuses_a_different_run(tmp_path, capsys, tiny_policy_dir):
    base = ["--model", str(tiny_policy_dir), "--save-every", "2", "--algo", "grpo",
            "--log-completions-every", "1"] + SMALL
    train.main(base + ["--output-dir", str(tmp_path / "a"), "--total-steps", "4"])
    train.main(base + ["--output-dir", str(tmp_path / "b"), "--total-steps", "2"])
    (tmp_path / "b" / "grpo-s0" / "summary.json").unlink()  # as if killed after its step-2 checkpoint,
    for logged in ("metrics.jsonl", "completions.jsonl", "eval_completions.jsonl"):  # having logged a step 3
        with (tmp_path / "b" / "grpo-s0" / logged).open("a") as f:
            f.write(json.dumps({"step": 3, "killed": True}) + "\n")
    out = capsys.readouterr().out
    train.main(base + ["--output-dir", str(tmp_path / "b"), "--total-steps", "4", "--resume", "auto"])
    out = capsys.readouterr().out
    assert "resume: allowed change total_steps: 2 -> 4" in out and "resumed from" in out
    a, b = tmp_path / "a" / "grpo-s0", tmp_path / "b" / "grpo-s0"
    wa, wb = final_weights(a), final_weights(b)
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    assert metrics_without_timing(a) == metrics_without_timing(b)
    for logged in ("completions.jsonl", "eval_completions.jsonl"):
        assert (a / logged).read_text() == (b / logged).read_text(), logged
    assert [p.name for p in checkpoint.all_checkpoints(b / "checkpoints")] == ["step-000002", "step-000004"]

    ckpt = b / "checkpoints" / "step-000002"
    code, err = cli(base + ["--output-dir", str(tmp_path / "b"), "--resume", str(ckpt), "--algo", "gspo",
                            "--run-name", "other"], capsys)
    assert code == 2 and "cannot resume" in err and "algo: 'grpo' -> 'gspo'" in err
    code, err = cli(base + ["--output-dir", str(tmp_path / "b"), "--resume", str(ckpt), "--num-generations", "2",
                            "--num-minibatches", "2", "--run-name", "other"], capsys)
    assert code == 2 and "num_generations: 4 -> 2" in err


def test_truncated_and_corrupt_checkpoints_are_refused(tmp_path, capsys, tiny_policy_dir):
    base = ["--model", str(tiny_policy_dir), "--save-every", "1", "--keep-checkpoints", "3",
            "--output-dir", str(tmp_path)] + SMALL
    train.main(base + ["--total-steps", "2"])
    (tmp_path / "gspo-s0" / "summary.json").unlink()  # as if killed after its last checkpoint
    ckpts = checkpoint.all_checkpoints(tmp_path / "gspo-s0" / "checkpoints")
    state = ckpts[-1] / "state.pt"
    state.write_bytes(state.read_bytes()[:200])  # truncated
    code, err = cli(base + ["--resume", str(ckpts[-1]), "--total-steps", "3"], capsys)
    assert code == 2 and "truncated or corrupt" in err and "step-000001" in err and err.count("\n") == 1
    state.write_bytes(b"\x00garbage" * 50)  # corrupt
    code, err = cli(base + ["--resume", str(ckpts[-1]), "--total-steps", "3"], capsys)
    assert code == 2 and "truncated or corrupt" in err
    torch.save({"weights": torch.ones(2)}, state)  # a state.pt, but not one this trainer wrote
    code, err = cli(base + ["--resume", str(ckpts[-1]), "--total-steps", "3"], capsys)
    assert code == 2 and "is not a checkpoint of this trainer" in err and err.count("\n") == 1
    (ckpts[0] / "state.pt").unlink()  # incomplete
    code, err = cli(base + ["--resume", str(ckpts[0]), "--total-steps", "3"], capsys)
    assert code == 2 and "not a complete checkpoint" in err


def test_a_resumed_run_logs_to_the_same_wandb_run(tmp_path, tiny_policy_dir):
    """The checkpoint keeps the wandb run's id, and a resume goes on logging to that run, not to a new one."""
    base = ["--model", str(tiny_policy_dir), "--output-dir", str(tmp_path), *SMALL[:-2], "--wandb-mode", "offline",
            "--save-every", "1"]
    train.main(base + ["--total-steps", "1"])
    run_dir = tmp_path / "gspo-s0"
    (run_dir / "summary.json").unlink()  # as if killed after its step-1 checkpoint
    train.main(base + ["--total-steps", "2", "--resume", "auto"])
    saved = torch.load(run_dir / "checkpoints" / "step-000001" / "state.pt", weights_only=True)["wandb_id"]
    logged_to = {p.name.rsplit("-", 1)[1] for p in (run_dir / "wandb").glob("offline-run-*")}
    assert saved and logged_to == {saved}, (saved, logged_to)


def spawn(argv, out_dir):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    # Ctrl-C as at a terminal: a shell's background job (`pytest &` in a script) starts with SIGINT ignored, and a
    # child would inherit that and never see the tests' SIGINT
    return subprocess.Popen([sys.executable, "train.py", *argv, "--output-dir", str(out_dir)], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


def wait_until(ready, every: float = 0.05, seconds: float = 120.0) -> None:
    """Poll `ready()` until it holds or `seconds` pass (the assertions after it then say what did not happen)."""
    deadline = time.time() + seconds
    while not ready() and time.time() < deadline:
        time.sleep(every)


@pytest.mark.slow
@pytest.mark.parametrize("lora", [[], ["--lora-rank", "4"]], ids=["full", "lora"])
def test_sigkill_at_a_random_moment_then_resume_matches_uninterrupted_run(tmp_path, tiny_policy_dir, lora):
    argv = ["--model", str(tiny_policy_dir), "--total-steps", "16", "--save-every", "2", "--algo", "dapo",
            "--max-sampling-rounds", "30", "--lr-scheduler", "cosine"] + SMALL + lora  # the kill: within a second
    # of step 2's checkpoint; a schedule that moves every optimizer step, which the resumed run must pick up mid-way
    reference = spawn(argv, tmp_path / "ref")
    victim = spawn(argv, tmp_path / "kill")
    name = "dapo-lora4-s0" if lora else "dapo-s0"
    ckpts = tmp_path / "kill" / name / "checkpoints"
    wait_until(lambda: checkpoint.all_checkpoints(ckpts))
    time.sleep(random.Random(os.getpid()).uniform(0.0, 1.0))  # somewhere in the middle of a later step or save
    victim.send_signal(signal.SIGKILL)
    victim.wait()
    assert reference.wait(timeout=300) == 0, reference.stdout.read()
    assert not (tmp_path / "kill" / name / "summary.json").exists()  # it really died before finishing
    resumed = spawn(argv + ["--resume", "auto"], tmp_path / "kill")
    log = resumed.communicate(timeout=300)[0]
    assert resumed.returncode == 0 and "resumed from" in log, log
    ref_dir, kill_dir = tmp_path / "ref" / name, tmp_path / "kill" / name
    wa, wb = final_weights(ref_dir), final_weights(kill_dir)
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    assert metrics_without_timing(ref_dir) == metrics_without_timing(kill_dir)


@pytest.mark.slow
def test_sigterm_saves_and_exits_zero(tmp_path, tiny_policy_dir):
    proc = spawn(["--model", str(tiny_policy_dir), "--total-steps", "500"] + SMALL, tmp_path)
    metrics = tmp_path / "gspo-s0" / "metrics.jsonl"
    wait_until(lambda: metrics.exists() and len(metrics.read_text().splitlines()) >= 2)
    proc.send_signal(signal.SIGTERM)
    out = proc.communicate(timeout=120)[0]
    assert proc.returncode == 0, out
    assert "stopped by SIGTERM" in out and "--resume auto" in out
    assert checkpoint.all_checkpoints(tmp_path / "gspo-s0" / "checkpoints")


@pytest.mark.slow
def test_a_second_ctrl_c_aborts_at_once(tmp_path, tiny_policy_dir):
    """The first Ctrl-C asks the step to finish and save; a second aborts without waiting for either, in one line that
    names the checkpoint to resume (exit code 2, no traceback): the run stays unfinished and that checkpoint whole."""
    proc = spawn(["--model", str(tiny_policy_dir), "--total-steps", "500", "--save-every", "1"] + SMALL, tmp_path)
    ckpts = tmp_path / "gspo-s0" / "checkpoints"
    # step 2 saved (renamed into place last): step 3 has begun, its sampling seconds long
    wait_until(lambda: checkpoint.path_of(ckpts, 2) in checkpoint.all_checkpoints(ckpts), every=0.01)
    proc.send_signal(signal.SIGINT)
    shown = ""
    for line in proc.stdout:
        shown += line
        if "Ctrl-C again to abort" in line:
            break
    proc.send_signal(signal.SIGINT)
    out = shown + proc.communicate(timeout=60)[0]
    errors = [line for line in out.splitlines() if line.startswith("error:")]
    assert proc.returncode == 2 and "Traceback" not in out and len(errors) == 1, (proc.returncode, out[-2000:])
    assert errors[0].startswith("error: aborted by a second Ctrl-C: the step under way is lost; resume from the "
                                "latest checkpoint (step-"), errors
    assert "stopped by" not in out and not (tmp_path / "gspo-s0" / "summary.json").exists()
    named = errors[0].split("(")[1].split(")")[0]
    assert checkpoint.load_state(ckpts / named)["step"] >= 2  # the one named is whole and readable


def test_no_moment_between_start_up_and_the_loop_without_a_stop_handler(tmp_path, tiny_policy_dir, monkeypatch):
    """The loop's handler is in place before start-up and start-up hands it back: the moment the first evaluation
    ends (and during the final save) Ctrl-C and SIGTERM mean "finish the step and save", not a process that dies
    with a run folder behind it (SIGTERM's default) or says "nothing was written" (base.early's handler)."""
    from plumbing import run as runs
    real_start, real_finish, seen = runs.start_run, runs.finish_run, []

    def handlers():
        seen.extend(signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM))

    @contextlib.contextmanager
    def start(*a, **kw):
        with real_start(*a, **kw) as started:
            yield started  # (the first evaluation)
        handlers()  # start-up has just ended

    def finish(*a, **kw):
        handlers()  # the final save is about to begin
        return real_finish(*a, **kw)

    monkeypatch.setattr(runs, "start_run", start)
    monkeypatch.setattr(runs, "finish_run", finish)
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    train.main(["--model", str(tiny_policy_dir), "--output-dir", str(tmp_path), "--total-steps", "1"] + SMALL)
    assert (tmp_path / "gspo-s0" / "summary.json").is_file()
    assert len(seen) == 4 and all(isinstance(getattr(h, "__self__", None), lifecycle.GracefulStop) for h in seen), seen
    assert {s: signal.getsignal(s) for s in before} == before  # and after the run, what was there before


def loading_torch(pid: int) -> bool:
    """True once the process has mapped torch's library: Python is up and train.py is past its first lines, where
    base.early takes Ctrl-C over. (Without /proc, as on macOS: after a second.)"""
    maps = Path(f"/proc/{pid}/maps")
    if not Path("/proc/self/maps").exists():
        time.sleep(1.0)
        return True
    try:
        return "libtorch" in maps.read_text()
    except OSError:  # it has ended
        return True


@pytest.mark.slow
@pytest.mark.parametrize("phase", ["importing", "start-up"])
def test_ctrl_c_before_step_1_is_one_line_and_leaves_nothing(tmp_path, tiny_policy_dir, phase):
    """Ctrl-C from outside while torch loads (base.early: exit 1), or once start-up prints the objective and the run
    folder exists (lifecycle.Startup: exit 2, the folder removed): one line, no traceback, nothing left. The signal
    is sent on what the process shows, not after a fixed delay: before Python installs its own handler a SIGINT
    ends a process silently, and a loaded machine can take seconds to get there."""
    proc = spawn(["--model", str(tiny_policy_dir), "--total-steps", "2"] + SMALL, tmp_path)
    shown = ""
    if phase == "importing":
        wait_until(lambda: loading_torch(proc.pid), every=0.005)
    else:
        for line in proc.stdout:  # the start-up lines come after the run folder is made, before the first evaluation
            shown += line
            if line.startswith("gspo: "):
                break
    proc.send_signal(signal.SIGINT)
    out = shown + proc.communicate(timeout=120)[0]
    last = out.strip().splitlines()[-1] if out.strip() else ""
    assert "Traceback" not in out, out
    if phase == "importing":
        assert proc.returncode == 1 and last == "interrupted before start-up; nothing was written", (proc.returncode, out)
    else:
        assert proc.returncode == 2 and last.startswith("error: interrupted by SIGINT during start-up"), (
            proc.returncode, out)
    assert not (tmp_path / "gspo-s0").exists()


def test_an_interrupt_inside_a_print_still_gets_an_error_line_of_its_own(monkeypatch):
    """A signal can land inside print(), after its text and before its newline (the start-up test above once caught
    '...(full fine-tune)error: interrupted ...' on one line): the error line starts a line of its own."""
    import io

    from base import errors

    screen = io.StringIO()  # stdout and stderr on one terminal
    monkeypatch.setattr(sys, "stdout", screen)
    monkeypatch.setattr(sys, "stderr", screen)
    screen.write("model: embedded; trains every weight (full fine-tune)")  # the print the signal cut short
    errors.report(errors.Interrupted("interrupted by SIGINT during start-up"), 0)
    assert screen.getvalue().splitlines()[-1] == "error: interrupted by SIGINT during start-up"


# ---------------------------------------------------------------------------------------------------------------
# Numerical guards
# ---------------------------------------------------------------------------------------------------------------


def test_non_finite_updates_are_skipped_then_stop_the_run(tmp_path, capsys, tiny_policy_dir, monkeypatch):
    real = losses.policy_loss

    def poisoned(*a, **kw):
        return real(*a, **kw) * float("nan")

    monkeypatch.setattr(losses, "policy_loss", poisoned)
    code, err = cli(["--model", str(tiny_policy_dir), "--output-dir", str(tmp_path), "--total-steps", "10",
                     "--max-nonfinite-steps", "2"] + SMALL, capsys)
    assert code == 2 and "2 steps in a row" in err and "last finite step: 0" in err
    rows = [json.loads(line) for line in (tmp_path / "gspo-s0" / "metrics.jsonl").open()]
    assert [r["losses/skipped_updates"] for r in rows if r["step"] > 0] == [2, 2]


def test_the_watch_warns_on_streaks_only_and_counts_only_fully_skipped_steps(capsys):
    """lifecycle.Watch's thresholds, step by step: the cut-off warning needs more than half truncated in 3 steps in a
    row (a step at 0.5 or below resets the streak) and prints once; a step stops the streak of non-finite steps
    unless every one of its updates was skipped; the no-correct warning comes after 5 steps without a correct
    completion, once, and never after a step with one."""
    watch = lifecycle.Watch(limit=2, updates_per_step=4, answer_format="tags", max_new_tokens=7, reference="3")
    step = lambda frac, skipped=0, acc=0.5: {"charts/truncated_frac": frac, "losses/skipped_updates": skipped,  # noqa: E731
                                            "charts/accuracy": acc}
    for i, frac in enumerate([0.6, 0.6, 0.5, 0.9, 0.9], 1):
        watch.check(i, step(frac))
    assert "hit --max-new-tokens" not in capsys.readouterr().out  # 2, reset at 0.5, then 2
    for i in (6, 7):
        watch.check(i, step(0.51))
    assert capsys.readouterr().out.count("hit --max-new-tokens 7 in each of the last 3 steps") == 1  # at step 6
    watch.check(8, step(0.0, skipped=4))
    watch.check(9, step(0.0, skipped=3))  # one update of four was taken: the streak ends
    watch.check(10, step(0.0, skipped=4))
    with pytest.raises(lifecycle.NonFiniteError, match="2 steps in a row .*last finite step: 9"):
        watch.check(11, step(0.0, skipped=4))
    for correct_at in (None, 3):
        watch = lifecycle.Watch(limit=9, updates_per_step=4, answer_format="tags", max_new_tokens=7, reference="3")
        for i in range(1, 5):
            watch.check(i, step(0.0, acc=0.25 if i == correct_at else 0.0))
        assert "scored correct" not in capsys.readouterr().out  # 4 steps: not yet
        for i in (5, 6):
            watch.check(i, step(0.0, acc=0.0))
        assert capsys.readouterr().out.count("no completion of the first 5 steps was scored correct") == \
            (1 if correct_at is None else 0)


def degenerate_batches():
    """(name, logp, old, advantages, mask) for batches that must not produce NaN or inf anywhere."""
    g = torch.Generator().manual_seed(0)
    old = -torch.rand(8, 6, generator=g)
    logp = old + 0.05 * torch.randn(8, 6, generator=g)
    full = torch.ones(8, 6)
    first_only = torch.zeros(8, 6)
    first_only[:, 0] = 1
    adv = torch.randn(8, generator=g)
    return [
        ("equal rewards in every group", logp, old, losses.group_advantages(torch.ones(8), 4), full),
        ("immediate EOS everywhere", logp, old, adv, first_only),
        ("every completion truncated", logp, old, adv, full),
        ("single-token completions, equal rewards", logp, old, torch.zeros(8), first_only),
    ]


@pytest.mark.parametrize("name,logp,old,adv,mask", degenerate_batches(), ids=[b[0] for b in degenerate_batches()])
@pytest.mark.parametrize("algo", list(PRESETS))
def test_degenerate_batches_keep_everything_finite(name, logp, old, adv, mask, algo):
    leaf = logp.clone().requires_grad_(True)
    loss = losses.policy_loss(leaf, old, adv, mask, StepNorm.of(mask, 6), PRESETS[algo], ref_logp=old)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(leaf.grad).all()
    diag = {**losses.ratio_diagnostics(logp, old, adv, mask, PRESETS[algo]),
            **diagnostics.study_metrics(logp, old, adv, mask)}
    assert all(torch.isfinite(torch.tensor(v)) for v in diag.values()), diag
    for bucket in diagnostics.length_bucket_stats(logp, old, mask):
        assert all(torch.isfinite(torch.tensor(v)) for v in bucket.values())


# ---------------------------------------------------------------------------------------------------------------
# The verifier never raises
# ---------------------------------------------------------------------------------------------------------------

unicode_digits = st.sampled_from("0123456789٠١٢٣٤٥٦٧٨٩０１２３４５６７８９۱۲۳")
answer_like = st.one_of(
    st.text(),
    st.integers(min_value=-10**400, max_value=10**400).map(str),
    st.text(unicode_digits, min_size=1, max_size=50),
    st.from_regex(r"[+-]?[\d,. ]{0,30}", fullmatch=True),
)
completion = st.lists(st.one_of(st.just("<answer>"), st.just("</answer>"), answer_like), max_size=12).map("".join)


@pytest.mark.slow
@settings(max_examples=400, deadline=None)
@given(completion, answer_like)
def test_verifier_never_raises(text, reference):
    assert rewards.is_correct(text, reference) in (True, False)
    assert rewards.format_ok(text) in (True, False)
    s = rewards.score([text], [reference], [len(text)], [False], 0.1, 1.0, 20, 4)
    assert all(len(v) == 1 for v in s.values())
