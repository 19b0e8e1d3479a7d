"""bench.py compares equal work: the TRL config it builds does the same arithmetic as our side, and both sides,
run, count the same work per RL step."""

import warnings

import pytest

GRPOConfig = pytest.importorskip("trl", reason="bench.py's comparison needs trl (in requirements-dev.txt)").GRPOConfig

from tools import bench


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_trl_config_matches_our_side(tmp_path, dtype):
    cfg = bench.CONFIGS["tiny"]
    args, loss = bench.our_args(cfg, dtype, "cpu")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        config = GRPOConfig(**bench.trl_config(cfg, steps=3, dtype=dtype, device="cpu", output_dir=str(tmp_path)))
    # the checkpointing switch by the name this transformers reads without a warning (renamed in 5.23)
    assert not [str(w.message) for w in caught if "checkpointing" in str(w.message)]
    # precision: TRL's default is bf16 autocast; it must be what our side computes in, set explicitly
    assert config.bf16 is (dtype == "bfloat16") and args.dtype == dtype
    assert not config.fp16 and not config.gradient_checkpointing  # no hidden extra forward pass either
    # the objective: GSPO's sequence-level ratio, its clip range, no KL, std-scaled group advantages
    assert (config.importance_sampling_level, config.loss_type) == ("sequence", "grpo") == \
        (loss.importance_sampling_level, bench.TRL_LOSS_TYPE[loss.loss_agg_mode])
    assert (config.epsilon, config.epsilon_high, config.beta) == (loss.epsilon, loss.epsilon_high, loss.beta) \
        == (3e-4, 4e-4, 0.0)
    assert config.scale_rewards == loss.scale_rewards == "group"
    # one rollout of P*G rows split into the same number of optimizer steps, one epoch
    rows = cfg["num_prompts"] * cfg["num_generations"]
    assert config.steps_per_generation == args.num_minibatches == 4
    assert config.per_device_train_batch_size * config.steps_per_generation == rows
    assert config.num_iterations == args.num_epochs == 1 and config.max_steps == 4 * (3 + 1)
    # sampling and optimizer
    assert (config.num_generations, config.max_completion_length) == (cfg["num_generations"], cfg["max_new_tokens"])
    assert (config.temperature, config.top_p, config.top_k) == (args.temperature, 1.0, 0)
    assert (config.learning_rate, config.weight_decay, config.max_grad_norm) == \
        (args.lr, args.weight_decay, args.max_grad_norm)
    assert config.use_cpu


@pytest.mark.slow
def test_both_sides_run_and_count_the_same_work_per_rl_step():
    """The documented command runs TRL's GRPOTrainer beside ours (one process each, one timed step after the warm-up)
    and prints, read back from each side as it ran, the same work per RL step: P x G completions from one rollout,
    four optimizer steps. TRL generating per optimizer step, or splitting the rollout otherwise, would show here."""
    import subprocess
    import sys
    from pathlib import Path

    out = subprocess.run([sys.executable, "-m", "tools.bench", "--sides", "ours", "trl", "--repeats", "1", "--steps",
                          "1"], capture_output=True, text=True, cwd=Path(__file__).resolve().parents[2], timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    cfg = bench.CONFIGS["tiny"]
    work = f"per RL step {cfg['num_prompts'] * cfg['num_generations']} completions from 1 rollout(s), 4 optimizer steps"
    sides = [ln.strip() for ln in out.stdout.splitlines() if ln.startswith(("  ours:", "  trl:"))]
    assert len(sides) == 2 and all(ln.endswith(work) and "cpu, float32 weights, bf16 autocast off" in ln
                                   for ln in sides), out.stdout
    step = next(ln for ln in out.stdout.splitlines() if ln.startswith("seconds per RL step")).split()
    ours, trl, ratio = float(step[4]), float(step[6]), float(step[8])  # median (min-max) per side, then ours/trl
    assert ours > 0 and trl > 0 and abs(ratio - ours / trl) <= 0.006, step
