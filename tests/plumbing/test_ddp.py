"""Data parallel under torchrun (2 CPU processes, gloo): exact updates, sharded evaluation, rank-0 writing, an exact
resume, and a failure on one rank that stops the job with one line instead of a hang."""

import json
import os
import random
import signal
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch

import train
from plumbing import checkpoint
from conftest import TORCHRUN_SMALL as SMALL, children, final_weights, finish, metrics_without_timing, torchrun

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not torch.distributed.is_available() or not sys.platform.startswith("linux"),
                                reason="needs torch.distributed (gloo) and Linux's /proc")]


def test_update_over_two_ranks_equals_one_process(tmp_path, tiny_policy_dir):
    """All four presets, equal and unequal completion lengths per rank, micro-batches, two epochs, LoRA: the parameter
    change of a 2-rank update equals the 1-process update on the union (float64: the split's arithmetic, not fp32
    rounding). The same comparison with per-rank normalisers shows what the check would catch: DAPO's token-mean
    moves by 10-50%, while the sequence-mean objectives, with equal rows per rank, do not need the global count."""
    out = tmp_path / "exact.json"
    code, _, err = finish(torchrun(2, "tests/plumbing/ddp_exactness.py", [str(tiny_policy_dir), str(out)]))
    assert code == 0, err[-3000:]
    results = json.loads(out.read_text())
    assert len(results) == 20  # 4 presets x 5 cases (one with LoRA)
    for name, r in results.items():
        assert r["rel_diff"] < 1e-6, (name, r)
        assert r["delta_norm"] > 0, name  # the update moved something
    assert results["dapo/unequal"]["tokens_per_rank"][0] < results["dapo/unequal"]["tokens_per_rank"][1]
    for case in ("equal", "unequal", "micro", "two-epochs"):
        assert results[f"dapo/{case}"]["rel_diff_local_norm"] > 1e-2  # the pitfall is visible
        assert results[f"gspo/{case}"]["rel_diff_local_norm"] < 1e-6


def test_two_processes_train_evaluate_and_write_once(tmp_path, tiny_policy_dir):
    """A 2-process DAPO run (dynamic sampling: ranks draw extra rounds together) finishes; its first evaluation, sharded
    over ranks, equals the 1-process one; rank 0 alone wrote one line per step, and every completion of the steps
    --log-completions-every picks, both ranks' groups, each of mixed correctness; the final model and summary exist."""
    small = SMALL + ["--eval-size", "40"]  # 20 held-out problems per rank
    argv = ["--model", str(tiny_policy_dir), "--algo", "dapo", "--total-steps", "4", "--eval-every", "2",
            "--max-sampling-rounds", "30", "--log-completions-every", "2",
            "--output-dir", str(tmp_path / "two")] + small
    code, out, err = finish(torchrun(2, "train.py", argv))
    assert code == 0, err[-3000:]
    assert "2 processes" in out and out.count("held-out accuracy before") == 1  # rank 0 speaks for all
    run = tmp_path / "two" / "dapo-np2-s0"
    rows = metrics_without_timing(run)
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4]
    assert any(r["dynamic/drawn"] > 4 for r in rows[1:])  # extra rounds happened, in step on both ranks
    completions = [json.loads(line) for line in (run / "completions.jsonl").open()]
    assert [c["step"] for c in completions] == [2] * 16 + [4] * 16  # 4 prompts x 4, of both ranks, written once
    for step in (2, 4):
        groups = [[c for c in completions if c["step"] == step and c["group"] == i] for i in range(4)]
        assert all(len({c["prompt"] for c in g}) == 1 and len({c["correct"] for c in g}) == 2 for g in groups)
    answers = [json.loads(line) for line in (run / "eval_completions.jsonl").open()]  # each rank every other problem,
    for m in (m for m in rows if "eval/accuracy" in m):  # written once in the held-out set's order
        mine = [a for a in answers if a["step"] == m["step"]]
        assert [a["problem"] for a in mine] == list(range(40))
        assert sum(a["correct"] for a in mine) / 40 == pytest.approx(m["eval/accuracy"])
    assert (run / "final" / "model.safetensors").is_file() and (run / "summary.json").is_file()
    train.main([*argv[:-len(small) - 2], "--output-dir", str(tmp_path / "one"), "--total-steps", "1", *small])
    first = metrics_without_timing(tmp_path / "one" / "dapo-s0")[0]  # (one process: this one, one thread)
    assert first["eval/accuracy"] == rows[0]["eval/accuracy"]  # the same greedy answers, counted on two ranks
    assert first["eval/reward"] == pytest.approx(rows[0]["eval/reward"], rel=1e-12)  # summed in another order


def test_one_process_under_torchrun_is_the_plain_run(tmp_path, tiny_policy_dir):
    """`torchrun --nproc-per-node 1` goes through the process group and DDP (the code path of N GPUs, checkable on
    one) and must change nothing: the same metrics, bit for bit, as `python train.py`."""
    argv = ["--model", str(tiny_policy_dir), "--algo", "dapo", "--total-steps", "3", "--eval-every", "3",
            "--max-sampling-rounds", "30", "--no-save-model"] + SMALL
    code, out, err = finish(torchrun(1, "train.py", argv + ["--output-dir", str(tmp_path / "torchrun")]))
    assert code == 0, err[-3000:]
    train.main([*argv, "--output-dir", str(tmp_path / "plain")])  # `python train.py`, in this process (one thread)
    assert metrics_without_timing(tmp_path / "torchrun" / "dapo-s0") == \
        metrics_without_timing(tmp_path / "plain" / "dapo-s0")


def test_two_process_resume_after_sigkill_matches_uninterrupted_run(tmp_path, tiny_policy_dir, capsys):
    argv = ["--model", str(tiny_policy_dir), "--algo", "grpo", "--total-steps", "12", "--save-every", "2",
            "--eval-every", "6"] + SMALL  # the kill lands within a second of step 2's checkpoint: steps 2-4
    code, _, err = finish(torchrun(2, "train.py", argv + ["--output-dir", str(tmp_path / "ref")]))
    assert code == 0, err[-3000:]
    victim = torchrun(2, "train.py", argv + ["--output-dir", str(tmp_path / "kill")])
    ckpts = tmp_path / "kill" / "grpo-np2-s0" / "checkpoints"
    deadline = time.time() + 120
    while not checkpoint.all_checkpoints(ckpts) and time.time() < deadline:
        time.sleep(0.05)
    time.sleep(random.Random(os.getpid()).uniform(0.0, 1.0))  # within the next steps
    for pid in [p.pid for p in workers(victim.pid)] + [victim.pid]:  # both ranks and torchrun, as a lost machine
        os.kill(pid, signal.SIGKILL)  # (torchrun starts its workers in sessions of their own: killpg misses them)
    victim.communicate()
    assert not (tmp_path / "kill" / "grpo-np2-s0" / "summary.json").exists()
    resumed = torchrun(2, "train.py", argv + ["--output-dir", str(tmp_path / "kill"), "--resume", "auto"])
    code, out, err = finish(resumed)
    assert code == 0 and "resumed from" in out, err[-3000:]
    ref, kill = tmp_path / "ref" / "grpo-np2-s0", tmp_path / "kill" / "grpo-np2-s0"
    wa, wb = final_weights(ref), final_weights(kill)
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    assert metrics_without_timing(ref) == metrics_without_timing(kill)
    # the checkpoint holds both ranks' RNG streams: one process cannot continue it exactly, and says so
    with pytest.raises(SystemExit) as one:
        train.main([*argv, "--output-dir", str(tmp_path / "kill"), "--resume",
                    str(checkpoint.all_checkpoints(kill / "checkpoints")[-1]), "--run-name", "again"])
    err = capsys.readouterr().err
    assert one.value.code == 2 and "written by 2 processes" in err
    assert "torchrun --nproc-per-node 2" in err
    assert len(err.strip().splitlines()) == 1


def error_lines(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("error:")]


def test_bad_flag_under_torchrun_is_one_line(tmp_path, tiny_policy_dir):
    argv = ["--model", str(tiny_policy_dir), "--output-dir", str(tmp_path), *SMALL, "--num-prompts", "3"]
    code, _, err = finish(torchrun(2, "train.py", argv), timeout=120)
    assert code != 0
    assert error_lines(err) == ["error: --num-prompts 3 is not divisible by the 2 processes (each takes whole prompt "
                                "groups); use a multiple of 2"]
    assert not (tmp_path / "gspo-np2-s0").exists()


def test_bad_data_under_torchrun_is_one_line(tmp_path, tiny_policy_dir):
    """A bad row is found while loading, where rank 0 goes first and the others wait for it: they reported rank 0's
    exit as a failure of their own (a second `error:` line). They now meet the bad row themselves, and rank 0 alone
    prints it."""
    rows = [{"prompt": f"{n} mod 3 =", "answer": str(n % 3)} for n in range(10, 30)] + [{"prompt": "7 mod 3 ="}]
    (tmp_path / "bad.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    argv = ["--model", str(tiny_policy_dir), "--output-dir", str(tmp_path / "out"), "--dataset",
            str(tmp_path / "bad.jsonl"), *SMALL, "--max-new-tokens", "24"]
    code, _, err = finish(torchrun(2, "train.py", argv), timeout=120)
    lines = error_lines(err)
    assert code != 0 and len(lines) == 1 and "bad.jsonl:21" in lines[0], err[-3000:]
    assert not (tmp_path / "out" / "gspo-np2-s0").exists()


def test_a_rank_other_than_zero_waits_for_rank_zero_to_print_a_shared_error(monkeypatch, capsys):
    """torchrun stops every process once one exits: had rank 1 exited at once on a bad flag, rank 0 could be killed
    before printing it (seen once in CI: no error line at all; reproduced by delaying rank 0 by 3 s). Rank 1 now
    waits, with SIGTERM at its default so that torchrun's stop ends the wait; a per-rank error is its own to print."""
    from base import errors

    waits, handlers = [], []
    monkeypatch.setattr(errors.time, "sleep", waits.append)
    monkeypatch.setattr(errors.signal, "signal", lambda sig, handler: handlers.append((sig, handler)))
    for rank, error, printed, waited in [
            ("1", errors.ConfigError("--x is bad"), "", True),
            ("0", errors.ConfigError("--x is bad"), "error: --x is bad\n", False),
            ("1", errors.OutOfMemory("out of memory"), "error: rank 1: out of memory\n", False)]:
        monkeypatch.setenv("RANK", rank)
        waits.clear(), handlers.clear()
        with pytest.raises(SystemExit) as stop, errors.one_line_errors():
            raise error
        assert stop.value.code == 2 and capsys.readouterr().err == printed
        assert (waits == [10.0] and handlers == [(signal.SIGTERM, signal.SIG_DFL)]) if waited else not waits


def test_more_processes_than_gpus_is_one_line(monkeypatch):
    """NCCL needs a GPU per process: torchrun with 2 processes on a 1-GPU machine is refused before any set-up."""
    from base import errors
    from plumbing import flags
    import train
    from plumbing import run as runs

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    args = runs.resolve(train.Args(wandb_mode="disabled"))[0]
    with pytest.raises(errors.ConfigError, match=r"starts 2 processes on this machine but it has 1 GPU.*"
                                                  r"--nproc-per-node 1 \(or --device cpu\)"):
        flags.validate(args, world_size=2)
    flags.validate(replace(args, device="cpu"), world_size=2)  # gloo on the CPU: any number of processes


def test_peer_failures_are_told_apart_from_bugs(monkeypatch):
    from base import errors

    gloo = RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:1")
    nccl = RuntimeError("NCCL error in: ProcessGroupNCCL.cpp:1970, remote process exited or there was a network error, "
                        "NCCL version 2.21.5\nncclRemoteError: A call failed possibly due to a network error or a "
                        "remote process exiting prematurely.")
    bug = RuntimeError("mat1 and mat2 shapes cannot be multiplied (4x8 and 16x8)")
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert not errors.is_peer_failure(gloo)  # no torchrun: no other process to blame
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert errors.is_peer_failure(gloo) and errors.is_peer_failure(nccl) and not errors.is_peer_failure(bug)
    assert errors.is_peer_failure(torch.distributed.DistNetworkError("store timed out"))
    assert errors.first_line(gloo) == "Connection closed by peer [127.0.0.1]:1"


@pytest.mark.parametrize("sharded", [[], ["--fsdp"]], ids=["data-parallel", "fsdp"])
def test_a_rank_that_dies_stops_the_job_without_a_hang(tmp_path, tiny_policy_dir, sharded):
    """SIGKILL one rank mid-run (a crashed process, an OOM kill): the other leaves its collective with one line and
    torchrun ends the job, within seconds, not at the process group's 30-minute timeout; data parallel or sharded."""
    argv = ["--model", str(tiny_policy_dir), "--total-steps", "100000", "--output-dir", str(tmp_path)] + SMALL + sharded
    job = torchrun(2, "train.py", argv)
    log, deadline = tmp_path / "gspo-np2-s0" / "metrics.jsonl", time.time() + 120
    while not (log.is_file() and len(log.read_text().splitlines()) >= 3) and time.time() < deadline:
        time.sleep(0.1)  # past start-up (where a signal from torchrun would mean "interrupted"), inside the steps
    rank1 = [w.pid for w in workers(job.pid) if w.rank == 1]
    assert len(rank1) == 1
    os.kill(rank1[0], signal.SIGKILL)
    t0 = time.time()
    code, _, err = finish(job, timeout=90)
    assert code != 0 and time.time() - t0 < 60
    lines = error_lines(err)
    assert len(lines) == 1 and lines[0].startswith("error: another process of this torchrun job stopped"), err[-3000:]


class Worker:
    def __init__(self, pid: int, rank: int):
        self.pid, self.rank = pid, rank


def workers(parent: int) -> list[Worker]:
    """The processes torchrun `parent` started, with their RANK (read from /proc)."""
    found = []
    for pid in children(parent):
        try:
            env = dict(kv.split(b"=", 1) for kv in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0") if b"=" in kv)
        except OSError:
            continue
        if b"RANK" in env:
            found.append(Worker(pid, int(env[b"RANK"])))
    return found
