"""Masks and log-probs: what the trainer scores must be what the sampler drew."""

import pytest
import torch

import model as models
import rollout

EOS = 1


def test_mask_keeps_the_first_eos_and_drops_what_follows():
    ids = torch.tensor([[5, 6, EOS, 0, 0], [5, 6, 7, 8, 9], [EOS, 0, 0, 0, 0]])
    mask, truncated = rollout.completion_mask(ids, [EOS])
    assert mask.tolist() == [[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]]
    assert truncated.tolist() == [False, True, False]


def test_mask_when_pad_equals_eos():
    # generate pads with EOS after the first EOS; only the first one is part of the completion
    ids = torch.tensor([[5, EOS, EOS, EOS], [EOS, EOS, EOS, EOS], [5, 6, 7, EOS]])
    mask, truncated = rollout.completion_mask(ids, [EOS])
    assert mask.tolist() == [[1, 1, 0, 0], [1, 0, 0, 0], [1, 1, 1, 1]]
    assert not truncated.any()


def test_left_padded_logprobs_equal_unpadded_forward(tiny_policy_dir, cpu):
    policy, tok = models.load_model(str(tiny_policy_dir), cpu, torch.float32)
    torch.manual_seed(0)
    prompts = ["7 mod 3 =", "47 mod 13 =", "100 mod 17 ="]  # different lengths: rows 0, 1 are left-padded
    ro = rollout.generate(policy, tok, prompts, max_new_tokens=12, temperature=1.0)
    assert ro.prompt_mask[0, 0] == 0  # padding really is on the left
    t = ro.completion_ids.shape[1]
    batched = rollout.completion_logprobs(policy, ro.input_ids, ro.attention_mask, t, temperature=0.7)
    for i in range(3):
        keep = ro.attention_mask[i].bool()
        ids = ro.input_ids[i][keep].unsqueeze(0)
        with torch.no_grad():
            logits = policy(input_ids=ids).logits[0, -t - 1:-1] / 0.7  # plain forward, no padding
        expected = torch.log_softmax(logits, -1).gather(-1, ids[0, -t:].unsqueeze(-1)).squeeze(-1)
        valid = ro.completion_mask[i].bool()
        assert torch.allclose(batched[i][valid], expected[valid], atol=1e-5)


def test_a_tokenizer_saved_with_right_padding_is_made_to_pad_left(tiny_policy_dir, cpu, tmp_path):
    """Many hub tokenizers pad on the right; generate needs the prompts' padding on the left (prepare sets it)."""
    import json
    import shutil

    folder = shutil.copytree(tiny_policy_dir, tmp_path / "model")
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "padding_side": "right"}))
    policy, tok = models.load_model(str(folder), cpu, torch.float32)
    assert tok.padding_side == "left"
    ro = rollout.generate(policy, tok, ["7 mod 3 =", "100 mod 17 ="], max_new_tokens=4, temperature=1.0)
    assert ro.prompt_mask[0, 0] == 0 and ro.prompt_mask[0, -1] == 1  # the shorter prompt padded before its text


def test_entropy_matches_definition(tiny_policy_dir, cpu):
    policy, tok = models.load_model(str(tiny_policy_dir), cpu, torch.float32)
    enc = tok(["5 mod 3 = 5-3=2"], return_tensors="pt")
    logp, ent = rollout.completion_logprobs(policy, enc["input_ids"], enc["attention_mask"], 4, 1.3, with_entropy=True)
    with torch.no_grad():
        logits = policy(**enc).logits[0, -5:-1] / 1.3
    p = torch.softmax(logits, -1)
    assert torch.allclose(ent[0], -(p * torch.log(p)).sum(-1), atol=1e-5)


def test_concat_pads_prompts_left_and_completions_right():
    a = rollout.Rollout(torch.tensor([[3, 4]]), torch.tensor([[1, 1]]), torch.tensor([[5, EOS]]),
                        torch.tensor([[1, 1]]), torch.tensor([False]))
    b = rollout.Rollout(torch.tensor([[3]]), torch.tensor([[1]]), torch.tensor([[5, 6, EOS]]),
                        torch.tensor([[1, 1, 1]]), torch.tensor([False]))
    c = rollout.Rollout.concat([a, b], pad_id=0)
    assert c.prompt_ids.tolist() == [[3, 4], [0, 3]] and c.prompt_mask.tolist() == [[1, 1], [0, 1]]
    assert c.completion_ids.tolist() == [[5, EOS, 0], [5, 6, EOS]]
    assert c.completion_mask.tolist() == [[1, 1, 0], [1, 1, 1]]
    assert c.sampler_logp is None  # nothing kept, nothing invented


def test_concat_and_select_carry_the_sampler_logprobs():
    a = rollout.Rollout(torch.tensor([[3]]), torch.tensor([[1]]), torch.tensor([[5, EOS]]), torch.tensor([[1, 1]]),
                        torch.tensor([False]), torch.tensor([[-0.5, -0.25]]), torch.tensor([[1.0, 2.0]]))
    b = rollout.Rollout(torch.tensor([[3]]), torch.tensor([[1]]), torch.tensor([[EOS]]), torch.tensor([[1]]),
                        torch.tensor([False]), torch.tensor([[-0.75]]), torch.tensor([[0.5]]))
    c = rollout.Rollout.concat([a, b], pad_id=0)
    assert c.sampler_logp.tolist() == [[-0.5, -0.25], [-0.75, 0.0]]
    assert c.sampler_entropy.tolist() == [[1.0, 2.0], [0.5, 0.0]]
    assert c.select(torch.tensor([1])).sampler_logp.tolist() == [[-0.75, 0.0]]


def test_sampler_logprobs_equal_a_recomputed_forward(tiny_policy_dir, cpu):
    """pi_old kept from generate's own logits is the policy's distribution: a separate forward pass over the
    finished rollout agrees to float rounding (far inside GSPO's 3e-4 clip range), entropy included."""
    policy, tok = models.load_model(str(tiny_policy_dir), cpu, torch.float32)
    torch.manual_seed(0)
    prompts = ["7 mod 3 =", "47 mod 13 =", "100 mod 17 ="] * 2  # left-padded rows too
    ro = rollout.generate(policy, tok, prompts, max_new_tokens=16, temperature=0.7)
    with torch.no_grad():
        logp, ent = rollout.completion_logprobs(policy, ro.input_ids, ro.attention_mask, ro.completion_ids.shape[1],
                                                temperature=0.7, with_entropy=True)
    valid = ro.completion_mask.bool()
    assert ro.sampler_logp.shape == logp.shape
    assert (ro.sampler_logp - logp)[valid].abs().max() < 1e-4
    assert (ro.sampler_entropy - ent)[valid].abs().max() < 1e-4
    seq_log_ratio = ((logp - ro.sampler_logp) * valid).sum(1) / valid.sum(1)  # GSPO's log s_i at theta = theta_old
    assert seq_log_ratio.abs().max() < 1e-5
    assert (ro.sampler_logp[valid] < 0).all()  # real log-probs, not zeros


def test_sampler_logprobs_are_those_of_the_logits_generate_drew_from(tiny_policy_dir, cpu, monkeypatch):
    """The recorder keeps one (B, V) row at a time; what it records equals log softmax(raw logits / T) at the drawn
    tokens, taken from generate's own stacked logits, bit for bit (so it saw the logits before the temperature warper
    and divided once), entropy included."""
    policy, tok = models.load_model(str(tiny_policy_dir), cpu, torch.float32)
    seen = []
    real = policy.generate
    monkeypatch.setattr(policy, "generate", lambda *a, **k: seen.append(real(*a, **{**k, "output_logits": True}))
                        or seen[-1])
    torch.manual_seed(0)
    ro = rollout.generate(policy, tok, ["7 mod 3 =", "47 mod 13 ="] * 3, max_new_tokens=16, temperature=0.7)
    logp, ent = rollout.token_logprobs(torch.stack(seen[0].logits, dim=1), ro.completion_ids, 0.7, with_entropy=True)
    assert torch.equal(ro.sampler_logp, logp) and torch.equal(ro.sampler_entropy, ent)
    greedy = rollout.generate(policy, tok, ["7 mod 3 ="], max_new_tokens=4, greedy=True)
    assert greedy.sampler_logp is None  # greedy decoding samples from no distribution


def test_mismatch_metrics_read_what_they_say():
    import metrics as diagnostics

    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 0.0, 0.0]])
    mu = torch.full((2, 4), -1.0)
    old = mu + torch.tensor([[0.3, -0.1, 0.1, 9.0], [1e-4, 2e-4, 0.0, 9.0]])  # the 9s are padding
    m = diagnostics.mismatch_metrics(old, mu, mask)
    assert m["mismatch/abs_max"] == pytest.approx(0.3) and m["mismatch/abs_mean"] == pytest.approx(0.5003 / 5)
    assert m["mismatch/token_frac"] == pytest.approx(1 / 5)  # only 0.3 is beyond 0.2
    assert m["mismatch/seq_frac"] == pytest.approx(1 / 2)  # row 0's mean 0.1 > 3e-4; row 1's 1.5e-4 is not
    d = torch.tensor([0.3, -0.1, 0.1, 1e-4, 2e-4])
    assert m["mismatch/kl_k3"] == pytest.approx(float((d.exp() - 1 - d).mean()), rel=1e-5)
    assert diagnostics.mismatch_metrics(mu, mu, mask)["mismatch/kl_k3"] == 0.0


# ---------------------------------------------------------------------------------------------------------------
# Log-probs a chunk of positions at a time, from the last hidden states (issue 48)
# ---------------------------------------------------------------------------------------------------------------

CHUNKED_CASES = {  # the objective, and what else the loss reads
    "gspo": dict(algo="gspo"),
    "grpo, beta > 0": dict(algo="grpo"),
    "grpo, LoRA, beta > 0": dict(algo="grpo", lora=True),
    "dapo, entropy bonus": dict(algo="dapo", entropy_coef=0.01),
    "grpo, top-entropy tokens": dict(algo="grpo", beta=0.0, top_entropy_quantile=0.5),
    "clip-cov": dict(algo="grpo", beta=0.0, surrogate="clip_cov"),
    "kl-cov": dict(algo="grpo", beta=0.0, surrogate="kl_cov"),
}


def loss_and_grads(policy, ref, ro, cfg, adv, chunk, dtype=None):
    """One micro-batch's loss as train.update makes it (policy_loss over rollout.logprobs, the reference's too),
    and the gradient of every trained parameter."""
    import losses

    policy.zero_grad(set_to_none=True)
    rows = torch.arange(len(ro.lengths))
    mask = ro.completion_mask.float()
    needs_entropy = "grad" if cfg.entropy_coef else cfg.top_entropy_quantile < 1.0
    out = rollout.logprobs(policy, ro, rows, 0.8, needs_entropy, chunk)
    logp, entropy = out if needs_entropy else (out, None)
    with torch.no_grad():
        old = rollout.logprobs(policy, ro, rows, 0.8, chunk=chunk) - 0.05 * torch.sin(torch.arange(mask.numel())).view_as(mask)
        ref_logp = None if ref is None else rollout.logprobs(ref, ro, rows, 0.8, chunk=chunk)
    loss = losses.policy_loss(logp, old, adv, mask, losses.StepNorm.of(mask, mask.shape[1]), cfg, ref_logp,
                              entropy=entropy, generator=torch.Generator().manual_seed(0))
    loss.backward()
    return loss.detach(), logp.detach(), [p.grad.clone() for p in policy.parameters() if p.requires_grad]


@pytest.mark.parametrize("case", list(CHUNKED_CASES))
def test_chunked_logprobs_give_the_whole_logits_values_and_gradients(tiny_policy_dir, case):
    """--logprob-chunk 5 against whole logits (-1) on the same rollout: the loss, the log-probs and every gradient
    equal within 1e-6 in fp32, gradients relative to their largest entry (the chunks' own rounding of the
    log-softmax's backward, no more)."""
    import copy
    from dataclasses import replace

    import losses

    spec = dict(CHUNKED_CASES[case])
    lora, algo = spec.pop("lora", False), spec.pop("algo")
    cfg = replace(losses.PRESETS[algo], **spec)
    policy, tok = models.load_model(str(tiny_policy_dir), torch.device("cpu"), torch.float32)
    torch.manual_seed(0)
    ro = rollout.generate(policy, tok, ["7 mod 3 =", "47 mod 13 =", "100 mod 17 =", "9 mod 4 ="] * 2, 24)
    ref = None
    if lora:
        policy = models.add_lora(policy, 4, 8.0, models.LORA_TARGETS)
        ref = models.AdapterOff(policy) if cfg.beta > 0 else None
    elif cfg.beta > 0:
        ref = models.frozen_reference(copy.deepcopy(policy))
    adv = torch.linspace(-1.0, 1.2, len(ro.lengths))
    whole = loss_and_grads(policy, ref, ro, cfg, adv, chunk=-1)
    chunked = loss_and_grads(policy, ref, ro, cfg, adv, chunk=5)
    assert ro.completion_ids.numel() > 5 * 10  # many chunks
    torch.testing.assert_close(chunked[0], whole[0], rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(chunked[1], whole[1], rtol=0, atol=1e-6)
    scale = max(float(g.abs().max()) for g in whole[2])  # the largest gradient entry
    assert max(float((a - b).abs().max()) for a, b in zip(chunked[2], whole[2])) <= 1e-6 * scale, case


def test_chunked_logprobs_under_bf16_autocast_within_its_rounding(tiny_policy_dir):
    """The same under bf16 autocast over fp32 weights: the log-probs within fp32's rounding of the same bf16 logits
    (the head runs in bf16 on the same rows; a fused log-softmax against logit - logsumexp), the gradients within
    bf16's rounding (the chunks' sums of the head's gradient are kept in fp32)."""
    import losses

    policy, tok = models.load_model(str(tiny_policy_dir), torch.device("cpu"), torch.float32)
    policy = models.compute_in(policy, torch.bfloat16)
    torch.manual_seed(0)
    ro = rollout.generate(policy, tok, ["7 mod 3 =", "47 mod 13 ="] * 4, 24)
    adv = torch.linspace(-1.0, 1.2, len(ro.lengths))
    whole = loss_and_grads(policy, None, ro, losses.PRESETS["gspo"], adv, chunk=-1)
    chunked = loss_and_grads(policy, None, ro, losses.PRESETS["gspo"], adv, chunk=5)
    torch.testing.assert_close(chunked[1], whole[1], rtol=0, atol=1e-6)
    scale = max(float(g.abs().max()) for g in whole[2])
    assert max(float((a - b).abs().max()) for a, b in zip(chunked[2], whole[2])) <= 2 ** -7 * scale


def test_a_model_whose_logits_are_not_its_head_is_refused_in_the_chunked_path(tiny_policy_dir):
    """A model whose logits are not its head's output under the map its config names (here a cap no config names)
    is refused by the chunked path in one line that names whole logits (-1), which still work."""
    policy, tok = models.load_model(str(tiny_policy_dir), torch.device("cpu"), torch.float32)
    real = policy.forward

    def capped(*a, **kw):  # a soft cap after the head, as Gemma 2's final_logit_softcapping
        out = real(*a, **kw)
        out.logits = 30 * torch.tanh(out.logits / 30)
        return out

    policy.forward = capped
    ids, mask = torch.randint(5, 100, (2, 20)), torch.ones(2, 20, dtype=torch.long)
    with pytest.raises(rollout.HeadError, match="--logprob-chunk -1"):
        rollout.completion_logprobs(policy, ids, mask, 12, chunk=4)
    assert rollout.completion_logprobs(policy, ids, mask, 12, chunk=-1).shape == (2, 12)


HEAD_MAPS = {  # a small cap, scale and divisor, so that each map moves the logits far beyond check_head's 1e-3
    "gemma2": dict(model_type="gemma2", head_dim=8, final_logit_softcapping=1.5, tie_word_embeddings=True),
    "granite": dict(model_type="granite", logits_scaling=0.25),
    "cohere": dict(model_type="cohere", logit_scale=4.0, tie_word_embeddings=True),
}


@pytest.mark.parametrize("arch", list(HEAD_MAPS))
def test_chunked_logprobs_apply_the_map_a_model_makes_of_its_heads_output(arch):
    """Gemma 2 soft-caps its logits after the head, Granite divides them, Cohere scales them: the chunked path applies
    the map the config names (rollout.LogitMap), so its log-probs, entropies and gradients (fp32, temperature 0.7) are
    the model's own logits' computed in float64, within 1e-6 (log-probs and gradients relative; an entropy, log Z -
    E[z], relative to log Z: the difference keeps the terms' rounding), where the head alone is refused. (The
    whole-logits path is no closer: 3.2e-7 of log Z at Cohere's, 3.5e-6 absolute, on an AVX-512 Xeon.)"""
    import copy

    import transformers

    tok = models.build_tokenizer()
    spec = dict(HEAD_MAPS[arch])
    config = transformers.AutoConfig.for_model(spec.pop("model_type"), vocab_size=len(tok), hidden_size=32,
                                               intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                               num_key_value_heads=2, pad_token_id=tok.pad_token_id,
                                               bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, **spec)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    model.get_output_embeddings().weight.data.mul_(3)  # logits of units: the cap and the scales bite
    ids, mask = torch.randint(5, len(tok), (3, 20)), torch.ones(3, 20, dtype=torch.long)
    weights = torch.linspace(-1.0, 1.0, 36, dtype=torch.float64).view(3, 12)

    def objective(logp, entropy):  # a stand-in loss that reads every log-prob and every entropy
        return (logp * weights).sum() + (entropy * weights.flip(-1)).sum()

    logp, entropy = rollout.completion_logprobs(model, ids, mask, 12, 0.7, "grad", chunk=4)
    objective(logp.double(), entropy.double()).backward()
    exact = copy.deepcopy(model).double()
    exact.zero_grad(set_to_none=True)
    z = exact(input_ids=ids, attention_mask=mask).logits[:, -13:-1] / 0.7  # (3, 12, V) the model's own, float64
    logp_all = torch.log_softmax(z, -1)
    exact_logp, exact_entropy = logp_all.gather(-1, ids[:, -12:, None]).squeeze(-1), -(logp_all.exp() * logp_all).sum(-1)
    objective(exact_logp, exact_entropy).backward()
    torch.testing.assert_close(logp.detach().double(), exact_logp.detach(), rtol=1e-6, atol=1e-6)
    log_z = torch.logsumexp(z, -1).detach()  # (3, 12) the scale an fp32 entropy rounds at (1.3e-6 at Granite's)
    assert float(((entropy.detach().double() - exact_entropy.detach()).abs() / log_z.abs()).max()) <= 1e-6, arch
    grads = [(q.grad.double(), e.grad) for q, e in zip(model.parameters(), exact.parameters())]
    scale = max(float(e.abs().max()) for _, e in grads)
    assert max(float((g - e).abs().max()) for g, e in grads) <= 1e-6 * scale, arch

    logit_map, head, hidden = rollout.LogitMap.of(model), model.get_output_embeddings(), torch.randn(3, 1, 32)
    with torch.no_grad():  # the map matters: without it, the model's logits are not its head's
        logits = logit_map(head(hidden))
        with pytest.raises(rollout.HeadError):
            rollout.check_head(head, hidden, logits, None)
        rollout.check_head(head, hidden, logits, None, logit_map)


def test_the_default_makes_small_logits_whole_and_chunks_large_ones(tiny_policy_dir, monkeypatch):
    """--logprob-chunk 0: a micro-batch's logits of up to WHOLE_ENTRIES (2^26) are made whole (all of the embedded
    model's, so its default run computes as before; SmolLM2's at 8 rows x 128 tokens), larger ones in chunks of
    CHUNK_ENTRIES / V positions (110 at Qwen's 151,936-token vocabulary, where 8 rows x 512 tokens are chunked)."""
    assert 16 * 8 * 64 * 100 <= rollout.WHOLE_ENTRIES and 8 * 128 * 49152 <= rollout.WHOLE_ENTRIES
    assert rollout.CHUNK_ENTRIES // 151936 == 110 and 8 * 512 * 151936 > rollout.WHOLE_ENTRIES
    policy, _ = models.load_model(str(tiny_policy_dir), torch.device("cpu"), torch.float32)
    ids, mask = torch.randint(5, 100, (3, 20)), torch.ones(3, 20, dtype=torch.long)  # 36 positions x V 100
    calls, chunked = [], rollout.chunked_logprobs
    monkeypatch.setattr(rollout, "chunked_logprobs", lambda *a: calls.append(a[-1]) or chunked(*a))
    whole = rollout.completion_logprobs(policy, ids, mask, 12)
    assert calls == []
    monkeypatch.setattr(rollout, "WHOLE_ENTRIES", 36 * 100 - 1)
    monkeypatch.setattr(rollout, "CHUNK_ENTRIES", 8 * 100)
    torch.testing.assert_close(rollout.completion_logprobs(policy, ids, mask, 12), whole, rtol=0, atol=1e-6)
    assert calls == [8]  # chunks of 8 positions


def test_the_head_in_fp32_computes_in_fp32_in_generate_and_in_every_pass(tiny_policy_dir):
    """--cast-lm-head-to-fp32 under bf16 autocast: the logits are fp32 (the rest of the forward bf16), the chunked
    path reads them the same way, and the bf16 reference copy keeps its head in fp32."""
    import copy

    policy, tok = models.load_model(str(tiny_policy_dir), torch.device("cpu"), torch.float32)
    policy = models.head_in_fp32(models.compute_in(policy, torch.bfloat16))
    ids, mask = torch.randint(5, 100, (3, 20)), torch.ones(3, 20, dtype=torch.long)
    assert policy(input_ids=ids).logits.dtype == torch.float32
    whole = rollout.completion_logprobs(policy, ids, mask, 12, chunk=-1)
    chunked = rollout.completion_logprobs(policy, ids, mask, 12, chunk=4)
    torch.testing.assert_close(chunked, whole, rtol=0, atol=1e-6)
    plain = models.compute_in(models.load_model(str(tiny_policy_dir), torch.device("cpu"), torch.float32)[0],
                              torch.bfloat16)
    assert not torch.equal(rollout.completion_logprobs(plain, ids, mask, 12, chunk=-1), whole)  # it changed something
    ref = models.frozen_reference(copy.deepcopy(policy))
    assert ref(input_ids=ids).logits.dtype == torch.float32
    torch.testing.assert_close(rollout.completion_logprobs(ref, ids, mask, 12, chunk=-1), whole, rtol=0, atol=0)
    torch.manual_seed(0)
    ro = rollout.generate(policy, tok, ["7 mod 3 ="] * 4, 12)  # the sampler reads the fp32 head too
    assert ro.sampler_logp is not None


def test_decode_stops_at_the_first_eos_whatever_follows_it():
    """A completion's text is its tokens up to its first EOS: what a batch row holds after it (generate's padding,
    or tokens of another row's width) is not part of it, special or not."""
    tok = models.build_tokenizer()
    ids = tok("12 mod 5 = 2")["input_ids"]
    after = tok(" 7")["input_ids"]  # ordinary tokens after the EOS
    completion = torch.tensor([ids + [tok.eos_token_id] + after, ids + after + [tok.eos_token_id]])
    mask, truncated = rollout.completion_mask(completion, [tok.eos_token_id])
    ro = rollout.Rollout(torch.ones(2, 1, dtype=torch.long), torch.ones(2, 1, dtype=torch.long), completion, mask,
                         truncated)
    assert rollout.decode(tok, ro) == [tok.decode(ids), tok.decode(ids + after)]


def test_a_chat_prompt_carries_the_answer_formats_instruction():
    """A model with a chat template is told where the verifier reads the answer (rewards.INSTRUCTIONS)."""
    import rewards

    tok = models.build_tokenizer()
    tok.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    for answer_format in ("tags", "last-number", "boxed"):
        assert rollout.format_prompt(tok, "7 mod 3 =", answer_format) == \
            f"7 mod 3 =\n{rewards.INSTRUCTIONS[answer_format]}"


def test_left_padding_gives_learned_position_embeddings_no_negative_position():
    """GPT-2 reads a table of learned positions: a left-padded row's pads would sit at position -1 without the clamp
    (an index error); its completion log-probs equal the same row's without padding."""
    from transformers import AutoModelForCausalLM, GPT2Config

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(GPT2Config(vocab_size=120, n_embd=32, n_layer=1, n_head=2,
                                                        n_positions=16)).eval()
    padded = rollout.completion_logprobs(model, torch.tensor([[0, 0, 5, 6, 7, 8]]),
                                         torch.tensor([[0, 0, 1, 1, 1, 1]]), 2)
    alone = rollout.completion_logprobs(model, torch.tensor([[5, 6, 7, 8]]), torch.ones(1, 4, dtype=torch.long), 2)
    torch.testing.assert_close(padded, alone, rtol=0, atol=1e-6)


def test_the_chunked_heads_bias_gets_its_gradient():
    """A head with a bias (HeadLogprobs): its gradient, chunk by chunk, equals autograd's through whole logits."""
    torch.manual_seed(0)
    h, w, b = (torch.randn(6, 8, dtype=torch.float64, requires_grad=True),
               torch.randn(20, 8, dtype=torch.float64, requires_grad=True),
               torch.randn(20, dtype=torch.float64, requires_grad=True))
    targets, weights = torch.randint(20, (6,)), torch.randn(6, dtype=torch.float64)
    logp, _ = rollout.HeadLogprobs.apply(h, w, b, targets, 0.7, 4, False, None)
    mine = torch.autograd.grad((logp * weights).sum(), (h, w, b))
    whole = torch.log_softmax((h @ w.T + b) / 0.7, -1).gather(-1, targets[:, None]).squeeze(-1)
    reference = torch.autograd.grad((whole * weights).sum(), (h, w, b))
    for got, want in zip(mine, reference):  # (the chunks compute in fp32)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
