"""Checkpoints: atomic saves, the last K kept, and what an exact resume needs.

A checkpoint is a folder <run>/checkpoints/step-NNNNNN/ holding
    model/      the policy (or, under LoRA, its adapter) and tokenizer (save_pretrained); under --fsdp the config
                and tokenizer only, the weights being in shards/
    state.pt    optimizer, scheduler, every RNG state (python, numpy, torch, the minibatch generator) of every
                rank, the step, the prompt cursor, the run's config, its wandb id and the 'before' evaluation.
    shards/     under --fsdp: a torch.distributed.checkpoint folder of the weights and AdamW's moments, each rank
                writing its own shards (nothing is gathered); it loads at any number of processes, resharded, and
                `python -m plumbing.checkpoint --export STEP OUT` makes it a model folder.
It is written under a temporary name and renamed into place, so a kill mid-save leaves the previous checkpoint
as the latest one. Restoring all of the above makes a resumed run repeat the uninterrupted one exactly (same
machine, CPU). Nothing in it runs code when loaded: state.pt loads with weights_only, shards/ through a reader
that admits only tensors and the index's own classes (safe_reader).
"""

from __future__ import annotations

import json
import os
import pickle
import random
import shutil
import zipfile
from pathlib import Path

import numpy as np
import torch

import model as models
from base.errors import UserError

# Flags that may change across a resume without changing what the run computes.
HARMLESS = {"total_steps", "eval_every", "eval_size", "output_dir", "run_name", "wandb_mode", "wandb_project",
            "wandb_group", "wandb_tags", "save_every", "keep_checkpoints", "resume", "save_model", "overwrite",
            "device", "max_nonfinite_steps", "micro_batch_size", "max_sampling_rounds", "eval_samples",
            "merge_lora", "gradient_checkpointing", "log_study_metrics", "log_completions_every"}


# Settings newer than some checkpoints, with the value every run before them computed with (VESPO's kernel: no
# earlier objective read it): a checkpoint without the key resumes where the run keeps that value.
ADDED_SINCE = {"vespo_k_pos": 2.0, "vespo_lambda_pos": 3.0, "vespo_k_neg": 3.0, "vespo_lambda_neg": 2.0}


class CheckpointError(UserError, ValueError):
    """A checkpoint that cannot be resumed from; the message says why and what to do."""


def rng_state(gen: torch.Generator) -> dict:
    """Every RNG stream, as tensors, numbers, strings, lists and tuples only (state.pt loads with weights_only)."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    return {"python": random.getstate(), "numpy": (kind, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, gauss),
            "torch": torch.get_rng_state(), "generator": gen.get_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
            "mps": torch.mps.get_rng_state() if torch.backends.mps.is_available() else None}  # a Mac's GPU samples too


def restore_rng(state: dict, gen: torch.Generator) -> None:
    random.setstate(state["python"])
    kind, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss, gauss))
    torch.set_rng_state(state["torch"])
    gen.set_state(state["generator"])
    if state["cuda"] is not None and torch.cuda.is_available():  # one per GPU of the machine that saved it: this
        for i, cuda in enumerate(state["cuda"][:torch.cuda.device_count()]):  # one may have fewer
            torch.cuda.set_rng_state(cuda, i)
    if state.get("mps") is not None and torch.backends.mps.is_available():  # (checkpoints before 2026-12-06 have none)
        torch.mps.set_rng_state(state["mps"])


def path_of(root: Path, step: int) -> Path:
    return root / f"step-{step:06d}"


def temp_path(root: Path, step: int) -> Path:
    """Where step-NNNNNN is written before it is renamed into place (the same name on every rank)."""
    return root / f".tmp-step-{step:06d}"


def save(root: Path, step: int, policy, tokenizer, state: dict, keep: int, sharded: bool = False) -> Path:
    """Write step-NNNNNN atomically (temp folder + rename) and delete all but the newest `keep`. `sharded`: every
    rank has written its shards into the temp folder already (save_shards); model/ gets the config only."""
    root.mkdir(parents=True, exist_ok=True)
    final, tmp = path_of(root, step), temp_path(root, step)
    if sharded:  # what export needs to make the shards a model folder as final/ is: its class, dtype, sampling
        policy.config.save_pretrained(tmp / "model")
        models.published_generation_config(policy).save_pretrained(tmp / "model")
        models.name_in_config(tmp / "model", policy, dtype=str(models.published_dtype(policy)).removeprefix("torch."))
    else:
        shutil.rmtree(tmp, ignore_errors=True)
        models.save_pretrained(policy, tmp / "model")
    tokenizer.save_pretrained(tmp / "model")
    torch.save(state, tmp / "state.pt")
    if final.exists():  # saving the same step again (a stop right after a periodic save)
        shutil.rmtree(final)
    os.replace(tmp, final)
    for old in all_checkpoints(root)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


# ---------------------------------------------------------------------------------------------------------------
# --fsdp: each rank writes and reads its own shards (torch.distributed.checkpoint), and nothing in them runs code
# ---------------------------------------------------------------------------------------------------------------

# What a shards/.metadata index is made of (torch 2.6-2.13), besides dtypes: DCP's dataclasses, torch.Size, layouts,
# the folder's path.
INDEX_CLASSES = {("torch.distributed.checkpoint.metadata", name) for name in (
    "Metadata", "MetadataIndex", "StorageMeta", "TensorProperties", "TensorStorageMetadata", "ChunkStorageMetadata",
    "BytesStorageMetadata", "_MEM_FORMAT_ENCODING")} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"),
    ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"), ("pathlib", "WindowsPath")}


class Index(pickle.Unpickler):
    """Unpickles a shards/.metadata index admitting only INDEX_CLASSES and dtypes: anything else is an
    UnpicklingError, never an import or a call. Python 3.13 pickles a path under pathlib._local (3.11 and 3.12
    under pathlib): read as pathlib's, so an index written by one Python loads under the others."""

    def find_class(self, module: str, name: str):
        module = "pathlib" if module == "pathlib._local" else module
        dtype = module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        if (module, name) not in INDEX_CLASSES and not dtype:
            raise pickle.UnpicklingError(f"{module}.{name} is not part of a checkpoint index")
        return super().find_class(module, name)


def save_shards(folder: Path, model: torch.nn.Module, optimizer) -> list[dict]:
    """Every rank writes its shards of the weights and of AdamW's moments into `folder` (tensors only); returns
    AdamW's param_groups (plain data, for state.pt)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    optim = get_optimizer_state_dict(model, optimizer)  # {"state": {name: {step, exp_avg, exp_avg_sq}}, ...}
    dcp.save({"model": get_model_state_dict(model), "optim": optim["state"]}, checkpoint_id=folder)
    return optim["param_groups"]


def load_shards(folder: Path, model: torch.nn.Module, optimizer=None, param_groups: list[dict] | None = None) -> None:
    """save_shards' folder into a model sharded over any number of processes (each rank reads the parts of the
    tensors it holds) and its AdamW (None: the weights only); every rank calls it. Outside torchrun, one process
    reads every shard into an ordinary model (export)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.state_dict import (get_model_state_dict, set_model_state_dict,
                                                         set_optimizer_state_dict)

    class TensorsOnly(DefaultLoadPlanner):
        def load_bytes(self, read_item, value):  # DCP unpickles non-tensor entries in full: refused, not read
            raise CheckpointError(f"{folder} holds an entry that is not a tensor ({read_item.dest_index.fqn}), "
                                  "which could run code when loaded, so it was not loaded")

    reader = safe_reader(folder)
    saved = reader.read_metadata().state_dict_metadata  # moments exist only for parameters that were stepped
    weights = get_model_state_dict(model)
    moments = {name: {"step": torch.zeros(()), "exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p)}
               for name, p in model.named_parameters() if optimizer is not None and f"optim.{name}.exp_avg" in saved}
    try:
        dcp.load({"model": weights, "optim": moments}, storage_reader=reader, planner=TensorsOnly())
    except dcp.api.CheckpointException as e:  # what failed on which rank (every rank raises it)
        first = next((failure[0] for failure in e.failures.values()), e)
        if isinstance(first, CheckpointError):
            raise first from None
        reason = (str(first).strip().splitlines() or ["no details"])[0][:160]
        raise CheckpointError(f"{folder} cannot be read ({type(first).__name__}: {reason}); "
                              f"{earlier_hint(folder.parent)}") from None
    set_model_state_dict(model, weights)
    if optimizer is not None:
        set_optimizer_state_dict(model, optimizer, {"state": moments, "param_groups": param_groups})


def safe_reader(folder: Path):
    """A reader of shards/ that runs no code (built on first use: DCP takes ~1 s to import; only --fsdp needs it)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

    class SafeReader(dcp.FileSystemReader):
        """torch's FileSystemReader, but the index is unpickled admitting only INDEX_CLASSES (torch's own reader
        unpickles it in full, which could run code); the tensors themselves load with weights_only, as in torch."""

        def read_metadata(self, *args, **kwargs):
            path = Path(self.path) / ".metadata"
            try:
                with path.open("rb") as f:
                    metadata = Index(f).load()
                if not isinstance(metadata, Metadata):
                    raise TypeError(f"it holds a {type(metadata).__name__}")
            except (pickle.UnpicklingError, EOFError, AttributeError, ValueError, TypeError, OSError) as e:
                raise CheckpointError(f"{path} is not an index of tensors this trainer wrote ({e}), so it was not "
                                      f"loaded; {earlier_hint(Path(self.path).parent)}") from None
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return SafeReader(folder)


def all_checkpoints(root: Path) -> list[Path]:
    return sorted(p for p in root.glob("step-*") if p.is_dir()) if root.is_dir() else []


def find(resume: str, run_dir: Path) -> Path | None:
    """The checkpoint folder that --resume names: 'auto' (the run's latest, or None), a checkpoint, or a run."""
    if resume == "auto":
        found = all_checkpoints(run_dir / "checkpoints")
        return found[-1] if found else None
    path = Path(resume)
    if path.is_file() and path.parent.name.startswith("step-"):
        raise CheckpointError(f"--resume {resume} is a file inside a checkpoint; pass the checkpoint folder "
                              f"{path.parent}")
    if not path.exists():
        raise CheckpointError(f"--resume {resume}: no such checkpoint; pass a checkpoints/step-NNNNNN folder, "
                              "a run folder, or 'auto'")
    if (path / "checkpoints").is_dir():  # a run folder: its latest checkpoint
        found = all_checkpoints(path / "checkpoints")
        if not found:
            raise CheckpointError(f"--resume {resume}: the run has no checkpoints (train with --save-every N)")
        return found[-1]
    return path


def earlier_hint(path: Path) -> str:
    """What to do when the checkpoint at `path` cannot be used: the others beside it, or starting again."""
    others = [str(p) for p in all_checkpoints(path.parent) if p != path]
    return (f"resume from another checkpoint with --resume {others[-1]}" if others else
            "no other checkpoint here: start again with --overwrite (or another --run-name)")


def load_state(path: Path) -> dict:
    """state.pt of a checkpoint, with a one-line error for a missing, truncated or corrupt file."""
    hint = earlier_hint(path)
    model = path / "model"  # a whole model (config.json) or, under LoRA, its adapter (adapter_config.json)
    if not (path / "state.pt").is_file() or not any((model / f).is_file() for f in ("config.json", "adapter_config.json")):
        raise CheckpointError(f"{path} is not a complete checkpoint (state.pt or model/ missing); {hint}")
    try:  # weights_only: tensors and plain data only; a pickle that would run code is refused, not run
        state = torch.load(path / "state.pt", map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        if "weights only" not in str(e).lower() or not zipfile.is_zipfile(path / "state.pt"):  # not what torch.save
            raise CheckpointError(f"{path}/state.pt is truncated or corrupt ({type(e).__name__}); {hint}")  # writes
        raise CheckpointError(f"{path}/state.pt holds objects other than tensors and plain data, which could run code "
                              "when loaded, so it was not loaded (checkpoints of this trainer before 2026-12-02 hold "
                              "numpy arrays); if you trust its source, convert it with `python -m plumbing.checkpoint "
                              f"--convert-trusted {path}`, else {hint}")
    except (RuntimeError, EOFError, zipfile.BadZipFile, OSError) as e:
        raise CheckpointError(f"{path}/state.pt is truncated or corrupt ({type(e).__name__}); {hint}")
    if not isinstance(state, dict) or "step" not in state or "config" not in state:
        raise CheckpointError(f"{path}/state.pt is not a checkpoint of this trainer; {hint}")
    if state.get("sharded") and not (path / "shards" / ".metadata").is_file():
        raise CheckpointError(f"{path} is not a complete checkpoint (--fsdp's shards/ missing); {hint}")
    return state


def compare_configs(saved: dict, current: dict, path: Path | None = None) -> list[str]:
    """Refuse a resume that changes what the run computes, naming how to train from the checkpoint's weights with
    the new settings instead; return the harmless changes, for the log."""
    changed = sorted(k for k in set(saved) | set(current) if saved.get(k, ADDED_SINCE.get(k)) != current.get(k))
    meaningful = [k for k in changed if k not in HARMLESS]
    if meaningful:
        diffs = ", ".join(f"{k}: {saved.get(k)!r} -> {current.get(k)!r}" for k in meaningful)
        raise CheckpointError(f"cannot resume: the checkpoint's run differs in {diffs}; use the original flags to "
                              f"resume it{new_run_from(path)}; or start a new run with another --run-name")
    return [f"{k}: {saved.get(k)!r} -> {current.get(k)!r}" for k in changed if k != "resume"]


def new_run_from(path: Path | None) -> str:
    """How a new run starts from a checkpoint's weights with other settings (AdamW's moments and the schedule start
    afresh): its model/ folder, or under --fsdp (model/ holds no weights) the folder --export writes. A LoRA
    checkpoint's model/ is an adapter, which --model does not take: nothing."""
    if path is None:
        return ""
    fresh = "(a new run: AdamW's moments and the learning-rate schedule start afresh)"
    if (path / "model" / "config.json").is_file() and any((path / "model").glob("*.safetensors")):
        return f"; to train from its weights with these settings, replace --resume with --model {path / 'model'} " \
            + fresh
    if (path / "shards" / ".metadata").is_file():
        return (f"; to train from its weights with these settings, write them out (`python -m plumbing.checkpoint "
                f"--export {path} OUT`) and replace --resume with --model OUT {fresh}")
    return ""


def rank_rngs(state: dict) -> list[dict]:
    """The RNG states of every rank, in rank order (a checkpoint from before data parallel holds one, as "rng")."""
    return state["rng_ranks"] if "rng_ranks" in state else [state["rng"]]


def check_world_size(state: dict, world_size: int, path: Path) -> None:
    """A checkpoint holds one RNG state per process; an exact resume needs the same number of processes. A sharded
    one (--fsdp) resumes at any number: the same weights and optimizer state, resharded (restore)."""
    saved = len(rank_rngs(state))
    if saved != world_size and not state.get("sharded"):
        how = "python train.py" if saved == 1 else f"torchrun --nproc-per-node {saved} train.py"
        raise CheckpointError(f"{path} was written by {saved} process{'es' if saved > 1 else ''}, this run has "
                              f"{world_size}; resume it with `{how} ...`")


def restore(state: dict, optimizer, scheduler, gen: torch.Generator, stream, rank: int = 0,
            sharded_model=None, path: Path | None = None) -> tuple[int, float]:
    """Put optimizer, scheduler, this rank's RNG streams and the prompt cursor back; returns (first step, minutes
    already spent). A sharded checkpoint at `path` puts back the weights and AdamW moments of `sharded_model`'s
    shards too; at another number of processes a rank without a saved RNG state keeps its fresh seed (the run goes
    on from the same weights and optimizer state, not as the uninterrupted run would)."""
    if state.get("sharded"):
        load_shards(path / "shards", sharded_model, optimizer, state["optimizer"]["param_groups"])
    else:
        optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    if rank < len(rank_rngs(state)):
        restore_rng(rank_rngs(state)[rank], gen)
    stream.cursor = state["cursor"]
    return state["step"] + 1, state.get("minutes", 0.0)


def keep_steps_up_to(path: Path, step: int) -> None:
    """A killed run may have logged steps after its last checkpoint (metrics.jsonl, the completions' files): the lines
    of later steps go, since the resumed run logs those steps again."""
    if path.is_file():
        lines = [line for line in path.open() if json.loads(line)["step"] <= step]
        path.write_text("".join(lines))


def convert_trusted(path: Path) -> None:
    """Rewrite an older checkpoint's state.pt (numpy RNG arrays) in the form that loads with weights_only. This
    unpickles the file in full: only for a checkpoint whose source you trust."""
    state = torch.load(path / "state.pt", map_location="cpu", weights_only=False)
    for rng in rank_rngs(state):
        kind, keys, pos, has_gauss, gauss = rng["numpy"]
        rng["numpy"] = (kind, torch.from_numpy(np.asarray(keys).astype(np.int64)), pos, has_gauss, gauss)
    torch.save(state, path / "state.pt.tmp")
    torch.load(path / "state.pt.tmp", map_location="cpu", weights_only=True)  # it loads safely now
    os.replace(path / "state.pt.tmp", path / "state.pt")


def export(path: Path, out: Path) -> None:
    """A --fsdp checkpoint's weights as an ordinary model folder (what final/ is at the end of a run), read from
    its shards by one process: for evaluating or sampling from a step of a sharded run."""
    import warnings

    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    models.refuse_custom_code(path / "model")  # as every model folder this trainer reads: no auto_map, no code
    config = AutoConfig.from_pretrained(path / "model", trust_remote_code=False)
    dtype = config.dtype if isinstance(config.dtype, torch.dtype) else getattr(torch, config.dtype or "float32")
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with warnings.catch_warnings():  # DCP's "no process group: assuming a single process", which is the intent
        warnings.simplefilter("ignore", UserWarning)
        load_shards(path / "shards", model)
    if (path / "model" / "generation_config.json").is_file():
        model.generation_config = GenerationConfig.from_pretrained(path / "model")
    tmp = out.with_name(f".tmp-{out.name}")
    shutil.rmtree(tmp, ignore_errors=True)
    model.to(dtype).save_pretrained(tmp)  # in the model's own dtype, as final/
    AutoTokenizer.from_pretrained(path / "model").save_pretrained(tmp)
    models.readable_as_config(tmp)
    os.replace(tmp, out)


def main(argv: list[str] | None = None) -> None:
    """`python -m plumbing.checkpoint --convert-trusted DIR` or `--export DIR OUT`: this module's command lines."""
    import sys

    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--export"]:
        return main_export(argv[1:])
    usage = ("python -m plumbing.checkpoint --convert-trusted RUN/checkpoints/step-NNNNNN (a checkpoint you trust), "
             "or --export RUN/checkpoints/step-NNNNNN OUT (a --fsdp checkpoint as a model folder)")
    if argv in (["-h"], ["--help"]):
        print(f"usage: {usage}")
        return
    problem = (f"usage: {usage}" if len(argv) != 2 or argv[0] != "--convert-trusted" else
               f"{argv[1]} has no state.pt: pass a checkpoint folder, RUN/checkpoints/step-NNNNNN"
               if not (Path(argv[1]) / "state.pt").is_file() else None)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        sys.exit(2)
    try:
        convert_trusted(Path(argv[1]))
    except Exception as e:  # torch.load and an unexpected layout raise many types; all mean "not a checkpoint"
        print(f"error: cannot convert {argv[1]}/state.pt ({type(e).__name__}: {str(e).splitlines()[0][:160]}); "
              "it is not a checkpoint this project wrote", file=sys.stderr)
        sys.exit(2)
    print(f"converted {argv[1]}/state.pt: it loads with weights_only now")


def main_export(argv: list[str]) -> None:
    """`python -m plumbing.checkpoint --export CHECKPOINT OUT`: one `error:` line and nothing written for bad input."""
    import sys

    path, out = (Path(a) for a in argv) if len(argv) == 2 else (None, None)
    problem = ("usage: python -m plumbing.checkpoint --export RUN/checkpoints/step-NNNNNN OUT" if path is None else
               f"{out} exists: choose a new folder for the model" if out.exists() else
               f"{path} has no shards/: only a --fsdp checkpoint needs exporting (the model/ folder of any other is "
               "a model folder already)" if not (path / "shards").is_dir() else None)
    try:
        if problem is None:
            load_state(path)  # a complete checkpoint of this trainer, or one line saying why not
            export(path, out)
    except (CheckpointError, models.ModelError) as e:
        problem = str(e)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        sys.exit(2)
    print(f"wrote {out}: the weights of {path} as a model folder (--model {out} loads it)")


if __name__ == "__main__":
    main()
