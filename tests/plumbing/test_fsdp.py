"""Sharded training (--fsdp: FSDP2 over torchrun, 2 CPU processes, gloo): one update equals one process's, each rank
holds half of the weights, gradients and AdamW state, a short run logs data parallel's metrics, final/ is an
ordinary model, and what does not work yet is refused in one line."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import model as models
from conftest import TORCHRUN_SMALL as SMALL, finish, metrics_without_timing, torchrun

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not torch.distributed.is_available() or not sys.platform.startswith("linux"),
                                reason="needs torch.distributed (gloo)")]


def test_a_sharded_update_is_the_one_process_update_and_each_rank_holds_half(tmp_path, tiny_policy_dir):
    """GSPO (the default) and GRPO with β 0.04 (a sharded reference) in micro-batches of 2 rows, two epochs each, and
    DAPO with activation checkpointing and log-probs in chunks of 16 positions: the loss, the gradient norm and the weights after the update equal one process's within 1e-6 (float64); each rank
    holds half of one process's parameter, gradient and AdamW bytes, and with β half of the reference's after its
    scoring pass, a forward with no backward (its root stayed gathered on every card before World.scored released
    it) (measured, printed)."""
    out = tmp_path / "fsdp.json"
    code, _, err = finish(torchrun(2, "tests/plumbing/fsdp_exactness.py", [str(tiny_policy_dir), str(out)]))
    assert code == 0, err[-3000:]
    results = json.loads(out.read_text())
    assert set(results) == {"gspo", "grpo-beta-micro", "dapo-checkpointed-chunked"}
    assert results["dapo-checkpointed-chunked"]["checkpointing"] == [True, True]
    for case, r in results.items():
        print(case, {k: f"{a / 2**20:.3f} MiB per rank sharded, {b / 2**20:.3f} MiB in one process"
                     for k, (a, b) in r["held_per_rank"].items()})
        (sharded_loss, one_loss), (sharded_norm, one_norm) = r["loss"], r["grad_norm"]
        assert abs(sharded_loss - one_loss) <= 1e-6 * max(1.0, abs(one_loss)), (case, r["loss"])
        assert abs(sharded_norm - one_norm) <= 1e-6 * one_norm and one_norm > 0, (case, r["grad_norm"])
        # the chunked head computes its log-softmax in fp32 whatever the model's dtype (rollout.HeadLogprobs), so
        # that case agrees to fp32's rounding, which AdamW's first step g / (|g| + eps) magnifies in tiny gradients
        # (4.7e-8 of a 1e-3 change here); the others to float64's
        tolerance = 1e-4 if "chunked" in case else 1e-6
        assert r["max_weight_diff"] <= tolerance * r["max_weight_change"] and r["max_weight_change"] > 0, case
        for what, (sharded, one) in r["held_per_rank"].items():
            assert abs(sharded - one / 2) <= 0.01 * one, (case, what, sharded, one)


@pytest.mark.parametrize("algo", ["gspo", "dapo"])
def test_a_sharded_run_logs_data_parallels_metrics_and_writes_an_ordinary_model(tmp_path, tiny_policy_dir, algo):
    """2 steps with --fsdp and without it (data parallel), 2 processes each, float32, of the default objective and of
    DAPO (dynamic sampling: a rank whose groups are full samples no more while the other does, so generate must hold
    no collective; log-probs in chunks of 16 positions, the default wherever a vocabulary is large: the head runs
    after the model's forward, and once found its weights sharded again after a rollout's gather; β 0.04, so the
    reference is scored in chunks too, which once found its head sharded by a fix of its memory): the same tokens
    are drawn and every logged metric agrees (see the tolerances below); final/ loads as a plain model with the
    weights the run ended with."""
    base = ["--model", str(tiny_policy_dir), "--total-steps", "2", "--eval-every", "2", "--device", "cpu",
            "--algo", algo] + SMALL + ["--logprob-chunk", "16", "--beta", "0.04"] * (algo == "dapo")  # (chunks: a real
    # vocabulary's default; the reference scored in chunks too, its root kept gathered for the head and freed after)
    runs = {}
    for name, extra in (("fsdp", ["--fsdp"]), ("ddp", [])):
        code, out, err = finish(torchrun(2, "train.py", base + ["--output-dir", str(tmp_path / name)] + extra))
        # on failure, both streams' ends: stdout says how far the run got (seen once: a rank aborting in gloo)
        assert code == 0, f"stdout:\n{out[-2500:]}\nstderr:\n{err[-5000:]}"
        assert ("sharded (FSDP2)" in out) == (name == "fsdp"), out[:2000]
        runs[name] = tmp_path / name / f"{algo}-np2-s0"
    a, b = metrics_without_timing(runs["fsdp"]), metrics_without_timing(runs["ddp"])
    assert [r["step"] for r in a] == [r["step"] for r in b] == [0, 1, 2]
    if algo == "dapo":  # a second round of prompts was drawn (some rank short of mixed groups after the first)
        print("dynamic/drawn per step:", [r.get("dynamic/drawn") for r in a])
        assert max(r.get("dynamic/drawn", 0) for r in a) > 4
    for ra, rb in zip(a, b):
        # from the same weights (steps 0-1) within 1e-6; after one update the weights differ in fp32's last bits
        # (reduce-scatter against all-reduce), the same tokens are drawn, and the ratio statistics (variances of
        # differences of nearly equal log-probs) carry that rounding at up to ~3e-4 relative
        tolerance = 1e-6 if ra["step"] <= 1 else 1e-3
        # the policy loss is a sum of A (w - 1) terms up to the clip (the advantages sum to 0 in each group), so it
        # cancels to far below its terms (-8e-6 at step 2) and carries their rounding: judged on their scale, mean |A|
        # times the ratios' mean |log w| at either level (2.2e-7 at step 2, where the two differ by 1.9e-8 and a loss
        # off by 3% would exceed it)
        terms = rb.get("charts/advantage_abs", 0) * max(rb.get("ratio/abs_log_token", 0),
                                                         rb.get("ratio/abs_log_seq", 0))
        for k, v in rb.items():
            if isinstance(v, float) and v == v:
                floor = max(1e-9, tolerance * terms) if k == "losses/policy_loss" else 1e-9
                assert ra[k] == pytest.approx(v, rel=tolerance, abs=floor), (ra["step"], k, ra[k], v)
            elif k.startswith(("rewards/", "rollout/")):
                assert ra[k] == v, (ra["step"], k)
    import model as models

    loaded, _ = models.load_model(str(runs["fsdp"] / "final"), torch.device("cpu"), torch.float32)
    reference, _ = models.load_model(str(runs["ddp"] / "final"), torch.device("cpu"), torch.float32)
    assert type(loaded).__name__ == type(reference).__name__
    from safetensors.torch import load_file  # the head tied to the embeddings is saved once, as one process saves it
    assert set(load_file(runs["fsdp"] / "final" / "model.safetensors")) == \
        set(load_file(runs["ddp"] / "final" / "model.safetensors"))
    for (k, p), q in zip(loaded.state_dict().items(), reference.state_dict().values()):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-6, msg=k)


@pytest.mark.parametrize("flags,expected", [
    ([], "--fsdp shards the model over torchrun's processes"),
    (["--lora-rank", "4"], "--fsdp does not work with --lora-rank"),
])
def test_what_fsdp_does_not_do_is_refused_in_one_line(tmp_path, tiny_policy_dir, flags, expected):
    argv = ["--model", str(tiny_policy_dir), "--fsdp", "--output-dir", str(tmp_path)] + SMALL + flags
    if flags:  # under torchrun
        code, out, err = finish(torchrun(2, "train.py", argv))
    else:
        proc = subprocess.run([sys.executable, "train.py", *argv], cwd=ROOT, capture_output=True, text=True,
                              timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})
        code, err = proc.returncode, proc.stderr
    lines = [ln for ln in err.splitlines() if ln.startswith("error:")]
    assert code != 0 and lines and expected in lines[0], err[-2000:]
    assert not any(tmp_path.iterdir())  # nothing written


def test_a_sharded_checkpoint_resumes_exactly_and_reshards(tmp_path, tiny_policy_dir, capsys):
    """--fsdp --save-every: each rank writes its shards of the weights and AdamW moments (a torch.distributed.checkpoint
    folder, shards/), rank 0 the config, tokenizer and state.pt; SIGTERM to torchrun stops both ranks with one
    checkpoint, and resuming it logs the uninterrupted run's later steps exactly; a checkpoint written at 2 processes
    and one written at 1, each loaded at 1 and at 2, give the same weights and every AdamW moment (and not --model's);
    a 2-process run resumes from the 1-process checkpoint and a 1-process run from the 2-process one;
    `python -m plumbing.checkpoint --export` makes the shards a model folder with the same weights."""
    from plumbing import checkpoint

    base = ["--model", str(tiny_policy_dir), "--device", "cpu", "--fsdp", "--eval-every", "2"] + SMALL

    def run(n, *flags):
        code, out, err = finish(torchrun(n, "train.py", base + list(flags)))
        assert code == 0, err[-3000:]
        return out

    run(2, "--total-steps", "4", "--save-every", "2", "--keep-checkpoints", "2", "--output-dir", str(tmp_path / "a"))
    a = tmp_path / "a" / "gspo-np2-s0"
    saved = a / "checkpoints" / "step-000002"
    state = checkpoint.load_state(saved)  # weights_only: tensors and plain data
    assert state["sharded"] and json.loads((saved / "model" / "config.json").read_text())["architectures"] == \
        ["LlamaForCausalLM"]
    shards = sorted(f.name for f in (saved / "shards").iterdir())
    assert shards == [".metadata", "__0_0.distcp", "__1_0.distcp"], shards  # one file of shards per rank
    assert not list((saved / "model").glob("*.safetensors"))  # nothing gathered: the weights are in shards/
    # SIGTERM to torchrun (a scheduler's preemption) reaches both ranks: they stop after the same step, each writes
    # its shards of one checkpoint, and a resume under the same command logs the uninterrupted run's later steps
    job = torchrun(2, "train.py", base + ["--total-steps", "1000", "--output-dir", str(tmp_path / "sig")])
    log, deadline = tmp_path / "sig" / "gspo-np2-s0" / "metrics.jsonl", time.time() + 120
    while not (log.is_file() and len(log.read_text().splitlines()) >= 2) and time.time() < deadline:
        time.sleep(0.05)  # step 1 logged: the run is inside its steps
    job.send_signal(signal.SIGTERM)
    _, out, err = finish(job)
    assert "stopped by SIGTERM" in out, (out[-2000:], err[-2000:])
    (stopped,) = checkpoint.all_checkpoints(tmp_path / "sig" / "gspo-np2-s0" / "checkpoints")
    k = checkpoint.load_state(stopped)["step"]
    print(f"SIGTERM: both ranks stopped after step {k}")
    assert 1 <= k < 4, k  # (it ran on, past the reference's 4 steps, only on a machine far slower than this)
    run(2, "--total-steps", "4", "--resume", "auto", "--output-dir", str(tmp_path / "sig"))
    assert metrics_without_timing(tmp_path / "sig" / "gspo-np2-s0") == metrics_without_timing(a)

    run(1, "--total-steps", "2", "--save-every", "2", "--output-dir", str(tmp_path / "d"))
    one = next((tmp_path / "d").glob("*/checkpoints/step-000002"))
    start = models.load_model(str(tiny_policy_dir), torch.device("cpu"), torch.float32)[0]

    def reshard(n):  # both checkpoints loaded by n processes, gathered back
        argv = ["--reshard", str(tiny_policy_dir), str(tmp_path / f"at{n}"), str(saved), str(one)]
        code, _, err = finish(torchrun(n, "tests/plumbing/fsdp_exactness.py", argv))
        assert code == 0, err[-3000:]
        loaded = [torch.load(tmp_path / f"at{n}-{i}.pt", weights_only=True) for i in range(2)]
        assert all(r["processes"] == n and len(r["moments"]) == sum(1 for _ in start.parameters()) for r in loaded)
        return loaded

    of_saved = None
    for at_one, at_two in zip(reshard(1), reshard(2)):  # written at 2, then at 1: read alike by 1 and by 2
        assert at_one["weights"].keys() == at_two["weights"].keys()
        assert at_one["moments"].keys() == at_two["moments"].keys()
        assert all(torch.equal(at_one["weights"][k], at_two["weights"][k]) for k in at_one["weights"])
        assert all(torch.equal(at_one["moments"][k][m], at_two["moments"][k][m])
                   for k in at_one["moments"] for m in at_one["moments"][k])
        assert at_one["lr"] == at_two["lr"]
        moved = max(float((at_one["weights"][k] - v).abs().max()) for k, v in start.state_dict().items())
        assert moved > 0, moved  # the checkpoint's weights were read (trained: they moved), not --model's kept
        of_saved = at_two if of_saved is None else of_saved
    # one process, no torchrun, turns the 2-rank shards into an ordinary model folder holding the same weights
    exported = tmp_path / "exported"
    checkpoint.main(["--export", str(saved), str(exported)])
    assert f"wrote {exported}" in capsys.readouterr().out
    assert (exported / "model.safetensors").stat().st_mode & 0o777 == (exported / "config.json").stat().st_mode & 0o777
    model = models.load_model(str(exported), torch.device("cpu"), torch.float32)[0]
    assert all(torch.equal(v, of_saved["weights"][k]) for k, v in model.state_dict().items())
    for n, path, name in ((2, one, "e"), (1, saved, "f")):  # a run goes on at another number of processes
        out = run(n, "--total-steps", "3", "--resume", str(path), "--run-name", name,
                  "--output-dir", str(path.parents[2]))
        assert "resumed from" in out and "resharded" in out, out[-2000:]
        assert [r["step"] for r in metrics_without_timing(path.parents[2] / name)] == [3]


def test_bf16_gathers_linear_weights_in_bf16_and_computes_what_fp32_gathers_did(tmp_path, tiny_policy_dir):
    """Under bf16 autocast, ddp.shard gathers each layer's linear weights in bf16 (FSDP's mixed precision, gradients
    reduce-scattered in fp32) and the norms and root in fp32: GRPO with β 0.04, micro-batches and two epochs over 2
    ranks gives the loss of every weight gathered in fp32 bit for bit (a norm gathered in bf16 would not), the
    gradient norm to fp32's rounding (a gradient summed in another order); a forward keeps no layer's bf16 weights
    for its backward (fp32 gathers kept autocast's copy of each); and generation's gathered model is the linear
    weights at 2 bytes and the rest at 4, as ddp.gathered_bytes (the start-up line's count) says."""
    out = tmp_path / "bf16.json"
    code, _, err = finish(torchrun(2, "tests/plumbing/fsdp_exactness.py", ["--bf16", str(tiny_policy_dir), str(out)]))
    assert code == 0, err[-3000:]
    r = json.loads(out.read_text())
    mixed, fp32 = r["shard"], r["fp32 gathers"]
    print({k: r[k] for k in ("max_weight_diff", "max_weight_change", "diff_by_name")}, mixed["gathered"],
          fp32["gathered"])
    assert mixed["loss"] == fp32["loss"]
    assert abs(mixed["grad_norm"] - fp32["grad_norm"]) <= 1e-6 * fp32["grad_norm"]
    # AdamW's first steps divide each gradient by its own size, which magnifies fp32's last bit in tiny gradients
    assert r["max_weight_diff"] <= 0.01 * r["max_weight_change"] and r["max_weight_change"] > 0
    whole = fp32["gathered"]["torch.float32"]  # every weight at 4 bytes
    assert set(fp32["gathered"]) == {"torch.float32"}
    linear, rest = mixed["gathered"]["torch.bfloat16"] // 2, mixed["gathered"]["torch.float32"] // 4
    assert linear + rest == whole // 4 and linear > 0.8 * (linear + rest)
    assert mixed["counted"] == sum(mixed["gathered"].values())
    assert mixed["kept for backward"] == 0 and fp32["kept for backward"] == 2 * linear


def test_rank_0_alone_reads_the_weights_and_a_model_that_does_not_load_is_one_line(tmp_path, tiny_policy_dir):
    """Under --fsdp (World.from_main) rank 0 reads the model's weights into host memory and the other ranks receive a
    skeleton and, as the model is sharded, their shards from it: with β 0.04 (the reference a copy of the starting
    policy, sharded the same way) rank 0 loads --model once and rank 1 never, and the run finishes (that its numbers
    are data parallel's: the run test above). A model that does not load, met by rank 0 alone, reaches rank 1 too:
    one error line (rank 0's), exit 2, nothing written, rank 1 loading nothing."""
    argv = ["--total-steps", "1", "--eval-every", "1", "--device", "cpu", "--fsdp", "--beta", "0.04"] + SMALL
    seen = {}
    bad = tmp_path / "bad-model"
    shutil.copytree(tiny_policy_dir, bad)
    (bad / "model.safetensors").write_bytes(b"not a safetensors file")
    for name, model in (("good", tiny_policy_dir), ("bad", bad)):
        (tmp_path / name).mkdir()
        runs = tmp_path / f"{name}-runs"
        code, out, err = finish(torchrun(2, "tests/plumbing/fsdp_loading.py", [
            str(tmp_path / name), "--model", str(model), "--output-dir", str(runs)] + argv))
        seen[name] = code, out, err, [json.loads((tmp_path / name / f"rank{r}.json").read_text()) for r in (0, 1)]
    code, out, err, ranks = seen["good"]
    assert code == 0, err[-3000:]
    print("host high-water mark at the end of start-up and of the run, MiB (rank 0, rank 1):",
          [(r["startup"] // 2**20, r["end"] // 2**20) for r in ranks])
    assert ranks[0]["loaded"] == [str(tiny_policy_dir)] and ranks[1]["loaded"] == []
    code, out, err, ranks = seen["bad"]
    lines = [ln for ln in err.splitlines() if ln.startswith("error:")]
    assert code != 0 and len(lines) == 1 and "could not load model" in lines[0], err[-3000:]
    assert "another process" not in err and ranks[1]["loaded"] == []
    assert not (tmp_path / "bad-runs").exists() or not any((tmp_path / "bad-runs").iterdir())


def test_a_checkpoint_after_a_scoring_pass_without_gradient_saves_and_resumes(tmp_path, tiny_policy_dir):
    """--log-prefix-spread scores every row once more after the update, a forward with no backward, which leaves the
    root's weights gathered: a checkpoint written then read the gathered tensors and failed (KeyError in DCP's
    optimizer state). Now the model is resharded before its state is read: a 3-step run saving every step finishes,
    and resuming its step-2 checkpoint logs the same step 3 (the prefix spread included)."""
    base = ["--model", str(tiny_policy_dir), "--device", "cpu", "--fsdp", "--eval-every", "3", "--total-steps", "3",
            "--log-prefix-spread", "True", "--output-dir", str(tmp_path)] + SMALL
    code, out, err = finish(torchrun(2, "train.py", base + ["--save-every", "1", "--keep-checkpoints", "3"]))
    assert code == 0, err[-3000:]
    run = tmp_path / "gspo-np2-s0"
    code, out, err = finish(torchrun(2, "train.py", base + ["--resume", str(run / "checkpoints" / "step-000002"),
                                                           "--run-name", "resumed"]))
    assert code == 0 and "resumed from" in out, err[-3000:]
    whole, resumed = metrics_without_timing(run), metrics_without_timing(tmp_path / "resumed")
    assert [r["step"] for r in resumed] == [3] and any(k.startswith("prefix/") for k in resumed[0])
    assert resumed[0] == whole[-1]
