"""Guards: what stands between bad input (or a bad moment) and a lost run. train.py calls these; none holds RL.

    validate(args)          every flag, before anything is loaded or written: one ConfigError line each
    check_run_folder(...)   a finished run is never replaced; an unfinished one is resumed or replaced on request
    Startup / GracefulStop  Ctrl-C or SIGTERM: during start-up, nothing is left behind; later, save and exit 0
    shrink_on_oom(...)      --micro-batch-size 0: halve the micro-batch after an out-of-memory error, and remember
    StepFailures            a failed RL step (dynamic sampling gave up, out of memory) becomes one line naming what
                            was saved; NonFiniteStreak stops a run whose updates are all non-finite
    report(e)               print a user error as one line, once per torchrun job
    wandb_init(...)         wandb online only when its server answers within seconds (network.py)

Every error a user can cause is one of USER_ERRORS: train.main prints it as one `error: ...` line, exit code 2.
"""

from __future__ import annotations

import ast
import contextlib
import inspect
import json
import math
import os
import shutil
import signal
import sys
import textwrap
import types
from dataclasses import asdict, fields
from decimal import Decimal
from pathlib import Path

import torch

import checkpoint
import ddp
import losses
import model as models
import network
import rewards
import task


class ConfigError(ValueError):
    """A flag value that cannot work; the message says which and what to do."""


class NonFiniteError(RuntimeError):
    """Too many updates in a row had a non-finite loss or gradient."""


class OutOfMemory(RuntimeError):
    """The device ran out of memory even at one row per forward/backward, or while generating."""


class Interrupted(RuntimeError):
    """Ctrl-C or SIGTERM before the first step: nothing was kept."""


class PeerFailure(RuntimeError):
    """Under torchrun: another rank stopped (its own error is printed by it), so this one stops too."""


class DynamicSamplingError(RuntimeError):
    """Dynamic sampling could not fill a batch with informative groups."""


# ---------------------------------------------------------------------------------------------------------------
# Flags
# ---------------------------------------------------------------------------------------------------------------

MAX_EVAL_SAMPLES = 1024  # pass@k papers sample up to a few hundred per problem; more is a run that never evaluates
CHECKS = [  # (is the value wrong?, message): checked before any work is done
    (lambda a: a.num_generations < 2, "--num-generations must be at least 2 (got {num_generations}): a group "
                                      "advantage compares completions of the same prompt"),
    (lambda a: a.num_prompts < 1, "--num-prompts must be at least 1 (got {num_prompts})"),
    (lambda a: a.threads < 0, "--threads must be >= 0 (got {threads}); 0 keeps torch's default"),
    (lambda a: a.total_steps < 1, "--total-steps must be at least 1 (got {total_steps})"),
    (lambda a: a.max_new_tokens < 1, "--max-new-tokens must be at least 1 (got {max_new_tokens})"),
    (lambda a: not a.temperature > 0, "--temperature must be > 0 (got {temperature}); use 1.0 for plain sampling"),
    (lambda a: not a.lr > 0, "--lr must be > 0 (got {lr}); the default is 5e-5"),
    (lambda a: a.warmup_steps < 0, "--warmup-steps must be >= 0 (got {warmup_steps})"),
    (lambda a: not a.max_grad_norm > 0, "--max-grad-norm must be > 0 (got {max_grad_norm})"),
    (lambda a: a.weight_decay < 0, "--weight-decay must be >= 0 (got {weight_decay})"),
    (lambda a: not 0 < a.epsilon < 1 and not (a.surrogate in ("cispo", "gmpo") and 0 < a.epsilon <= 1),
     "--epsilon must be in (0, 1) (got {epsilon}; CISPO and GMPO take 1, no lower bound); GRPO uses 0.2, GSPO 3e-4"),
    (lambda a: not a.epsilon_high >= 0, "--epsilon-high must be >= 0 (got {epsilon_high}); DAPO uses 0.28"),
    (lambda a: not a.beta >= 0, "--beta must be >= 0 (got {beta}); 0 turns the KL term off"),
    (lambda a: a.num_epochs < 1, "--num-epochs must be at least 1 (got {num_epochs})"),
    (lambda a: a.micro_batch_size < 0, "--micro-batch-size must be >= 0 (got {micro_batch_size}); 0 sizes "
                                       "them to the machine"),
    (lambda a: a.max_sampling_rounds < 1, "--max-sampling-rounds must be at least 1 (got {max_sampling_rounds})"),
    (lambda a: a.overlong_weight and not 0 < a.overlong_cache <= a.max_new_tokens,
     "--overlong-cache must be in [1, --max-new-tokens] (got {overlong_cache}) when the overlong term is on"),
    (lambda a: a.eval_every < 1, "--eval-every must be at least 1 (got {eval_every})"),
    (lambda a: a.eval_size < 0, "--eval-size must be >= 0 (got {eval_size}); 0 evaluates every held-out problem"),
    (lambda a: a.eval_samples < 0, "--eval-samples must be >= 0 (got {eval_samples}); 0 evaluates greedily only"),
    (lambda a: a.eval_samples > MAX_EVAL_SAMPLES, "--eval-samples {eval_samples} would sample that many completions "
     f"of every held-out problem at every evaluation; pass@k estimates need far fewer: use at most {MAX_EVAL_SAMPLES} "
     "(and --eval-size to evaluate fewer problems)"),
    (lambda a: a.save_every < 0, "--save-every must be >= 0 (got {save_every})"),
    (lambda a: a.keep_checkpoints < 1, "--keep-checkpoints must be at least 1 (got {keep_checkpoints})"),
    (lambda a: a.max_nonfinite_steps < 1, "--max-nonfinite-steps must be at least 1 (got {max_nonfinite_steps})"),
    (lambda a: not 0 <= a.seed < 2**32, "--seed must be in [0, 2**32) (got {seed})"),
    (lambda a: a.temperature < 0.01, "--temperature {temperature} is greedy in all but name: every completion of a "
                                     "group would be the same, so no advantage is non-zero. Use >= 0.01 (1.0 samples "
                                     "plainly)"),
    (lambda a: a.format_weight < 0 or a.overlong_weight < 0,
     "reward weights must be >= 0 (got --format-weight {format_weight}, --overlong-weight {overlong_weight}); a "
     "negative one rewards what it should punish"),
    (lambda a: a.resume and a.overwrite, "--resume and --overwrite contradict each other: --resume continues a run, "
                                         "--overwrite replaces it; pass one"),
    (lambda a: any(not 1 <= len(t) <= 64 for t in a.wandb_tags), "--wandb-tags: each tag must be 1 to 64 characters "
                                                                  "(wandb's limit)"),
    (lambda a: not a.output_dir.strip(), "--output-dir must name a folder (got {output_dir!r}); the default is runs"),
    (lambda a: not a.model.strip(), "--model must not be empty; 'embedded' is the default"),
    (lambda a: not a.dataset.strip(), "--dataset must not be empty; 'embedded' is the default"),
]


def docstrings_as_help(cls):
    """Hand each dataclass field's docstring to tyro as its --help text, as one paragraph. (tyro 1.0.17 removes single
    line breaks before dedenting, so a field docstring's indented continuation lines stay hard breaks in --help.)"""
    body = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0].body
    for node, after in zip(body, body[1:]):
        if isinstance(node, ast.AnnAssign) and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant):
            f = cls.__dataclass_fields__[node.target.id]
            f.metadata = types.MappingProxyType({**f.metadata, "help": " ".join(str(after.value.value).split())})
    return cls


def default_hints(cls, hints: dict[str, str]):
    """Show a derived default in --help (e.g. '(default from --algo: ...)') where tyro would print
    '(default: None)' for a field whose None means 'taken from another flag'."""
    import typing

    import tyro

    resolved = typing.get_type_hints(cls)  # plain types: wrapping again on a second call replaces the hint
    for name, hint in hints.items():
        cls.__annotations__[name] = typing.Annotated[resolved[name], tyro.conf.arg(help_behavior_hint=hint)]
    return cls


def working_schedulers() -> list[str]:
    """The transformers scheduler names the loop can drive: built from (warmup, total) steps alone and stepped
    without a metric (reduce_lr_on_plateau, cosine_with_min_lr, warmup_stable_decay, ... need more)."""
    from transformers import get_scheduler
    from transformers.trainer_utils import SchedulerType

    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    names = []
    for kind in SchedulerType:
        try:
            scheduler = get_scheduler(kind.value, opt, num_warmup_steps=1, num_training_steps=4)
            opt.step()  # no parameter has a gradient: a no-op, in the order torch expects
            scheduler.step()
            names.append(kind.value)
        except (TypeError, ValueError):
            pass
    return names


def preflight(args, run_dir: Path, world_size: int = 1):
    """Everything that can be checked before a byte is loaded or written: the flags, the output folder, the run
    folder (a finished run is never replaced) and the checkpoint --resume names. Returns (checkpoint path, its state)
    or (None, None)."""
    validate(args, world_size)
    check_writable(Path(args.output_dir))
    check_run_folder(run_dir, args.resume, args.overwrite)
    resume_from = checkpoint.find(args.resume, run_dir) if args.resume else None
    if resume_from is None:
        return None, None
    state = checkpoint.load_state(resume_from)
    checkpoint.check_world_size(state, world_size, resume_from)
    for change in checkpoint.compare_configs(state["config"], asdict(args)):
        print(f"resume: allowed change {change}")
    return resume_from, state


def validate(args, world_size: int = 1) -> None:
    """Every flag on its own and against the others (and against torchrun's process count); the first wrong one is
    a ConfigError."""
    for f in fields(args):  # no inf or nan anywhere: --lr inf, --temperature inf, --format-weight nan, ...
        value = getattr(args, f.name)
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"--{f.name.replace('_', '-')} must be a finite number (got {value})")
    for wrong, message in CHECKS:
        if wrong(args):
            raise ConfigError(message.format(**asdict(args)))
    try:  # objective fields that do not go together (CISPO at sequence level, GMPO at token level, ...)
        losses.check_config(losses.LossConfig(**{f: getattr(args, f) for f in losses.OBJECTIVE_FIELDS}))
    except ValueError as e:
        raise ConfigError(f"--algo {args.algo}: {e}")
    if args.num_prompts % world_size:
        raise ConfigError(f"--num-prompts {args.num_prompts} is not divisible by the {world_size} processes (each takes "
                          f"whole prompt groups); use a multiple of {world_size}")
    if args.num_minibatches < 1 or (args.num_prompts // world_size * args.num_generations) % args.num_minibatches:
        rollout = "the rollout's" if world_size == 1 else "each process's"
        raise ConfigError(f"--num-minibatches {args.num_minibatches} must divide {rollout} "
                          f"{args.num_prompts // world_size}x{args.num_generations} rows")
    if world_size > 1 and (args.device not in ("auto", "cpu", "cuda") or (
            args.device == "auto" and not torch.cuda.is_available() and torch.backends.mps.is_available())):
        raise ConfigError(f"--device {args.device} under torchrun: each rank takes its own GPU (LOCAL_RANK) with "
                          "--device auto or cuda; without CUDA, use --device cpu (gloo cannot reduce MPS tensors)")
    gpus, local = torch.cuda.device_count() if torch.cuda.is_available() else 0, ddp.local_world_size()
    if ddp.launched() and args.device in ("auto", "cuda") and 0 < gpus < local:
        raise ConfigError(f"torchrun starts {local} processes on this machine but it has {gpus} GPU(s), one per "
                          f"process; use --nproc-per-node {gpus} (or --device cpu)")
    if args.lr_scheduler not in (names := working_schedulers()):
        raise ConfigError(f"--lr-scheduler {args.lr_scheduler!r} cannot be used here; use one of {', '.join(names)}")
    name = args.run_name
    if not name.strip() or name in (".", "..") or "/" in name or os.sep in name:
        raise ConfigError(f"--run-name {name!r} must be a plain folder name (no '/', not '.' or '..')")
    check_device(args.device)
    context = models.context_without_loading(args.model, args.dataset)
    if context and args.max_new_tokens >= context:  # every prompt takes a token at least: refused before any warm
        raise ConfigError(f"--max-new-tokens {args.max_new_tokens} leaves no room for a prompt in the model's context "
                          f"of {context} tokens; use at most {context - 1} minus the longest prompt")  # start or load
    if args.dtype == "float16" and (args.device == "cpu" or (args.device == "auto" and not torch.cuda.is_available()
                                                            and not torch.backends.mps.is_available())):
        raise ConfigError("--dtype float16 on the CPU overflows in training (no loss scaling); use float32 or bfloat16")
    if args.answer_format == "boxed":
        try:
            rewards.require_math_verify()
        except rewards.VerifierError as e:
            raise ConfigError(str(e))
    check_wandb_login(args.wandb_mode)


def check_device(name: str) -> None:
    if name == "auto":
        return
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ConfigError(f"--device {name!r} is not a device; use auto, cpu, cuda, cuda:N or mps")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"--device {name}: this torch has no usable CUDA device (torch {torch.__version__}); "
                          "use --device auto or cpu")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise ConfigError(f"--device {name}: only {torch.cuda.device_count()} CUDA device(s) here")
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise ConfigError(f"--device {name}: MPS is not available on this machine; use --device auto or cpu")
    if device.type not in ("cpu", "cuda", "mps"):
        raise ConfigError(f"--device {name}: only cpu, cuda and mps are supported; use --device auto")


def check_writable(folder: Path) -> None:
    """`folder` must be creatable: its nearest existing ancestor a directory that really takes a new entry (a
    permission bit is not proof: /proc or a read-only mount say writable to root). Proved by making and removing an
    empty folder there; nothing is left behind."""
    import tempfile

    probe = folder.resolve()
    while not probe.exists():
        probe = probe.parent
    why = "not a folder" if not probe.is_dir() else None
    if why is None:
        try:
            os.rmdir(tempfile.mkdtemp(prefix=".grpo-probe-", dir=probe))
        except OSError as e:
            why = f"it takes no new folder: {e.strerror or type(e).__name__}"
    if why:
        raise ConfigError(f"--output-dir {folder} cannot be created ({probe}: {why}); pass a folder you can write to")


# ---------------------------------------------------------------------------------------------------------------
# wandb and the hub: asked only when they answer, never a prompt
# ---------------------------------------------------------------------------------------------------------------


def wandb_has_login() -> bool:
    netrc = Path(os.environ.get("NETRC", Path.home() / ".netrc"))
    return bool(os.environ.get("WANDB_API_KEY")) or (netrc.is_file() and "api.wandb.ai" in netrc.read_text(errors="ignore"))


def wandb_mode(requested: str | None) -> str:
    """online only when credentials exist; never an interactive login prompt."""
    if requested:
        return requested
    if os.environ.get("WANDB_MODE") in ("online", "offline", "disabled"):
        return os.environ["WANDB_MODE"]
    return "online" if wandb_has_login() else "offline"


def check_wandb_login(requested: str | None) -> None:
    if wandb_mode(requested) == "online" and not wandb_has_login():
        raise ConfigError("wandb online needs a login (`wandb login`, or WANDB_API_KEY); use --wandb-mode offline "
                          "(sync later with `wandb sync`) or disabled")


def wandb_init(**kwargs):
    """wandb.init that cannot hang or prompt: online falls back to offline, with one warning line, when the server
    does not answer within seconds or refuses the login."""
    import wandb

    settings = wandb.Settings(console="off", silent=True, init_timeout=30)
    if kwargs["mode"] == "online":
        base = os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")
        if not network.reachable(base):
            print(f"warning: wandb server {base} did not answer within 3 s; logging offline instead (wandb sync later)")
            kwargs["mode"] = "offline"
        else:
            try:
                return wandb.init(settings=settings, **kwargs)
            except Exception as e:  # bad key, server error: the run matters more than the online dashboard
                print(f"warning: wandb online failed ({type(e).__name__}: {str(e).splitlines()[0][:100] if str(e) else ''}); "
                      "logging offline instead")
                kwargs["mode"] = "offline"
    return wandb.init(settings=settings, **kwargs)


# ---------------------------------------------------------------------------------------------------------------
# The run folder: never replace a finished run, never leave one that its own advice cannot get out of
# ---------------------------------------------------------------------------------------------------------------


def finished_summary(run_dir: Path) -> dict | None:
    try:
        return json.loads((run_dir / "summary.json").read_text())
    except (OSError, ValueError):
        return None if not (run_dir / "summary.json").exists() else {}


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
        n = summary.get("steps", "?")
        result = (f"{n} step{'' if n == 1 else 's'}, held-out accuracy {summary.get('accuracy_before', float('nan')):.3f} "
                  f"-> {summary.get('accuracy_after', float('nan')):.3f}") if summary else "summary unreadable"
        ways = []
        ckpts = checkpoint.all_checkpoints(run_dir / "checkpoints")
        if ckpts:
            ways.append(f"--resume {ckpts[-1]} --run-name NEW_NAME --total-steps N continues it exactly")
        if (run_dir / "final" / "config.json").is_file():
            ways.append(f"--model {run_dir / 'final'} --run-name NEW_NAME starts a new run from its final policy")
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


# ---------------------------------------------------------------------------------------------------------------
# Out of memory
# ---------------------------------------------------------------------------------------------------------------


def is_out_of_memory(e: BaseException) -> bool:
    """CUDA raises torch.OutOfMemoryError; MPS and the CPU allocator a RuntimeError that says so."""
    text = str(e)
    return isinstance(e, torch.OutOfMemoryError) or (
        isinstance(e, RuntimeError) and ("out of memory" in text or "can't allocate memory" in text))


def free_cached_memory() -> None:
    """Hand the allocator's cached blocks back after an out-of-memory error (CUDA keeps them otherwise)."""
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def out_of_memory(e: Exception, step: int, unchanged: bool, save_start, run_dir: Path, resume_hint: str) -> OutOfMemory:
    """The one-line error for an out-of-memory step. If no optimizer step was taken yet, the weights are still those
    the step started from, so that state is saved and nothing is lost; else the latest checkpoint is named."""
    free_cached_memory()
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


AUTO_MICRO_BATCH: dict[int, int] = {}  # rows of an optimizer step -> micro-batch size that fits


def shrink_on_oom(run, rows: int, fixed: int, reset, world_size: int = 1):
    """run(micro) with `micro` rows per forward/backward. --micro-batch-size 0 (`fixed` 0) starts at `rows` and, after
    each out-of-memory error, calls `reset` (drop the partial gradient) and retries at half; the size that fits is
    remembered for the rest of the process, per `rows`. Over several processes an error is raised instead: one
    rank retrying alone would leave the others waiting in the gradient all-reduce."""
    micro = fixed or AUTO_MICRO_BATCH.get(rows, rows)
    while True:
        try:
            return run(micro)
        except RuntimeError as e:
            if not is_out_of_memory(e) or fixed or micro == 1 or world_size > 1:
                raise
            reset()
            free_cached_memory()
            micro = AUTO_MICRO_BATCH[rows] = micro // 2
            print(f"out of memory at {micro * 2} rows per forward/backward: using {micro} from now on")


# ---------------------------------------------------------------------------------------------------------------
# A failed step: one line that names what was saved
# ---------------------------------------------------------------------------------------------------------------


class StepFailures:
    """Wraps one RL step. If dynamic sampling gives up, nothing was updated, so the state the step started from is
    saved (every rank takes part: the decision was global). If memory runs out before the first optimizer step of
    the step, the same is saved in a single process; otherwise the latest checkpoint is named."""

    def __init__(self, save, run_dir: Path, resume_hint: str, gen: torch.Generator, stream, scheduler,
                 world_size: int):
        self.save, self.run_dir, self.hint, self.gen = save, run_dir, resume_hint, gen
        self.stream, self.scheduler, self.world_size = stream, scheduler, world_size

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
                                       "--no-dynamic-sampling") from None
        if exc is not None and is_out_of_memory(exc):
            unchanged = self.scheduler.last_epoch == self.updates and self.world_size == 1
            raise out_of_memory(exc, self.step, unchanged, save_start, self.run_dir, self.hint) from None
        return False


class NonFiniteStreak:
    """Stops a run after `limit` steps in a row in which every update was skipped as non-finite."""

    def __init__(self, limit: int, updates_per_step: int):
        self.limit, self.per_step, self.streak = limit, updates_per_step, 0

    def check(self, step: int, skipped: int) -> None:
        self.streak = self.streak + 1 if skipped == self.per_step else 0
        if self.streak >= self.limit:
            raise NonFiniteError(
                f"{self.streak} steps in a row had only non-finite losses or gradients (last finite step: "
                f"{step - self.streak}); a resume would repeat them. Lower --lr or check the reward weights, then "
                "start again with --overwrite (or another --run-name)")


class NothingCorrect:
    """One warning when no sampled completion of the first `steps` steps was scored correct: the answer format and
    the references may not fit each other (a silent reward of 0 for the whole run)."""

    def __init__(self, answer_format: str, reference: str, steps: int = 5):
        self.format, self.reference, self.steps, self.seen, self.any = answer_format, reference, steps, 0, False

    def check(self, accuracy: float) -> None:
        self.seen += 1
        self.any = self.any or accuracy > 0
        if self.seen == self.steps and not self.any:
            print(f"warning: no completion of the first {self.steps} steps was scored correct. Check that "
                  f"--answer-format {self.format} finds answers the references can equal (e.g. reference "
                  f"{self.reference[:40]!r}), or whether the model can answer at all", flush=True)


class TruncatedStreak:
    """One warning when more than half of each rollout's completions hit --max-new-tokens for `steps` steps in a
    row: answers are being cut off (chains of thought need room), and the reward sees none of them finish."""

    def __init__(self, max_new_tokens: int, steps: int = 3):
        self.max_new_tokens, self.steps, self.streak, self.warned = max_new_tokens, steps, 0, False

    def check(self, truncated_frac: float) -> None:
        self.streak = self.streak + 1 if truncated_frac > 0.5 else 0
        if self.streak >= self.steps and not self.warned:
            self.warned = True
            print(f"warning: more than half of the completions hit --max-new-tokens {self.max_new_tokens} in each of "
                  f"the last {self.steps} steps (truncated: no answer, and DAPO's overlong penalty); raise "
                  "--max-new-tokens", flush=True)


def check_references(examples: list, answer_format: str) -> None:
    """Under last-number, a reference that is not a number can never be matched: refuse it when the data is
    loaded, naming the first such row."""
    if answer_format != "last-number":
        return
    for i, ex in enumerate(examples):
        if not isinstance(rewards.normalize(ex.answer), Decimal):
            raise ConfigError(f"--answer-format last-number scores the last number of a completion, but the reference "
                              f"of row {i} ({ex.prompt[:40]!r}) is {ex.answer[:40]!r}, not a number, so it could never "
                              "be matched; fix the references (GSM8K's worked answers keep what follows '####') or "
                              "use --answer-format tags or boxed")


# ---------------------------------------------------------------------------------------------------------------
# Prompts that do not fit, and how a user error is printed
# ---------------------------------------------------------------------------------------------------------------


def check_prompt_lengths(tokenizer, context: int | None, examples: list, max_new_tokens: int,
                         answer_format: str) -> None:
    """Every prompt plus the generation budget must fit the model's context. For the embedded model the tokenizer
    and context are known before its warm start is built, so this runs before minutes of work."""
    if not context:
        return
    prompts = [models.format_prompt(tokenizer, e.prompt, answer_format) for e in examples]
    lengths = [len(tokenizer(p, add_special_tokens=False)["input_ids"]) for p in prompts]
    longest = max(range(len(lengths)), key=lengths.__getitem__)
    if lengths[longest] + max_new_tokens > context:
        raise ConfigError(f"prompt {longest} ({examples[longest].prompt[:40]!r}...) has {lengths[longest]} tokens; "
                          f"with --max-new-tokens {max_new_tokens} it exceeds the model's context of {context}. "
                          "Shorten or drop such prompts, or lower --max-new-tokens")


USER_ERRORS = (ConfigError, checkpoint.CheckpointError, models.ModelError, task.TaskError, DynamicSamplingError,
               NonFiniteError, OutOfMemory, Interrupted)
PER_RANK = (OutOfMemory, PeerFailure)  # the errors one rank can meet alone; every rank meets the others the same way


@contextlib.contextmanager
def one_line_errors():
    """Around train(): a user error (USER_ERRORS, or under torchrun a collective that failed because another rank
    died) is printed as one line and exits with code 2; anything else is a bug and keeps its traceback."""
    try:
        yield
    except USER_ERRORS as e:
        report(e, ddp.rank())
        sys.exit(2)
    except RuntimeError as e:
        if not ddp.is_peer_failure(e):
            raise
        report(PeerFailure(f"another process of this torchrun job stopped ({ddp.first_line(e)}); torchrun's report "
                           "names it and its exit code"), ddp.rank())
        sys.exit(2)
    finally:
        ddp.teardown()


def report(e: BaseException, rank: int) -> None:
    """One `error: ...` line. Under torchrun every rank meets a bad flag or dataset alike, so rank 0 alone prints
    it; a per-rank error names its rank."""
    if rank == 0 or isinstance(e, PER_RANK):
        print(f"error: {'' if rank == 0 else f'rank {rank}: '}{e}", file=sys.stderr)
