"""User errors: the exceptions a user can cause, and how one is printed (one `error: ...` line, exit code 2).

Every such exception is a UserError (the flags' ConfigError here; model.ModelError, task.TaskError,
checkpoint.CheckpointError beside the code that raises them). `one_line_errors()` around train() prints one as a
single line, once per torchrun job; anything else is a bug and keeps its traceback. Imports nothing of the project.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import sys
import time


class UserError(Exception):
    """An error the user can fix: its message says what was wrong and what to do."""


class ConfigError(UserError, ValueError):
    """A flag value that cannot work; the message says which and what to do."""


class NonFiniteError(UserError, RuntimeError):
    """Too many updates in a row had a non-finite loss or gradient."""


class OutOfMemory(UserError, RuntimeError):
    """The device ran out of memory even at one row per forward/backward, or while generating."""


class OptimizerOutOfMemory(OutOfMemory):
    """The optimizer step ran out of memory: the weights, gradients and AdamW state do not fit, whatever the batch."""


class Interrupted(UserError, RuntimeError):
    """Ctrl-C or SIGTERM before the first step: nothing was kept."""


class DynamicSamplingError(UserError, RuntimeError):
    """Dynamic sampling could not fill a batch with informative groups."""


class PeerFailure(RuntimeError):
    """Under torchrun: another rank stopped (its own error is printed by it), so this one stops too."""


PER_RANK = (OutOfMemory, PeerFailure)  # the errors one rank can meet alone; every rank meets the others the same way


@contextlib.contextmanager
def one_line_errors(cleanup=lambda: None):
    """Around train(): a user error (a UserError, or under torchrun a collective that failed because another rank
    died) is printed as one line and exits with code 2; anything else is a bug and keeps its traceback. `cleanup`
    runs last whatever happened (train.py leaves the process group there)."""
    rank = int(os.environ.get("RANK", "0"))  # under torchrun (or another env:// launcher) this process's rank
    try:
        yield
    except UserError as e:
        exit_with(e, rank)
    except RuntimeError as e:
        if not is_peer_failure(e):
            raise
        report(PeerFailure(f"another process of this torchrun job stopped ({first_line(e)}); torchrun's report "
                           "names it and its exit code"), rank)
        sys.exit(2)
    finally:
        cleanup()


def is_peer_failure(e: BaseException) -> bool:
    """Under torchrun, a collective that failed because another rank died or timed out (gloo and NCCL word it
    differently; torch.distributed's DistNetworkError says so by its type)."""
    text = str(e).lower()
    by_type = any(cls.__name__ == "DistNetworkError" for cls in type(e).__mro__)
    return "WORLD_SIZE" in os.environ and (by_type or any(w in text for w in (
        "connection closed", "connection reset", "broken pipe", "timed out", "timeout", "aborted", "watchdog",
        "remote process")))  # the last: NCCL's ncclRemoteError ("... a remote process exiting prematurely")


def first_line(e: BaseException) -> str:
    """The gist of a collective's error: its first line without gloo's '[source.cc:123]' prefix."""
    text = re.sub(r"^\[[^\]]*\]\s*", "", str(e).strip())
    return text.splitlines()[0][:120] if text else type(e).__name__


def exit_with(e: UserError, rank: int) -> None:
    """One `error:` line (report) and exit code 2; under torchrun a rank other than 0 leaves an error every rank
    meets to rank 0 and waits for it (wait_for_rank_zero)."""
    report(e, rank)
    if rank != 0 and not isinstance(e, PER_RANK):
        wait_for_rank_zero()
    sys.exit(2)


def wait_for_rank_zero(seconds: float = 10.0) -> None:
    """An error every rank meets is printed by rank 0 alone, but torchrun stops every process as soon as one exits:
    a rank that got there first and exited at once would have rank 0 killed before it printed anything. So the other
    ranks wait (SIGTERM at its default, so torchrun's stop ends the wait) until rank 0 has printed and exited."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    time.sleep(seconds)


def report(e: BaseException, rank: int) -> None:
    """One `error: ...` line. Under torchrun every rank meets a bad flag or dataset alike, so rank 0 alone prints
    it; a per-rank error names its rank."""
    if rank == 0 or isinstance(e, PER_RANK):
        if isinstance(e, Interrupted):  # a signal can land inside a print, between its text and its newline (and a
            print(flush=True)  # terminal echoes ^C): the error line starts a line of its own
        print(f"error: {'' if rank == 0 else f'rank {rank}: '}{e}", file=sys.stderr)
