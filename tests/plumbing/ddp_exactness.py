"""Run by tests/plumbing/test_ddp.py under `torchrun --nproc-per-node 2`: is a data-parallel update the one-process update?

Every rank samples the same fixed rollout (same model, same seed), keeps its half of the groups and runs
train.update through DistributedDataParallel; rank 0 also runs train.update alone on the whole rollout, from the
same weights. The optimizer is plain SGD and clipping is off, so the parameter change is the gradient itself
(AdamW's first step, ~lr * sign(g), and norm clipping would hide a wrongly scaled gradient). Rank 0 writes, per
preset and case, the relative difference ||d_ddp - d_one|| / ||d_one|| of the parameter changes, and the same for
a deliberately wrong update whose normalisers are each rank's own (the pitfall the global normalisers avoid).

    torchrun --nproc-per-node 2 tests/plumbing/ddp_exactness.py MODEL_DIR OUT.json [float64|float32]

The updates run in float64 by default, so that what is compared is the arithmetic of the split (fp32 rounding of
sums taken in another order and of matmuls of another batch shape is ~3e-6 relative on its own).
"""

import copy
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from plumbing import ddp  # noqa: E402
import losses  # noqa: E402
import train  # noqa: E402
from plumbing import run as runs

DTYPE = torch.float64
CASES = {  # name: (micro-batch size, epochs, groups split by length?, LoRA rank)
    "equal": (0, 1, False, 0),  # groups in their drawn order
    "unequal": (0, 1, True, 0),  # rank 0 holds the short completions, rank 1 the long: token counts differ per rank
    "micro": (2, 1, True, 0),  # the same, in micro-batches of 2 rows (gradient accumulation inside DDP)
    "two-epochs": (0, 2, True, 0),  # a second optimizer step on the moved policy: ratios != 1, clipping active
    "lora": (2, 2, True, 4),  # LoRA adapters only (GRPO's β > 0: the reference is the base, adapter off)
}


class LocalNormWorld(ddp.World):
    """The pitfall: each rank normalises by its own rows and tokens, and DDP averages the ranks' gradients."""

    def step_totals(self, mask):
        return mask.shape[0], int(mask.sum())

    def backward(self, loss):
        loss.backward()


def delta(before, model):
    return torch.cat([(p.detach() - b).flatten() for b, p in zip(before, model.parameters())])


def one_update(policy, batch, adv, cfg, args, world):
    policy = policy.to(DTYPE).train()
    optimizer = torch.optim.SGD(policy.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    before = [p.detach().clone() for p in policy.parameters()]
    ref = None if cfg.beta == 0 else train.models.AdapterOff(policy) if train.models.is_lora(policy) else \
        copy.deepcopy(policy).eval().requires_grad_(False)
    world.wrap(policy)
    train.update(policy, ref, optimizer, scheduler, batch, adv, cfg, args, torch.Generator().manual_seed(0), world)
    world.ddp_model = None
    return delta(before, policy)


def main(model_dir: str, out: str, dtype: str = "float64") -> None:
    global DTYPE
    DTYPE = getattr(torch, dtype)
    world = ddp.setup("cpu")
    results = {}
    for algo in ("grpo", "dr_grpo", "dapo", "gspo"):
        for case, (micro, epochs, by_length, lora) in CASES.items():
            args, cfg = runs.resolve(train.Args(model=model_dir, algo=algo, num_prompts=8, num_generations=4,
                                                 num_minibatches=1, num_epochs=epochs, micro_batch_size=micro,
                                                 max_grad_norm=1e9, old_logprobs="recompute"))
            policy, tokenizer = runs.load_policy(args)
            if lora:
                policy = train.models.add_lora(policy, lora, 2.0 * lora, train.models.LORA_TARGETS, seed=0)
            torch.manual_seed(1)  # the same rollout on every rank
            examples = runs.load_data(args)[0][:args.num_prompts]
            batch = train.sample_groups(policy.eval(), tokenizer, examples, args)
            g = args.num_generations
            group_len = batch.ro.lengths.view(-1, g).float().mean(1)  # (P,)
            order = group_len.argsort().tolist() if by_length else list(range(args.num_prompts))
            batch = train.select_groups(batch, order, g)
            adv = losses.group_advantages(torch.tensor(batch.scores["reward"]), g, scale=cfg.scale_rewards)
            half = len(order) // world.size
            mine = list(range(world.rank * half, (world.rank + 1) * half))
            rows = torch.tensor([i * g + j for i in mine for j in range(g)])
            shard = train.select_groups(batch, mine, g)
            tokens = world.gather(int(shard.ro.lengths.sum()))
            d_ddp = one_update(copy.deepcopy(policy), shard, adv[rows], cfg, args, world)
            wrong = LocalNormWorld(world.rank, world.size, world.cpu_group, distributed=True)
            d_wrong = one_update(copy.deepcopy(policy), shard, adv[rows], cfg, args, wrong)
            if world.main:
                d_one = one_update(copy.deepcopy(policy), batch, adv, cfg, args, ddp.SINGLE)
                scale = float(d_one.norm())
                results[f"{algo}/{case}"] = {"rel_diff": float((d_ddp - d_one).norm()) / scale,
                                             "rel_diff_local_norm": float((d_wrong - d_one).norm()) / scale,
                                             "tokens_per_rank": tokens, "delta_norm": scale}
    if world.main:
        Path(out).write_text(json.dumps(results, indent=1))
    world.barrier()  # a rank that leaves the group while another still works can abort in gloo (seen once)
    ddp.teardown()


if __name__ == "__main__":
    main(*sys.argv[1:])
