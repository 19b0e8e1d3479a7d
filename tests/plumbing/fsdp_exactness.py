"""Run by tests/plumbing/test_fsdp.py under `torchrun --nproc-per-node 2`: is a sharded (FSDP2) update the one-process
update, and does each rank hold half?

Every rank samples the same fixed rollout (same model, same seed) and keeps its half of the groups; each shards a
copy of the policy with ddp.shard (fully_shard per decoder layer, then the root) and runs train.update with AdamW
and gradient clipping, as train.py does; rank 0 also runs train.update alone on the whole rollout from the same
weights. Rank 0 writes, per case, the update's loss and gradient norm both ways, the largest difference of the
weights after it, and each way's bytes of parameters, gradients and AdamW state held by one rank.

    torchrun --nproc-per-node 2 tests/plumbing/fsdp_exactness.py MODEL_DIR OUT.json

Float64, as ddp_exactness.py: what is compared is the arithmetic of the split, not fp32's rounding of sums taken in
another order.
"""

import copy
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from plumbing import ddp  # noqa: E402
import losses  # noqa: E402
import model as models  # noqa: E402
import train  # noqa: E402
from plumbing import run as runs  # noqa: E402

CASES = {  # name: (algo, β, micro-batch size, epochs, --gradient-checkpointing, --logprob-chunk)
    "gspo": ("gspo", 0.0, 0, 2, False, 0),  # the default objective, sequence level; the second epoch moves the ratios
    "grpo-beta-micro": ("grpo", 0.04, 2, 2, False, 0),  # token level, a sharded reference, micro-batches, a 2nd step
    "dapo-checkpointed-chunked": ("dapo", 0.0, 2, 1, True, 16),  # the memory options: activation checkpointing and
    # log-probs in chunks of 16 positions (the decoder and the head called apart: FSDP's root hook is not run)
}


def local_bytes(tensors) -> int:
    return sum(t.to_local().nbytes if hasattr(t, "to_local") else t.nbytes for t in tensors)


def one_update(policy, batch, adv, cfg, args, world, fsdp: bool) -> dict:
    policy = policy.to(torch.float64).train()
    if args.gradient_checkpointing:
        models.enable_checkpointing(policy)
    ref = None if cfg.beta == 0 else copy.deepcopy(policy).eval().requires_grad_(False)
    if fsdp:
        world.wrap(policy, fsdp=True)
        if ref is not None:
            ddp.shard(ref, frozen=True)
            assert not any(p.requires_grad for p in ref.parameters())  # sharded, the reference stays frozen
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    m = train.update(policy, ref, optimizer, scheduler, batch, adv, cfg, args, torch.Generator().manual_seed(0), world)
    weights = ddp.full_state_dict(policy) if fsdp else policy.state_dict()
    ids = batch.ro.input_ids[:2]  # one more backward, to count the gradients' bytes
    policy(input_ids=ids).logits.float().sum().backward()
    held = {"parameters": local_bytes(policy.parameters()),
            "gradients": local_bytes(p.grad for p in policy.parameters() if p.grad is not None),
            "AdamW state": local_bytes(v for s in optimizer.state.values() for v in s.values() if v.dim() > 0)}
    if ref is not None:  # after its scoring pass, a forward with no backward: still sharded (its root too)
        held["reference"] = local_bytes(ref.parameters())
    world.sharded = None
    return {"loss": m["losses/policy_loss"], "grad_norm": m["losses/grad_norm"], "weights": weights, "held": held,
            "checkpointing": models.is_checkpointing(policy)}


def main(model_dir: str, out: str) -> None:
    world = ddp.setup("cpu")
    results = {}
    for case, (algo, beta, micro, epochs, checkpointing, chunk) in CASES.items():
        args, cfg = runs.resolve(train.Args(model=model_dir, algo=algo, beta=beta, num_prompts=8, num_generations=4,
                                             num_minibatches=1, num_epochs=epochs, micro_batch_size=micro,
                                             old_logprobs="recompute", logprob_chunk=chunk,
                                             gradient_checkpointing=checkpointing, dynamic_sampling=False))
        policy, tokenizer = runs.load_policy(args)
        torch.manual_seed(1)  # the same rollout on every rank
        batch = train.sample_groups(policy.eval(), tokenizer, runs.load_data(args)[0][:args.num_prompts], args)
        g = args.num_generations
        adv = losses.group_advantages(torch.tensor(batch.scores["reward"]), g, scale=cfg.scale_rewards)
        half = args.num_prompts // world.size
        mine = list(range(world.rank * half, (world.rank + 1) * half))
        rows = torch.tensor([i * g + j for i in mine for j in range(g)])
        sharded = one_update(copy.deepcopy(policy), train.select_groups(batch, mine, g), adv[rows], cfg, args, world,
                             fsdp=True)
        if world.main:
            one = one_update(copy.deepcopy(policy), batch, adv, cfg, args, ddp.SINGLE, fsdp=False)
            diff = max(float((sharded["weights"][k] - v).abs().max()) for k, v in one["weights"].items())
            moved = max(float((v - policy.state_dict()[k].double()).abs().max()) for k, v in one["weights"].items())
            results[case] = {"loss": [sharded["loss"], one["loss"]], "grad_norm": [sharded["grad_norm"], one["grad_norm"]],
                             "max_weight_diff": diff, "max_weight_change": moved,
                             "checkpointing": [sharded["checkpointing"], one["checkpointing"]],
                             "held_per_rank": {k: [sharded["held"][k], one["held"][k]] for k in one["held"]}}
    if world.main:
        Path(out).write_text(json.dumps(results, indent=1))
    world.barrier()  # a rank that leaves the group while another still works can abort in gloo (seen once)
    ddp.teardown()


def bf16(model_dir: str, out: str) -> None:
    """`fsdp_exactness.py --bf16 MODEL OUT.json` under torchrun with 2 processes: GRPO with β 0.04 (a sharded
    reference) in micro-batches of 2 rows, bf16 autocast, sharded two ways from the same weights: by ddp.shard (each
    layer's linear weights gathered in bf16) and by fully_shard alone (every weight gathered in fp32, autocast
    casting it: what ddp.shard did before). Rank 0 writes both updates' loss, gradient norm and weights, and the
    bytes of the whole model as generation gathers it, each way, with the dtypes it holds, and the bytes of the
    layers' linear weights in bf16 (autocast's copies, or the gathered weights) that one forward keeps for its
    backward."""
    from torch.distributed.fsdp import fully_shard

    world = ddp.setup("cpu")
    args, cfg = runs.resolve(train.Args(model=model_dir, algo="grpo", beta=0.04, num_prompts=8, num_generations=4,
                                         num_minibatches=1, num_epochs=2, micro_batch_size=2, dtype="bfloat16",
                                         old_logprobs="recompute", dynamic_sampling=False))
    policy, tokenizer = runs.load_policy(args)
    torch.manual_seed(1)  # the same rollout on every rank
    batch = train.sample_groups(policy.eval(), tokenizer, runs.load_data(args)[0][:args.num_prompts], args)
    g, half = args.num_generations, args.num_prompts // world.size
    adv = losses.group_advantages(torch.tensor(batch.scores["reward"]), g, scale=cfg.scale_rewards)
    mine = list(range(world.rank * half, (world.rank + 1) * half))
    rows = torch.tensor([i * g + j for i in mine for j in range(g)])
    results = {}
    for way in ("shard", "fp32 gathers"):
        model, ref = copy.deepcopy(policy).train(), models.frozen_reference(copy.deepcopy(policy))
        if way == "shard":
            world.wrap(model, fsdp=True)
            ddp.shard(ref, frozen=True)
        else:  # every unit gathered in its stored dtype: fp32 master weights, the reference's bf16 linears
            for m in (model, ref):
                for layer in m.get_decoder().layers:
                    fully_shard(layer)
                fully_shard(m)
            ref.requires_grad_(False)
            world.sharded = model
        saved = []  # what one forward keeps for its backward, measured after it (FSDP frees a layer's gather then)

        def keep(t):
            saved.append(t)
            return t
        with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
            loss = model(input_ids=batch.ro.input_ids[rows[:2]]).logits.float().sum()
        shapes = {tuple(m.weight.shape) for m in model.get_decoder().layers.modules() if isinstance(m, torch.nn.Linear)}
        copies = sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in saved  # a layer's weight
                      if t.dtype == torch.bfloat16 and {tuple(t.shape), tuple(t.shape)[::-1]} & shapes}.values())
        loss.backward()
        model.zero_grad(set_to_none=True)
        del saved, loss
        with world.gathered(model):
            gathered = {str(dtype): sum(p.numel() * p.element_size() for p in model.parameters() if p.dtype == dtype)
                        for dtype in {p.dtype for p in model.parameters()}}
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
        m = train.update(model, ref, optimizer, scheduler, train.select_groups(batch, mine, g), adv[rows], cfg, args,
                         torch.Generator().manual_seed(0), world)
        weights = ddp.full_state_dict(model)
        world.sharded = None
        if world.main:
            results[way] = {"loss": m["losses/policy_loss"], "grad_norm": m["losses/grad_norm"], "gathered": gathered,
                            "counted": ddp.gathered_bytes(model), "weights": weights, "kept for backward": copies}
    if world.main:
        a, b = results["shard"].pop("weights"), results["fp32 gathers"].pop("weights")
        start = policy.state_dict()
        results["max_weight_diff"] = max(float((a[k] - v).abs().max()) for k, v in b.items())
        results["diff_by_name"] = {k: float((a[k] - v).abs().max()) for k, v in b.items() if not torch.equal(a[k], v)}
        results["max_weight_change"] = max(float((v - start[k]).abs().max()) for k, v in b.items())
        Path(out).write_text(json.dumps(results, indent=1))
    world.barrier()
    ddp.teardown()


def reshard(model_dir: str, out_prefix: str, *checkpoint_dirs: str) -> None:
    """`fsdp_exactness.py --reshard MODEL OUT_PREFIX CHECKPOINT...` under torchrun with N processes: load each --fsdp
    checkpoint as a resumed run does (--model's weights sharded over N, then each rank's part of the checkpoint's
    shards and AdamW moments read into them), gather the weights and moments back, and save them (rank 0) to
    OUT_PREFIX-<i>.pt, i the checkpoint's place in the list, for comparison."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    from plumbing import checkpoint

    world = ddp.setup("cpu")
    for i, checkpoint_dir in enumerate(checkpoint_dirs):
        path = Path(checkpoint_dir)
        state = checkpoint.load_state(path)
        policy, _ = models.load_model(model_dir, torch.device("cpu"), torch.float32)
        world.wrap(policy, fsdp=True)
        optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-3)
        torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)  # as a run's: its groups hold initial_lr
        checkpoint.load_shards(path / "shards", policy, optimizer, state["optimizer"]["param_groups"])
        weights, optim = get_state_dict(policy, optimizer,
                                        options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if world.main:
            torch.save({"processes": world.size, "weights": weights, "moments": optim["state"],
                        "lr": optimizer.param_groups[0]["lr"]}, f"{out_prefix}-{i}.pt")
    world.barrier()  # a rank that leaves the group while another still works can abort in gloo (seen once)
    ddp.teardown()


if __name__ == "__main__":
    if sys.argv[1] == "--reshard":
        reshard(*sys.argv[2:])
    elif sys.argv[1] == "--bf16":
        bf16(*sys.argv[2:])
    else:
        main(*sys.argv[1:])
