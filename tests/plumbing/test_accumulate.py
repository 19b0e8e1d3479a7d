"""The inner loop's plumbing on its own: which micro-batch all-reduces, when an optimizer step is skipped, the
order prompts are read in, and what a step's normalisers and gathered rows hold over two ranks (a stand-in). Fast
unit tests; the runs that use them are in test_train.py, test_ddp.py and test_reliability.py."""

import contextlib
import gc
import math
import weakref

import torch

from plumbing import lifecycle
from plumbing.accumulate import MicroBatches, StepLog
from plumbing.ddp import SINGLE, World
from plumbing.run import PromptStream

from conftest import TwoRanks  # noqa: E402


class RecordingDDP(torch.nn.Module):
    """Stands in for DistributedDataParallel: records which micro-batches ran without the gradient all-reduce."""

    def __init__(self):
        super().__init__()
        self.unsynced = 0

    @contextlib.contextmanager
    def no_sync(self):
        self.unsynced += 1
        yield


def test_only_the_last_micro_batch_of_a_step_all_reduces():
    ddp = RecordingDDP()
    step = MicroBatches(torch.arange(10), 3, World(rank=0, size=2, distributed=True, ddp_model=ddp), None)
    seen = []
    for part in step:
        with step.guard():
            seen.append((part.tolist(), ddp.unsynced))
    assert [p for p, _ in seen] == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9]]
    assert [n for _, n in seen] == [1, 2, 3, 3]  # no_sync around the first three; the fourth all-reduces
    assert ddp.unsynced == 3


def test_a_steps_logged_loss_is_the_sum_of_its_micro_batches_losses():
    """Each micro-batch's loss carries the whole step's normalisers, so the step's loss (losses/policy_loss) is their
    sum, whatever the micro-batch size; what each saw is kept for the logs, in order."""
    step, log = MicroBatches(torch.arange(5), 2, SINGLE, None), StepLog()
    for part in step:
        with step.guard():
            step.keep(torch.tensor(float(part.sum())), part.tolist())  # 1, 5, 4
    assert log.finite(step, torch.tensor(1.0), SINGLE) and log.seen == [[0, 1], [2, 3], [4]]
    assert log.metrics() == {"losses/policy_loss": 10.0, "losses/grad_norm": 1.0, "losses/skipped_updates": 0}


def test_out_of_memory_after_a_backward_drops_its_partial_gradient_and_begins_again_at_half():
    """--micro-batch-size 0: a try that ran out of memory after some backward passes left a partial gradient; the
    step begins again at half the rows from a zero gradient, so the step's gradient is the whole minibatch's once."""
    torch.manual_seed(0)
    model, x = torch.nn.Linear(3, 1), torch.randn(4, 3)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    model(x).sum().backward()
    whole = model.weight.grad.clone()  # the gradient of the whole minibatch, taken once
    optimizer.zero_grad(set_to_none=True)
    lifecycle.AUTO_MICRO_BATCH.pop(4, None)
    step, sizes = MicroBatches(torch.arange(4), 0, SINGLE, optimizer), []
    for part in step:
        with step.guard():
            sizes.append(len(part))
            model(x[part]).sum().backward()
            if len(part) == 4:  # out of memory after the backward: its gradient is in .grad
                raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")
    lifecycle.AUTO_MICRO_BATCH.pop(4, None)
    assert sizes == [4, 2, 2]
    assert torch.allclose(model.weight.grad, whole)  # not twice it


def test_a_try_that_ran_out_of_memory_frees_its_tensors_before_the_next_begins():
    """The failed try's tensors are locals of the frames in the error's traceback; a reference cycle through it (here
    the error held by its own frame; on Python 3.12 also contextlib's) would keep them until Python's next
    collection, so every smaller try could run out too (seen: the GPU check's out-of-memory case on the GPU image's
    Python 3.12). Both halvings, the update's micro-batches and a pass without gradient, drop them at once."""
    def attempt(n, made):  # a forward of n rows: its activations, then out of memory at 4 rows
        activations = torch.zeros(n, 1000)
        made.append(weakref.ref(activations))
        if n == 4:
            error = RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")
            raise error

    gc.disable()  # (the cyclic collector, running by chance, would hide what is kept)
    try:
        lifecycle.AUTO_MICRO_BATCH.pop(4, None)
        made, alive = [], []
        step = MicroBatches(torch.arange(4), 0, SINGLE, torch.optim.SGD(torch.nn.Linear(1, 1).parameters(), lr=0.0))
        for part in step:
            alive.append([r() is not None for r in made])
            with step.guard():
                attempt(len(part), made)
        assert alive == [[], [False], [False, False]]  # at each try's start, nothing of the tries before
        made, alive = [], []

        def scored(micro):
            alive.append([r() is not None for r in made])
            return attempt(micro, made)

        lifecycle.shrink_on_oom(scored, 4, 0, key="test")
        assert alive == [[], [False]]
    finally:
        gc.enable()
        lifecycle.AUTO_MICRO_BATCH.pop(4, None)
        lifecycle.AUTO_MICRO_BATCH.pop("test", None)


def test_a_step_is_skipped_when_its_loss_or_its_gradient_norm_is_not_finite():
    log = StepLog()
    for loss, norm in [(0.5, 1.0), (float("nan"), 1.0), (0.5, float("inf")), (0.25, 3.0)]:
        step = MicroBatches(torch.arange(2), 0, SINGLE, None)
        step.loss, step.seen = loss, [("rows", loss)]
        log.finite(step, torch.tensor(norm), SINGLE)
    assert log.skipped == 2 and log.losses == [0.5, 0.25] and log.grad_norms == [1.0, 3.0]
    assert log.metrics() == {"losses/policy_loss": 0.375, "losses/grad_norm": 2.0, "losses/skipped_updates": 2}
    assert len(log.seen) == 4  # what a skipped step saw is still logged
    assert math.isnan(StepLog().metrics()["losses/policy_loss"])


def test_prompts_are_read_in_a_new_order_each_pass_and_a_cursor_resumes_it():
    examples = list(range(7))
    stream = PromptStream(examples, seed=3)
    first, second = stream.take(7), stream.take(7)
    assert sorted(first) == sorted(second) == examples and first != second  # every prompt once per pass, reshuffled
    again = PromptStream(examples, seed=3)
    again.take(5)
    resumed = PromptStream(examples, seed=3)
    resumed.cursor = again.cursor  # as a checkpoint restores it
    assert resumed.take(9) == (first + second)[5:14]
    assert PromptStream(examples, seed=4).take(7) != first


def test_the_steps_normalisers_count_every_ranks_rows_and_tokens():
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])  # this rank: 2 sequences, 3 tokens
    assert TwoRanks(other_sum=[3.0, 7.0]).step_totals(mask) == (5, 10)  # the other: 3 sequences, 7 tokens
    assert SINGLE.step_totals(mask) == (2, 3)


def test_a_flag_is_up_on_every_rank_when_any_rank_raises_it():
    """world.any: DAPO's "a rank is still short of mixed groups" and "a rank was signalled to stop", which every rank
    must answer alike (a rank that stopped drawing alone would leave its prompt cursor behind the others')."""
    assert TwoRanks(other_sum=[1.0]).any(False) and TwoRanks(other_sum=[0.0]).any(True)
    assert not TwoRanks(other_sum=[0.0]).any(False)
    assert SINGLE.any(True) and not SINGLE.any(False)


def test_gathered_rows_pad_each_ranks_completions_on_the_right():
    """Completions are right-padded (a zero mask marks padding), so a rank whose are shorter is padded after them:
    token t of every row stays at position t."""
    mine, theirs = torch.tensor([[1.0, 2.0]]), torch.tensor([[3.0, 4.0, 5.0], [6.0, 7.0, 8.0]])
    lengths = torch.tensor([2]), torch.tensor([3, 1])
    rows, lens, missing = TwoRanks(other_obj=[theirs, lengths[1], None]).gather_rows(mine, lengths[0], None)
    assert torch.equal(rows, torch.tensor([[1.0, 2.0, 0.0], [3.0, 4.0, 5.0], [6.0, 7.0, 8.0]]))
    assert torch.equal(lens, torch.tensor([2, 3, 1])) and missing is None
