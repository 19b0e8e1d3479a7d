"""The flags that change nothing the algorithm is (where data and models come from, hardware and memory, logging,
checkpoints), in groups. train.Args inherits them after its own fields, so every flag stays flat (`--lora-rank`,
not `--lora.lora-rank`) and `--help` lists the algorithm's first."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from model import LORA_TARGETS


@dataclass
class DataSource:
    prompt_field: str = ""
    """a file's or hub dataset's prompt column; default: prompt, question or problem"""
    answer_field: str = ""
    """its answer column; default: answer or solution (GSM8K's '#### 42' and MATH's \\boxed{} are cut to the answer)"""
    dataset_config: str = ""
    """a hub dataset's configuration (e.g. main for openai/gsm8k)"""
    enable_thinking: bool = False
    """let a chat template that can think (Qwen3) open a thinking block; off, as most budgets here are too short
    (refused for a model whose prompts it would not change)"""


@dataclass
class Hardware:
    device: str = "auto"
    """cuda, mps or cpu; auto picks the first available"""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """the precision forwards compute in: bf16 runs under autocast and trained weights, gradients and AdamW's moments
    stay fp32 (LoRA: a bf16 base, fp32 adapters). auto: bf16 on GPUs with native bf16, else fp32; float16 is refused"""
    threads: int = 0
    """CPU threads torch uses (0: its default, OMP_NUM_THREADS or one per core). On a busy or shared machine 1 is
    often faster; metrics repeat exactly for the same seed and thread count"""
    micro_batch_size: int = 0
    """rows per forward/backward (gradient accumulation); 0: sized to the machine (a whole minibatch, halved on
    each out-of-memory error)"""
    cast_lm_head_to_fp32: bool = False
    """the head (the last matmul, vocabulary-wide) in fp32 under bf16 autocast, in generate and every scoring pass,
    so its bf16 rounding does not enter the ratios (TRL's cast_lm_head_to_fp32, after ScaleRL)"""
    logprob_chunk: int = 0
    """completion positions whose logits are made at once when log-probs are computed from the last hidden states
    (again in the backward), so that no rows x tokens x vocabulary tensor is held; 0: a micro-batch's logits whole up
    to 2^26 entries (all of the embedded model's), else chunks of 2^24 / vocabulary size positions (110 at Qwen's
    151,936); -1: always whole logits"""
    fsdp: bool = False
    """under torchrun: shard the policy's weights, gradients and AdamW state over the processes (PyTorch's FSDP2,
    fully_shard on each decoder layer and then the root), so each holds 1/N of them, instead of a copy on each
    (data parallel). Generation gathers the whole model once per rollout"""
    gradient_checkpointing: bool = False
    """recompute activations in the backward pass instead of keeping them (transformers' own, non-reentrant): less
    memory for long completions at the cost of a second forward per layer; the same loss and gradient. Acts in the
    update only"""


@dataclass
class LoRA:
    lora_rank: int = 0
    """LoRA rank r: train only low-rank adapters on --lora-target-modules (needs `pip install peft`); the reference
    policy of β > 0 is then the same model with its adapter off, not a second copy. 0: train every weight"""
    lora_alpha: float | None = None
    """LoRA scale α: each adapted layer adds (α / r) B A x"""
    lora_target_modules: tuple[str, ...] = LORA_TARGETS
    """the projections that get adapters (by module name); the default's names a model lacks are skipped (the
    start-up line lists those adapted), a name you give must be a module of the model"""
    merge_lora: bool = False
    """with --lora-rank: also save the base with the adapter merged in (final/merged/, a plain model --model loads)"""


@dataclass
class Evaluation:
    eval_every: int = 25
    """held-out greedy evaluation every this many steps (and before and after training)"""
    eval_size: int = 0
    """held-out problems to evaluate, spread evenly over the held-out set (the same ones in every run); 0: all"""
    eval_dataset: str = ""
    """your own held-out set, read as --dataset is (formats, --prompt-field/--answer-field): its test split if it has
    one, else every row (an embedded name: its held-out split); a file or hub --dataset then trains on all its rows"""
    eval_samples: int = 0
    """also draw this many samples per held-out problem at --temperature and log eval/pass@1 and eval/pass@N
    (unbiased estimator); 0: greedy accuracy only"""


@dataclass
class Logging:
    output_dir: str = "runs"
    """each run writes <output_dir>/<run_name>/ (metrics.jsonl, final model, wandb files)"""
    run_name: str | None = None
    """the run's folder and wandb name"""
    wandb_mode: Literal["online", "offline", "disabled"] | None = None
    """W&B logging; never prompts"""
    wandb_project: str = "grpo-family"
    """W&B project the run is logged to"""
    wandb_group: str | None = None
    """groups the runs of a sweep"""
    wandb_tags: tuple[str, ...] = ()
    """W&B tags of the run (sweeps add 'sweep' and the algo)"""
    save_model: bool = True
    """save the final policy with save_pretrained"""
    log_completions_every: int = 0
    """every this many steps, write the step's whole rollout to completions.jsonl in the run folder (and a wandb
    table): each completion with its prompt, reference, reward terms, advantage and length; and every evaluation's
    greedy answers to eval_completions.jsonl; 0: none"""
    log_study_metrics: bool = False
    """the study's instrumentation every update: what each preset would clip on the same batch (clip/shadow_<algo>),
    SAPO's gate (clip/sapo_gate_mean), the ratio spread by response-length quartile (lenbucket/) and the length gap
    of wrong answers (charts/len_incorrect_rel); tools.sweep and tools.study turn it on (nothing learned changes)"""
    log_prefix_spread: bool = False
    """the study's instrumentation: after each step's update, score the rollout once more under the updated policy
    and log the spread of the prefix sums of log rho_t (metrics.prefix_spread; one forward pass, nothing learned
    changes)"""


@dataclass
class SafetyNets:
    save_every: int = 0
    """write a checkpoint every this many steps (0: only when stopped by a signal or an error)"""
    keep_checkpoints: int = 2
    """how many of the newest checkpoints to keep"""
    resume: str | None = None
    """'auto' (this run's latest checkpoint, if any), a checkpoint folder, or a run folder"""
    overwrite: bool = False
    """replace an existing run folder of the same name instead of refusing"""
    max_nonfinite_steps: int = 3
    """stop after this many steps in a row whose every update had a non-finite loss or gradient"""


def own_fields_first(cls):
    """Order a dataclass's fields as its class body reads, its own before those it inherits: Python puts a base's
    fields first, and tyro's --help and config.json follow that order. (Fields are passed by keyword everywhere.)"""
    own = [f for f in cls.__annotations__ if f in cls.__dataclass_fields__]
    order = own + [f for f in cls.__dataclass_fields__ if f not in own]
    cls.__dataclass_fields__ = {f: cls.__dataclass_fields__[f] for f in order}
    return cls
