"""Plumbing: what a run needs that changes nothing it learns.

settings (the flags that are not the algorithm's), flags (every flag checked before anything is loaded), lifecycle
(the run folder, signals, out-of-memory halving, failed steps, the warnings that watch a run), checkpoint (atomic
saves, exact resume), ddp (torchrun data parallel and --fsdp sharding), run (set-up, the held-out evaluation and the
end of a run), logs (metrics.jsonl, wandb and the printed lines), accumulate (the inner loop's micro-batches: their
size, out-of-memory halving, DDP's all-reduce on the last; what each step saw). The ground floor every layer uses
(errors, network, early signal handling) is base/.
"""
