"""One optimizer step over any number of rows, processes and micro-batches, as if it were one forward/backward.

train.update says what the loss of some rows is; `Accumulator.step` owns the rest: the step's normalisers summed
over ranks (so DDP's gradient average is the one-process gradient), micro-batches (gradient accumulation, halved
after an out-of-memory error), the gradient all-reduce on the last micro-batch only, gradient clipping, and the
skip of an update whose loss or gradient is not finite. Nothing here changes what is learned.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import torch

import rollout
from plumbing import lifecycle
from plumbing.ddp import World


class Accumulator:
    def __init__(self, policy, optimizer, scheduler, world: World, micro_batch_size: int, max_grad_norm: float,
                 max_new_tokens: int):
        self.policy, self.optimizer, self.scheduler, self.world = policy, optimizer, scheduler, world
        self.micro_batch_size, self.max_grad_norm, self.max_new_tokens = micro_batch_size, max_grad_norm, max_new_tokens
        self.net = world.trainable(policy)  # the DDP wrapper under torchrun: its backward all-reduces the gradients
        self.records, self.losses, self.grad_norms, self.skipped = [], [], [], 0  # of the steps taken so far

    def score(self, fn, rows: torch.Tensor, step_rows: int):
        """fn(rows) over every row in micro-batches (see score_rows)."""
        return score_rows(fn, rows, step_rows, self.micro_batch_size)

    def step(self, rows: torch.Tensor, mask: torch.Tensor, loss_of) -> None:
        """One optimizer step on `rows` (this rank's share). loss_of(model, rows, norm) -> (loss, record): the loss of
        some rows under the step's normalisers `norm`, and what to keep of them for the diagnostics."""
        total, records = lifecycle.shrink_on_oom(
            lambda micro: self._accumulate(rows, mask, micro, loss_of), len(rows), self.micro_batch_size,
            lambda: self.optimizer.zero_grad(set_to_none=True), self.world.size)
        total = self.world.sum([total])[0]  # the whole step's loss: every rank takes the same decision below
        self.records += records
        grad_norm = torch.nn.utils.clip_grad_norm_(self.policy.parameters(), self.max_grad_norm)
        if math.isfinite(total) and torch.isfinite(grad_norm):
            with lifecycle.optimizer_memory(self.policy, grad_norm.device):
                self.optimizer.step()
            self.scheduler.step()
            self.losses.append(total)
            self.grad_norms.append(float(grad_norm))
        else:  # a non-finite loss or gradient would poison the weights: skip this update
            self.skipped += 1
        self.optimizer.zero_grad(set_to_none=True)

    def _accumulate(self, rows: torch.Tensor, mask: torch.Tensor, micro: int, loss_of) -> tuple[float, list]:
        norm = self.world.step_norm(mask[rows], self.max_new_tokens)  # normalisers of the whole step, all ranks
        total, records = 0.0, []
        parts = rows.split(micro)
        norm = dataclasses.replace(norm, micro_batches=len(parts))
        for i, part in enumerate(parts):
            with self.world.sync_gradients(last=i == len(parts) - 1):
                loss, record = loss_of(self.net, part, norm)
                self.world.backward(loss)  # under torchrun: scaled so that DDP's average over ranks is the sum
            total += loss.item()
            records.append(record)
        return total, records

    def metrics(self) -> dict:
        return {"losses/policy_loss": float(np.mean(self.losses)) if self.losses else float("nan"),
                "losses/grad_norm": float(np.mean(self.grad_norms)) if self.grad_norms else float("nan"),
                "losses/skipped_updates": self.skipped}


def score_rows(fn, rows: torch.Tensor, step_rows: int, micro_batch_size: int):
    """fn(rows) over every row in micro-batches (--micro-batch-size, or halved from step_rows after an out-of-memory
    error), concatenated: a forward pass without gradient, e.g. pi_old's or the reference's log-probs of a rollout.
    It holds no collective, so under torchrun a rank halves alone too; its size is remembered apart from the
    update's, which every rank must split alike."""
    @torch.inference_mode()
    def run(micro):
        parts = [fn(r) for r in rows.split(micro)]
        return tuple(torch.cat(p) for p in zip(*parts)) if isinstance(parts[0], tuple) else torch.cat(parts)
    return lifecycle.shrink_on_oom(run, step_rows, micro_batch_size, lambda: None, key=f"score {step_rows}")


def score_rollout(model, ro, temperature: float, device, micro_batch_size: int = 0,
                  step_rows: int | None = None) -> torch.Tensor:
    """log pi(y_t) of every completion token of a rollout under `model`, without gradient, in micro-batches of
    --micro-batch-size or, with 0, of `step_rows` (default: all rows), halved after an out-of-memory error: (B, T), on
    the host."""
    on = ro.to(device)
    rows = torch.arange(len(ro.lengths), device=device)
    return score_rows(lambda r: rollout.completion_logprobs(model, on.input_ids[r], on.attention_mask[r],
                                                            ro.completion_ids.shape[1], temperature),
                      rows, step_rows or len(rows), micro_batch_size).cpu()
