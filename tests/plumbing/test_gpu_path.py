"""The one-GPU path, as far as a CPU can show it: where the rollout lives, the pi_old pass's memory, precision,
EOS ids, the generation config, and the smaller things a hub model brings (tests/gpu_check.py runs the rest on a GPU).
"""

import copy
import functools
import json
from dataclasses import replace

import pytest
import torch
import torch.utils._pytree as pytree
from torch.overrides import TorchFunctionMode

import model as models
import rollout
import train
from conftest import SMALL_ARGS, metrics_without_timing
from plumbing import ddp, logs, run as runs


def is_host(x) -> bool:
    """A device argument that names the host: the string 'cpu'. A torch.device object is what the code got from the
    policy (next(policy.parameters()).device, model.device), which on a GPU machine is the accelerator."""
    return isinstance(x, str) and x.startswith("cpu")


class PretendAccelerator(TorchFunctionMode):
    """A stand-in for a second device on a CPU-only machine, strict enough to see the update. On the accelerator:
    the parameters and buffers of the models it is given, what `.to(d)` moves there (d a torch.device object, as the
    code gets it from the policy; a move to the host is spelled `.cpu()` or `.to("cpu")`), tensors made with such a
    `device=`, whatever `generate` returns, and everything computed from any of these, until moved off. Raised, as
    CUDA raises them: an op that mixes the accelerator with a host tensor of one or more dimensions (a 0-d host
    tensor is a scalar CUDA accepts), indexing a host tensor with an accelerator index (the other way round is
    allowed), `.numpy()` of an accelerator tensor, and a random op on the accelerator drawing from a generator of the
    host. `.item()` and `.tolist()` return plain numbers. While counting (`counting`), every op with a tensor operand
    is counted, and those with an accelerator operand are `seen`."""

    MOVES_OFF = (torch.Tensor.cpu, torch.Tensor.item, torch.Tensor.tolist)

    def __init__(self, *models):
        super().__init__()
        self.ids, self.keep = set(), []  # id() of tensors on the pretend device (kept alive so ids stay unique)
        self.inside_model = False  # generate runs on the device as a whole: nothing to check in there
        self.counting, self.ops, self.seen = False, 0, 0
        self.stay_on_host = set()  # planted faults: ids whose .to(device) is left out, as if the line were deleted
        for model in models:
            for t in [*model.parameters(), *model.buffers()]:
                self.put(t)

    def put(self, t):
        if isinstance(t, torch.Tensor):
            self.ids.add(id(t))
            self.keep.append(t)
        return t

    def on(self, t) -> bool:
        return isinstance(t, torch.Tensor) and id(t) in self.ids

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.inside_model:
            return func(*args, **kwargs)
        leaves = pytree.tree_leaves((args, kwargs))
        tensors = [t for t in leaves if isinstance(t, torch.Tensor)]
        on = [t for t in tensors if self.on(t)]
        target = kwargs.get("device", next((a for a in args[1:] if isinstance(a, (str, torch.device))), None)
                            if func is torch.Tensor.to else None)
        if func is torch.Tensor.to and args[1:] and isinstance(args[1], torch.Tensor):  # .to(other_tensor)
            target = torch.device("cpu") if self.on(args[1]) else "cpu"
        to_host = func in self.MOVES_OFF or is_host(target)
        to_device = isinstance(target, torch.device) and not (tensors and id(tensors[0]) in self.stay_on_host)
        made_on_device = func is not torch.Tensor.to and isinstance(kwargs.get("device"), torch.device)
        if self.counting and tensors:
            self.ops += 1
            self.seen += bool(on) or to_device
        if on and func is torch.Tensor.numpy:
            raise TypeError("can't convert cuda:0 device type tensor to numpy (pretend accelerator)")
        if made_on_device and isinstance(kwargs.get("generator"), torch.Generator):
            raise RuntimeError(f"Expected a 'cuda' device type for generator ({func.__name__} on the pretend "
                               "accelerator draws from a host generator)")
        if on and not (to_host or to_device):
            if func in (torch.Tensor.__getitem__, torch.Tensor.__setitem__):
                if not self.on(args[0]):  # a host tensor indexed with (or assigned) an accelerator tensor
                    raise RuntimeError(f"indices should be either on cpu or on the same device as the indexed tensor "
                                       f"(cpu) ({func.__name__}, pretend accelerator)")
                host = [t for t in tensors[2:] if not self.on(t) and t.dim() > 0]  # an assigned host value
            else:
                host = [t for t in tensors if not self.on(t) and t.dim() > 0]
            if host:
                raise RuntimeError(f"Expected all tensors to be on the same device ({func.__name__} mixes the "
                                   "pretend accelerator and the host)")
        out = func(*args, **kwargs)
        if (to_host or to_device) and any(out is t for t in tensors):  # a real move makes a new tensor; on one
            out = out.clone()                                              # CPU .to() returns its input
        if to_host:
            return out
        # .to(dtype) or a move left out follows its input; every other op lands where any operand or `device=` is
        if to_device or made_on_device or (on and not (func is torch.Tensor.to and not self.on(tensors[0]))):
            for t in pytree.tree_leaves(out):
                self.put(t)
        return out


def step_on_pretend_device(policy, ref, tokenizer, args, cfg, monkeypatch, adv_on_host: bool = False):
    """One RL step (rollout, verifier, advantages, update, metrics) with the models on the pretend accelerator;
    returns (batch, metrics, mode). adv_on_host plants a fault: the update's `adv.to(device)` left out."""
    mode = PretendAccelerator(*[m for m in (policy, ref) if isinstance(m, torch.nn.Module)])
    real_generate, real_update = policy.generate, train.update

    def generate_on_device(*a, **kw):
        mode.inside_model = True
        try:
            out = real_generate(*a, **kw)
        finally:
            mode.inside_model = False
        for processor in kw.get("logits_processor") or []:  # what a processor kept was made on the device
            for t in pytree.tree_leaves(vars(processor)):
                mode.put(t)
        for t in pytree.tree_leaves(dict(out)):
            mode.put(t)
        return out

    def counted_update(policy, ref_policy, optimizer, scheduler, batch, adv, *a, **kw):
        if adv_on_host:
            mode.stay_on_host.add(id(adv))
        mode.counting = True
        try:
            return real_update(policy, ref_policy, optimizer, scheduler, batch, adv, *a, **kw)
        finally:
            mode.counting = False

    monkeypatch.setattr(policy, "generate", generate_on_device)
    monkeypatch.setattr(train, "update", counted_update)
    optimizer = torch.optim.AdamW([p for p in policy.parameters() if p.requires_grad], lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    stream = runs.PromptStream(runs.load_data(args)[0], 0)
    runs.seed_everything(0)  # the same step whatever ran before
    with mode:
        batch, metrics = train.rl_step(policy, ref, tokenizer, optimizer, scheduler, stream, cfg, args,
                                       torch.Generator().manual_seed(0))
    return batch, metrics, mode


BRANCHES = {  # the default step, and each branch of the step that moves tensors differently
    "default (gspo, pi_old from the sampler)": {},
    "grpo, pi_old recomputed, beta in the loss": dict(algo="grpo", old_logprobs="recompute"),
    "beta in the reward": dict(algo="grpo", kl_in="reward"),
    "rollout correction": dict(algo="grpo", beta=0.0, rollout_correction="sequence_mask"),
    "entropy bonus and top-entropy tokens": dict(entropy_coef=0.01, top_entropy_quantile=0.5),
    "adaptive entropy": dict(algo="grpo", beta=0.0, entropy_target=5.0),
    "LoRA, beta in the loss": dict(algo="grpo", lora_rank=4),
    "DAPO (dynamic sampling, overlong shaping)": dict(algo="dapo"),
}


def policy_and_reference(args, cfg):
    import model as models

    policy, tokenizer = runs.load_policy(args)
    if args.lora_rank:
        policy = models.add_lora(policy, args.lora_rank, args.lora_alpha, args.lora_target_modules)
        return policy, (models.AdapterOff(policy) if cfg.beta > 0 else None), tokenizer
    return policy, (models.frozen_reference(copy.deepcopy(policy)) if cfg.beta > 0 else None), tokenizer


@pytest.mark.parametrize("branch", list(BRANCHES))
def test_one_step_keeps_every_tensor_on_its_device(tmp_path, tiny_policy_dir, monkeypatch, branch, capsys):
    """Issues 39.1 and 45.2: under the stand-in, one RL step of each branch mixes no devices, its rollout stays on
    the host, and the stand-in sees at least 90% of the update's ops (before 45.2 it saw none of them)."""
    args = train.Args(**{**SMALL_ARGS, "model": str(tiny_policy_dir), "output_dir": str(tmp_path), "num_prompts": 8,
                         "max_new_tokens": 32, **BRANCHES[branch]})
    args, cfg = runs.resolve(args)
    if args.entropy_target is not None:
        import losses

        entropy_control = losses.AdaptiveEntropy(cfg.entropy_coef, args.entropy_target)
        monkeypatch.setattr(train, "rl_step", functools.partial(train.rl_step, entropy_control=entropy_control))
    policy, ref, tokenizer = policy_and_reference(args, cfg)
    batch, metrics, mode = step_on_pretend_device(policy, ref, tokenizer, args, cfg, monkeypatch)
    share = mode.seen / mode.ops
    with capsys.disabled():
        print(f"\n{branch}: the stand-in saw {mode.seen} of the update's {mode.ops} ops ({share:.0%})")
    assert share >= 0.9, (mode.seen, mode.ops)
    assert all(not mode.on(t) for t in vars(batch.ro).values() if t is not None), "rollout on the host"
    assert "losses/policy_loss" in metrics and metrics["losses/skipped_updates"] == 0


@pytest.mark.parametrize("fault", ["advantages left on the host", "loss times a host tensor"])
def test_the_stand_in_fails_what_cuda_refuses(tmp_path, tiny_policy_dir, monkeypatch, fault):
    """The two faults the old stand-in let pass: the update's advantages never moved to the device (the line
    `adv.to(device)` deleted), and a loss multiplied by a host tensor."""
    import losses

    args, cfg = runs.resolve(train.Args(**{**SMALL_ARGS, "model": str(tiny_policy_dir), "output_dir": str(tmp_path),
                                           "max_new_tokens": 32}))
    policy, ref, tokenizer = policy_and_reference(args, cfg)
    if fault == "loss times a host tensor":
        real_loss = losses.policy_loss
        monkeypatch.setattr(losses, "policy_loss", lambda *a, **kw: real_loss(*a, **kw) * torch.ones(1))
    with pytest.raises(RuntimeError, match="Expected all tensors to be on the same device|indices should be"):
        step_on_pretend_device(policy, ref, tokenizer, args, cfg, monkeypatch,
                               adv_on_host=fault == "advantages left on the host")


def test_the_stand_in_models_cuda_s_other_refusals():
    w = torch.nn.Linear(3, 3)
    mode = PretendAccelerator(w)
    device = next(w.parameters()).device
    with mode:
        on = torch.arange(4, device=device)
        host = torch.zeros(4)
        assert mode.on(on) and not mode.on(host) and mode.on(host.to(device)) and not mode.on(on.cpu())
        assert not mode.on(on.to("cpu")) and isinstance(on.sum().item(), int)
        assert mode.on(on[torch.tensor([0, 1])])  # an accelerator tensor indexed from the host: allowed
        with pytest.raises(RuntimeError, match="indices should be"):
            host[on[:2]]
        with pytest.raises(TypeError, match="numpy"):
            on.numpy()
        with pytest.raises(RuntimeError, match="generator"):
            torch.randperm(4, generator=torch.Generator(), device=device)
        assert mode.on(on + torch.tensor(2))  # a 0-d host tensor is a scalar
        with pytest.raises(RuntimeError, match="same device"):
            on + host


def moved_after_one_step(tmp_path, model_dir, dtype: str) -> dict:
    """Which weight elements one RL step (2 optimizer steps, GSPO, lr 1e-6: a full fine-tune's usual rate) changes."""
    args = train.Args(**{**SMALL_ARGS, "model": str(model_dir), "output_dir": str(tmp_path), "dtype": dtype,
                         "lr": 1e-6})
    args, cfg = runs.resolve(args)
    runs.seed_everything(0)
    policy, tokenizer = runs.load_policy(args)
    start = {k: v.detach().clone() for k, v in policy.named_parameters()}
    optimizer = torch.optim.AdamW(policy.parameters(), lr=args.lr)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    stream = runs.PromptStream(runs.load_data(args)[0], 0)
    train.rl_step(policy, None, tokenizer, optimizer, scheduler, stream, cfg, args, torch.Generator().manual_seed(0))
    return {k: v.dtype for k, v in policy.named_parameters()}, \
        {k: v.detach() != start[k] for k, v in policy.named_parameters()}


def test_bf16_full_fine_tune_keeps_fp32_weights_and_moves_every_weight_fp32_moves(tmp_path, tiny_policy_dir):
    """Issue 39.3: pure bf16 weights rounded most updates away (1.5% of weights moved at lr 1e-6 against 100% in
    fp32). bf16 now means autocast over fp32 weights, gradients and AdamW moments."""
    dtypes, moved32 = moved_after_one_step(tmp_path / "a", tiny_policy_dir, "float32")
    dtypes16, moved16 = moved_after_one_step(tmp_path / "b", tiny_policy_dir, "bfloat16")
    assert set(dtypes16.values()) == {torch.float32}
    n32 = sum(int(m.sum()) for m in moved32.values())
    total = sum(m.numel() for m in moved32.values())
    assert n32 > 0.9 * total
    missed = sum(int((m & ~moved16[k]).sum()) for k, m in moved32.items())
    assert missed == 0, f"{missed} of the {n32} weights fp32 moves stay put in bf16"


def test_bf16_forwards_compute_in_bf16_under_autocast(tiny_policy_dir):
    args = train.Args(**{**SMALL_ARGS, "model": str(tiny_policy_dir), "dtype": "bfloat16"})
    policy, _ = runs.load_policy(runs.resolve(args)[0])
    ids = torch.tensor([[5, 6, 7]])
    assert policy(input_ids=ids).logits.dtype == torch.bfloat16  # the lm_head ran in bf16
    twin = copy.deepcopy(policy)  # the reference model of beta > 0: its forward must be its own
    with torch.no_grad():
        next(twin.parameters()).add_(1.0)
    assert not torch.equal(twin(input_ids=ids).logits, policy(input_ids=ids).logits)
    assert logs.precision(policy) == "bfloat16 autocast, float32 weights"
    assert logs.precision(models.linears_as_computed(twin)) == "bfloat16 autocast, bfloat16 and float32 weights"


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fsdp_gathers_bf16_runs_linear_weights_at_2_bytes(tiny_policy_dir, dtype):
    """What --fsdp's generation gathers on each rank (ddp.gathered_bytes, the start-up line's count): a decoder
    layer's linear weights at 2 bytes under bf16, everything else (embeddings, head, norms) at 4; all at 4 in fp32;
    and shard's rule for a layer with a weight of its own."""
    policy, _ = runs.load_policy(runs.resolve(train.Args(**{**SMALL_ARGS, "model": str(tiny_policy_dir),
                                                            "dtype": dtype}))[0])
    layers = policy.get_decoder().layers
    linear = sum(p.numel() for m in layers.modules() if isinstance(m, torch.nn.Linear) for p in m.parameters())
    everything = sum(p.numel() for p in policy.parameters())
    assert 0 < linear < everything
    per_linear = 2 if dtype == "bfloat16" else 4
    assert ddp.gathered_bytes(policy) == linear * per_linear + (everything - linear) * 4
    # a weight of a layer's own (no model here has one): which op reads it is unknown, so that layer is gathered as
    # stored, its linear weights at 4 bytes too
    first = sum(p.numel() for m in layers[0].modules() if isinstance(m, torch.nn.Linear) for p in m.parameters())
    layers[0].register_parameter("scale", torch.nn.Parameter(torch.ones(4)))
    assert ddp.gathered_bytes(policy) == (linear - first) * per_linear + (everything - linear + first + 4) * 4


def test_the_skeleton_other_ranks_receive_is_the_model_without_its_bytes(tiny_policy_dir):
    """ddp.skeleton (what World.from_main sends under --fsdp): every parameter and buffer a meta tensor of the same
    name, shape, dtype and trainability; a tied head still tied; the bf16 autocast and fp32-head forwards bound to
    the copy; the generation config kept; and it survives pickling (broadcast_object_list), the original untouched."""
    import pickle

    args = runs.resolve(train.Args(**{**SMALL_ARGS, "model": str(tiny_policy_dir), "dtype": "bfloat16",
                                      "cast_lm_head_to_fp32": True}))[0]
    policy, _ = runs.load_policy(args)
    policy.lm_head.weight = policy.model.embed_tokens.weight  # tied, as SmolLM2's and Qwen's small models are
    bones = pickle.loads(pickle.dumps(ddp.skeleton(policy)))
    for ours, theirs in ((policy.named_parameters(remove_duplicate=False), bones.named_parameters(remove_duplicate=False)),
                         (policy.named_buffers(), bones.named_buffers())):
        ours, theirs = dict(ours), dict(theirs)
        assert list(ours) == list(theirs) and ours
        for name, t in ours.items():
            b = theirs[name]
            assert b.is_meta and not t.is_meta, name
            assert (b.shape, b.dtype, b.requires_grad) == (t.shape, t.dtype, t.requires_grad), name
    assert bones.lm_head.weight is bones.model.embed_tokens.weight
    assert bones.forward.args[0] is bones and bones.autocast_dtype == torch.bfloat16
    assert bones.lm_head.forward.args[0] is bones.lm_head and bones.lm_head.fp32
    assert bones.generation_config.to_dict() == policy.generation_config.to_dict()


# ---------------------------------------------------------------------------------------------------------------
# Stop ids: Qwen- and Llama-3-shaped tokenizers built offline, base and instruct (issue 39.4)
# ---------------------------------------------------------------------------------------------------------------

QWEN_TEMPLATE = ("{% for m in messages %}{{'<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n'}}"
                 "{% endfor %}{% if add_generation_prompt %}{{'<|im_start|>assistant\\n'}}{% endif %}")
LLAMA3_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
                   "{{ m['content'] }}<|eot_id|>{% endfor %}{% if add_generation_prompt %}"
                   "<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")
SHAPES = {  # family: (special tokens, template, eos of the base / instruct tokenizer, generation_config eos ids by name)
    "qwen": (["<|endoftext|>", "<|im_start|>", "<|im_end|>"], QWEN_TEMPLATE, "<|endoftext|>", "<|im_end|>",
             ["<|endoftext|>"], ["<|im_end|>", "<|endoftext|>"], "<|im_end|>"),
    "llama3": (["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eom_id|>",
                "<|eot_id|>"], LLAMA3_TEMPLATE, "<|end_of_text|>", "<|eot_id|>",
               ["<|end_of_text|>"], ["<|end_of_text|>", "<|eom_id|>", "<|eot_id|>"], "<|eot_id|>"),
}


def shaped(family: str, variant: str):
    """(tokenizer, generation config eos ids, end-of-turn id) of a hub-shaped family, over the embedded characters."""
    import model as models
    from transformers import GenerationConfig

    specials, template, base_eos, instruct_eos, base_gen, instruct_gen, turn_end = SHAPES[family]
    tok = models.build_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": specials})
    tok.chat_template = template
    tok.eos_token = base_eos if variant == "base" else instruct_eos
    if family == "llama3":
        tok.bos_token = "<|begin_of_text|>"
    ids = tok.convert_tokens_to_ids
    gen = GenerationConfig(eos_token_id=[ids(t) for t in (base_gen if variant == "base" else instruct_gen)])
    return tok, gen, ids(turn_end)


@pytest.mark.parametrize("family", ["qwen", "llama3"])
@pytest.mark.parametrize("variant", ["base", "instruct"])
def test_stop_ids_hold_every_eos_and_the_templates_end_of_turn(family, variant):
    import model as models

    tok, gen, turn_end = shaped(family, variant)
    assert models.end_of_turn_id(tok) == turn_end
    stops = models.stop_ids(gen, tok)
    assert turn_end in stops and tok.eos_token_id in stops and set(gen.eos_token_id) <= set(stops)


def model_that_always_says(tok, token_id: int):
    """A random Llama whose every next token is `token_id` (the residual stream carries only the embedding, whose
    dimension 0 is 1; the final norm keeps that dimension; the head maps it to `token_id`)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64,
                                         num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=4,
                                         max_position_embeddings=128, tie_word_embeddings=False,
                                         pad_token_id=tok.pad_token_id))
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.model.embed_tokens.weight[:, 0] = 1.0
        model.model.norm.weight.zero_()
        model.model.norm.weight[0] = 1.0
        model.lm_head.weight.zero_()
        model.lm_head.weight[token_id, 0] = 100.0
    return model


@pytest.mark.parametrize("family", ["qwen", "llama3"])
def test_a_base_model_through_its_template_stops_at_the_end_of_turn(family, tmp_path):
    """The R1-Zero set-up: a base checkpoint (EOS <|endoftext|> / <|end_of_text|>) prompted through its chat
    template ends its turn with <|im_end|> / <|eot_id|>; before, that token did not stop generation and the model
    wrote made-up turns until the budget."""
    import model as models
    import rollout

    tok, gen, turn_end = shaped(family, "base")
    policy = model_that_always_says(tok, turn_end)
    policy.generation_config = gen
    policy, tok = models.prepare(policy, tok, torch.device("cpu"))
    prompt = rollout.format_prompt(tok, "2 + 3 =", "tags")
    for greedy in (True, False):
        ro = rollout.generate(policy, tok, [prompt] * 2, max_new_tokens=16, greedy=greedy)
        assert ro.completion_ids[:, 0].tolist() == [turn_end] * 2
        assert ro.lengths.tolist() == [1, 1] and not ro.truncated.any()


# ---------------------------------------------------------------------------------------------------------------
# Only temperature acts (issue 34.1)
# ---------------------------------------------------------------------------------------------------------------

PROCESSORS = dict(repetition_penalty=1.3, no_repeat_ngram_size=2, min_p=0.2, top_k=5, top_p=0.5, temperature=0.3,
                  typical_p=0.6, do_sample=True)


def with_processors(model_dir, out):
    """A copy of a model folder whose generation_config.json asks for several logits processors."""
    import shutil

    shutil.copytree(model_dir, out)
    config = json.loads((out / "generation_config.json").read_text())
    (out / "generation_config.json").write_text(json.dumps({**config, **PROCESSORS}))
    return out


def test_generate_samples_from_the_raw_logits_over_temperature(tiny_policy_dir, tmp_path, monkeypatch):
    """The scores generate sampled from are the model's logits / temperature, whatever generation_config.json says."""
    import model as models
    import rollout

    policy, tok = models.load_model(str(with_processors(tiny_policy_dir, tmp_path / "m")), torch.device("cpu"),
                                    torch.float32)
    seen = []
    real = policy.generate

    def generate_with_scores(*a, **kw):
        out = real(*a, **{**kw, "output_scores": True, "output_logits": True})
        seen.append(out)
        return out

    monkeypatch.setattr(policy, "generate", generate_with_scores)
    torch.manual_seed(0)
    rollout.generate(policy, tok, ["7 mod 3 =", "47 mod 13 ="] * 4, max_new_tokens=12, temperature=0.7)
    out = seen[0]
    assert len(out.scores) > 1
    for scores, logits in zip(out.scores, out.logits):
        torch.testing.assert_close(scores, logits / 0.7, rtol=0, atol=0)


@pytest.mark.slow
def test_a_model_folder_with_processors_trains_bit_identically_to_a_plain_copy(tiny_policy_dir, tmp_path):
    import shutil

    plain = tmp_path / "plain"
    shutil.copytree(tiny_policy_dir, plain)
    processed = with_processors(tiny_policy_dir, tmp_path / "processed")
    rows = []
    for model_dir in (plain, processed):
        args = train.Args(**{**SMALL_ARGS, "model": str(model_dir), "output_dir": str(tmp_path / "runs"),
                             "total_steps": 2, "run_name": model_dir.name, "save_model": False})
        train.train(args)
        rows.append(metrics_without_timing(tmp_path / "runs" / model_dir.name))
    assert rows[0] == rows[1] and len(rows[0]) == 3


# ---------------------------------------------------------------------------------------------------------------
# pi_old, the reference and evaluation in micro-batches, halved on out-of-memory (issue 39.2, 39.5)
# ---------------------------------------------------------------------------------------------------------------

OOM = "DefaultCPUAllocator: can't allocate memory: you tried to allocate 9 GB"  # as the CPU says it


def device_that_fits(monkeypatch, module, function: str, rows: int, arg: int) -> None:
    """module.<function> raises the CPU's out-of-memory error when called on more than `rows` rows (its argument
    number `arg`), as on a device that holds no more; the remembered micro-batch sizes start afresh."""
    from plumbing import lifecycle

    real = getattr(module, function)

    def small_device(*args, **kwargs):
        if len(args[arg]) > rows:
            raise RuntimeError(OOM)
        return real(*args, **kwargs)

    monkeypatch.setattr(module, function, small_device)
    monkeypatch.setattr(lifecycle, "AUTO_MICRO_BATCH", {})


def test_pi_old_and_reference_passes_fit_a_device_that_holds_two_rows(tmp_path, tiny_policy_dir, monkeypatch, capsys):
    """Before, pi_old (recomputed) and the reference were scored over the whole rollout in one forward, outside the
    halving: a device that fits 2 rows died at step 1. Now they compute what --micro-batch-size 2 computes."""
    common = dict(algo="grpo", old_logprobs="recompute", total_steps=2, save_model=False)  # beta 0.04: a reference
    fixed = tmp_path / "fixed"
    train.train(train.Args(**{**SMALL_ARGS, **common, "model": str(tiny_policy_dir), "output_dir": str(fixed),
                              "micro_batch_size": 2}))
    device_that_fits(monkeypatch, train.rollout, "completion_logprobs", 2, 1)  # (model, input_ids, ...)
    auto = tmp_path / "auto"
    train.train(train.Args(**{**SMALL_ARGS, **common, "model": str(tiny_policy_dir), "output_dir": str(auto)}))
    assert "out of memory at 8 rows" in capsys.readouterr().out
    a, b = (metrics_without_timing(d / "grpo-s0") for d in (auto, fixed))
    assert len(a) == len(b) == 3
    for x, y in zip(a, b):
        assert x.keys() == y.keys()
        for key in x:
            assert x[key] == pytest.approx(y[key], rel=1e-5, abs=1e-7), key


def test_evaluation_halves_on_out_of_memory(tiny_policy_dir, monkeypatch, capsys):
    args, _ = runs.resolve(train.Args(**{**SMALL_ARGS, "model": str(tiny_policy_dir), "eval_size": 16}))
    policy, tok = runs.load_policy(args)
    test_set = runs.load_data(args)[1][:16]
    whole, _ = train.evaluate(policy, tok, test_set, args, 0)
    device_that_fits(monkeypatch, train, "sample", 4, 2)  # sample(policy, tokenizer, rows, ...)
    halved, _ = train.evaluate(policy, tok, test_set, args, 0)
    assert halved == whole and "out of memory at 8 rows" in capsys.readouterr().out
    # sampled evaluation (--eval-samples) halves too (issue 45.7): 16 problems x 2 samples, 4 rows fit
    sampled, _ = train.evaluate(policy, tok, test_set, replace(args, eval_samples=2), 0)
    assert "out of memory at 32 rows" in capsys.readouterr().out and 0 <= sampled["eval/pass@2"] <= 1


def test_scoring_passes_halve_under_torchrun_too():
    """pi_old's and the reference's passes hold no collective, so a rank halves alone (issue 45.7: under torchrun
    they raised instead); their size is remembered apart from the update's, which every rank splits alike."""
    from plumbing import lifecycle
    from plumbing.accumulate import MicroBatches, score_rows
    from plumbing.ddp import World

    lifecycle.AUTO_MICRO_BATCH.clear()

    def fits_two(rows):
        if len(rows) > 2:
            raise RuntimeError(OOM)
        return rows * 10

    assert score_rows(fits_two, torch.arange(8), 8, 0).tolist() == list(range(0, 80, 10))  # no world size to ask
    assert lifecycle.AUTO_MICRO_BATCH == {"score 8": 2}
    lifecycle.AUTO_MICRO_BATCH.clear()
    assert score_rows(fits_two, torch.arange(8), 8, 0, World(rank=1, size=2)).tolist() == list(range(0, 80, 10))
    lifecycle.AUTO_MICRO_BATCH.clear()
    with pytest.raises(RuntimeError, match="allocate"):  # under --fsdp a forward gathers from every rank: no halving
        score_rows(fits_two, torch.arange(8), 8, 0, World(rank=1, size=2, sharded=torch.nn.Linear(1, 1)))
    step = MicroBatches(torch.arange(8), 0, World(rank=1, size=2), None)
    with pytest.raises(RuntimeError, match="allocate"):  # the update itself still refuses to halve alone
        for part in step:
            with step.guard():
                fits_two(part)


def test_out_of_memory_in_a_periodic_evaluation_saves_the_step_and_is_one_line(tmp_path, tiny_policy_dir,
                                                                                monkeypatch, capsys):
    """Evaluation ran outside the step's failure handler: running out of memory there, even at one row, was a raw
    traceback with nothing saved. Now it is one line, and the state after the step is saved and resumes."""
    real, calls = train.sample, []

    def no_room_after_training_starts(*a, **kw):
        if kw.get("greedy") and len(calls) > 0:
            raise RuntimeError(OOM)
        if kw.get("greedy"):
            calls.append(1)  # the evaluation before step 1 (one call: 8 problems)
        return real(*a, **kw)

    monkeypatch.setattr(train, "sample", no_room_after_training_starts)
    monkeypatch.setattr(runs.lifecycle, "AUTO_MICRO_BATCH", {})
    argv = ["--model", str(tiny_policy_dir), "--output-dir", str(tmp_path), "--total-steps", "2", "--eval-every", "1"]
    argv += [x for k, v in SMALL_ARGS.items() if k != "eval_every" for x in (f"--{k.replace('_', '-')}", str(v))]
    with pytest.raises(SystemExit) as exc:
        train.main(argv)
    err = capsys.readouterr().err
    assert exc.value.code == 2 and err.count("\n") == 1, err
    assert "out of memory in the held-out evaluation after step 1" in err and "--eval-size" in err
    assert (tmp_path / "gspo-s0" / "checkpoints" / "step-000001" / "state.pt").is_file()
    monkeypatch.setattr(train, "sample", real)
    train.main(argv + ["--resume", "auto"])
    assert "resumed from" in capsys.readouterr().out


PEAK_SCRIPT = r"""
import sys, torch
sys.path.insert(0, ".")
import train, rollout
from metrics import resident_peak_gib
from plumbing import logs, run as runs
from transformers import LlamaConfig, LlamaForCausalLM
rows, micro, vocab, T = (int(a) for a in sys.argv[1:5])
torch.manual_seed(0)
model = LlamaForCausalLM(LlamaConfig(vocab_size=vocab, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                     num_attention_heads=2, num_key_value_heads=2, tie_word_embeddings=True))
ids = torch.randint(vocab, (rows, 8 + T))
ro = rollout.Rollout(ids[:, :8], torch.ones(rows, 8, dtype=torch.long), ids[:, 8:], torch.ones(rows, T, dtype=torch.long),
                     torch.zeros(rows, dtype=torch.bool))
args = train.Args(num_minibatches=2, micro_batch_size=micro, old_logprobs="recompute", lr=1e-3,
                  logprob_chunk=-1)  # whole logits: the micro-batch's size is what this measures
args, cfg = runs.resolve(args)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0)
batch = train.Batch(ro, [None] * rows, {}, [""] * rows)
before = resident_peak_gib()
train.update(model, None, opt, sched, batch, torch.randn(rows), cfg, args, torch.Generator().manual_seed(0))
print((resident_peak_gib() - before) * 1024)  # MiB above the start-up's peak
"""


@pytest.mark.slow
def test_the_updates_peak_memory_grows_with_the_micro_batch_not_with_the_rollout(tmp_path):
    """On a 32,000-token vocabulary (each row's logits 8 MB in fp32 at 64 tokens), an update with pi_old recomputed
    at 4 rows per forward peaks alike over 16 and 64 rollout rows (measured: 89 and 89 MiB above start-up; 32 rows
    per forward: 531 MiB). Before, pi_old was scored over the whole rollout in one forward: 509 and 2017 MiB."""
    import os
    import subprocess
    import sys

    script = tmp_path / "peak.py"
    script.write_text(PEAK_SCRIPT)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MALLOC_MMAP_THRESHOLD_": str(2**20)}  # freed blocks leave RSS

    def peak(rows, micro):
        out = subprocess.run([sys.executable, str(script), str(rows), str(micro), "32000", "64"], env=env,
                             capture_output=True, text=True, cwd=os.path.dirname(train.__file__), timeout=300)
        assert out.returncode == 0, out.stderr[-2000:]
        return float(out.stdout.split()[-1])

    small, large, whole = peak(16, 4), peak(64, 4), peak(64, 32)
    assert large < 1.2 * small + 30, (small, large)  # 4x the rows, the same micro-batch
    assert whole > large + 200, (large, whole)  # the check can see a larger micro-batch


# ---------------------------------------------------------------------------------------------------------------
# The smaller things a hub model brings (issue 39.5)
# ---------------------------------------------------------------------------------------------------------------

THINKING_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
                     "{% if add_generation_prompt %}<|assistant|>{% if enable_thinking is defined and not "
                     "enable_thinking %}<think>\n\n</think>\n\n{% endif %}{% endif %}")
DATED_TEMPLATE = ("{% if not date_string is defined %}{% set date_string = strftime_now('%d %b %Y') %}{% endif %}"
                  "Today Date: {{ date_string }}\n{% for m in messages %}{{ m['content'] }}\n{% endfor %}")


def test_thinking_is_off_unless_asked_and_dated_templates_get_a_fixed_date():
    import model as models

    tok = models.build_tokenizer()
    tok.chat_template = THINKING_TEMPLATE
    assert "<think>\n\n</think>" in rollout.format_prompt(tok, "2 + 3 =")  # Qwen3's way of not thinking
    assert "<think>" not in rollout.format_prompt(tok, "2 + 3 =", enable_thinking=True)
    tok.chat_template = DATED_TEMPLATE
    assert f"Today Date: {rollout.TEMPLATE_DATE}" in rollout.format_prompt(tok, "2 + 3 =")
    assert train.Args().enable_thinking is False


def test_enable_thinking_is_refused_where_the_template_does_not_read_it():
    """flags.check_thinking: a template that reads enable_thinking passes; one that does not (or none) is refused,
    as --enable-thinking would change no prompt."""
    import model as models
    from base.errors import ConfigError
    from plumbing import flags

    tok = models.build_tokenizer()
    tok.chat_template = THINKING_TEMPLATE
    flags.check_thinking(tok, "qwen3-like")
    for template in (DATED_TEMPLATE, None):
        tok.chat_template = template
        with pytest.raises(ConfigError, match="--enable-thinking changes no prompt of m: it has no chat template "
                                              "with a thinking switch"):
            flags.check_thinking(tok, "m")


def test_a_template_less_model_whose_tokenizer_adds_bos_gets_it():
    import model as models

    tok = models.build_tokenizer()
    assert rollout.format_prompt(tok, "7 mod 3 =") == "7 mod 3 ="  # the embedded model: no BOS, no change
    from tokenizers import processors

    tok.add_special_tokens({"bos_token": "<s>"})
    assert rollout.format_prompt(tok, "7 mod 3 =") == "7 mod 3 ="  # a BOS its tokenizer does not add: none added
    tok._tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[
        ("<s>", tok.bos_token_id)])
    assert tok("1")["input_ids"][0] == tok.bos_token_id  # like Llama-2 or Mistral's tokenizers
    prompt = rollout.format_prompt(tok, "7 mod 3 =")
    assert prompt == "<s>7 mod 3 =" and tok(prompt, add_special_tokens=False)["input_ids"][0] == tok.bos_token_id
    assert rollout.format_prompt(tok, prompt) == prompt  # a prompt that starts with it: one BOS, not two


@pytest.mark.parametrize("family", ["gpt2", "opt", "llama"])
def test_dropout_is_off_so_an_unchanged_policy_scores_alike_twice(family, tmp_path):
    """GPT-2 and OPT keep dropout in their configs (0.1 by default); in train mode it made pi_old and the update
    score one sequence differently, so the ratio of an unchanged policy was not 1. Llama's is a float attribute of
    its attention (attention_dropout), not a module."""
    import model as models
    from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig, OPTConfig

    config = {"gpt2": lambda: GPT2Config(vocab_size=120, n_embd=32, n_layer=1, n_head=2, resid_pdrop=0.5,
                                         embd_pdrop=0.5, attn_pdrop=0.5, bos_token_id=1, eos_token_id=1),
              "opt": lambda: OPTConfig(vocab_size=120, hidden_size=32, ffn_dim=64, num_hidden_layers=1,
                                       num_attention_heads=2, word_embed_proj_dim=32, dropout=0.5,
                                       attention_dropout=0.5),
              "llama": lambda: LlamaConfig(vocab_size=120, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                           num_attention_heads=2, num_key_value_heads=2,
                                           attention_dropout=0.5)}[family]()
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    tok = models.build_tokenizer()
    tok.save_pretrained(tmp_path)
    policy, _ = models.load_model(str(tmp_path), torch.device("cpu"), torch.float32)
    policy.train()
    ids = torch.tensor([[5, 6, 7, 8]])
    assert torch.equal(policy(input_ids=ids).logits, policy(input_ids=ids).logits)


def test_ddp_turns_buffer_sync_off_by_the_name_its_torch_knows():
    from plumbing import ddp

    class Old:  # torch 2.4-2.12's DistributedDataParallel
        def __init__(self, module, device_ids=None, broadcast_buffers=True):
            pass

    class New:
        def __init__(self, module, device_ids=None, broadcast_buffers=None, forward_sync_buffers=None):
            pass

    assert ddp.no_buffer_sync(Old) == {"broadcast_buffers": False}
    assert ddp.no_buffer_sync(New) == {"forward_sync_buffers": False}
    from packaging.version import Version

    renamed = Version(torch.__version__.split("+")[0]) >= Version("2.13")  # the installed torch (2.11: the GPU image's)
    assert ddp.no_buffer_sync() == ({"forward_sync_buffers": False} if renamed else {"broadcast_buffers": False})


def test_auto_dtype_takes_bf16_only_where_it_is_native(monkeypatch):
    """T4 and V100 report bf16 as supported by emulation (slow); auto then computes in fp32."""
    import model as models

    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: including_emulation)
    assert models.pick_dtype(torch.device("cuda")) == torch.float32
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: True)
    assert models.pick_dtype(torch.device("cuda")) == torch.bfloat16
    assert models.pick_dtype(torch.device("cpu")) == torch.float32


# ---------------------------------------------------------------------------------------------------------------
# Generation casts each weight once per rollout (issue 45.6)
# ---------------------------------------------------------------------------------------------------------------


def weight_casts(policy, fn) -> int:
    """How many times autocast copies one of `policy`'s weight matrices while fn() runs (the profiler's
    aten::_to_copy events whose input has a weight's shape)."""
    from torch.profiler import profile

    shapes = {str([list(p.shape)]) for p in policy.parameters() if p.dim() == 2}
    with profile(record_shapes=True) as prof:
        fn()
    return sum(1 for e in prof.events() if e.name == "aten::_to_copy" and str(e.input_shapes[:1]) in shapes)


@pytest.mark.slow
def test_bf16_generate_casts_each_weight_once_per_rollout_and_samples_the_same_tokens(tiny_policy_dir):
    """Autocast entered around each forward under inference_mode cast every fp32 weight at every decode step (480
    casts of the tests' 2-layer model's 15 matrices over 32 tokens). One autocast region under no_grad casts each once; the tokens and
    the sampler's log-probs are the same bits."""
    import model as models

    policy, tok = models.load_model(str(tiny_policy_dir), torch.device("cpu"), torch.float32)
    matrices = sum(1 for p in policy.parameters() if p.dim() == 2)
    prompts = ["7 mod 3 =", "47 mod 13 ="] * 2
    for dtype in (torch.float32, torch.bfloat16):
        policy = models.compute_in(policy, dtype)
        outs = {}
        for path in ("per token", "one region"):
            def sample():
                torch.manual_seed(0)
                if path == "per token":  # as before: inference_mode turns autocast's weight cache off
                    with torch.inference_mode():
                        outs[path] = rollout.generate(policy, tok, prompts, max_new_tokens=16)
                else:
                    outs[path] = rollout.generate(policy, tok, prompts, max_new_tokens=16)
            casts = weight_casts(policy, sample)
            steps = outs[path].completion_ids.shape[1]
            if dtype == torch.float32:
                assert casts == 0
            elif path == "one region":
                assert casts <= matrices, (casts, matrices)
            else:
                assert casts >= matrices * (steps - 1), (casts, matrices, steps)  # the planted old path is seen
        a, b = outs["per token"], outs["one region"]
        assert torch.equal(a.completion_ids, b.completion_ids) and torch.equal(a.sampler_logp, b.sampler_logp)
    assert steps > 8


# ---------------------------------------------------------------------------------------------------------------
# final/ as the model was published (issue 45.7)
# ---------------------------------------------------------------------------------------------------------------


def test_final_is_saved_in_the_models_own_dtype_with_its_own_generation_config(tmp_path, tiny_policy_dir):
    """A bf16 model trained here (fp32 weights under the hood) was saved as fp32 (a 1.5B final/ of 6.2 GB, 'dtype:
    float32') with the trainer's own generation config (its sampling defaults gone). Now final/ is bf16, tied
    weights stay tied, generation_config.json is the model's, and final/ loads and trains again."""
    import shutil

    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, GenerationConfig

    import model as models

    folder = tmp_path / "bf16-model"
    shutil.copytree(tiny_policy_dir, folder)
    AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).save_pretrained(folder)
    published = GenerationConfig(do_sample=True, temperature=0.6, top_p=0.9, eos_token_id=1, pad_token_id=0)
    published.save_pretrained(folder)
    train.train(train.Args(**{**SMALL_ARGS, "model": str(folder), "output_dir": str(tmp_path / "runs"),
                              "total_steps": 1, "run_name": "r"}))
    final = tmp_path / "runs" / "r" / "final"
    config = json.loads((final / "config.json").read_text())
    weights = load_file(final / "model.safetensors")
    assert config["dtype"] == "bfloat16" and {t.dtype for t in weights.values()} == {torch.bfloat16}
    assert "lm_head.weight" not in weights  # tied to the embeddings, saved once
    # readable by whoever can read its config (safetensors 0.8 alone would leave the weights 0600: owner only)
    assert (final / "model.safetensors").stat().st_mode & 0o777 == (final / "config.json").stat().st_mode & 0o777
    saved = json.loads((final / "generation_config.json").read_text())
    assert (saved["temperature"], saved["top_p"], saved["do_sample"]) == (0.6, 0.9, True)
    policy, _ = models.load_model(str(final), torch.device("cpu"), torch.float32)
    assert policy.own_dtype == torch.bfloat16


def test_the_precision_helpers_keep_what_autocast_keeps_in_fp32():
    """linears_as_computed stores a frozen model's linear layers in the compute dtype but not the embeddings (a head
    tied to them included) nor a head that head_in_fp32 keeps in fp32; head_in_fp32 turns a bf16 head (a LoRA
    base's) into fp32 weights, and its logits are fp32."""
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = models.build_tokenizer()
    tied = models.linears_as_computed(models.compute_in(models.build_tiny_model(tok, hidden=32, layers=1),
                                                        torch.bfloat16))
    assert tied.model.embed_tokens.weight.dtype == torch.float32 and tied.lm_head.weight is \
        tied.model.embed_tokens.weight
    assert tied.model.layers[0].self_attn.q_proj.weight.dtype == torch.bfloat16
    config = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=False)
    untied = models.head_in_fp32(models.compute_in(LlamaForCausalLM(config), torch.bfloat16))
    assert models.linears_as_computed(untied).lm_head.weight.dtype == torch.float32
    bf16_base = models.head_in_fp32(models.compute_in(LlamaForCausalLM(config).to(torch.bfloat16), torch.bfloat16))
    assert bf16_base.lm_head.weight.dtype == torch.float32
    assert bf16_base(input_ids=torch.tensor([[5, 6, 7]])).logits.dtype == torch.float32


def test_what_a_model_folder_says_before_it_is_loaded(tmp_path):
    """context_without_loading reads max_position_embeddings, or GPT-2's n_positions; a value that is not a positive
    whole number is no context. name_in_config names the transformers class under FSDP's subclass."""
    from transformers import LlamaForCausalLM

    for config, context in (({"n_positions": 1024}, 1024), ({"max_position_embeddings": 4096}, 4096),
                            ({"max_position_embeddings": -1}, None), ({"max_position_embeddings": "8k"}, None)):
        (tmp_path / "config.json").write_text(json.dumps(config))
        assert models.context_without_loading(str(tmp_path), "embedded") == context, config
    fsdp_class = type("FSDPLlamaForCausalLM", (LlamaForCausalLM,), {})
    models.name_in_config(tmp_path, fsdp_class.__new__(fsdp_class), dtype="bfloat16")
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["architectures"] == ["LlamaForCausalLM"] and saved["dtype"] == "bfloat16"


def test_a_tokenizer_without_pad_pads_with_eos_and_a_plain_character_after_a_turn_is_no_stop():
    """prepare: no pad token -> EOS pads (the first EOS of a row is kept in its mask); end_of_turn_id: a template
    whose assistant turn ends in plain characters has no end-of-turn token (stopping at the first of them would
    cut completions short)."""
    tok = models.build_tokenizer()
    tok.pad_token = None
    model, tok = models.prepare(models.build_tiny_model(tok, hidden=32, layers=1), tok, torch.device("cpu"))
    assert tok.pad_token == tok.eos_token
    tok.chat_template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }} |{% endfor %}"
    assert models.end_of_turn_id(tok) is None
    assert models.stop_ids(model.generation_config, tok) == [tok.eos_token_id]
