"""The one-GPU path, as far as a CPU can show it: where the rollout lives, the pi_old pass's memory, precision,
EOS ids, the generation config, and the smaller things a hub model brings (tests/gpu_check.py runs the rest on a GPU).
"""

import torch
import torch.utils._pytree as pytree
from torch.overrides import TorchFunctionMode

import train
from conftest import SMALL_ARGS


class PretendAccelerator(TorchFunctionMode):
    """A stand-in for a second device on a CPU-only machine. Tensors that the model's `generate` takes or returns
    count as "on the accelerator", and so does everything computed from them, until `.cpu()` / `.to("cpu")` moves
    them off. An op that mixes such a tensor with a host tensor of one or more dimensions raises, as CUDA does
    ("Expected all tensors to be on the same device"); indexing with a host index is allowed, as CUDA allows it."""

    def __init__(self):
        super().__init__()
        self.ids, self.keep = set(), []  # id() of tensors on the pretend device (kept alive so ids stay unique)
        self.inside_model = False  # the model itself runs on the device: nothing to check in there

    def put(self, t):
        if isinstance(t, torch.Tensor):
            self.ids.add(id(t))
            self.keep.append(t)
        return t

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.inside_model:
            return func(*args, **kwargs)
        leaves = pytree.tree_leaves((args, kwargs))
        tensors = [t for t in leaves if isinstance(t, torch.Tensor)]
        on = [t for t in tensors if id(t) in self.ids]
        to_host = func in (torch.Tensor.cpu,) or (func is torch.Tensor.to and any(
            (isinstance(a, str) and a == "cpu") or (isinstance(a, torch.device) and a.type == "cpu") for a in leaves))
        if on and func not in (torch.Tensor.__getitem__, torch.Tensor.__setitem__) and not to_host:
            host = [t for t in tensors if id(t) not in self.ids and t.dim() > 0]
            if host:
                raise RuntimeError(f"Expected all tensors to be on the same device ({func.__name__} mixes the "
                                   "pretend accelerator and the host)")
        out = func(*args, **kwargs)
        if on and to_host and any(out is t for t in on):  # a real move makes a new tensor; .to() of a CPU one does not
            out = out.clone()
        if on and not to_host:
            for t in pytree.tree_leaves(out):
                self.put(t)
        return out


def test_one_process_step_keeps_host_bookkeeping_on_the_host(tmp_path, tiny_policy_dir, monkeypatch):
    """Issue 39.1: with one process, generate's outputs stayed on the GPU and the rollout metrics multiplied them
    with CPU correctness masks. Under the stand-in, one RL step (rollout, verifier, advantages, update, metrics) of
    GRPO with a reference model and pi_old both kept and recomputed must not mix devices."""
    args = train.Args(**{**SMALL_ARGS, "model": str(tiny_policy_dir), "output_dir": str(tmp_path), "algo": "grpo",
                         "num_prompts": 16, "max_new_tokens": 48})
    args, cfg = train.resolve(args)
    for old in ("sampler", "recompute"):
        args = train.replace(args, old_logprobs=old)
        policy, tokenizer = train.load_policy(args)
        ref = train.copy.deepcopy(policy).eval().requires_grad_(False)
        mode = PretendAccelerator()
        real_generate = policy.generate

        def generate_on_device(*a, **kw):
            mode.inside_model = True
            try:
                out = real_generate(*a, **kw)
            finally:
                mode.inside_model = False
            for v in kw.values():
                mode.put(v)
            for t in pytree.tree_leaves(dict(out)):
                mode.put(t)
            return out

        monkeypatch.setattr(policy, "generate", generate_on_device)
        optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-3)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
        stream = train.PromptStream(train.load_data(args)[0], 0)
        with mode:
            batch, metrics = train.rl_step(policy, ref, tokenizer, optimizer, scheduler, stream, cfg, args,
                                           torch.Generator().manual_seed(0))
        assert mode.ids, "the stand-in saw generate's tensors"
        assert "charts/len_incorrect_rel" in metrics and "losses/kl_ref" in metrics, metrics  # mixed groups seen
        assert all(id(t) not in mode.ids for t in vars(batch.ro).values() if t is not None), "rollout on the host"


def moved_after_one_step(tmp_path, model_dir, dtype: str) -> dict:
    """Which weight elements one RL step (2 optimizer steps, GSPO, lr 1e-6: a full fine-tune's usual rate) changes."""
    args = train.Args(**{**SMALL_ARGS, "model": str(model_dir), "output_dir": str(tmp_path), "dtype": dtype,
                         "lr": 1e-6})
    args, cfg = train.resolve(args)
    train.seed_everything(0)
    policy, tokenizer = train.load_policy(args)
    start = {k: v.detach().clone() for k, v in policy.named_parameters()}
    optimizer = torch.optim.AdamW(policy.parameters(), lr=args.lr)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    stream = train.PromptStream(train.load_data(args)[0], 0)
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
    policy, _ = train.load_policy(train.resolve(args)[0])
    ids = torch.tensor([[5, 6, 7]])
    assert policy(input_ids=ids).logits.dtype == torch.bfloat16  # the lm_head ran in bf16
    copy = train.copy.deepcopy(policy)  # the reference model of beta > 0: its forward must be its own
    with torch.no_grad():
        next(copy.parameters()).add_(1.0)
    assert not torch.equal(copy(input_ids=ids).logits, policy(input_ids=ids).logits)
    assert train.precision(policy) == "bfloat16 autocast, float32 weights"
