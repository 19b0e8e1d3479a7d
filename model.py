"""Models: pick the device, load a policy (hub id, local directory or .gguf file), or build the embedded default.

The embedded default is a 0.67M-parameter Llama with a character-level tokenizer, both plain transformers
objects: they save and load with save_pretrained / from_pretrained and go through the same code as a hub model.
Its starting policy comes from a short supervised warm start on the noisy teacher of task.py, cached on disk.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import inspect
import json
import os
import random
import shutil
import string
import warnings
from pathlib import Path
from typing import NamedTuple

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from tqdm import tqdm

from base import network
import task
from base.errors import UserError


class ModelError(UserError, ValueError):
    """A model that cannot be used; the message says what is wrong and what to do."""


# ---------------------------------------------------------------------------------------------------------------
# Device and precision
# ---------------------------------------------------------------------------------------------------------------


def pick_device(name: str = "auto") -> torch.device:
    if name != "auto":
        return torch.device(name)
    if torch.cuda.is_available():
        return torch.device("cuda")
    if torch.backends.mps.is_available():
        return torch.device("mps")
    return torch.device("cpu")


def pick_dtype(device: torch.device, name: str = "auto") -> torch.dtype:
    """The precision forwards compute in: bf16 where the device has it natively (Ampere and later; T4 and V100 only
    emulate it, slowly), else fp32. CPU bf16 is slow and lossy. Trained weights stay fp32 whatever this says."""
    if name == "auto":
        bf16 = device.type == "cuda" and torch.cuda.is_bf16_supported(including_emulation=False)
        return torch.bfloat16 if bf16 else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[name]


def compute_in(model, dtype: torch.dtype):
    """Mixed precision as TRL and accelerate do it: the weights (and so the gradients and AdamW's moments) keep their
    own dtype, and every forward of `model` (in the update, in generate, under DDP or peft) runs under autocast to
    `dtype`. Pure bf16 weights would round away any update smaller than half a bf16 ulp (~0.4% of the weight)."""
    if dtype == torch.float32:
        return model
    forward = functools.partial(_autocast_forward, model, dtype)  # a partial: deepcopy(model) rebinds it to the copy
    forward.__signature__ = inspect.signature(model.forward)  # generate reads forward's arguments (logits_to_keep)
    model.forward, model.autocast_dtype = forward, dtype
    return model


def _autocast_forward(model, dtype, *args, **kwargs):
    with torch.autocast(model.device.type, dtype=dtype):
        return type(model).forward(model, *args, **kwargs)


def head_in_fp32(model):
    """TRL's cast_lm_head_to_fp32 (after ScaleRL, 2510.13913): the head computes in fp32 whatever autocast does to
    the rest of `model`, in generate as in every scoring pass, so that bf16's rounding of the last matmul does not
    enter the ratios (a LoRA base's bf16 head is stored in fp32 for it). A partial, as in compute_in: a copy of the
    model (the reference) gets its own."""
    head = model.get_output_embeddings()
    head.float()
    head.forward, head.fp32 = functools.partial(_fp32_forward, head), True
    return model


def _fp32_forward(head, x):
    with torch.autocast(x.device.type, enabled=False):
        return type(head).forward(head, x.float())


def compute_dtype(model) -> torch.dtype:
    """The precision `model`'s forwards compute in (compute_in), which is what rounding depends on."""
    return getattr(model, "autocast_dtype", None) or model.dtype


def frozen_reference(model):
    """`model` (a copy of the starting policy) as the frozen reference of β > 0, its linear layers stored as autocast
    computes them (linears_as_computed)."""
    return linears_as_computed(model.eval().requires_grad_(False))


def linears_as_computed(model):
    """A model that no update touches (the reference; the policy of an evaluation alone) needs no fp32 master copy.
    Under bf16 autocast its linear layers are stored in bf16, the copy autocast makes of them at every forward
    anyway: it scores bit for bit as the fp32 weights would, at 2 bytes per weight instead of 4 (embeddings, a head
    tied to them or kept in fp32 by head_in_fp32, and norms stay fp32, as autocast computes them)."""
    dtype = compute_dtype(model)
    if dtype != torch.float32:
        embeddings = {id(p) for m in model.modules() if isinstance(m, torch.nn.Embedding) for p in m.parameters()}
        for m in model.modules():
            if isinstance(m, torch.nn.Linear) and id(m.weight) not in embeddings and not getattr(m, "fp32", False):
                m.to(dtype)
    return model


# ---------------------------------------------------------------------------------------------------------------
# What stays on the device: refused before loading when it cannot fit
# ---------------------------------------------------------------------------------------------------------------

GiB = 2**30


def resident_bytes(params: float, linear: float, compute_bytes: int, lora_params: float = 0.0,
                   reference: bool = False) -> dict[str, float]:
    """What a run keeps on its device whatever the batch, by part, in bytes (`linear`: the parameters of linear
    layers not tied to the embeddings, which frozen_reference stores in the compute precision):
        full fine-tune   fp32 weights (4 per parameter), autocast's copies of them while a forward's graph lives
                         (compute_bytes each; none in fp32), fp32 gradients (4), AdamW's two fp32 moments (8)
        LoRA             the base in the compute precision, and 16 bytes per adapter parameter (an fp32 weight, its
                         gradient and two moments)
        reference        β > 0, a full fine-tune: frozen_reference's copy (LoRA's reference is its base: free)"""
    if lora_params:
        return {"weights": params * compute_bytes, "adapter": lora_params * 16}
    return {"weights": params * 4, "autocast copies": params * compute_bytes if compute_bytes < 4 else 0.0,
            "gradients": params * 4, "AdamW moments": params * 8,
            "reference": (params - linear) * 4 + linear * compute_bytes if reference else 0.0}


SPLIT_BY_FSDP = ("weights", "gradients", "AdamW moments", "reference")  # what --fsdp splits over its processes


class Counts(NamedTuple):
    """A model's parameter counts, from its config alone (parameter_counts)."""
    params: float  # every parameter
    linear: float  # those of linear layers not tied to the embeddings (frozen_reference stores them as computed)
    layer_linear: float  # those of the decoder layers' linear layers (--fsdp gathers them in the compute precision)
    head: float  # the output head's weight, vocabulary x hidden, tied to the embeddings or not
    layers: int  # decoder layers


def sharded_resident(parts: dict[str, float], n: int, counts: Counts, compute_bytes: int) -> dict[str, float]:
    """resident_bytes' parts per card under --fsdp over n processes (ddp.shard): the fp32 weights, gradients, AdamW
    moments and the reference split n ways. Whole on every card: the root (embeddings, head, final norm) and the
    norms gathered in fp32 for the update; in bf16, autocast's copy of the head alone (each layer's linear weights
    are gathered in bf16 and freed after its forward, so no copy of them is kept); FSDP's buffers for the layers in
    flight in the update (two gathered, the one computing and the next, and an all-gather buffer, in the compute
    precision; one layer's gradient in it and in fp32 for its reduce-scatter); and, while it samples, the whole model
    gathered, the layers' linear weights in the compute precision and the rest in fp32, and the root's all-gather
    buffer, which FSDP holds until it has copied the root's weights out of it (the largest unit). Measured on CPUs:
    `python -m tools.memory --measure --fsdp 2`."""
    rest, layer = counts.params - counts.layer_linear, counts.layer_linear / max(counts.layers, 1)
    return {**{k: v / n if k in SPLIT_BY_FSDP else v for k, v in parts.items()},
            "autocast copies": compute_bytes * counts.head if compute_bytes < 4 else 0.0, "gathered root": 4 * rest,
            "layers in flight": layer * (4 * compute_bytes + 4),
            "gathered for generation": 4 * rest + compute_bytes * counts.layer_linear, "gather buffer": 4 * rest}


GENERATION = ("gathered for generation", "gather buffer")  # sharded_resident's parts that sampling alone holds


def generation_bytes(parts: dict[str, float]) -> float:
    """What a card holds while it samples under --fsdp: the gathered model (and the buffer it came through) beside
    the shards of the weights, AdamW moments and reference (the gradients are freed, no autocast copy is made)."""
    return sum(parts.get(k, 0.0) for k in (*GENERATION, "weights", "AdamW moments", "reference"))


def parameter_counts(name: str) -> Counts | None:
    """The parameter counts of a hub id, model folder or .gguf file, from its config alone: the model is built on the
    meta device, no weight is read. None where the config cannot be read (loading the model then says why)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    source, kwargs = Path(name).expanduser(), {}
    if name.endswith(".gguf"):
        source, kwargs = source.parent, {"gguf_file": source.name}
    elif not source.exists() and network.hub_offline():
        kwargs = {"local_files_only": True}
    try:
        config = AutoConfig.from_pretrained(str(source) if source.exists() else name, trust_remote_code=False, **kwargs)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, trust_remote_code=False)
    except Exception:  # any loader error: the real load names it
        return None
    embeddings = {id(p) for m in model.modules() if isinstance(m, torch.nn.Embedding) for p in m.parameters()}

    def linear_in(module):
        return sum(p.numel() for m in module.modules() if isinstance(m, torch.nn.Linear) and id(m.weight) not in
                   embeddings for p in m.parameters())
    layers = model.get_decoder().layers
    return Counts(sum(p.numel() for p in model.parameters()), linear_in(model), linear_in(layers),
                  model.get_output_embeddings().weight.numel(), len(layers))


def free_memory(device: torch.device) -> int | None:
    """Bytes free on the device now: CUDA's own count; None on a CPU or MPS (nothing is refused there)."""
    return torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else None


def refuse_what_cannot_fit(name: str, device: torch.device, dtype: torch.dtype, reference: bool,
                           shards: int = 1) -> None:
    """Before anything is loaded: a full fine-tune whose resident state (resident_bytes; per card under --fsdp over
    `shards` processes, the larger of the update's and generation's) is larger than the device's free memory would
    fail at its first optimizer step, after the rollout and a checkpoint, whatever the batch."""
    free = free_memory(device)
    counts = None if free is None or name == "embedded" else parameter_counts(name)
    if counts is None:
        return
    compute_bytes = torch.finfo(dtype).bits // 8
    parts = resident_bytes(counts.params, counts.linear, compute_bytes=compute_bytes, reference=reference)
    need, where = sum(parts.values()), "on the device"
    if shards > 1:
        parts = sharded_resident(parts, shards, counts, compute_bytes)
        need = max(sum(v for k, v in parts.items() if k not in GENERATION), generation_bytes(parts))
        where = f"per card under --fsdp over {shards} processes"
    if need > free:
        detail = ", ".join(f"{k} {v / GiB:.1f}" for k, v in parts.items() if v)
        raise ModelError(f"a full fine-tune of {name} ({counts.params / 1e9:.2f}B parameters) keeps {need / GiB:.1f} "
                         f"GiB {where} before any activation ({detail} GiB), and {device} has {free / GiB:.1f} GiB "
                         "free: train LoRA adapters instead (--lora-rank 16, with --gradient-checkpointing for long "
                         "completions), take a smaller model, shard it over more devices (--fsdp under torchrun), "
                         "or a device with more memory")


# ---------------------------------------------------------------------------------------------------------------
# The embedded tokenizer and model
# ---------------------------------------------------------------------------------------------------------------


# transformers is imported inside the functions that use it: importing it takes seconds, and a refused flag or
# --help should not wait for that (flags.py imports this module)

FLOORS = {"torch": "2.6", "transformers": "5.17"}  # the oldest releases that run (requirements.txt, reliability.md)


def require_releases(installed: dict[str, str] | None = None) -> None:
    """A ModelError (one line) where torch or transformers is older than its floor: older releases fail late and
    obscurely (transformers 5.17 turns a torch below 2.5 off; transformers 4.x cannot read the embedded tokenizer, and
    its generate refuses token_type_ids; before 5.17 a GGUF model does not save). `installed` stands in for what is
    installed, by name. Reads the packages' metadata, not the packages (importing transformers takes seconds)."""
    from importlib import metadata

    from packaging.version import Version

    for name, floor in FLOORS.items():
        try:
            version = (installed or {}).get(name) or metadata.version(name)
        except metadata.PackageNotFoundError:  # no metadata (a folder on the path): the package's own, or none
            try:
                version = importlib.import_module(name).__version__
            except ImportError:
                raise ModelError(f"{name} is not installed: pip install -r requirements.txt") from None
        if Version(version) < Version(floor):
            raise ModelError(f"{name} {version} is older than this project's floor {floor}: upgrade it (pip install -U "
                             f"'{name}>={floor}', or pip install -r requirements.txt)")


def quiet_transformers() -> None:
    """No per-file load/save progress bars: they would bury the training log (and error lines)."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()


def build_tokenizer() -> PreTrainedTokenizerFast:
    """A character-level tokenizer (printable ASCII, with <answer> and </answer> as single tokens)."""
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<eos>", "<unk>"]
    pieces = specials + [task.ANSWER_OPEN, task.ANSWER_CLOSE] + list(string.printable[:-5])  # no \t\r\x0b\x0c
    tok = Tokenizer(models.WordLevel({p: i for i, p in enumerate(pieces)}, unk_token="<unk>"))
    # Each tag is one piece, every other character is its own piece; Fuse joins pieces back without spaces.
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"</?answer>|[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>", padding_side="left"
    )


def build_tiny_model(tokenizer, seed: int = 0, hidden: int = 128, layers: int = 4,
                     max_positions: int = 128) -> LlamaForCausalLM:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=max_positions,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
        tie_word_embeddings=True,
    )
    return LlamaForCausalLM(config)


# ---------------------------------------------------------------------------------------------------------------
# Loading any policy
# ---------------------------------------------------------------------------------------------------------------


def load_model(name: str, device: torch.device, dtype: torch.dtype):
    """(model, tokenizer) from a hub id, a local model directory, or a .gguf file (dequantised by transformers)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    quiet_transformers()
    kwargs, source = {}, name
    local = Path(name).expanduser()
    looks_local = name.startswith(("/", ".", "~")) or local.suffix in (".gguf", ".safetensors", ".bin", ".pt") \
        or name.count("/") > 1
    if looks_local and not local.exists():
        raise ModelError(f"model path {name} does not exist; pass a model directory, a .gguf file or a hub id")
    if name.endswith(".gguf"):
        if not local.is_file():
            raise ModelError(f"GGUF file {name} is not a file; pass the path to a .gguf model file")
        source, kwargs = str(local.parent), {"gguf_file": local.name}
        from transformers import modeling_gguf_pytorch_utils as gguf_utils  # its dequantising bar is a plain tqdm,
        if not isinstance(gguf_utils.tqdm, functools.partial):  # which disable_progress_bar does not reach
            gguf_utils.tqdm = functools.partial(gguf_utils.tqdm, disable=True)
    elif local.exists() and (local / "adapter_config.json").is_file() and not (local / "config.json").is_file():
        raise ModelError(f"{name} holds a LoRA adapter, not a whole model; train with --merge-lora and pass its "
                         "final/merged folder (or the base --model with --lora-rank to train a new adapter)")
    elif local.exists() and not (local / "config.json").is_file():
        raise ModelError(f"{name} is not a model directory (no config.json); pass a save_pretrained directory")
    elif local.exists():
        refuse_custom_code(local)
    elif not local.exists() and network.hub_offline():  # a hub id, and no hub: only the local cache can have it
        kwargs = {"local_files_only": True}
    try:
        # never the model's own Python code; weights from safetensors or GGUF, a .bin only through torch's safe load
        tokenizer = AutoTokenizer.from_pretrained(source, trust_remote_code=False, **kwargs)
        own = AutoConfig.from_pretrained(source, trust_remote_code=False, **kwargs).dtype  # before it is loaded as `dtype`
        model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype, trust_remote_code=False, **kwargs)
    except Exception as e:  # loaders raise many types (OSError, ValueError, ImportError, ...); all mean "cannot load"
        if kwargs.get("local_files_only"):
            raise ModelError(f"model {name!r}: no such local folder, and the hub ({network.hub_endpoint()}) is unreachable "
                             "and has no cached copy; pass a local model directory or .gguf file")
        first = str(e).strip().splitlines()[0][:300] if str(e).strip() else type(e).__name__
        raise ModelError(f"could not load model {name!r}: {first}")
    quantization = getattr(model.config, "quantization_config", None)
    if "gguf_file" in kwargs or getattr(quantization, "quant_method", None) == "gguf":
        # transformers dequantises a GGUF file's weights to `dtype` on load but leaves the model flagged as quantised:
        # Trainer refuses it, save_pretrained refuses it (a checkpoint, final/), and a folder saved with the flag in
        # its config (by this trainer before it dropped it) loads flagged again, though its weights are plain
        model.is_quantized, model.hf_quantizer = False, None
        if quantization is not None:  # (the flag a .gguf load leaves in the config; absent, nothing to drop)
            del model.config.quantization_config
    model.own_dtype = own if isinstance(own, torch.dtype) else None  # what save_final writes the weights in
    return prepare(without_dropout(model), tokenizer, device)


def without_dropout(model):
    """Dropout off everywhere (GPT-2, OPT and Phi have it on by default): pi_old, the reference and the update must
    score a sequence with the same function, or the ratio of an unchanged policy is not 1. Modules read it from
    nn.Dropout or from a float attribute (Llama's attention_dropout, OPT's dropout)."""
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
        for name, value in vars(module).items():
            if "dropout" in name and isinstance(value, float):
                setattr(module, name, 0.0)
    return model


def refuse_custom_code(folder: Path) -> None:
    """A model folder whose config or tokenizer config maps to its own Python files (auto_map) would need that code
    run to load; this trainer runs none of a model's code."""
    for name in ("config.json", "tokenizer_config.json"):
        try:
            config = json.loads((folder / name).read_text()) if (folder / name).is_file() else {}
        except (OSError, ValueError):
            continue  # unreadable: loading it names the problem
        if isinstance(config, dict) and config.get("auto_map"):
            raise ModelError(f"{folder} needs its own Python code to load ({name} has auto_map: "
                             f"{', '.join(sorted(config['auto_map']))}), and this trainer runs no code from a model "
                             "folder; use a model whose architecture transformers has built in")


def enable_checkpointing(model) -> None:
    """transformers' activation (gradient) checkpointing, non-reentrant; by either of its names (renamed in 5.x)."""
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def is_checkpointing(model) -> bool:
    return bool(model.is_activation_checkpointing if hasattr(type(model), "is_activation_checkpointing")
                else model.is_gradient_checkpointing)


# ---------------------------------------------------------------------------------------------------------------
# LoRA (peft): train low-rank adapters only; the reference policy is the same model with the adapter off
# ---------------------------------------------------------------------------------------------------------------

LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")  # attention and MLP


def add_lora(model, rank: int, alpha: float, targets: tuple[str, ...], adapter: Path | None = None, seed: int = 0):
    """The policy as a peft model: W x + (alpha / rank) B A x on each target projection, A random (drawn from
    `seed`, on every rank alike, whatever the global RNG holds) and B = 0 at the start, so the policy starts equal to
    the base model; only A and B train. `adapter`: a saved adapter to continue from (a checkpoint). Dropout stays 0:
    the update's log-probs must equal pi_old's at the first step."""
    try:
        from peft import LoraConfig, PeftModel, get_peft_model
    except ImportError:
        raise ModelError("--lora-rank needs the peft package: pip install peft")
    warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*deprecated")  # peft asks the old name
    if adapter is not None:
        return PeftModel.from_pretrained(model, str(adapter), is_trainable=True)
    present = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()}
    missing = [t for t in targets if t not in present]  # the default list names every projection some model has;
    if not set(targets) & present or (missing and tuple(targets) != LORA_TARGETS):  # a name given is meant (a typo)
        which = "none is" if not set(targets) & present else \
            f"{' '.join(missing)} {'is' if len(missing) == 1 else 'are'} not"
        raise ModelError(f"--lora-target-modules {' '.join(targets)}: {which} a module of this model; its linear "
                         f"layers include {', '.join(sorted(n for n in present if n.endswith('proj'))[:8]) or 'none'}")
    config = LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=0.0, target_modules=list(set(targets) & present),
                        bias="none", task_type="CAUSAL_LM")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return get_peft_model(model, config)


def is_lora(model) -> bool:
    return hasattr(model, "disable_adapter") and hasattr(model, "peft_config")


class AdapterOff:
    """The reference policy of a LoRA run: the same model called with its adapter switched off, i.e. the starting
    policy, with no second copy of the weights in memory (TRL does the same)."""

    def __init__(self, model):
        self.model = model

    def __call__(self, **kwargs):
        with self.model.disable_adapter():
            return self.model(**kwargs)


def save_final(model, tokenizer, folder: Path, merge: bool, state: dict | None = None) -> None:
    """The final policy: the whole model, or under LoRA its adapter, and with `merge` also the base with the
    adapter merged in (folder/merged, a plain model that --model loads). A full fine-tune trains fp32 weights and is
    saved in the model's own dtype (a bf16 model's final/ is bf16, as its hub folder was); each folder keeps the
    model's own generation_config.json (its sampling defaults), not the one this trainer samples with. `state`: the
    weights to write where `model` holds only a shard of them (--fsdp: ddp.full_state_dict)."""
    as_published(model, folder, state)
    tokenizer.save_pretrained(folder)
    if merge and is_lora(model):
        merged = model.merge_and_unload()
        as_published(merged, folder / "merged")
        tokenizer.save_pretrained(folder / "merged")


def published_dtype(model) -> torch.dtype:
    """The dtype a published copy of `model` is written in: the one its own config named when it was loaded, else
    the one it holds."""
    return getattr(model, "own_dtype", None) or model.dtype


def published_generation_config(model):
    """The generation config a published copy carries: the model's own (kept by prepare), not the project's."""
    return getattr(model, "own_generation_config", None) or model.generation_config


def as_published(model, folder: Path, state: dict | None = None) -> None:
    """save_pretrained with the model's own generation config, and its weights (`state`, or the model's own) in its
    own dtype (a full model)."""
    ours, dtype = model.generation_config, published_dtype(model)
    if not is_lora(model) and dtype != model.dtype:
        cast = {}  # one copy per storage, so that tied weights stay tied
        state = {k: cast.setdefault(v.untyped_storage().data_ptr(), v.detach().to("cpu", dtype))
                 if v.is_floating_point() else v for k, v in (state or model.state_dict()).items()}
    try:
        model.generation_config = published_generation_config(model)
        save_pretrained(model, folder, state)
    finally:
        model.generation_config = ours
    if state is not None:  # the config names the dtype the weights were written in, and the model's own class
        name_in_config(folder, model, dtype=str(dtype).removeprefix("torch."))
    readable_as_config(folder)


def save_pretrained(model, folder: Path, state: dict | None = None) -> None:
    """model.save_pretrained, without peft's warning for an adapter whose base has no config.json beside it (a .gguf
    file): "will assume that the vocabulary was not modified", which holds (no adapter on the embeddings)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Could not find a config file in")
        model.save_pretrained(folder, state_dict=state)


def readable_as_config(folder: Path) -> None:
    """safetensors 0.8 writes each file through a temporary one created 0600 (safetensors issue 782), so a saved
    model's weights are readable by their owner only, unlike the config beside them: a colleague, or an inference
    server running as another user, could not load the folder. The weights get the config's permission bits."""
    configs = sorted(folder.glob("*config.json"))  # config.json, or a LoRA adapter's adapter_config.json
    if configs:
        for weights in folder.glob("*.safetensors"):
            weights.chmod(configs[0].stat().st_mode & 0o777)


def name_in_config(folder: Path, model, **fields) -> None:
    """Write into folder/config.json the model's transformers class under fully_shard's subclass
    (FSDPLlamaForCausalLM -> LlamaForCausalLM: what the folder must name to load as an ordinary model) and `fields`."""
    config = json.loads((folder / "config.json").read_text())
    config.update(fields, architectures=[next(c.__name__ for c in type(model).__mro__
                                              if not c.__name__.startswith("FSDP"))])
    (folder / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def prepare(model, tokenizer, device: torch.device):
    """Left padding for generation, a pad token, every id that ends a completion, and a generation config of the
    project's own: pad, EOS and nothing else. A hub model's generation_config.json may carry logits processors
    (Qwen2.5-Instruct: repetition_penalty 1.05-1.1; others no_repeat_ngram_size, min_p, bad words, ...) that would
    make the sampler draw from another distribution than the pi_old the loss computes; none of them is kept. The
    sampling temperature is rollout.generate's argument."""
    if tokenizer.eos_token_id is None:
        raise ModelError("the tokenizer has no EOS token; completions could never end. Use a model with one")
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token  # pad == eos: rollout.py keeps the first EOS in the mask
    tokenizer.padding_side = "left"
    from transformers import GenerationConfig

    model.own_generation_config = model.generation_config  # kept for save_final
    model.generation_config = GenerationConfig(pad_token_id=tokenizer.pad_token_id,
                                               eos_token_id=stop_ids(model.generation_config, tokenizer))
    return model.to(device), tokenizer


def stop_ids(generation_config, tokenizer) -> list[int]:
    """The ids that end a completion: the tokenizer's EOS, every EOS id of the model's generation_config (Qwen2.5-
    Instruct lists <|im_end|> and <|endoftext|>, Llama-3.x-Instruct three ids), and the chat template's end-of-turn
    token, which a base model used through its template (the R1-Zero set-up) must stop at too."""
    listed = generation_config.eos_token_id if generation_config is not None else None
    listed = listed if isinstance(listed, list) else [listed]
    ids = [tokenizer.eos_token_id, *listed, end_of_turn_id(tokenizer)]
    return list(dict.fromkeys(int(i) for i in ids if i is not None))


def end_of_turn_id(tokenizer) -> int | None:
    """The special token the chat template writes right after an assistant turn (<|im_end|>, <|eot_id|>,
    <end_of_turn>, ...), found by rendering one; None without a template or when a plain character follows."""
    if not getattr(tokenizer, "chat_template", None):
        return None
    marker = "Zq9Zq"
    try:
        text = tokenizer.apply_chat_template([{"role": "user", "content": "1"}, {"role": "assistant", "content": marker}],
                                             tokenize=False)
    except Exception:  # templates may refuse this conversation (e.g. a required system turn): no end-of-turn known
        return None
    after = text[text.rfind(marker) + len(marker):] if marker in text else ""
    ids = tokenizer(after, add_special_tokens=False)["input_ids"] if after else []
    if not ids:
        return None
    added = getattr(tokenizer, "added_tokens_decoder", {})
    special = ids[0] in tokenizer.all_special_ids or (ids[0] in added and added[ids[0]].special)
    return ids[0] if special else None


# ---------------------------------------------------------------------------------------------------------------
# Warm start: the embedded default's starting policy
# ---------------------------------------------------------------------------------------------------------------

WARM_START = dict(version=1, steps=600, batch_size=64, lr=1e-3, slip_prob=0.6, hidden=128, layers=4)
# The long task: answers ~10x longer, so fewer, shorter batches see as many subtractions; a longer context.
WARM_START_LONG = dict(version=1, task="long", steps=600, batch_size=32, lr=2e-3, slip_prob=0.6,
                       hidden=128, layers=4, max_positions=512, sft_chunk=8)


def warm_start_settings(dataset: str) -> dict:
    """The warm-start recipe for an embedded dataset: the long task has its own, every other one the default's."""
    return WARM_START_LONG if dataset == "embedded-long" else WARM_START


def cache_root() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "grpo-family"


def context_without_loading(name: str, dataset: str) -> int | None:
    """The model's context length, known before any weights are built or read: the embedded model's is fixed by
    its warm-start recipe; a model folder's is in its config.json; otherwise (a hub id, a .gguf) unknown here."""
    if name == "embedded":
        return warm_start_settings(dataset).get("max_positions", 128)
    config = Path(name) / "config.json"
    try:
        cfg = json.loads(config.read_text()) if config.is_file() else {}
    except (OSError, ValueError):
        return None  # unreadable: loading it names the problem
    value = cfg.get("max_position_embeddings") or cfg.get("n_positions")
    return value if isinstance(value, int) and value > 0 else None


SHIPPED = Path(__file__).parent / "weights"  # warm starts committed with the code: seed 0 of the default task's
# recipe and of the long task's (the default runs of --dataset embedded and embedded-long)


def warm_start_path(seed: int, settings: dict, cache: Path | None = None) -> Path:
    """Where the warm start of (settings, seed) is: shipped with the code (weights/), else in the cache, under a hash
    of both, so a changed recipe never reuses a stale policy. A shipped one makes the default run start from the
    same policy on every machine (a warm start built elsewhere differs in floating point) and skips building it."""
    key = hashlib.sha256(json.dumps({**settings, "seed": seed}, sort_keys=True).encode()).hexdigest()[:12]
    shipped = SHIPPED / f"warm-start-{key}"
    if cache is None and (shipped / "config.json").is_file():
        return shipped
    return (cache or cache_root()) / f"warm-start-{key}"


def warm_start(seed: int = 0, settings: dict = WARM_START, cache: Path | None = None, quiet: bool = False) -> Path:
    """Supervised imitation of the noisy teacher; returns the cached model directory (built on first use)."""
    out = warm_start_path(seed, settings, cache)
    if (out / "config.json").is_file():
        return out
    quiet_transformers()
    tokenizer = build_tokenizer()
    long = settings.get("task") == "long"
    model = build_tiny_model(tokenizer, seed, settings["hidden"], settings["layers"], settings.get("max_positions", 128))
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    problems = task.split(heldout=False, long=long)
    opt = torch.optim.AdamW(model.parameters(), lr=settings["lr"], weight_decay=0.0)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, settings["lr"], total_steps=settings["steps"], pct_start=0.1)
    model.train()
    bar = tqdm(range(settings["steps"]), desc="warm start (supervised)", disable=quiet, mininterval=1.0)
    for _ in bar:
        idx = torch.randint(len(problems), (settings["batch_size"],), generator=gen).tolist()
        batch = [problems[i] for i in idx]
        texts = [(p, task.solve(p, rng, settings["slip_prob"], first_step_only=long)) for p in batch]
        chunk = settings.get("sft_chunk")
        if chunk:  # padded in chunks of similar length (long answers span 20-295 tokens): the same gradient as
            texts.sort(key=lambda pt: len(pt[1]))  # one padded batch, without computing most of the padding
        size = chunk or len(texts)
        chunks = [sft_batch(tokenizer, texts[i:i + size]) for i in range(0, len(texts), size)]
        n_tokens = sum(int((labels != -100).sum()) for _, labels in chunks)
        opt.zero_grad(set_to_none=True)
        total = 0.0
        for ids, labels in chunks:
            loss = model(input_ids=ids, attention_mask=(ids != tokenizer.pad_token_id).long(), labels=labels).loss
            if len(chunks) > 1:  # token-weighted, as one padded batch would be
                loss = loss * int((labels != -100).sum()) / n_tokens
            loss.backward()
            total += loss.item()
        opt.step()
        sched.step()
        bar.set_postfix(loss=f"{total:.3f}", refresh=False)
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        os.replace(tmp, out)
    except OSError:  # a concurrent run finished first (out exists and is not empty): keep its copy, drop ours
        shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:  # interrupted while saving: leave no half-written folder in the cache
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def sft_batch(tokenizer, texts: list[tuple[task.Problem, str]]):
    """Right-padded (input_ids, labels) of (problem, completion) pairs for teacher-forced training; only
    completion tokens (and EOS) carry a loss."""
    prompts = tokenizer([task.prompt_text(problem) for problem, _ in texts])["input_ids"]  # batched: one call each
    completions = [c + [tokenizer.eos_token_id]
                   for c in tokenizer([completion for _, completion in texts])["input_ids"]]
    rows = [(p + c, [-100] * len(p) + c) for p, c in zip(prompts, completions)]
    width = max(len(r[0]) for r in rows)
    pad = tokenizer.pad_token_id
    ids = torch.tensor([r[0] + [pad] * (width - len(r[0])) for r in rows])
    labels = torch.tensor([r[1] + [-100] * (width - len(r[1])) for r in rows])
    return ids, labels
