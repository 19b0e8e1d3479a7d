"""Flags: every value checked before anything is loaded or written, and --help's text.

    validate(args)              each flag on its own and against the others (and torchrun's process count)
    check_writable(folder)      --output-dir can really be created
    check_references(...)       data checks that need the loaded rows: references the answer format can match,
    check_prompt_lengths(...)   prompts that fit the model's context with --max-new-tokens
    check_thinking(...)         --enable-thinking only where the chat template reads it
    docstrings_as_help(cls)     each Args field's docstring is its --help text; default_hints shows derived defaults

The first wrong value is one ConfigError (base/errors.py): one line, exit code 2.
"""

from __future__ import annotations

import ast
import functools
import importlib.util
import inspect
import math
import os
import re
import textwrap
import types
from dataclasses import asdict, fields, is_dataclass
from decimal import Decimal
from pathlib import Path

import torch

from plumbing import ddp
import model as models
from base import errors, network
import rewards
import rollout
import task
from base.errors import ConfigError

# ---------------------------------------------------------------------------------------------------------------
# Every flag
# ---------------------------------------------------------------------------------------------------------------

MAX_EVAL_SAMPLES = 1024  # pass@k papers sample up to a few hundred per problem; more is a run that never evaluates
CHECKS = [  # (is the value wrong?, message): checked before any work is done
    (lambda a: a.num_generations < 2, "--num-generations must be at least 2 (got {num_generations}): a group "
                                      "advantage compares completions of the same prompt"),
    (lambda a: a.num_prompts < 1, "--num-prompts must be at least 1 (got {num_prompts})"),
    (lambda a: a.logprob_chunk < -1, "--logprob-chunk must be a number of positions, 0 (chosen from the vocabulary) "
                                     "or -1 (whole logits) (got {logprob_chunk})"),
    (lambda a: a.advantage_estimator == "maxrl" and a.overlong_weight > 0,
     "--advantage-estimator maxrl divides by the group's mean reward, which needs rewards >= 0, and DAPO's overlong "
     "punishment makes them negative; use --overlong-weight 0 (or another estimator)"),
    (lambda a: a.rollout_correction != "off" and a.old_logprobs == "sampler",
     "--rollout-correction {rollout_correction} reweights by pi_old / mu, which is 1 when pi_old is the sampler's own "
     "log-probs; use --old-logprobs recompute (or auto)"),
    (lambda a: a.rollout_correction != "off" and a.rollout_correction_min is None and a.rollout_correction_max is None,
     "--rollout-correction {rollout_correction} needs a bound: set --rollout-correction-max (TRL's default 3) or "
     "--rollout-correction-min"),
    (lambda a: any(c is not None and not c > 0 for c in (a.rollout_correction_min, a.rollout_correction_max))
     or None not in (a.rollout_correction_min, a.rollout_correction_max)
     and not a.rollout_correction_min < a.rollout_correction_max,
     "--rollout-correction-min {rollout_correction_min} and --rollout-correction-max {rollout_correction_max} must be "
     "> 0 with min < max"),
    (lambda a: a.rollout_correction == "off" and (a.rollout_correction_min is not None or a.rollout_correction_max
                                                  != type(a).__dataclass_fields__["rollout_correction_max"].default),
     "--rollout-correction-min/-max bound the weight of --rollout-correction, which is off, so they change nothing: "
     "add --rollout-correction MODE (e.g. sequence_mask) or drop them"),
    (lambda a: a.threads < 0, "--threads must be >= 0 (got {threads}); 0 keeps torch's default"),
    (lambda a: a.total_steps < 0, "--total-steps must be >= 0 (got {total_steps}); 0 evaluates without training"),
    (lambda a: a.total_steps == 0 and a.resume, "--total-steps 0 evaluates --model without training; it resumes "
                                                 "nothing: drop --resume (a checkpoint's model: --model CHECKPOINT/model)"),
    (lambda a: a.max_new_tokens < 1, "--max-new-tokens must be at least 1 (got {max_new_tokens})"),
    (lambda a: not a.temperature > 0, "--temperature must be > 0 (got {temperature}); use 1.0 for plain sampling"),
    (lambda a: not a.lr > 0, "--lr must be > 0 (got {lr}); the default is 5e-5"),
    (lambda a: a.warmup_steps < 0, "--warmup-steps must be >= 0 (got {warmup_steps})"),
    (lambda a: not a.max_grad_norm > 0, "--max-grad-norm must be > 0 (got {max_grad_norm})"),
    (lambda a: a.weight_decay < 0, "--weight-decay must be >= 0 (got {weight_decay})"),
    # 1: no lower bound, for CISPO's cap and GMPO's log-ratio clip; SAPO's and VESPO's objectives never read epsilon
    (lambda a: not 0 < a.epsilon < 1 and not (a.surrogate in ("cispo", "gmpo", "sapo", "vespo") and 0 < a.epsilon <= 1),
     "--epsilon must be in (0, 1) with --surrogate {surrogate} (got {epsilon}, from --epsilon or else --algo {algo}; "
     "CISPO and GMPO take 1, no lower bound); GRPO uses 0.2, GSPO 3e-4"),
    (lambda a: not a.epsilon_high >= 0, "--epsilon-high must be >= 0 (got {epsilon_high}); DAPO uses 0.28"),
    (lambda a: a.surrogate == "vespo" and a.rollout_correction.startswith("sequence"),
     "VESPO folds the rollout correction's token weights pi_old / mu into its own sequence ratio (as TRL and the "
     "paper's code): use --rollout-correction token_truncate or token_mask with it"),
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
    (lambda a: a.log_completions_every < 0, "--log-completions-every must be >= 0 (got {log_completions_every}); 0 "
                                            "writes none"),
    (lambda a: a.keep_checkpoints < 1, "--keep-checkpoints must be at least 1 (got {keep_checkpoints})"),
    (lambda a: a.max_nonfinite_steps < 1, "--max-nonfinite-steps must be at least 1 (got {max_nonfinite_steps})"),
    (lambda a: not 0 <= a.seed < 2**32, "--seed must be in [0, 2**32) (got {seed})"),
    (lambda a: a.temperature < 0.01, "--temperature {temperature} is greedy in all but name: every completion of a "
                                     "group would be the same, so no advantage is non-zero. Use >= 0.01 (1.0 samples "
                                     "plainly)"),
    (lambda a: a.entropy_target is not None and not a.entropy_target > 0,
     "--entropy-target must be > 0 nats per token (got {entropy_target}): entropy is never below 0, so the bonus "
     "would never apply; leave it unset for a fixed --entropy-coef"),
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
    (lambda a: a.enable_thinking and a.model == "embedded", "--enable-thinking opens a chat template's thinking block "
     "(Qwen3's); the embedded model has no chat template, so no prompt would change: drop the flag"),
    (lambda a: a.lora_rank < 0, "--lora-rank must be >= 0 (got {lora_rank}); 0 trains every weight"),
    (lambda a: a.lora_rank and not a.lora_alpha > 0, "--lora-alpha must be > 0 (got {lora_alpha}); the default is "
                                                      "2 x --lora-rank"),
    (lambda a: a.lora_rank and not a.lora_target_modules, "--lora-target-modules must name at least one module "
                                                          "(e.g. q_proj v_proj)"),
    (lambda a: a.merge_lora and not a.lora_rank, "--merge-lora merges a LoRA adapter into the base: it needs "
                                                 "--lora-rank > 0"),
    (lambda a: a.lora_rank and importlib.util.find_spec("peft") is None,
     "--lora-rank needs the peft package: pip install peft (or --lora-rank 0 for a full fine-tune)"),
]


@functools.cache  # it sets the class's own field metadata: once per process (reading the source takes ~60 ms)
def docstrings_as_help(cls):
    """Hand each dataclass field's docstring to tyro as its --help text, as one paragraph. (tyro 1.0.17 removes single
    line breaks before dedenting, so a field docstring's indented continuation lines stay hard breaks in --help.)"""
    for klass in cls.__mro__[:-1]:  # the class and the groups it inherits (train.Args: plumbing/settings.py's)
        body = ast.parse(textwrap.dedent(inspect.getsource(klass))).body[0].body
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


def parse(cli, description: str, argv: list[str] | None, program: str = "python train.py", **tyro_kwargs):
    """tyro's parse, with a parse error (an unknown flag, a value of the wrong type, a choice that does not exist)
    as one `error:` line and exit code 2 instead of tyro's box (under torchrun, rank 0's); a choice's valid values
    come closest first. Every entry point parses through here (`program` names it in --help's usage line and in the
    hint)."""
    import contextlib
    import difflib
    import io
    import sys

    import tyro

    argv = switch_values(cli, sys.argv[1:] if argv is None else list(argv))
    box = io.StringIO()
    try:
        with contextlib.redirect_stderr(box):
            return tyro.cli(cli, prog=program, description=description, args=argv, **tyro_kwargs)
    except SystemExit as e:
        if e.code in (0, None):  # --help
            raise
        message = box_message(box.getvalue()) or "could not parse the flags"
        choice = re.search(r"invalid choice '(.*?)' for argument '(--[\w-]+)'\. Expected one of \((.*)\)", message)
        if choice:
            value, flag, options = choice.group(1), choice.group(2), re.findall(r"'([^']*)'", choice.group(3))
            ranked = sorted(options, key=lambda o: -difflib.SequenceMatcher(None, value.lower(), o.lower()).ratio())
            message = f"{flag} {value!r} is not one of its choices; use one of {', '.join(ranked)}"
        elif message.startswith("Unrecognized options"):
            message = other_name(cli, argv) or with_suggestions(message, box.getvalue())
        # under torchrun every rank parses the same flags: rank 0 alone prints the line
        errors.exit_with(ConfigError(f"{message} ({program} --help lists every flag)"), ddp.rank())


def field_types(cli) -> dict[str, type]:
    """A dataclass's fields and their types ({} for anything else tyro parses)."""
    import typing

    return typing.get_type_hints(cli) if is_dataclass(cli) else {}


def switch_values(cli, argv: list[str]) -> list[str]:
    """An on/off flag (a bool with a default, which tyro spells --x / --no-x) also takes True or False, as the flags
    whose default is None do (--dynamic-sampling False): `--mask-truncated True`, `--save-model=false` and a W&B
    sweep's `--mask_truncated=True` become --mask-truncated and --no-save-model."""
    switches = {name for name, kind in field_types(cli).items() if kind is bool}
    out, i = [], 0
    while i < len(argv):
        token = argv[i]
        flag, eq, value = token.partition("=")
        name = flag[2:].replace("-", "_") if flag.startswith("--") else ""
        negated = name.startswith("no_") and name[3:] in switches
        name = name[3:] if negated else name
        if name in switches and not eq and i + 1 < len(argv) and argv[i + 1].lower() in ("true", "false"):
            value, i = argv[i + 1], i + 1
        if name in switches and value.lower() in ("true", "false"):
            on = (value.lower() == "true") != negated
            token = f"--{'' if on else 'no-'}{name.replace('_', '-')}"
        out.append(token)
        i += 1
    return out


# Names another trainer gives a setting that this project spells its own way: TRL 1.16's GRPOConfig and its
# scripts' ScriptArguments and ModelConfig, verl's config
OTHER_NAMES = {
    "model_name_or_path": ("TRL", "--model"),
    "dataset_name": ("TRL", "--dataset"),
    "use_peft": ("TRL", "--lora-rank R (LoRA when R > 0)"),
    "lora_r": ("TRL", "--lora-rank"),
    "learning_rate": ("TRL", "--lr"),
    "lr_scheduler_type": ("TRL", "--lr-scheduler"),
    "max_completion_length": ("TRL", "--max-new-tokens"),
    "max_steps": ("TRL", "--total-steps"),
    "num_iterations": ("TRL", "--num-epochs"),
    "steps_per_generation": ("TRL", "--num-minibatches"),
    "per_device_train_batch_size": ("TRL", "--num-prompts x --num-generations rows per rollout, split into "
                                           "--num-minibatches optimizer steps"),
    "gradient_accumulation_steps": ("TRL", "--micro-batch-size (it changes neither the loss nor the gradient)"),
    "loss_type": ("TRL", "--algo, or --loss-agg-mode for the aggregation alone"),
    "mask_truncated_completions": ("TRL", "--mask-truncated"),
    "use_bias_correction_kl": ("TRL", "--kl-ratio-correction"),
    "vllm_importance_sampling_correction": ("TRL", "--rollout-correction MODE"),
    "vllm_importance_sampling_mode": ("TRL", "--rollout-correction"),
    "vllm_importance_sampling_cap": ("TRL", "--rollout-correction-max"),
    "bf16": ("TRL", "--dtype bfloat16"),
    "save_steps": ("TRL", "--save-every"),
    "eval_steps": ("TRL", "--eval-every"),
    "report_to": ("TRL", "--wandb-mode"),
    "clip_ratio_low": ("verl", "--epsilon"),
    "clip_ratio_high": ("verl", "--epsilon-high"),
    "kl_loss_coef": ("verl", "--beta"),
    "kl_loss_type": ("verl", "--kl-estimator"),
    "adv_estimator": ("verl", "--advantage-estimator"),
    "entropy_coeff": ("verl", "--entropy-coef"),
    "ppo_epochs": ("verl", "--num-epochs"),
}


def other_name(cli, argv: list[str]) -> str | None:
    """'--learning-rate is TRL's name; here: --lr' for the first flag of argv that is another trainer's name for one of
    cli's flags (the flag it names exists in cli)."""
    fields_ = field_types(cli)
    for token in argv:
        name = token.partition("=")[0][2:].replace("-", "_") if token.startswith("--") else ""
        if name in OTHER_NAMES and name not in fields_:
            trainer, ours = OTHER_NAMES[name]
            if all(flag[2:].replace("-", "_") in fields_ for flag in re.findall(r"--[\w-]+", ours)):
                return f"{token.partition('=')[0]} is {trainer}'s name; here: {ours}"
    return None


def with_suggestions(message: str, box: str) -> str:
    """tyro's 'Unrecognized options: ...' with the flags its box suggests ('Perhaps you meant'), closest first (a
    rule of dashes, in the box's plain rendering, is not a flag)."""
    suggested = re.findall(r"^[│|\s]*(--[a-z][\w-]*)", box.partition("Perhaps you meant:")[2], re.M)
    suggested = list(dict.fromkeys(suggested))[:3]
    return f"{message}; did you mean {' or '.join(suggested)}?" if suggested else message


def box_message(text: str) -> str:
    """The message of tyro's error box, in either of rich's renderings: on a terminal the title sits in the top
    border (╭─ Invalid choice ─╮) and the message follows in │ ... │ lines; elsewhere the title is a line of its own
    above a dashed rule. The message ends at the next rule (tyro's help text follows)."""
    rule = set("─-━═+╭╮╰╯│| ")
    groups, current, titled = [], [], False
    for line in text.splitlines():
        inner = line.strip().strip("│|").strip()
        if not inner:
            continue
        if set(inner) <= rule:
            groups.append(current)
            current = []
        elif inner[0] in "─-╭+" and not groups and not current:  # the title inside the top border
            titled = True
        else:
            current.append(inner)
    groups = [g for g in groups + [current] if g]
    if not titled and len(groups) > 1:  # the title was a line of its own
        groups = groups[1:]
    return " ".join(groups[0]) if groups else ""


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
    if args.num_prompts % world_size:
        raise ConfigError(f"--num-prompts {args.num_prompts} is not divisible by the {world_size} processes (each takes "
                          f"whole prompt groups); use a multiple of {world_size}")
    if args.num_minibatches < 1 or (args.num_prompts // world_size * args.num_generations) % args.num_minibatches:
        rollout = "the rollout's" if world_size == 1 else "each process's"
        rows = args.num_prompts // world_size * args.num_generations
        divisors = [d for d in range(1, rows + 1) if rows % d == 0]
        raise ConfigError(f"--num-minibatches {args.num_minibatches} must divide {rollout} "
                          f"{args.num_prompts // world_size}x{args.num_generations} rows; use one of "
                          f"{', '.join(map(str, divisors))} (or change --num-prompts or --num-generations)")
    if world_size > 1 and (args.device not in ("auto", "cpu", "cuda") or (
            args.device == "auto" and not torch.cuda.is_available() and torch.backends.mps.is_available())):
        raise ConfigError(f"--device {args.device} under torchrun: each rank takes its own GPU (LOCAL_RANK) with "
                          "--device auto or cuda; without CUDA, use --device cpu (gloo cannot reduce MPS tensors)")
    gpus, local = torch.cuda.device_count() if torch.cuda.is_available() else 0, ddp.local_world_size()
    if ddp.launched() and args.device in ("auto", "cuda") and 0 < gpus < local:
        raise ConfigError(f"torchrun starts {local} processes on this machine but it has {gpus} GPU(s), one per "
                          f"process; use --nproc-per-node {gpus} (or --device cpu)")
    if args.fsdp:
        check_fsdp(args)
    name = args.run_name
    if not name.strip() or name in (".", "..") or "/" in name or os.sep in name:
        raise ConfigError(f"--run-name {name!r} must be a plain folder name (no '/', not '.' or '..')")
    for flag, name in (("--dataset", args.dataset), ("--eval-dataset", args.eval_dataset)):
        if task.names_a_path(name) and not Path(name).expanduser().exists():  # named before the run folder is read
            raise ConfigError(f"{flag} {name}: the file does not exist; pass a JSONL file of prompt/answer rows (or "
                              "a dataset file, folder or hub id: docs/reference.md)")
    check_device(args.device)
    context = models.context_without_loading(args.model, args.dataset)
    if context and args.max_new_tokens >= context:  # every prompt takes a token at least: refused before any warm
        raise ConfigError(f"--max-new-tokens {args.max_new_tokens} leaves no room for a prompt in the model's context "
                          f"of {context} tokens; use at most {context - 1} minus the longest prompt")  # start or load
    if args.dtype == "float16":  # AdamW's second moment underflows in fp16 and, without loss scaling, NaNs follow
        raise ConfigError("--dtype float16 is not supported for training (no loss scaling: the weights turn NaN at "
                          "the first step); use bfloat16 (Ampere GPUs and later) or float32")
    if args.answer_format == "boxed":
        try:
            rewards.require_math_verify()
        except rewards.VerifierError as e:
            raise ConfigError(str(e))
    check_wandb(args.wandb_mode)
    if args.lr_scheduler not in (names := working_schedulers()):  # last: it imports transformers' trainer (~5 s)
        raise ConfigError(f"--lr-scheduler {args.lr_scheduler!r} cannot be used here; use one of {', '.join(names)}")


def check_fsdp(args) -> None:
    """--fsdp where it is tested (ddp.shard): under torchrun, a full fine-tune, a torch with FSDP2 (on the CPU, 2.11 or
    later); LoRA refused."""
    if not ddp.launched():
        raise ConfigError("--fsdp shards the model over torchrun's processes: run it as torchrun --nproc-per-node N "
                          "train.py --fsdp ... (one process needs no sharding; drop --fsdp)")
    try:
        from torch.distributed.fsdp import fully_shard  # noqa: F401  FSDP2 (an older torch is refused before this)
    except ImportError:  # a build of torch without torch.distributed
        raise ConfigError(f"--fsdp needs FSDP2 (torch.distributed.fsdp.fully_shard), which this torch "
                          f"{torch.__version__} lacks (built without torch.distributed?): install a torch build with "
                          "distributed support, or drop --fsdp") from None
    from packaging.version import Version

    on_cpu = models.pick_device(args.device).type == "cpu"
    if on_cpu and Version(torch.__version__) < Version("2.11"):  # (2.11 and 2.13 tested; 2.6 fails)
        raise ConfigError(f"--fsdp on the CPU needs torch 2.11 or later (torch {torch.__version__}'s FSDP2 records "
                          "events on a stream the CPU does not have); upgrade torch, or drop --fsdp (data parallel)")
    if args.lora_rank > 0:
        raise ConfigError("--fsdp does not work with --lora-rank (LoRA's adapters are small: use data parallel, "
                          "without --fsdp)")


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


def check_wandb(requested: str | None) -> None:
    """wandb online or offline needs the package (an image may lack it), and online a login (never a prompt)."""
    mode = network.wandb_mode(requested)
    if mode != "disabled" and importlib.util.find_spec("wandb") is None:
        raise ConfigError(f"wandb {mode} needs the wandb package, which is not installed: pip install wandb "
                          "(requirements.txt), or --wandb-mode disabled to log to metrics.jsonl alone")
    if mode == "online" and not network.wandb_has_login():
        raise ConfigError("wandb online needs a login (`wandb login`, or WANDB_API_KEY); use --wandb-mode offline "
                          "(sync later with `wandb sync`) or disabled")


# ---------------------------------------------------------------------------------------------------------------
# Checks that need the data
# ---------------------------------------------------------------------------------------------------------------


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


def check_thinking(tokenizer, model: str) -> None:
    """--enable-thinking acts only through a chat template that reads it (Qwen3's): refused where a prompt formatted
    with it is the prompt formatted without it, as a comparison of the two would compare the same runs."""
    same = rollout.format_prompt(tokenizer, "1 + 1", enable_thinking=True) == rollout.format_prompt(tokenizer, "1 + 1")
    if same:
        raise ConfigError(f"--enable-thinking changes no prompt of {model}: it has no chat template with a thinking "
                          "switch (Qwen3's has one); drop the flag")


def check_prompt_lengths(tokenizer, context: int | None, examples: list, max_new_tokens: int,
                         answer_format: str, enable_thinking: bool = False) -> None:
    """Every prompt plus the generation budget must fit the model's context. For the embedded model the tokenizer
    and context are known before its warm start is built, so this runs before minutes of work."""
    if not context:
        return
    prompts = [rollout.format_prompt(tokenizer, e.prompt, answer_format, enable_thinking) for e in examples]
    lengths = [len(ids) for ids in tokenizer(prompts, add_special_tokens=False)["input_ids"]]  # one batched call
    longest = max(range(len(lengths)), key=lengths.__getitem__)
    if lengths[longest] + max_new_tokens > context:
        raise ConfigError(f"prompt {longest} ({examples[longest].prompt[:40]!r}...) has {lengths[longest]} tokens; "
                          f"with --max-new-tokens {max_new_tokens} it exceeds the model's context of {context}. "
                          "Shorten or drop such prompts, or lower --max-new-tokens")
