"""The inner loop's plumbing: train.update runs every forward, backward and optimizer step itself; from here it takes
the micro-batches of each optimizer step (their size: --micro-batch-size, or the whole minibatch halved after each
out-of-memory error and begun again; DDP's gradient all-reduce on the last one only), the forward passes without
gradient done in micro-batches (π_old's, the reference's), and a log of what each step saw. Nothing here changes
what is learned.
"""

from __future__ import annotations

import contextlib
import math

import numpy as np
import torch

from plumbing import lifecycle
from plumbing.ddp import World


class MicroBatches:
    """The micro-batches of one optimizer step over `rows` (this rank's share), as the update's inner loop takes them:

        for part in step:
            with step.guard():    # DDP's no_sync on all but the last micro-batch; an out-of-memory error is caught
                loss, seen = ...; world.backward(loss); step.keep(loss, seen)

    `fixed` (--micro-batch-size) rows each, or with 0 all rows at once; after an out-of-memory error inside `guard`
    the partial gradient is dropped (the optimizer's zero_grad), the size halves (remembered for the process:
    lifecycle.halved) and the loop begins again at the first row. Under torchrun the error is raised instead
    (lifecycle.halved says why)."""

    def __init__(self, rows: torch.Tensor, fixed: int, world: World, optimizer: torch.optim.Optimizer):
        self.rows, self.fixed, self.world, self.optimizer = rows, fixed, world, optimizer
        self.size = fixed or min(len(rows), lifecycle.AUTO_MICRO_BATCH.get(len(rows), len(rows)))
        self.parts, self.last, self.restart, self.loss, self.seen = (), False, False, 0.0, []

    def __iter__(self):
        while True:
            self.parts, self.restart, self.loss, self.seen = self.rows.split(self.size), False, 0.0, []
            for i, part in enumerate(self.parts):
                self.last = i == len(self.parts) - 1
                yield part
                if self.restart:
                    break
            else:
                return

    @contextlib.contextmanager
    def guard(self):
        try:
            with self.world.sync_gradients(last=self.last):
                yield
        except RuntimeError as e:
            self.size = lifecycle.halved(e, self.size, self.fixed, self.world.size, len(self.rows),
                                         reset=lambda: self.optimizer.zero_grad(set_to_none=True))
            self.restart = True

    def keep(self, loss: torch.Tensor, seen) -> None:
        """One micro-batch's loss (summed into the step's) and what it saw, for the logs."""
        self.loss += loss.item()
        self.seen.append(seen)


class StepLog:
    """What the update's optimizer steps saw, for the logs: per micro-batch (rows, log-probs, entropy), each step's
    loss over every rank and its gradient norm, and the updates skipped as non-finite."""

    def __init__(self):
        self.seen, self.losses, self.grad_norms, self.skipped = [], [], [], 0

    def finite(self, step: MicroBatches, grad_norm: torch.Tensor, world: World) -> bool:
        """Whether to take the optimizer step: the step's loss, summed over ranks (so that every rank decides
        alike), and its gradient norm are finite. A non-finite one would poison the weights: the step is skipped."""
        loss = world.sum([step.loss])[0]
        self.seen += step.seen
        if math.isfinite(loss) and math.isfinite(norm := float(grad_norm)):  # (a DTensor under --fsdp)
            self.losses.append(loss)
            self.grad_norms.append(norm)
            return True
        self.skipped += 1
        return False

    def metrics(self) -> dict:
        return {"losses/policy_loss": float(np.mean(self.losses)) if self.losses else float("nan"),
                "losses/grad_norm": float(np.mean(self.grad_norms)) if self.grad_norms else float("nan"),
                "losses/skipped_updates": self.skipped}


def score_rows(fn, rows: torch.Tensor, step_rows: int, micro_batch_size: int, world: World | None = None):
    """fn(rows) over every row in micro-batches (--micro-batch-size, or halved from step_rows after an out-of-memory
    error), concatenated: a forward pass without gradient, e.g. pi_old's or the reference's log-probs of a rollout.
    Under data parallel it holds no collective, so a rank halves alone; its size is remembered apart from the
    update's, which every rank must split alike. Under --fsdp (`world.sharded`) each layer's forward gathers its
    weights from every rank, so a rank halving alone would leave the others waiting: the error is raised instead."""
    @torch.no_grad()  # not inference_mode: FSDP's gather buffers made in it could not be written outside it
    def run(micro):
        parts = [fn(r) for r in rows.split(micro)]
        return tuple(torch.cat(p) for p in zip(*parts)) if isinstance(parts[0], tuple) else torch.cat(parts)
    collective = world is not None and world.sharded is not None
    return lifecycle.shrink_on_oom(run, step_rows, micro_batch_size, world.size if collective else 1,
                                   key=f"score {step_rows}")
