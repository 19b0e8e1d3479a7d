"""LoRA through peft: the policy starts equal to the base, the reference policy is the base (adapter off, no second
copy), only the adapter trains, the final folder holds the adapter and a merged model that --model loads."""

import json

import pytest
import torch
from safetensors.torch import load_file

pytest.importorskip("peft", reason="LoRA needs peft (in requirements-dev.txt; optional for users)")

import losses
import model as models
import rollout
import train
from plumbing import run as runs

from conftest import SMALL_ARGS, final_weights, metrics_without_timing  # noqa: E402


def scored_batch(policy, tokenizer, n=6):
    """A fixed batch of prompt + sampled completion rows, and its completion length."""
    args, _ = runs.resolve(train.Args(num_prompts=2, num_generations=3, max_new_tokens=16))
    torch.manual_seed(0)
    examples = runs.load_data(args)[0][:2]
    ro = train.sample_groups(policy.eval(), tokenizer, examples, args).ro
    return ro.input_ids[:n], ro.attention_mask[:n], ro.completion_ids.shape[1], ro.completion_mask[:n].float()


def logprobs(model, batch):
    ids, attn, t, _ = batch
    with torch.no_grad():
        return rollout.completion_logprobs(model, ids, attn, t)


def test_lora_starts_as_the_base_and_its_reference_is_the_base(tiny_policy_dir):
    base, tok = models.load_model(str(tiny_policy_dir), torch.device("cpu"), torch.float32)
    batch = scored_batch(base, tok)
    before = logprobs(base, batch)
    torch.manual_seed(1)
    policy = models.add_lora(base, rank=4, alpha=8.0, targets=models.LORA_TARGETS)
    ref = models.AdapterOff(policy)
    assert torch.equal(logprobs(policy, batch), before)  # B = 0: W x + 0 is W x, to the bit
    mask = batch[3]
    assert losses.masked_mean(losses.k3_kl(logprobs(policy, batch), logprobs(ref, batch)), mask) == 0.0
    trainable = {n for n, p in policy.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)  # only the adapter trains
    with torch.no_grad():  # move the adapter: the policy changes, the reference stays the base exactly
        for n, p in policy.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.5)
    assert not torch.allclose(logprobs(policy, batch), before)
    assert torch.equal(logprobs(ref, batch), before)
    assert losses.masked_mean(losses.k3_kl(logprobs(policy, batch), logprobs(ref, batch)), mask) > 0


def test_a_lora_run_saves_its_adapter_and_a_merged_model_that_loads(tmp_path, tiny_policy_dir):
    args = train.Args(**{**SMALL_ARGS, "model": str(tiny_policy_dir), "output_dir": str(tmp_path), "algo": "grpo",
                         "total_steps": 2, "lora_rank": 4, "merge_lora": True})
    train.train(args)
    final = tmp_path / "grpo-lora4-s0" / "final"
    adapter = load_file(final / "adapter_model.safetensors")
    assert adapter and all("lora_" in k for k in adapter)
    assert any(v.abs().sum() > 0 for k, v in adapter.items() if "lora_B" in k)  # the adapter learned something
    assert not (final / "model.safetensors").exists()  # no full copy next to the adapter
    mode = lambda f: f.stat().st_mode & 0o777  # noqa: E731 (weights readable as their config is: not 0600 alone)
    assert mode(final / "adapter_model.safetensors") == mode(final / "adapter_config.json")
    assert mode(final / "merged" / "model.safetensors") == mode(final / "merged" / "config.json")
    config = json.loads((tmp_path / "grpo-lora4-s0" / "config.json").read_text())
    assert config["lora_rank"] == 4 and config["lora_alpha"] == 8.0  # α defaults to 2r
    rows = [json.loads(line) for line in (tmp_path / "grpo-lora4-s0" / "metrics.jsonl").open()]
    assert all(r["losses/kl_ref"] >= 0 for r in rows[1:])  # β 0.04: the KL to the base, adapter off

    base, tok = models.load_model(str(tiny_policy_dir), torch.device("cpu"), torch.float32)
    batch = scored_batch(base, tok)
    peft_policy = models.add_lora(base, 4, 8.0, models.LORA_TARGETS, adapter=final)
    merged, _ = models.load_model(str(final / "merged"), torch.device("cpu"), torch.float32)  # what --model loads
    a, b = logprobs(peft_policy, batch), logprobs(merged, batch)
    assert torch.allclose(a, b, atol=1e-4) and not torch.equal(a, logprobs(models.AdapterOff(peft_policy), batch))


@pytest.mark.slow
def test_lora_resume_continues_exactly(tmp_path, tiny_policy_dir):
    common = {**SMALL_ARGS, "model": str(tiny_policy_dir), "algo": "grpo", "lora_rank": 4, "save_every": 2}
    train.train(train.Args(**common, output_dir=str(tmp_path / "a"), total_steps=4))
    train.train(train.Args(**common, output_dir=str(tmp_path / "b"), total_steps=2))
    (tmp_path / "b" / "grpo-lora4-s0" / "summary.json").unlink()  # as if killed after its step-2 checkpoint
    assert (tmp_path / "b" / "grpo-lora4-s0" / "checkpoints" / "step-000002" / "model" / "adapter_model.safetensors").is_file()
    train.train(train.Args(**common, output_dir=str(tmp_path / "b"), total_steps=4, resume="auto"))
    a, b = tmp_path / "a" / "grpo-lora4-s0", tmp_path / "b" / "grpo-lora4-s0"
    assert (a / "final" / "adapter_model.safetensors").is_file()  # the adapter, not a whole model
    wa, wb = final_weights(a), final_weights(b)
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    assert metrics_without_timing(a) == metrics_without_timing(b)


def test_the_adapters_start_is_drawn_from_its_seed_alone(tiny_policy_dir):
    """A (lora_A) is drawn from add_lora's seed, whatever the global RNG holds: every rank of a torchrun job starts
    from the same adapter, and a resumed run from the same one as the first."""
    def lora_a(seed: int, global_seed: int) -> list[torch.Tensor]:
        base, _ = models.load_model(str(tiny_policy_dir), torch.device("cpu"), torch.float32)
        torch.manual_seed(global_seed)
        policy = models.add_lora(base, rank=4, alpha=8.0, targets=models.LORA_TARGETS, seed=seed)
        return [p.detach().clone() for n, p in policy.named_parameters() if "lora_A" in n]

    first, again, other = lora_a(3, global_seed=0), lora_a(3, global_seed=1), lora_a(4, global_seed=0)
    assert first and all(torch.equal(a, b) for a, b in zip(first, again))
    assert not any(torch.equal(a, b) for a, b in zip(first, other))


def test_an_adapter_over_a_gguf_base_saves_without_peft_warning_of_a_missing_config(tmp_path, tiny_policy_dir):
    """A base loaded from a .gguf file has no config.json beside it; peft then warned at every checkpoint and at
    final/ that it "will assume that the vocabulary was not modified" (true: no adapter on the embeddings)."""
    import warnings

    policy, _ = models.load_model(str(tiny_policy_dir), torch.device("cpu"), torch.float32)
    policy = models.add_lora(policy, 4, 8.0, models.LORA_TARGETS)
    (tmp_path / "gguf-dir").mkdir()  # where a .gguf file would sit: no config.json
    policy.peft_config["default"].base_model_name_or_path = str(tmp_path / "gguf-dir")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        policy.save_pretrained(tmp_path / "plain")  # peft's own save warns (the stand-in is right)
    assert any("Could not find a config file" in str(w.message) for w in seen)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        models.save_pretrained(policy, tmp_path / "ours")
    assert not any("Could not find a config file" in str(w.message) for w in seen)
    assert (tmp_path / "ours" / "adapter_model.safetensors").is_file()


def test_a_lora_final_without_merge_lora_holds_the_adapter_alone_in_fp32(tmp_path, tiny_policy_dir):
    """save_final without --merge-lora writes the adapter and tokenizer, no merged copy of the base; the adapter keeps
    the fp32 it trained in even where the base's own dtype is bf16 (only a whole model is published in its own)."""
    plain, tok = models.load_model(str(tiny_policy_dir), torch.device("cpu"), torch.float32)
    plain.to(torch.bfloat16).save_pretrained(tmp_path / "bf16")
    tok.save_pretrained(tmp_path / "bf16")
    base, tok = models.load_model(str(tmp_path / "bf16"), torch.device("cpu"), torch.float32)
    assert not models.is_lora(base) and models.published_dtype(base) == torch.bfloat16
    policy = models.add_lora(base, 4, 8.0, models.LORA_TARGETS)
    assert models.is_lora(policy)
    models.save_final(policy, tok, tmp_path / "final", merge=False)
    adapter = load_file(tmp_path / "final" / "adapter_model.safetensors")
    assert adapter and all(v.dtype == torch.float32 for v in adapter.values())
    assert not (tmp_path / "final" / "merged").exists() and not (tmp_path / "final" / "model.safetensors").exists()
