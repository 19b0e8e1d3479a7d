"""Data parallel over N processes with torch.distributed: `torchrun --nproc-per-node N train.py ...`.

What each of the N ranks does, and what is synchronised:
    rollout     every rank draws the same global P prompts from the same stream and keeps its own P/N of them
                (whole groups, so group advantages need no communication); its sampling RNG is its own
    update      DistributedDataParallel all-reduces the gradients of each optimizer step; the step's normalisers
                (B and sum |y_i|) are summed over ranks first, so every rank divides by the same constants
    metrics     gathered from every rank, so a logged statistic is that of the whole rollout
    eval        each rank scores every N-th held-out problem; the counts are summed
    writing     rank 0 alone writes logs, wandb, checkpoints and the final model (under --fsdp each rank
                writes its own shards of a checkpoint)

The normaliser pitfall: DDP *averages* gradients over ranks, which is the gradient of the whole step only when every
rank's loss was divided by the same number. A rank that divided by its own token count (DAPO's token-mean) would
weight the tokens of a rank with short answers more. So each rank's loss uses the global normaliser and is scaled by
N before backward: mean_r(N * grad L_r) = sum_r grad L_r, the gradient of the one-process loss on the union.

Sharded (`--fsdp`): the same loop, but each rank holds 1/N of every weight, gradient and AdamW moment (PyTorch's
FSDP2, `fully_shard` on each decoder layer and then the root; parameters become DTensors). A forward gathers each
layer's weights just before it runs and frees them after; the backward reduce-scatters each layer's gradients,
averaged over ranks as DDP's are, so the same x N scaling gives the union's gradient. Generation gathers the whole
model once per rollout (`gathered`), not once per token, and no collective runs inside generate, so ranks that
stop at different lengths do not wait on each other. bf16 stays autocast over the fp32 shards (as in one process),
with each layer's linear weights gathered in bf16 (`shard`): what autocast casts them to, in half the bytes.

A single process (no torchrun) is the world of size 1: every method here then returns its input unchanged.
"""

from __future__ import annotations

import contextlib
import copy
import datetime
import gc
import inspect
import os
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist

from base.errors import UserError


# Seed offset between ranks: rank 0 keeps the single-process seed, so a 1-process run is unchanged.
RANK_SEED_STRIDE = 100_003


@dataclass
class World:
    rank: int = 0
    size: int = 1
    cpu_group: object = None  # a gloo group for metrics and objects (the default group may be NCCL)
    distributed: bool = False  # in a process group (torchrun), even of one process: train through DDP
    ddp_model: torch.nn.Module | None = None  # the DistributedDataParallel wrapper the update trains through
    sharded: torch.nn.Module | None = None  # under --fsdp: the policy, sharded in place (fully_shard)
    device: torch.device | None = None  # under torchrun: this rank's device (its GPU under NCCL, else the CPU)

    @property
    def main(self) -> bool:
        return self.rank == 0

    def seed(self, seed: int) -> int:
        return seed + RANK_SEED_STRIDE * self.rank

    def shard(self, items: list) -> list:
        """This rank's contiguous 1/N of a list whose length N divides (the rollout's prompts)."""
        n = len(items) // self.size
        return items[self.rank * n:(self.rank + 1) * n]

    def sum(self, values: list[float]) -> list[float]:
        """Sums over ranks (float64), in the same order on every rank."""
        if self.size == 1:
            return list(values)
        t = torch.tensor(values, dtype=torch.float64)
        dist.all_reduce(t, group=self.cpu_group)
        return t.tolist()

    def any(self, flag: bool) -> bool:
        return self.sum([float(flag)])[0] > 0 if self.size > 1 else flag

    def gather(self, obj) -> list:
        """Every rank's `obj` (picklable), in rank order, on every rank."""
        if self.size == 1:
            return [obj]
        out = [None] * self.size
        dist.all_gather_object(out, obj, group=self.cpu_group)
        return out

    def gather_rows(self, *tensors: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        """Row-wise concatenation over ranks of (B_r,) or (B_r, T_r) tensors, in one collective; T is padded with
        zeros to the longest rank's (a zero mask marks the padding). A None stays None."""
        if self.size == 1:
            return tensors
        parts = self.gather([None if t is None else t.detach().cpu() for t in tensors])
        out = []
        for i in range(len(tensors)):
            pieces = [p[i] for p in parts]
            if pieces[0] is None:
                out.append(None)
                continue
            if pieces[0].dim() == 2:
                width = max(p.shape[1] for p in pieces)
                pieces = [torch.nn.functional.pad(p, (0, width - p.shape[1])) for p in pieces]
            out.append(torch.cat(pieces))
        return tuple(out)

    def step_totals(self, mask: torch.Tensor) -> tuple[int, int]:
        """(B, sum |y_i|) of an optimizer step over every rank's rows (mask: this rank's (B_r, T))."""
        seqs, tokens = self.sum([mask.shape[0], float(mask.sum())])
        return int(seqs), int(tokens)

    def backward(self, loss: torch.Tensor) -> None:
        """DDP averages gradients over the N ranks; each rank's loss already carries the global normaliser, so it is
        scaled by N: mean_r(N * grad L_r) = sum_r grad L_r. (Without torchrun, N = 1: a plain backward.)"""
        (loss * self.size).backward()

    def barrier(self) -> None:
        if self.size > 1:
            dist.barrier(group=self.cpu_group)

    @contextlib.contextmanager
    def main_first(self):
        """Rank 0 runs the block first (it may build a cache: the warm start, a dataset download), then the others.
        A bad input rank 0 meets there (a UserError: a bad row, a model that cannot fit) lets the others in too:
        each meets it itself and leaves the one line to rank 0, instead of reporting rank 0's exit as a failure."""
        if not self.main:
            self.barrier()
        try:
            yield
        except UserError:
            if self.main:
                self.barrier()
            raise
        if self.main:
            self.barrier()

    def from_main(self, load):
        """Under --fsdp: rank 0 alone runs `load` (reading the weights into host memory: (model, tokenizer)); every
        other rank receives the model's skeleton (skeleton: its parameters and buffers on the meta device, no bytes)
        and the tokenizer, and gets its shards from rank 0 when shard(from_rank0=True) shards it. So one process holds
        the whole fp32 model in host memory, not every process of the machine. A UserError rank 0 meets (a model that
        does not load) reaches every rank, which leaves the one line to rank 0."""
        sent = [None]
        if self.main:
            try:
                model, tokenizer = load()
            except UserError as e:
                sent[0] = e
            else:
                sent[0] = (skeleton(model), tokenizer)
        dist.broadcast_object_list(sent, src=0, group=self.cpu_group)
        if isinstance(sent[0], UserError):
            raise sent[0]
        return (model, tokenizer) if self.main else sent[0]

    def trainable(self, policy: torch.nn.Module) -> torch.nn.Module:
        """What the update's forward passes go through: the DDP wrapper (its backward all-reduces) or the policy."""
        return self.ddp_model if self.ddp_model is not None else policy

    def sync_gradients(self, last: bool):
        """Gradient accumulation: all-reduce (FSDP: reduce-scatter) only on the optimizer step's last micro-batch."""
        if self.sharded is not None:
            return _gradient_sync(self.sharded, last)
        return self.ddp_model.no_sync() if self.ddp_model is not None and not last else contextlib.nullcontext()

    def gathered(self, policy: torch.nn.Module):
        """Under --fsdp: the whole model gathered on every rank for the block (a rollout's or an evaluation's
        generate calls), freed after it. Otherwise nothing."""
        return _gathered(self.sharded) if self.sharded is not None and policy is self.sharded else \
            contextlib.nullcontext()

    @contextlib.contextmanager
    def scored(self, frozen: torch.nn.Module | None):
        """Under --fsdp: a frozen model (the reference) scored in the block, its whole root (embeddings, head) freed
        after it. FSDP keeps a root's weights gathered after a forward, for the backward that follows (and the chunked
        log-probs read the head after the forward); a frozen model has no backward, so its root stayed whole on
        every card from its first pass on. Otherwise nothing."""
        try:
            yield
        finally:
            if self.sharded is not None and frozen is not None:
                resharded(frozen)

    def wrap(self, policy: torch.nn.Module, fsdp: bool = False, from_rank0: bool = False) -> None:
        if self.distributed and fsdp:
            self.sharded = shard(policy, device=self.device, from_rank0=from_rank0)
        elif self.distributed:
            device = next(policy.parameters()).device
            self.ddp_model = torch.nn.parallel.DistributedDataParallel(
                policy, device_ids=[device.index] if device.type == "cuda" else None, **no_buffer_sync())


SINGLE = World()


def skeleton(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of `model` whose parameters and buffers are meta tensors of the same shapes and dtypes (no bytes):
    everything else (config, generation config, the autocast and fp32-head forwards, tied weights) is copied."""
    memo = {}
    for t in [*model.parameters(), *model.buffers()]:
        empty = torch.empty_like(t, device="meta")
        memo[id(t)] = torch.nn.Parameter(empty, requires_grad=t.requires_grad) \
            if isinstance(t, torch.nn.Parameter) else empty
    return copy.deepcopy(model, memo)


def shard(model: torch.nn.Module, frozen: bool = False, device: torch.device | None = None,
          from_rank0: bool = False) -> torch.nn.Module:
    """FSDP2 in place: each decoder layer its own unit (gathered for its forward and backward only), then the root
    (embeddings, final norm, head). A frozen model (the reference) keeps no gradients; World.scored frees its root's
    weights after a scoring pass. On `device` (the rank's, World.device; None: FSDP's default, a GPU where there is
    one): a model still on the CPU (start_run loads it there under --fsdp) goes to it one unit at a time as each is
    sharded, so no card ever holds the whole model at once.

    Under bf16 (model.compute_in: autocast over fp32 weights) a layer's linear weights are gathered in bf16, what
    autocast casts them to anyway, and their gradients reduce-scattered in fp32 (FSDP's MixedPrecisionPolicy, inputs
    left as they come); the layer's other parameters (its norms, each a unit of its own) and the root are gathered in
    fp32 as autocast reads them. So the same numbers are computed from 2 gathered bytes per linear weight, not 4,
    and no bf16 copy of a layer outlives its forward: the copy autocast would make and keep for the backward is the
    gathered weight, which FSDP frees after the forward and gathers again for the backward.

    `from_rank0` (World.from_main, with the rank's `device`): rank 0 holds the weights, the other ranks a skeleton;
    each rank's shards come from rank 0, one tensor at a time, and so do the buffers (the rotary tables, not in a
    state dict)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    inner = getattr(model, "module", model)
    whole = inner.state_dict() if from_rank0 and dist.get_rank() == 0 else {}  # (rank 0's host tensors, kept)
    mesh = None if device is None else init_device_mesh(device.type, (dist.get_world_size(),))
    for unit, dtype in _units_to_make(inner):
        fully_shard(unit, mesh=mesh, mp_policy=MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32,
                                                                    cast_forward_inputs=False) if dtype else
                    MixedPrecisionPolicy())
    if from_rank0:
        if dist.get_rank() != 0:  # the skeleton's shards and buffers, allocated on the rank's device, unset
            inner.to_empty(device=device)
        set_model_state_dict(inner, whole, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
        for buffer in inner.buffers():
            dist.broadcast(buffer, src=0)
        del whole
    if frozen:
        inner.requires_grad_(False)
    return inner


def _units_to_make(inner: torch.nn.Module) -> list[tuple[torch.nn.Module, torch.dtype | None]]:
    """shard's units, inner ones first, each with the dtype its weights are gathered in (None: as stored)."""
    dtype = getattr(inner, "autocast_dtype", None)  # bf16 (model.compute_in), or None: fp32 throughout
    units = []
    for layer in inner.get_decoder().layers:
        if dtype is None or next(layer.parameters(recurse=False), None) is not None:  # (a weight of the layer's own:
            units.append((layer, None))  # which op reads it is unknown, so it is gathered as stored)
            continue
        units += [(sub, None) for sub in layer.modules() if sub is not layer and not isinstance(sub, torch.nn.Linear)
                  and next(sub.parameters(recurse=False), None) is not None]  # the norms: fp32, as autocast reads
        units.append((layer, dtype))  # its linear layers, in the compute dtype
    return units + [(inner, None)]


def gathered_bytes(model: torch.nn.Module) -> int:
    """The bytes of the whole model as `gathered` holds it on each rank (shard's rule: a unit's weights in its
    gathered dtype), counted from the model, sharded or not."""
    counted, total = set(), 0
    for unit, dtype in _units_to_make(getattr(model, "module", model)):
        for p in unit.parameters():
            if id(p) not in counted:
                counted.add(id(p))
                total += p.numel() * (dtype.itemsize if dtype else p.element_size())
    return total


def resharded(model: torch.nn.Module) -> torch.nn.Module:
    """`model` with every unit holding its shards only, before its state is read. A forward with no backward after it
    (a scoring pass without gradient, as --log-prefix-spread's after the update) leaves the root's weights gathered,
    as fully_shard leaves a root after its forward; a state dict read then names those gathered tensors, not the
    shards AdamW steps (DCP's optimizer state failed with a KeyError)."""
    for unit in _units(model):
        unit.reshard()
    return model


def full_state_dict(model: torch.nn.Module) -> dict | None:
    """A sharded model's whole state dict, gathered on rank 0 in host memory (None on the others); every rank calls
    it (the final model: `final/` is an ordinary save_pretrained folder)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    resharded(model)
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if dist.get_rank() != 0:
        return None
    names = {}  # a weight the model ties (a head tied to the embeddings): every name of it, one tensor, saved once
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    for first, *others in names.values():
        state.update({other: state[first] for other in others if first in state and other in state})
    return state


def _units(model):
    from torch.distributed.fsdp import FSDPModule

    return [m for m in model.modules() if isinstance(m, FSDPModule)]


@contextlib.contextmanager
def _gathered(model):
    units = _units(model)
    for unit in units:
        unit.unshard()
        unit.set_reshard_after_forward(False, recurse=False)
    try:
        yield
    finally:  # as fully_shard left them: the root keeps its weights after a forward (the chunked log-probs' head
        for unit in units:  # runs after the model's forward, and the backward needs them), the layers free theirs
            unit.reshard()
            unit.set_reshard_after_forward(unit is not model, recurse=False)


@contextlib.contextmanager
def _gradient_sync(model, sync: bool):
    model.set_requires_gradient_sync(sync)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


def no_buffer_sync(ddp_class=None) -> dict:
    """DDP's switch for not re-broadcasting buffers at every forward (the policy's buffers, rotary tables, never
    change): `forward_sync_buffers` from torch 2.13, `broadcast_buffers` before (deprecated since)."""
    params = inspect.signature(ddp_class or torch.nn.parallel.DistributedDataParallel).parameters
    return {"forward_sync_buffers": False} if "forward_sync_buffers" in params else {"broadcast_buffers": False}


def world_size() -> int:
    """N processes as torchrun (or another env:// launcher) set it; 1 for a plain `python train.py`."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def rank() -> int:
    return int(os.environ.get("RANK", "0"))


def local_world_size() -> int:
    """The processes torchrun starts on this machine (--nproc-per-node); each needs a GPU of its own under NCCL."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", world_size()))


def launched() -> bool:
    """Started by torchrun, even with one process: `torchrun --nproc-per-node 1` runs the distributed code path
    (process group, DDP) and must give exactly the metrics of `python train.py` (tested)."""
    return "WORLD_SIZE" in os.environ


def setup(device: str, timeout_min: float = 30.0) -> World:
    """Join the process group torchrun describes: NCCL with one GPU per rank (LOCAL_RANK), else gloo. One process
    on `cuda:N` makes GPU N the current device, as each rank's is under torchrun.

    A rank that waits longer than `timeout_min` in a collective (another rank hung) raises instead of hanging."""
    if not launched():
        if device.startswith("cuda:"):  # 'cuda' now means the chosen GPU (memory peaks, CUDA calls without an index)
            torch.cuda.set_device(torch.device(device))
        return SINGLE
    local = int(os.environ.get("LOCAL_RANK", "0"))
    on_gpu = device in ("auto", "cuda") and torch.cuda.is_available()
    mine = torch.device("cuda", local) if on_gpu else torch.device("cpu")
    if dist.is_initialized():  # a second train() call in the same processes (tests)
        return World(dist.get_rank(), dist.get_world_size(), _cpu_group(), distributed=True, device=mine)
    if on_gpu:
        torch.cuda.set_device(local)  # 'cuda' now means this rank's GPU
    dist.init_process_group("nccl" if on_gpu else "gloo", timeout=datetime.timedelta(minutes=timeout_min),
                            device_id=torch.device("cuda", local) if on_gpu else None)  # NCCL set-up errors now
    if dist.get_rank() != 0:  # rank 0 speaks for all; errors still reach stderr from every rank
        sys.stdout = open(os.devnull, "w")
    return World(dist.get_rank(), dist.get_world_size(), _cpu_group(), distributed=True, device=mine)


_CPU_GROUP = None


def _cpu_group():
    global _CPU_GROUP
    if _CPU_GROUP is None:
        _CPU_GROUP = dist.new_group(backend="gloo") if dist.get_backend() != "gloo" else dist.group.WORLD
    return _CPU_GROUP


def teardown() -> None:
    """Leave the process group, after freeing what the run left in reference cycles (FSDP's modules and their gloo
    work), while the groups and the interpreter are alive. Twice in CI a rank of a finished --fsdp run aborted at
    exit (SIGABRT, "terminate called without an active exception"); PyTorch reports that message from gloo work
    left to interpreter shutdown. A mitigation: the abort was not reproduced here, so it is not shown to be cured."""
    global _CPU_GROUP
    if dist.is_initialized():
        gc.collect()
        dist.destroy_process_group()
    _CPU_GROUP = None
