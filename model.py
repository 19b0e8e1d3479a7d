"""Models: pick the device, load a policy (hub id, local directory or .gguf file), or build the embedded default.

The embedded default is a 0.67M-parameter Llama with a character-level tokenizer, both plain transformers
objects: they save and load with save_pretrained / from_pretrained and go through the same code as a hub model.
Its starting policy comes from a short supervised warm start on the noisy teacher of task.py, cached on disk.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import string
from pathlib import Path

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from tqdm import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
from transformers.utils import logging as hf_logging

import task

hf_logging.disable_progress_bar()  # per-file load/save bars would bury the training log (and error lines)


class ModelError(ValueError):
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
    """bf16 where the device computes in it natively (recent CUDA GPUs), else fp32. CPU bf16 is slow and lossy."""
    if name == "auto":
        bf16 = device.type == "cuda" and torch.cuda.is_bf16_supported()
        return torch.bfloat16 if bf16 else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


# ---------------------------------------------------------------------------------------------------------------
# The embedded tokenizer and model
# ---------------------------------------------------------------------------------------------------------------


def build_tokenizer() -> PreTrainedTokenizerFast:
    """A character-level tokenizer (printable ASCII, with <answer> and </answer> as single tokens)."""
    specials = ["<pad>", "<eos>", "<unk>"]
    pieces = specials + [task.ANSWER_OPEN, task.ANSWER_CLOSE] + list(string.printable[:-5])  # no \t\r\x0b\x0c
    tok = Tokenizer(models.WordLevel({p: i for i, p in enumerate(pieces)}, unk_token="<unk>"))
    # Each tag is one piece, every other character is its own piece; Fuse joins pieces back without spaces.
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"</?answer>|[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>", padding_side="left"
    )


def build_tiny_model(tokenizer, seed: int = 0, hidden: int = 128, layers: int = 4) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=128,
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
    kwargs, source = {}, name
    if name.startswith(("/", ".", "~")) and not Path(name).expanduser().exists():
        raise ModelError(f"model path {name} does not exist; pass a model directory, a .gguf file or a hub id")
    if name.endswith(".gguf"):
        path = Path(name)
        if not path.is_file():
            raise ModelError(f"GGUF file {name} does not exist; pass the path to a .gguf model file")
        source, kwargs = str(path.parent), {"gguf_file": path.name}
    elif Path(name).exists() and not (Path(name) / "config.json").is_file():
        raise ModelError(f"{name} is not a model directory (no config.json); pass a save_pretrained directory")
    try:
        tokenizer = AutoTokenizer.from_pretrained(source, **kwargs)
        model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype, **kwargs)
    except Exception as e:  # loaders raise many types (OSError, ValueError, ImportError, ...); all mean "cannot load"
        first = str(e).strip().splitlines()[0][:300] if str(e).strip() else type(e).__name__
        raise ModelError(f"could not load model {name!r}: {first}")
    return prepare(model, tokenizer, device)


def prepare(model, tokenizer, device: torch.device):
    """Left padding for generation, a pad token, and an EOS the verifier can rely on."""
    if tokenizer.eos_token_id is None:
        raise ModelError("the tokenizer has no EOS token; completions could never end. Use a model with one")
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token  # pad == eos: rollout.py keeps the first EOS in the mask
    tokenizer.padding_side = "left"
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    return model.to(device), tokenizer


def format_prompt(tokenizer, prompt: str) -> str:
    """A model with a chat template gets the prompt as a user turn; the embedded model sees the bare prompt."""
    if getattr(tokenizer, "chat_template", None):
        messages = [{"role": "user", "content": f"{prompt}\n{task.INSTRUCTION}"}]
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return prompt


# ---------------------------------------------------------------------------------------------------------------
# Warm start: the embedded default's starting policy
# ---------------------------------------------------------------------------------------------------------------

WARM_START = dict(version=1, steps=600, batch_size=64, lr=1e-3, slip_prob=0.6, hidden=128, layers=4)


def cache_root() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "grpo-family"


def warm_start(seed: int = 0, settings: dict = WARM_START, cache: Path | None = None, quiet: bool = False) -> Path:
    """Supervised imitation of the noisy teacher; returns the cached model directory (built on first use).

    The cache key is a hash of the settings and the seed, so a changed recipe never reuses a stale policy.
    """
    key = hashlib.sha256(json.dumps({**settings, "seed": seed}, sort_keys=True).encode()).hexdigest()[:12]
    out = (cache or cache_root()) / f"warm-start-{key}"
    if (out / "config.json").is_file():
        return out
    tokenizer = build_tokenizer()
    model = build_tiny_model(tokenizer, seed, settings["hidden"], settings["layers"])
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    problems = task.split(heldout=False)
    opt = torch.optim.AdamW(model.parameters(), lr=settings["lr"], weight_decay=0.0)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, settings["lr"], total_steps=settings["steps"], pct_start=0.1)
    model.train()
    bar = tqdm(range(settings["steps"]), desc="warm start (supervised)", disable=quiet, mininterval=1.0)
    for _ in bar:
        idx = torch.randint(len(problems), (settings["batch_size"],), generator=gen).tolist()
        batch = [problems[i] for i in idx]
        ids, labels = sft_batch(tokenizer, batch, rng, settings["slip_prob"])
        loss = model(input_ids=ids, attention_mask=(ids != tokenizer.pad_token_id).long(), labels=labels).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        bar.set_postfix(loss=f"{loss.item():.3f}", refresh=False)
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    try:
        os.replace(tmp, out)
    except OSError:  # a concurrent run finished first (out exists and is not empty): keep its copy, drop ours
        shutil.rmtree(tmp)
    return out


def sft_batch(tokenizer, problems, rng: random.Random, slip_prob: float):
    """Right-padded (input_ids, labels) for teacher-forced training; only completion tokens carry a loss."""
    rows = []
    for terms in problems:
        p = tokenizer(task.prompt_text(terms))["input_ids"]
        c = tokenizer(task.solve(terms, rng, slip_prob))["input_ids"] + [tokenizer.eos_token_id]
        rows.append((p + c, [-100] * len(p) + c))
    width = max(len(r[0]) for r in rows)
    pad = tokenizer.pad_token_id
    ids = torch.tensor([r[0] + [pad] * (width - len(r[0])) for r in rows])
    labels = torch.tensor([r[1] + [-100] * (width - len(r[1])) for r in rows])
    return ids, labels
