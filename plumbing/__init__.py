"""Plumbing: what a run needs that changes nothing it learns.

errors (one `error:` line, exit 2), flags (every flag checked before anything is loaded), lifecycle (the run folder,
signals, out-of-memory halving, failed steps), checkpoint (atomic saves, exact resume), ddp (torchrun data parallel),
network (the hub and wandb, never a prompt), run (set-up, logging and the end of a run), accumulate (the inner
loop's micro-batches: their size, out-of-memory halving, DDP's all-reduce on the last; what each step saw).
"""
