"""A run's life: its folder, start-up, signals, out-of-memory, failed steps and the warnings that watch it.
train.py calls these; none holds RL.

    preflight(args, ...)    torch's and transformers' releases, the flags (flags.py), the output folder, the run
                            folder and the checkpoint --resume names
    check_run_folder(...)   a finished run is never replaced; an unfinished one is resumed or replaced on request
    NewRunFolder            the folder start-up made is removed again if start-up fails, so the command can rerun
    Startup / GracefulStop  Ctrl-C or SIGTERM: during start-up, nothing is left behind; later, save and exit 0
    shrink_on_oom, halved   --micro-batch-size 0: halve the micro-batch after an out-of-memory error, and remember
    optimizer_out_of_memory  out of memory in the optimizer step: the sizes that do not fit, and no checkpoint
    StepFailures            a failed RL step (dynamic sampling gave up, out of memory) or held-out evaluation (out
                            of memory) becomes one line naming what was saved
    Watch                   after every step: a streak of steps whose updates were all non-finite stops the run;
                            one warning each when the reward or the token budget looks wrong
"""

from __future__ import annotations

import contextlib
import json
import shutil
import signal
import traceback
from dataclasses import asdict
from pathlib import Path

import torch

from model import require_releases
from plumbing import checkpoint, ddp
from plumbing import flags
from base.errors import (ConfigError, DynamicSamplingError, Interrupted, NonFiniteError, OptimizerOutOfMemory,
                             OutOfMemory)

# ---------------------------------------------------------------------------------------------------------------
# Before start-up: what can be checked without loading or writing
# ---------------------------------------------------------------------------------------------------------------


SPAN_FREE_SCHEDULES = ("constant", "constant_with_warmup", "inverse_sqrt")  # the rest decay over every optimizer step


def preflight(args, run_dir: Path, world_size: int = 1):
    """Everything that can be checked before a byte is loaded or written: the flags, the output folder, the run
    folder (a finished run is never replaced) and the checkpoint --resume names; first, that torch and transformers
    are not older than their floors. Returns (checkpoint path, its state) or (None, None)."""
    require_releases()
    flags.validate(args, world_size)
    flags.check_writable(Path(args.output_dir))
    check_run_folder(run_dir, args.resume, args.overwrite)
    resume_from = checkpoint.find(args.resume, run_dir) if args.resume else None
    if resume_from is None:
        return None, None
    state = checkpoint.load_state(resume_from)
    if state["step"] > args.total_steps:  # nothing would train, and the summary would report the accuracy before it
        raise ConfigError(f"--total-steps {args.total_steps}: the checkpoint {resume_from} is at step {state['step']}, "
                          f"past it; give --total-steps {state['step']} to finish that run, or more to train further")
    checkpoint.check_world_size(state, world_size, resume_from)
    changes = checkpoint.compare_configs(state["config"], asdict(args), resume_from)
    if ddp.rank() != 0:  # under torchrun every rank checks; rank 0 alone says what it found
        return resume_from, state
    for change in changes:
        print(f"resume: allowed change {change}")
    before = state["config"].get("total_steps")
    if before != args.total_steps and args.lr_scheduler not in SPAN_FREE_SCHEDULES:  # e.g. a finished run extended
        print(f"resume: --lr-scheduler {args.lr_scheduler} spans --total-steps: from step {state['step'] + 1} the "
              f"learning rate follows a {args.total_steps}-step schedule (the steps before followed a {before}-step "
              "one)")
    return resume_from, state


# ---------------------------------------------------------------------------------------------------------------
# The run folder: never replace a finished run, never leave one that its own advice cannot get out of
# ---------------------------------------------------------------------------------------------------------------


def finished_summary(run_dir: Path) -> dict | None:
    try:
        return json.loads((run_dir / "summary.json").read_text())
    except (OSError, ValueError):
        return None if not (run_dir / "summary.json").exists() else {}


def read_config(run_dir: Path) -> dict:
    """A run's config.json, or {} where it is missing or unreadable."""
    try:
        return json.loads((run_dir / "config.json").read_text())
    except (OSError, ValueError):
        return {}


def check_run_folder(run_dir: Path, resume: str | None, overwrite: bool) -> None:
    """Refuse what would replace a finished run or silently mix two runs; each message names a way out that works.

    finished (summary.json)      kept unless --overwrite; to train further, start a new run from its final model
    unfinished, checkpoints      --resume auto continues it (or --overwrite, or another --run-name)
    unfinished, no checkpoint    nothing to resume: --overwrite starts it again (or another --run-name)
    """
    outputs = ("config.json", "metrics.jsonl", "summary.json", "checkpoints", "final")
    if overwrite or not any((run_dir / name).exists() for name in outputs):
        return  # no run here (a launcher's own files, such as sweep.py's console.log, do not count)
    summary = finished_summary(run_dir)
    if summary is not None:
        n, before = summary.get("steps", "?"), summary.get("accuracy_before", float("nan"))
        if not summary:
            result = "summary unreadable"
        elif n == 0:  # --total-steps 0
            result = f"an evaluation alone, held-out accuracy {before:.3f}"
        else:
            result = (f"{n} step{'' if n == 1 else 's'}, held-out accuracy {before:.3f} -> "
                      f"{summary.get('accuracy_after', float('nan')):.3f}")
        ways = []
        ckpts = checkpoint.all_checkpoints(run_dir / "checkpoints")
        if ckpts:
            schedule = read_config(run_dir).get("lr_scheduler")  # one that spans --total-steps spans the new N
            how = "exactly" if schedule in SPAN_FREE_SCHEDULES + (None,) else \
                f"(its --lr-scheduler {schedule} then decays over the N steps)"
            ways.append(f"--resume {ckpts[-1]} --run-name NEW_NAME --total-steps N continues it {how}")
        final = next((f for f in (run_dir / "final", run_dir / "final" / "merged") if (f / "config.json").is_file()),
                     None)  # a whole model: a full fine-tune's final/, a LoRA run's merged/ (its adapter is not one)
        if final is not None:
            ways.append(f"--model {final} --run-name NEW_NAME starts a new run from its final policy")
        further = ("; to train further, in a new folder: " + ", or ".join(ways)) if ways else ""
        raise ConfigError(f"{run_dir} is a finished run ({result}); its results are kept. --run-name NEW_NAME starts "
                          f"a fresh run beside it{further}; --overwrite replaces it")
    ckpts = checkpoint.all_checkpoints(run_dir / "checkpoints")
    if ckpts and not resume:
        raise ConfigError(f"{run_dir} holds an unfinished run (latest checkpoint {ckpts[-1].name}); --resume auto "
                          "continues it, --overwrite replaces it, --run-name NAME starts another")
    if not ckpts and (resume == "auto" or not resume):
        raise ConfigError(f"{run_dir} holds an unfinished run with no checkpoint to resume (it stopped before one "
                          "was saved); --overwrite starts it again, --run-name NAME starts another")


class NewRunFolder:
    """The run folder's life during start-up: `create()` makes it (replacing an old one when asked); if start-up
    then fails or is interrupted, the folders this call created are removed again, so the same command can rerun."""

    def __init__(self, run_dir: Path, replace: bool):
        self.run_dir, self.replace, self.created, self.logger = run_dir, replace, None, None

    def create(self) -> None:
        if self.replace:
            shutil.rmtree(self.run_dir, ignore_errors=True)
        top = self.run_dir
        while not top.parent.exists():  # the outermost folder that this call creates
            top = top.parent
        self.created = None if top.exists() else top
        self.run_dir.mkdir(parents=True, exist_ok=True)

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is not None:
            if self.logger is not None:
                self.logger.finish()
            if self.created is not None:
                shutil.rmtree(self.created, ignore_errors=True)
        return False


# ---------------------------------------------------------------------------------------------------------------
# Signals
# ---------------------------------------------------------------------------------------------------------------


class Startup:
    """During start-up (loading, the first evaluation) Ctrl-C and SIGTERM raise Interrupted; train.py then removes
    the run folder it created, so a rerun of the same command starts cleanly."""

    def __enter__(self):
        def handler(signum, frame):
            raise Interrupted(f"interrupted by {signal.Signals(signum).name} during start-up, before step 1; "
                              "nothing was kept: run the same command again")

        self.previous = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}
        return self

    def __exit__(self, *exc):
        for s, h in self.previous.items():
            signal.signal(s, h)
        return False


class GracefulStop:
    """SIGINT/SIGTERM set a flag; the loop finishes its step, saves and exits 0. A second SIGINT aborts."""

    def __init__(self):
        self.signal = None
        self.previous = {s: signal.signal(s, self.handle) for s in (signal.SIGINT, signal.SIGTERM)}

    def handle(self, signum, frame):
        self.signal = signal.Signals(signum).name
        signal.signal(signal.SIGINT, signal.default_int_handler)
        print(f"\n{self.signal}: finishing this step, then saving a checkpoint (Ctrl-C again to abort)", flush=True)

    def restore(self):
        for s, handler in self.previous.items():
            signal.signal(s, handler)


def aborted(run_dir: Path) -> Interrupted:
    """The one line for a second Ctrl-C (KeyboardInterrupt): the step it fell in is lost, earlier checkpoints are whole
    (each is renamed into place only once written)."""
    last = checkpoint.all_checkpoints(run_dir / "checkpoints")
    where = f"resume from the latest checkpoint ({last[-1].name}) with the same flags plus --resume auto" if last \
        else "no checkpoint was written (--save-every N keeps some); start again with --overwrite"
    return Interrupted(f"aborted by a second Ctrl-C: the step under way is lost; {where}")


# ---------------------------------------------------------------------------------------------------------------
# Out of memory
# ---------------------------------------------------------------------------------------------------------------


def is_out_of_memory(e: BaseException) -> bool:
    """CUDA raises torch.OutOfMemoryError; MPS and the CPU allocator a RuntimeError that says so."""
    text = str(e)
    return isinstance(e, torch.OutOfMemoryError) or (
        isinstance(e, RuntimeError) and ("out of memory" in text or "can't allocate memory" in text))


def free_cached_memory(e: BaseException) -> None:
    """Hand back what out-of-memory error `e` left: the failed work's tensors (its logits, its activations), locals
    of the finished frames in e's traceback, which a reference cycle through the traceback would keep until Python's
    next collection (seen on Python 3.12: every smaller try of the halving ran out too), then the allocator's
    cached blocks (CUDA keeps them otherwise)."""
    traceback.clear_frames(e.__traceback__)
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def out_of_memory(e: Exception, step: int, unchanged: bool, save_start, run_dir: Path, resume_hint: str) -> OutOfMemory:
    """The one-line error for an out-of-memory step. If no optimizer step was taken yet, the weights are still those
    the step started from, so that state is saved and nothing is lost; else the latest checkpoint is named."""
    free_cached_memory(e)
    reason = str(e).strip().splitlines()[0] if str(e).strip() else "no details"
    last = None if unchanged else checkpoint.all_checkpoints(run_dir / "checkpoints")
    if unchanged or last:
        where = f"saved {save_start()}" if unchanged else f"latest checkpoint: {last[-1]}"
        way_out = f"Set --micro-batch-size and {resume_hint}"
    else:
        where = "no checkpoint to resume (--save-every N keeps some)"
        way_out = "Start again with --overwrite and a smaller --micro-batch-size"
    return OutOfMemory(f"out of memory in step {step} ({reason[:120]}); {where}. {way_out}, or start a new run "
                       "with fewer --num-prompts/--num-generations/--max-new-tokens")


def optimizer_out_of_memory(policy) -> str:
    """What to say when the optimizer step runs out of memory (AdamW allocates its two moments at the first step):
    not a matter of batch size, so the sizes that do not fit and what helps."""
    gib = lambda n: f"{n / 2**30:.1f} GiB"  # noqa: E731
    device = next(policy.parameters()).device
    params = [p.to_local() if hasattr(p, "to_local") else p for p in policy.parameters()]  # --fsdp: this card's
    trained = sum(p.numel() for p in params if p.requires_grad)
    weights = sum(p.numel() * p.element_size() for p in params)
    total = f" ({gib(torch.cuda.mem_get_info(device)[1])})" if device.type == "cuda" else ""
    return (f"the weights ({gib(weights)}), their fp32 gradients ({gib(4 * trained)}) and AdamW's two moments "
            f"({gib(8 * trained)} for {trained / 1e6:.1f}M trained parameters) do not fit on {device}{total} beside "
            "the rest; fewer rows per forward do not help. Train LoRA adapters instead (--lora-rank 16), take a "
            "smaller model, shard it over more devices (--fsdp under torchrun), or a device with more memory")


AUTO_MICRO_BATCH: dict = {}  # rows of an optimizer step (or another key) -> micro-batch size that fits


def shrink_on_oom(run, rows: int, fixed: int, world_size: int = 1, key: int | str | None = None):
    """run(micro) with `micro` rows per forward without gradient (a failed try leaves nothing to drop; the update's
    micro-batches are accumulate.MicroBatches). --micro-batch-size 0 (`fixed` 0) starts at `rows` and, after each
    out-of-memory error, retries at half (halved); the size that fits is remembered for the rest of the process, per
    `key` (default: `rows`)."""
    key = rows if key is None else key
    micro = fixed or min(rows, AUTO_MICRO_BATCH.get(key, rows))
    while True:
        try:
            return run(micro)
        except RuntimeError as e:
            micro = halved(e, micro, fixed, world_size, key)


def halved(e: RuntimeError, micro: int, fixed: int, world_size: int, key, reset=lambda: None) -> int:
    """After error `e` at `micro` rows per forward: half as many, remembered under `key`, once `reset` has dropped
    what the failed try left (a partial gradient). `e` is raised again when it is not an out-of-memory error, when
    the size is fixed (--micro-batch-size) or already 1, and over several processes where the pass holds a
    collective (world_size > 1): one rank retrying alone would leave the others waiting in the all-reduce."""
    if not is_out_of_memory(e) or fixed or micro == 1 or world_size > 1:
        raise e
    reset()
    free_cached_memory(e)  # the failed try's tensors too, before the next try
    AUTO_MICRO_BATCH[key] = micro // 2
    print(f"out of memory at {micro} rows per forward/backward: using {micro // 2} from now on")
    return micro // 2


# ---------------------------------------------------------------------------------------------------------------
# A failed step: one line that names what was saved
# ---------------------------------------------------------------------------------------------------------------


class StepFailures:
    """Wraps one RL step. If dynamic sampling gives up, nothing was updated, so the state the step started from is
    saved (every rank takes part: the decision was global). If memory runs out before the first optimizer step of
    the step, the same is saved in a single process; otherwise the latest checkpoint is named. If it runs out inside
    an optimizer step (seen by the optimizer's step hooks), the step may have moved some moments already and a resume
    would meet it again: one line with the sizes (optimizer_out_of_memory), and no checkpoint."""

    def __init__(self, save, run_dir: Path, resume_hint: str, gen: torch.Generator, stream, scheduler,
                 world_size: int, optimizer: torch.optim.Optimizer, policy):
        self.save, self.run_dir, self.hint, self.gen = save, run_dir, resume_hint, gen
        self.stream, self.scheduler, self.world_size, self.policy = stream, scheduler, world_size, policy
        self.in_optimizer = False  # between the optimizer step's start and its end
        optimizer.register_step_pre_hook(lambda *_: setattr(self, "in_optimizer", True))
        optimizer.register_step_post_hook(lambda *_: setattr(self, "in_optimizer", False))

    def __call__(self, step: int) -> "StepFailures":
        self.step, self.rng, self.cursor = step, checkpoint.rng_state(self.gen), self.stream.cursor
        self.updates = self.scheduler.last_epoch  # optimizer steps taken before this step
        return self

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        save_start = lambda: self.save(self.step - 1, self.rng, self.cursor)  # noqa: E731
        if isinstance(exc, DynamicSamplingError):
            raise DynamicSamplingError(f"{exc}. Saved {save_start()}: {self.hint} and a higher --max-sampling-rounds, "
                                       "or start again with --overwrite and more --num-generations or "
                                       "--dynamic-sampling False") from None
        if exc is not None and is_out_of_memory(exc):
            if self.in_optimizer:  # the step may have moved some moments: nothing worth saving
                free_cached_memory(exc)
                raise OptimizerOutOfMemory(f"out of memory in the optimizer step of step {self.step}: "
                                           f"{optimizer_out_of_memory(self.policy)}; no checkpoint of this step was "
                                           "written") from None
            unchanged = self.scheduler.last_epoch == self.updates and self.world_size == 1
            raise out_of_memory(exc, self.step, unchanged, save_start, self.run_dir, self.hint) from None
        return False

    @contextlib.contextmanager
    def evaluating(self, step: int):
        """The held-out evaluation after `step`: out of memory there, even at one row at a time, saves the state after
        the step (a single process; under torchrun the latest checkpoint is named) in one line."""
        try:
            yield
        except RuntimeError as e:
            if not is_out_of_memory(e):
                raise
            free_cached_memory(e)
            reason = str(e).strip().splitlines()[0][:120] if str(e).strip() else "no details"
            last = checkpoint.all_checkpoints(self.run_dir / "checkpoints")
            where = f"saved {self.save(step)}" if self.world_size == 1 else \
                f"latest checkpoint: {last[-1]}" if last else "no checkpoint to resume"
            raise OutOfMemory(f"out of memory in the held-out evaluation after step {step} ({reason}); {where}. "
                              f"{self.hint} and a smaller --eval-size (or --eval-samples)") from None


class Watch:
    """The checks after every step. `limit` steps in a row whose every update was skipped as non-finite stop the run
    (a resume would repeat them); two warnings, once each: no sampled completion of the first 5 steps was scored
    correct (the answer format and the references may not fit each other: a silent reward of 0), and more than half
    of each rollout's completions hit max_new_tokens for 3 steps in a row (answers cut off, none seen to finish)."""

    def __init__(self, limit: int, updates_per_step: int, answer_format: str, max_new_tokens: int, reference: str):
        self.limit, self.updates, self.format, self.max_new_tokens = limit, updates_per_step, answer_format, max_new_tokens
        self.reference, self.steps, self.nonfinite, self.truncated = reference, 0, 0, 0
        self.any_correct = self.warned_truncated = False

    def check(self, step: int, m: dict) -> None:
        self.nonfinite = self.nonfinite + 1 if m["losses/skipped_updates"] == self.updates else 0
        if self.nonfinite >= self.limit:
            raise NonFiniteError(
                f"{self.nonfinite} steps in a row had only non-finite losses or gradients (last finite step: "
                f"{step - self.nonfinite}); a resume would repeat them. Lower --lr or check the reward weights, then "
                "start again with --overwrite (or another --run-name)")
        self.steps, self.any_correct = self.steps + 1, self.any_correct or m["charts/accuracy"] > 0
        if self.steps == 5 and not self.any_correct:
            print(f"warning: no completion of the first 5 steps was scored correct. Check that --answer-format "
                  f"{self.format} finds answers the references can equal (e.g. reference {self.reference[:40]!r}), or "
                  "whether the model can answer at all", flush=True)
        self.truncated = self.truncated + 1 if m["charts/truncated_frac"] > 0.5 else 0
        if self.truncated >= 3 and not self.warned_truncated:
            self.warned_truncated = True
            print(f"warning: more than half of the completions hit --max-new-tokens {self.max_new_tokens} in each of "
                  "the last 3 steps (truncated: no answer, and DAPO's overlong penalty); raise --max-new-tokens",
                  flush=True)
