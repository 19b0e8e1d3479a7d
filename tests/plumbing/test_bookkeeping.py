"""A run's bookkeeping on its own, with stand-ins for the model: which checkpoints are kept and which one an error
names, which changes a resume allows, the held-out evaluation's sums and seeds, what metrics.jsonl holds and what
the step line prints. Fast unit tests; the runs that use all of it are in test_reliability.py and test_train.py."""

import dataclasses
import json
import math
import types
from pathlib import Path

import pytest
import torch

import task
import train
from plumbing import checkpoint, ddp, lifecycle, logs
from plumbing import run as runs
from plumbing.ddp import SINGLE

from conftest import TwoRanks  # noqa: E402


class Saves:
    """Stands in for a policy or a tokenizer: save_pretrained writes one small file."""

    def save_pretrained(self, folder: Path, state_dict: dict | None = None) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "config.json").write_text("{}")


def test_a_save_keeps_the_newest_checkpoints_and_an_error_names_the_newest_other_one(tmp_path):
    root = tmp_path / "checkpoints"
    for step in range(1, 6):
        checkpoint.save(root, step, Saves(), Saves(), {"step": step, "config": {}}, keep=3)
    assert [p.name for p in checkpoint.all_checkpoints(root)] == ["step-000003", "step-000004", "step-000005"]
    assert not list(root.glob(".tmp-*"))  # each was renamed into place
    assert torch.load(root / "step-000005" / "state.pt", weights_only=True)["step"] == 5
    hint = checkpoint.earlier_hint(root / "step-000005")  # the checkpoint that could not be used is step 5
    assert hint == f"resume from another checkpoint with --resume {root / 'step-000004'}", hint
    assert checkpoint.find("auto", tmp_path) == root / "step-000005"
    assert checkpoint.find(str(tmp_path), tmp_path / "elsewhere") == root / "step-000005"  # a run folder: its latest
    checkpoint.save(root, 5, Saves(), Saves(), {"step": 5, "config": {"again": True}}, keep=3)  # a stop right after
    assert [p.name for p in checkpoint.all_checkpoints(root)] == ["step-000003", "step-000004", "step-000005"]  # a save
    assert torch.load(root / "step-000005" / "state.pt", weights_only=True)["config"] == {"again": True}  # replaced


def test_a_restore_puts_back_adamws_moments_the_schedule_the_prompt_cursor_the_rngs_and_the_step():
    """checkpoint.restore from what Run.save keeps: the optimizer's moments, the learning rate where a moving schedule
    had it, the prompt stream's place, the sampling streams, the next step and the minutes spent; a checkpoint from
    before data parallel (one RNG state, as "rng") restores the same way."""
    from transformers import get_scheduler

    def fresh():
        w = torch.nn.Parameter(torch.arange(3.0))
        opt = torch.optim.AdamW([w], lr=0.1)
        return w, opt, get_scheduler("cosine", opt, num_warmup_steps=2, num_training_steps=10)

    w, opt, sched = fresh()
    for _ in range(5):
        (w ** 2).sum().backward()
        opt.step()
        sched.step()
        opt.zero_grad()
    examples = [task.Example(f"{i} mod 3 =", str(i % 3)) for i in range(7)]
    stream, gen = runs.PromptStream(examples, seed=0), torch.Generator().manual_seed(5)
    stream.take(9)  # into the second pass
    torch.rand(4, generator=gen)
    rng = checkpoint.rng_state(gen)
    state = {"step": 3, "cursor": stream.cursor, "optimizer": opt.state_dict(), "scheduler": sched.state_dict(),
             "minutes": 2.5}
    for kept in ({"rng_ranks": [rng]}, {"rng": rng}):
        _, opt2, sched2 = fresh()
        stream2, gen2 = runs.PromptStream(examples, seed=0), torch.Generator().manual_seed(6)
        assert checkpoint.restore({**state, **kept}, opt2, sched2, gen2, stream2) == (4, 2.5)
        assert sched2.get_last_lr() == sched.get_last_lr() != [0.1]  # mid-decay, not the schedule's start
        assert opt2.param_groups[0]["lr"] == opt.param_groups[0]["lr"]
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(opt2.state_dict()["state"][0][key], opt.state_dict()["state"][0][key]), key
        assert stream2.cursor == 9 and stream2.take(5) == runs.PromptStream(examples, seed=0).take(14)[9:]
        saved_gen = torch.Generator().set_state(rng["generator"])
        assert torch.equal(torch.rand(3, generator=gen2), torch.rand(3, generator=saved_gen))
    checkpoint.check_world_size({"rng": rng}, 1, Path("ckpt"))  # one process wrote it, one resumes it
    with pytest.raises(checkpoint.CheckpointError, match="written by 1 process, this run has 2"):
        checkpoint.check_world_size({"rng": rng}, 2, Path("ckpt"))


def test_a_resume_refuses_every_change_to_what_the_run_computes_and_allows_the_rest():
    """Every flag not in checkpoint.HARMLESS, changed, is refused by name; every harmless one is allowed and listed
    (--resume itself, which always differs, is not listed). HARMLESS names flags that exist."""
    saved = dataclasses.asdict(train.Args())
    assert checkpoint.HARMLESS <= set(saved), checkpoint.HARMLESS - set(saved)
    for field in saved:
        changed = {**saved, field: ("changed", saved[field])}
        if field in checkpoint.HARMLESS:
            listed = checkpoint.compare_configs(saved, changed)
            assert listed == ([] if field == "resume" else [f"{field}: {saved[field]!r} -> {changed[field]!r}"])
        else:
            with pytest.raises(checkpoint.CheckpointError, match=f"differs in {field}: "):
                checkpoint.compare_configs(saved, changed)


def test_a_checkpoint_older_than_a_setting_resumes_at_that_settings_old_value():
    """A checkpoint written before VESPO's flags existed (its config lacks them) resumes a run that resolves them to
    the values no earlier objective read, and is refused one that sets them otherwise."""
    from plumbing import run as runs

    current = dataclasses.asdict(runs.resolve(train.Args(algo="gspo"))[0])
    saved = {k: v for k, v in current.items() if k not in checkpoint.ADDED_SINCE}
    assert set(checkpoint.ADDED_SINCE) <= set(current) and checkpoint.compare_configs(saved, current) == []
    with pytest.raises(checkpoint.CheckpointError, match="differs in vespo_k_pos: "):
        checkpoint.compare_configs(saved, {**current, "vespo_k_pos": 5.0})


def test_a_refused_resume_names_how_to_train_from_the_checkpoints_weights(tmp_path):
    """Changing --lr (say) cannot resume a run, but its weights can start a new one: the refusal names --model and
    the checkpoint's model/ folder (a --fsdp checkpoint's weights are shards: --export first; a LoRA adapter, which
    --model does not take, gets no such advice). test_train's gguf-folder test trains from a checkpoint's model/."""
    saved = dataclasses.asdict(train.Args())
    changed = {**saved, "lr": 1e-4}
    whole, sharded, adapter = (tmp_path / name for name in ("whole", "sharded", "adapter"))
    for folder, files in ((whole, ["model/config.json", "model/model.safetensors"]),
                          (sharded, ["model/config.json", "shards/.metadata"]),
                          (adapter, ["model/adapter_config.json", "model/adapter_model.safetensors"])):
        for f in files:
            (folder / f).parent.mkdir(parents=True, exist_ok=True)
            (folder / f).write_text("{}")
    advice = {}
    for folder in (whole, sharded, adapter):
        with pytest.raises(checkpoint.CheckpointError) as refused:
            checkpoint.compare_configs(saved, changed, folder)
        advice[folder.name] = str(refused.value)
    assert f"replace --resume with --model {whole / 'model'} (a new run" in advice["whole"]
    assert f"--export {sharded} OUT`) and replace --resume with --model OUT" in advice["sharded"]
    assert "--model" not in advice["adapter"] and "differs in lr: 5e-05 -> 0.0001" in advice["adapter"]


@pytest.mark.parametrize("saved_by,resumed_by", [(1, 2), (2, 1), (2, 4)])
def test_a_checkpoint_resumes_at_its_own_number_of_processes_unless_it_is_sharded(tmp_path, saved_by, resumed_by):
    state = {"rng_ranks": [{}] * saved_by}
    with pytest.raises(checkpoint.CheckpointError, match=f"written by {saved_by} process"):
        checkpoint.check_world_size(state, resumed_by, tmp_path)
    checkpoint.check_world_size(state, saved_by, tmp_path)
    checkpoint.check_world_size({**state, "sharded": True}, resumed_by, tmp_path)  # resharded on load


@pytest.mark.parametrize("saved_gpus,here", [(4, 2), (1, 2), (2, 2)])
def test_a_checkpoint_from_a_machine_with_more_gpus_restores_the_rng_of_the_gpus_this_one_has(monkeypatch, saved_gpus,
                                                                                           here):
    """The CUDA RNG states of a checkpoint are one per GPU of the machine that saved it; a resume on a machine with
    fewer (another node, a sharded checkpoint at fewer processes) restores those that exist instead of failing on a
    GPU index this machine lacks. No GPU here: torch.cuda stands in, recording what is set."""
    set_states = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: here)
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda state, device: set_states.append((device, int(state[0]))))
    monkeypatch.setattr(torch.cuda, "get_rng_state_all", lambda: [torch.tensor([10 + i], dtype=torch.uint8)
                                                                  for i in range(saved_gpus)])
    gen = torch.Generator().manual_seed(3)
    state = checkpoint.rng_state(gen)
    checkpoint.restore_rng(state, torch.Generator())
    assert set_states == [(i, 10 + i) for i in range(min(saved_gpus, here))]


def test_a_checkpoint_keeps_the_rng_a_macs_gpu_samples_with(monkeypatch):
    """On a Mac, --device auto samples on MPS, whose generator is its own: a checkpoint saves it and a resume puts it
    back, as it does the CUDA generators (exact resume). A checkpoint without one (older, or from another machine)
    leaves it alone. No MPS here: torch.mps stands in."""
    mps = {"state": torch.tensor([7], dtype=torch.uint8)}
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: True)
    monkeypatch.setattr(torch.mps, "get_rng_state", lambda: mps["state"].clone())
    monkeypatch.setattr(torch.mps, "set_rng_state", lambda state: mps.update(state=state))
    state = checkpoint.rng_state(torch.Generator())
    mps["state"] = torch.tensor([9], dtype=torch.uint8)  # the run samples on
    checkpoint.restore_rng(state, torch.Generator())
    assert int(mps["state"][0]) == 7
    checkpoint.restore_rng({k: v for k, v in state.items() if k != "mps"}, torch.Generator())
    assert int(mps["state"][0]) == 7


def test_one_process_on_a_chosen_gpu_makes_it_the_current_device(monkeypatch):
    """`--device cuda:1` without torchrun: GPU 1 becomes the current device, as each rank's GPU is under torchrun,
    so what reads the current device (the logged CUDA memory peak) reads the run's GPU, not GPU 0."""
    current = []
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setattr(torch.cuda, "set_device", current.append)
    assert ddp.setup("cuda:1") is SINGLE and current == [torch.device("cuda", 1)]
    for device in ("auto", "cuda", "cpu"):
        assert ddp.setup(device) is SINGLE
    assert current == [torch.device("cuda", 1)]


class Policy:
    """What evaluate asks of a policy: eval(), train() and its device."""
    device = torch.device("cpu")

    def eval(self):
        self.training = False

    def train(self):
        self.training = True


def scored_sample(policy, tokenizer, rows, args, greedy):
    """Stands in for train.sample: a greedy answer is right for reference '1'; a sampled one is right with
    probability 0.4, drawn from torch's global stream; each reward is correctness plus 0.5 (a format term)."""
    correct = [float(ex.answer == "1") if greedy else float(torch.rand(()) < 0.4) for ex in rows]
    return types.SimpleNamespace(scores={"correct": correct, "reward": [c + 0.5 for c in correct]},
                                 texts=[f"answer to {ex.prompt}" for ex in rows])


EXAMPLES = [task.Example(f"p{i}", "1" if i % 3 == 0 else "2") for i in range(12)]  # 4 of 12 right when greedy


def evaluate(monkeypatch, policy, eval_samples: int, seed: int, step: int = 0, **kw):
    """train.evaluate over EXAMPLES, with scored_sample for train.sample."""
    monkeypatch.setattr(train, "sample", scored_sample)
    return train.evaluate(policy, None, EXAMPLES, types.SimpleNamespace(eval_samples=eval_samples, seed=seed), step,
                          **kw)


def test_the_held_out_evaluation_sums_accuracy_reward_and_pass_at_k(monkeypatch):
    policy = Policy()
    torch.manual_seed(123)
    before = torch.get_rng_state()
    out, answers = evaluate(monkeypatch, policy, eval_samples=4, seed=7, step=3, chunk=5)
    assert out["eval/accuracy"] == pytest.approx(4 / 12) and out["eval/reward"] == pytest.approx(4 / 12 + 0.5)
    assert torch.equal(torch.get_rng_state(), before)  # sampling here leaves the training run's stream alone
    assert policy.training  # back in train mode
    with torch.random.fork_rng():  # what evaluate drew: its own stream, seeded by the seed and the step
        torch.manual_seed(7 * 100_003 + 3)
        hits = (torch.rand(12 * 4) < 0.4).float().view(12, 4)  # one draw per sample, in the same order
    assert out["eval/pass@1"] == pytest.approx(float(hits.mean()))
    assert out["eval/pass@4"] == pytest.approx(float((hits.sum(1) > 0).float().mean()))
    assert [(a["problem"], a["prompt"], a["completion"], a["reference"], a["correct"], a["reward"]) for a in answers] \
        == [(i, ex.prompt, f"answer to {ex.prompt}", ex.answer, float(ex.answer == "1"), float(ex.answer == "1") + 0.5)
            for i, ex in enumerate(EXAMPLES)]  # each problem's greedy answer, as scored_sample scored it
    assert sum(a["correct"] for a in answers) / 12 == out["eval/accuracy"]  # the answers are what was counted
    again, _ = evaluate(monkeypatch, policy, eval_samples=4, seed=7, step=3)
    later, _ = evaluate(monkeypatch, policy, eval_samples=4, seed=7, step=4)
    assert again == out and later["eval/pass@1"] != out["eval/pass@1"]  # the same step repeats; another draws anew


def test_under_torchrun_each_rank_scores_every_other_problem_and_the_sums_are_the_whole_sets(monkeypatch):
    whole, _ = evaluate(monkeypatch, Policy(), eval_samples=0, seed=0)
    rank1 = TwoRanks(1)
    _, answers1 = evaluate(monkeypatch, Policy(), eval_samples=0, seed=0, world=rank1)
    assert rank1.mine == [2.0, 2.0 + 0.5 * 6]  # problems 1, 3, 5, ...: p3 and p9 right; six rewards of 0.5 more
    rank0 = TwoRanks(0, other_sum=rank1.mine)
    on_rank0, answers0 = evaluate(monkeypatch, Policy(), eval_samples=0, seed=0, world=rank0)
    assert on_rank0 == whole
    assert [a["problem"] for a in answers1] == list(range(1, 12, 2))  # each answer names its problem ...
    rank0.other_obj = answers1  # ... so the gathered answers read in the held-out set's order
    assert logs.every_rank(answers0, rank0, "problem") == evaluate(monkeypatch, Policy(), eval_samples=0, seed=0)[1]


def test_each_evaluation_shows_other_problems_one_right_and_one_wrong():
    answers = [{"prompt": ex.prompt, "completion": f"t{i}", "reference": ex.answer, "correct": float(ex.answer == "1")}
               for i, ex in enumerate(EXAMPLES)]
    picks = [logs.examples_to_show(answers, step) for step in range(4)]
    for shown in picks:
        assert [a["correct"] for a in shown] == [1.0, 0.0]
    assert len({tuple(a["prompt"] for a in shown) for shown in picks}) == 4  # a different pair at each step
    all_right = logs.examples_to_show([{**a, "correct": 1.0} for a in answers], 0)
    assert [a["correct"] for a in all_right] == [1.0]
    line = logs.eval_lines("at step 2", {"eval/accuracy": 0.25}, answers, 12, 2)
    assert line.count("\n  e.g. ") == 2 and "(reference '1': right)" in line, line


def test_metrics_jsonl_holds_strict_json_with_null_for_what_is_not_finite(tmp_path):
    logger = logs.Logger(train.Args(wandb_mode="disabled"), tmp_path)  # its file alone
    logger.log({"a": math.nan, "b": math.inf, "c": 0.25, "d": 3, "e": "text"}, step=2)
    logger.finish()
    line = (tmp_path / "metrics.jsonl").read_text()
    row = json.loads(line, parse_constant=lambda c: pytest.fail(f"{c} is not JSON"))
    assert row == {"step": 2, "a": None, "b": None, "c": 0.25, "d": 3, "e": None}, row


@pytest.mark.parametrize("level,shown,hidden", [("sequence", "seq_ratio_var 2.00e-02", "ratio_var 1.00e-03"),
                                                ("token", "ratio_var 1.00e-03", "seq_ratio_var")])
def test_the_step_line_shows_the_ratio_variance_at_the_objectives_level(level, shown, hidden):
    m = {"charts/reward": 0.5, "charts/accuracy": 0.25, "charts/completion_len": 30.0, "losses/policy_loss": 0.01,
         "clip/frac": 0.125, "ratio/token_var": 1e-3, "ratio/seq_var": 2e-2, "perf/rollout_s": 1.0,
         "perf/update_s": 2.0}
    line = logs.console_line(3, 10, m, 90.0, level)
    assert shown in line and hidden not in line.replace(shown, ""), line
    assert line.startswith("step    3/10 | reward 0.500 acc 0.250 | len 30.0 | loss +0.0100 | clip 0.1250 ")
    assert "drawn" not in line and line.endswith("| 1.0s+2.0s | eta 1.5 min")
    dapo = logs.console_line(3, 10, {**m, "dynamic/drawn": 48, "dynamic/dropped": 16}, 90.0, level)
    assert "| drawn 48 dropped 16 |" in dapo


def test_the_end_of_a_run_prints_and_writes_before_and_after(tmp_path, capsys):
    run = types.SimpleNamespace(args=train.Args(algo="dapo", seed=3, total_steps=7, save_model=False),
                                before={"eval/accuracy": 0.25}, minutes=lambda: 1.5, world=SINGLE,
                                run_dir=tmp_path, logger=types.SimpleNamespace(finish=lambda: None))
    summary = runs.finish_run(run, {"eval/accuracy": 0.75})
    assert summary == json.loads((tmp_path / "summary.json").read_text()) == {
        "algo": "dapo", "seed": 3, "steps": 7, "accuracy_before": 0.25, "accuracy_after": 0.75, "rl_minutes": 1.5}
    assert "held-out accuracy: 0.250 -> 0.750 (dapo, seed 3, 7 steps, 1.5 min)" in capsys.readouterr().out
    run.args.total_steps = 1
    runs.finish_run(run, {"eval/accuracy": 0.75})
    assert "(dapo, seed 3, 1 step, 1.5 min)" in capsys.readouterr().out


def test_out_of_memory_halves_the_micro_batch_only_where_the_size_is_free_and_the_process_alone():
    """--micro-batch-size 0: after an out-of-memory error the rows per forward halve, and the size that fit is kept
    for the next call under the same key. A fixed size, or a pass that holds a collective (several processes),
    raises the error instead; so does any other error."""
    def run(micro):  # fits at 2 rows or fewer
        if micro > 2:
            raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")
        tried.append(micro)
        return micro

    tried = []
    key = "test_bookkeeping"
    lifecycle.AUTO_MICRO_BATCH.pop(key, None)
    assert lifecycle.shrink_on_oom(run, 16, 0, key=key) == 2
    assert tried == [2] and lifecycle.AUTO_MICRO_BATCH[key] == 2  # 16 -> 8 -> 4 -> 2
    assert lifecycle.shrink_on_oom(run, 16, 0, key=key) == 2 and tried == [2, 2]  # begins where it fitted
    for fixed, world_size in [(8, 1), (0, 2)]:
        with pytest.raises(RuntimeError, match="out of memory"):
            lifecycle.shrink_on_oom(run, 16, fixed, world_size=world_size, key=f"{key} {fixed}")
    with pytest.raises(ValueError):
        lifecycle.shrink_on_oom(lambda micro: int("x"), 16, 0, key=f"{key} other")
    lifecycle.AUTO_MICRO_BATCH.pop(key, None)


def test_out_of_memory_is_blamed_on_the_optimizer_step_only_while_one_runs(tmp_path):
    """StepFailures reads the optimizer's step hooks: out of memory inside optimizer.step() is the resident state's
    problem (no checkpoint, --lora-rank advice); the same error in a forward after a finished optimizer step is the
    batch's (the latest checkpoint is named). A hook left unset or never cleared fails one of the two."""
    from base.errors import OptimizerOutOfMemory, OutOfMemory

    policy = torch.nn.Linear(4, 4)
    optimizer = torch.optim.AdamW(policy.parameters())
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    failures = lifecycle.StepFailures(lambda *a: pytest.fail("saved"), tmp_path, "resume", torch.Generator(),
                                      types.SimpleNamespace(cursor=0), scheduler, 1, optimizer, policy)
    oom = RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")

    def no_room(*_):  # the moments do not fit (registered after StepFailures's hook, so it runs after it)
        raise oom

    no_room_hook = optimizer.register_step_pre_hook(no_room)
    with pytest.raises(OptimizerOutOfMemory, match="optimizer step of step 1.*AdamW's two moments.*--lora-rank"):
        with failures(1):
            policy(torch.ones(1, 4)).sum().backward()
            optimizer.step()
    no_room_hook.remove()
    with pytest.raises(OutOfMemory) as raised:
        with failures(2):
            policy(torch.ones(1, 4)).sum().backward()
            optimizer.step()  # an optimizer step that ends
            scheduler.step()
            raise oom  # then the next forward runs out
    assert not isinstance(raised.value, OptimizerOutOfMemory) and "out of memory in step 2" in str(raised.value)


def test_a_step_that_fails_before_its_first_update_saves_the_state_it_started_from_in_one_process_only(tmp_path):
    """StepFailures: dynamic sampling that gives up, or out of memory before the step's first optimizer step, saves
    the step before with the RNG stream and prompt cursor the failed step started from, so a resume draws the same
    prompts again; under torchrun the same out of memory saves nothing (a save needs every rank, and the others are
    not failing) and names the latest checkpoint (here none, which it says)."""
    from base.errors import DynamicSamplingError, OutOfMemory

    policy = torch.nn.Linear(4, 4)
    optimizer = torch.optim.AdamW(policy.parameters())
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    gen = torch.Generator().manual_seed(0)
    stream = runs.PromptStream([task.Example(f"{i} mod 3 =", str(i % 3)) for i in range(6)], seed=0)
    stream.take(2)
    saved = []

    def save(step, rng=None, cursor=None):
        saved.append((step, rng, cursor))
        return tmp_path / f"step-{step}"

    started = gen.get_state()
    for world_size, error in ((1, DynamicSamplingError("no mixed groups")), (1, RuntimeError("CUDA out of memory.")),
                              (2, RuntimeError("CUDA out of memory."))):
        failures = lifecycle.StepFailures(save if world_size == 1 else lambda *a: pytest.fail("saved"), tmp_path,
                                          "resume", gen, stream, scheduler, world_size, optimizer, policy)
        with pytest.raises((DynamicSamplingError, OutOfMemory)) as raised:
            with failures(3):
                stream.take(4)  # the failed step's draws
                torch.rand(2, generator=gen)
                raise error
        if world_size == 1:
            step, rng, cursor = saved.pop()
            assert (step, cursor) == (2, 2) and torch.equal(rng["generator"], started), str(raised.value)
            assert f"aved {tmp_path / 'step-2'}" in str(raised.value)
        else:
            assert "no checkpoint to resume" in str(raised.value) and not saved
        stream.cursor = 2
        gen.set_state(started)


def test_the_schedules_a_resume_with_more_steps_changes_are_those_that_span_the_total():
    """lifecycle.SPAN_FREE_SCHEDULES: the schedules whose learning rate at a step does not depend on the number of
    training steps, so that extending a run on resume leaves them as they were; every other one the loop can drive
    does depend on it, and a resume that changes --total-steps says so (the next test)."""
    from transformers import get_scheduler

    from plumbing import flags

    def lrs(name, total):
        opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
        scheduler = get_scheduler(name, opt, num_warmup_steps=2, num_training_steps=total)
        out = []
        for _ in range(8):
            opt.step()
            scheduler.step()
            out.append(scheduler.get_last_lr()[0])
        return out

    names = flags.working_schedulers()
    assert set(lifecycle.SPAN_FREE_SCHEDULES) <= set(names)
    assert {n for n in names if lrs(n, 10) == lrs(n, 40)} == set(lifecycle.SPAN_FREE_SCHEDULES)


@pytest.mark.slow
def test_a_resume_with_more_steps_under_a_decaying_schedule_says_so(tmp_path, tiny_policy_dir, capsys):
    """A finished cosine run of 1 step, continued from its checkpoint to 2: its schedule now spans 2 steps, and the
    resume says so, as the finished run's refusal did (under the default constant schedule nothing changes: the
    refusal says "exactly", the resume nothing)."""
    from conftest import SMALL

    for schedule, said in (("cosine", True), ("constant_with_warmup", False)):
        argv = ["--model", str(tiny_policy_dir), "--output-dir", str(tmp_path / schedule), "--save-every", "1",
                "--lr-scheduler", schedule, "--save-model", "False"] + SMALL  # (SMALL: no warmup)
        train.main(argv + ["--total-steps", "1"])
        capsys.readouterr()
        ckpt = checkpoint.all_checkpoints(tmp_path / schedule / "gspo-s0" / "checkpoints")[-1]
        with pytest.raises(SystemExit):  # the finished run's refusal names the resume, and what it does to the schedule
            train.main(argv + ["--total-steps", "1"])
        how = "(its --lr-scheduler cosine then decays over the N steps)" if said else "exactly"
        assert f"--total-steps N continues it {how}" in capsys.readouterr().err
        train.main(argv + ["--total-steps", "2", "--resume", str(ckpt), "--run-name", "more"])
        out = capsys.readouterr().out
        note = (f"resume: --lr-scheduler {schedule} spans --total-steps: from step 2 the learning rate follows a "
                "2-step schedule (the steps before followed a 1-step one)")
        assert (note in out) == said, out


def test_the_start_up_line_names_the_modules_lora_adapts(tmp_path):
    """The default --lora-target-modules names every projection of a Llama or Qwen; a model with fused projections
    (Phi-3: qkv_proj, gate_up_proj) has two of them, and the start-up line names those two, not the seven."""
    from transformers import Phi3Config, Phi3ForCausalLM

    import model as models

    phi3 = Phi3ForCausalLM(Phi3Config(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=2, pad_token_id=0))
    args = runs.resolve(train.Args(lora_rank=4, wandb_mode="disabled", total_steps=1))[0]
    policy = models.add_lora(phi3, 4, 8.0, args.lora_target_modules)
    examples = [task.Example("1 mod 1 =", "0")]
    lines = logs.startup_lines(args, tmp_path, examples, examples, policy, SINGLE)
    assert "model: embedded; trains LoRA r=4 alpha=8 on o_proj, down_proj" in lines, lines


def test_a_finished_lora_runs_refusal_offers_its_merged_model_not_its_adapter(tmp_path):
    """--model takes a whole model: a LoRA run's final/ is an adapter (--model refuses it), its final/merged/ (with
    --merge-lora) a whole model. The finished run's refusal offers the one that loads."""
    from base.errors import ConfigError

    for merged in (True, False):
        run = tmp_path / f"lora-merged-{merged}"
        (run / "final").mkdir(parents=True)
        (run / "summary.json").write_text(json.dumps({"steps": 1, "accuracy_before": 0.5, "accuracy_after": 0.5}))
        (run / "final" / "adapter_config.json").write_text("{}")
        if merged:
            (run / "final" / "merged").mkdir()
            (run / "final" / "merged" / "config.json").write_text("{}")
        with pytest.raises(ConfigError) as refused:
            lifecycle.check_run_folder(run, None, False)
        offered = f"--model {run / 'final' / 'merged'} --run-name NEW_NAME starts a new run from its final policy"
        assert (offered in str(refused.value)) == merged and (f"--model {run / 'final'} " not in str(refused.value))


def test_under_torchrun_rank_0_alone_says_what_a_resume_changes(tmp_path, monkeypatch, capsys):
    """Every rank checks the checkpoint before start-up; the allowed changes and the schedule note were printed by
    each of them (twice under 2 processes). Rank 0 alone prints them; every rank still refuses what it must."""
    args = runs.resolve(train.Args(output_dir=str(tmp_path), total_steps=3, lr_scheduler="cosine",
                                   resume="somewhere", wandb_mode="disabled"))[0]
    saved = {**dataclasses.asdict(args), "total_steps": 2, "run_name": "before"}
    monkeypatch.setattr(checkpoint, "find", lambda resume, run_dir: tmp_path / "step-000002")
    monkeypatch.setattr(checkpoint, "load_state", lambda path: {"step": 2, "config": saved})
    monkeypatch.setattr(checkpoint, "check_world_size", lambda state, n, path: None)
    for rank, printed in (("1", False), ("0", True)):
        monkeypatch.setenv("RANK", rank)
        assert lifecycle.preflight(args, tmp_path / "run", 2)[1]["step"] == 2
        out = capsys.readouterr().out
        assert ("resume: allowed change total_steps: 2 -> 3" in out and "follows a 3-step schedule" in out) == printed
        assert printed or out == ""
    monkeypatch.setenv("RANK", "1")
    with pytest.raises(Exception, match="lr"):  # a change that is not allowed: refused on every rank
        lifecycle.preflight(dataclasses.replace(args, lr=1.0), tmp_path / "run", 2)
