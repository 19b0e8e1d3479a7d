"""What a run trusts (issue 40): a checkpoint or model folder someone hands you runs no code on your machine, and
no secret from the environment reaches the files a run writes."""

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from plumbing import checkpoint
import model as models
import train
from conftest import SMALL
from test_bad_input import refused


class RunsCode:
    """Unpickling this runs a shell command (what a malicious state.pt or pytorch_model.bin would carry)."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def checkpointed_run(tmp_path, tiny_policy_dir):
    """A one-step run with a checkpoint; returns its flags (without the step count) and the checkpoint."""
    argv = ["--model", str(tiny_policy_dir), "--output-dir", str(tmp_path), *SMALL]
    train.main(argv + ["--save-every", "1", "--total-steps", "1"])
    return argv, tmp_path / "gspo-s0" / "checkpoints" / "step-000001"


def test_a_state_pt_that_would_run_code_is_refused_in_one_line(tmp_path, capsys, tiny_policy_dir):
    argv, ckpt = checkpointed_run(tmp_path, tiny_policy_dir)
    state = torch.load(ckpt / "state.pt", weights_only=True)  # this trainer's own checkpoints load safely
    marker = tmp_path / "ran"
    torch.save({**state, "evil": RunsCode(marker)}, ckpt / "state.pt")
    capsys.readouterr()
    line = refused(argv + ["--resume", str(ckpt), "--run-name", "continued", "--total-steps", "2"], capsys, tmp_path,
                   "could run code when loaded")
    assert "--convert-trusted" in line and not marker.exists()


def test_an_older_checkpoint_converts_once_trusted_and_resumes(tmp_path, capsys, tiny_policy_dir):
    """Checkpoints written before this change hold numpy RNG arrays: refused as they are, and `python -m plumbing.checkpoint
    --convert-trusted` turns one into the safe form, after which the resume goes on."""
    argv, ckpt = checkpointed_run(tmp_path, tiny_policy_dir)
    state = torch.load(ckpt / "state.pt", weights_only=True)
    for rng in checkpoint.rank_rngs(state):  # as the old code saved it: np.random.get_state() itself
        kind, keys, pos, has_gauss, gauss = rng["numpy"]
        rng["numpy"] = (kind, keys.numpy().astype("uint32"), pos, has_gauss, gauss)
    torch.save(state, ckpt / "state.pt")
    with pytest.raises(checkpoint.CheckpointError, match="holds objects other than tensors"):
        checkpoint.load_state(ckpt)
    checkpoint.convert_trusted(ckpt)
    assert checkpoint.load_state(ckpt)["step"] == 1


def test_rng_state_round_trips_exactly():
    gen = torch.Generator().manual_seed(3)
    saved = checkpoint.rng_state(gen)
    import numpy as np
    import random

    draws = (random.random(), np.random.rand(), torch.rand(1).item(), torch.rand(1, generator=gen).item())
    checkpoint.restore_rng(saved, gen)
    assert (random.random(), np.random.rand(), torch.rand(1).item(), torch.rand(1, generator=gen).item()) == draws


def test_a_model_folder_that_needs_its_own_code_is_refused(tmp_path, capsys, tiny_policy_dir):
    folder = tmp_path / "custom"
    shutil.copytree(tiny_policy_dir, folder)
    config = json.loads((folder / "config.json").read_text())
    config["auto_map"] = {"AutoModelForCausalLM": "modeling_evil.EvilForCausalLM"}
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "modeling_evil.py").write_text(f"open({str(tmp_path / 'ran')!r}, 'w')\n")
    refused(["--model", str(folder), "--output-dir", str(tmp_path / "runs"), *SMALL], capsys, tmp_path / "runs",
            "needs its own Python code to load (config.json has auto_map")
    assert not (tmp_path / "ran").exists()


def test_a_bin_only_folder_loads_through_the_safe_path_and_a_malicious_one_is_refused(tmp_path, tiny_policy_dir):
    policy, tok = models.load_model(str(tiny_policy_dir), torch.device("cpu"), torch.float32)
    folder = tmp_path / "bin"
    policy.save_pretrained(folder)  # transformers 5 writes safetensors only: make the .bin an older save would be
    torch.save(policy.state_dict(), folder / "pytorch_model.bin")
    (folder / "model.safetensors").unlink()
    tok.save_pretrained(folder)
    assert (folder / "pytorch_model.bin").is_file() and not (folder / "model.safetensors").exists()
    loaded, _ = models.load_model(str(folder), torch.device("cpu"), torch.float32)
    assert all(torch.equal(a, b) for a, b in zip(loaded.state_dict().values(), policy.state_dict().values()))
    marker = tmp_path / "ran"
    torch.save({**policy.state_dict(), "evil": RunsCode(marker)}, folder / "pytorch_model.bin")
    with pytest.raises(models.ModelError, match="could not load model"):
        models.load_model(str(folder), torch.device("cpu"), torch.float32)
    assert not marker.exists()


def test_the_wandb_key_and_tokens_never_reach_a_runs_files(tmp_path, tiny_policy_dir, monkeypatch, capsys):
    secret = "local-0123456789abcdef0123456789abcdef0123"
    monkeypatch.setenv("WANDB_API_KEY", secret)
    monkeypatch.setenv("HF_TOKEN", "hf_" + secret)
    assert SMALL[-2:] == ["--wandb-mode", "disabled"]
    train.main(["--model", str(tiny_policy_dir), "--output-dir", str(tmp_path), *SMALL[:-2], "--wandb-mode",
                "offline", "--save-every", "1", "--total-steps", "1"])
    out = capsys.readouterr()
    assert secret not in out.out + out.err
    files = [p for p in (tmp_path / "gspo-s0").rglob("*") if p.is_file()]
    assert any(p.name == "state.pt" for p in files) and any("wandb" in str(p) for p in files)
    for p in files:
        assert secret.encode() not in p.read_bytes(), p


@pytest.mark.slow
def test_a_run_with_wandb_disabled_does_not_import_wandb(tmp_path):
    """Issue 45.7: --wandb-mode disabled still imported wandb (seconds at start-up, and a dependency a user may
    not want to load)."""
    import subprocess
    import sys

    code = ("import sys; sys.path.insert(0, '.'); import train; train.main(['--total-steps', '1', '--eval-size', '4', "
            "'--num-prompts', '2', '--num-generations', '2', '--num-minibatches', '1', '--wandb-mode', 'disabled', "
            f"'--output-dir', {str(tmp_path)!r}, '--no-save-model']); print('wandb loaded:', 'wandb' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         cwd=Path(__file__).resolve().parents[2])
    assert "wandb loaded: False" in out.stdout, out.stdout[-2000:] + out.stderr[-2000:]


def test_a_shard_index_names_paths_as_any_python_pickles_them_and_nothing_else_runs():
    """DCP's index holds the checkpoint folder's path: Python 3.11 and 3.12 pickle it as pathlib.PosixPath, 3.13 as
    pathlib._local.PosixPath (seen: 3.13 refused its own checkpoints). Both load under any Python; a callable that
    is not part of an index is refused, never imported."""
    import io
    import pickle

    def loaded(module: str, name: str, arg: bytes):  # protocol 2: GLOBAL module name, BINUNICODE arg, TUPLE1, REDUCE
        stream = b"\x80\x02c" + f"{module}\n{name}\n".encode() + b"X" + len(arg).to_bytes(4, "little") + arg + b"\x85R."
        return checkpoint.Index(io.BytesIO(stream)).load()

    assert loaded("pathlib", "PosixPath", b"/tmp/run") == loaded("pathlib._local", "PosixPath", b"/tmp/run") == \
        Path("/tmp/run")
    for module, name in (("os", "system"), ("pathlib._local", "Path"), ("builtins", "eval")):
        with pytest.raises(pickle.UnpicklingError, match="is not part of a checkpoint index"):
            loaded(module, name, b"true")


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # one process, as intended
def test_fsdp_shards_round_trip_and_an_index_or_entry_that_would_run_code_is_refused(tmp_path, tiny_policy_dir):
    """--fsdp's checkpoint shards (torch.distributed.checkpoint, here written and read by one process): the weights
    and AdamW moments come back exactly; torch's own reader would unpickle a tampered index (.metadata) or a
    non-tensor entry in full and run what it carries, this project's reader refuses both in one line."""
    import pickle
    import torch.distributed.checkpoint as dcp

    def stepped(seed):
        policy = models.load_model(str(tiny_policy_dir), torch.device("cpu"), torch.float32)[0]
        optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-2)
        torch.manual_seed(seed)
        policy(input_ids=torch.randint(0, 50, (2, 6))).logits.square().mean().backward()
        optimizer.step()
        return policy, optimizer

    (policy, optimizer), (other, other_optimizer) = stepped(0), stepped(1)
    groups = checkpoint.save_shards(tmp_path / "shards", policy, optimizer)
    assert not all(torch.equal(a, b) for a, b in zip(policy.state_dict().values(), other.state_dict().values()))
    checkpoint.load_shards(tmp_path / "shards", other, other_optimizer, groups)
    assert all(torch.equal(a, b) for a, b in zip(policy.state_dict().values(), other.state_dict().values()))
    saved, loaded = optimizer.state_dict()["state"], other_optimizer.state_dict()["state"]
    assert saved.keys() == loaded.keys()
    assert all(torch.equal(saved[k][m], loaded[k][m]) for k in saved for m in saved[k])

    marker = tmp_path / "ran"
    index = tmp_path / "shards" / ".metadata"
    metadata = pickle.loads(index.read_bytes())
    metadata.storage_meta = RunsCode(marker)
    index.write_bytes(pickle.dumps(metadata))
    with pytest.raises(checkpoint.CheckpointError, match="is not an index of tensors this trainer wrote"):
        checkpoint.load_shards(tmp_path / "shards", other, other_optimizer, groups)
    assert not marker.exists()

    weights = dict(policy.state_dict())
    weights["model.norm.weight"] = RunsCode(marker)  # DCP stores a non-tensor as a pickle, read back in full
    dcp.save({"model": weights}, checkpoint_id=tmp_path / "bytes")
    with pytest.raises(checkpoint.CheckpointError, match="model.model.norm.weight.*could run code"):
        checkpoint.load_shards(tmp_path / "bytes", other, other_optimizer, groups)
    assert not marker.exists()

    (shard,) = (tmp_path / "bytes").glob("*.distcp")
    shard.write_bytes(shard.read_bytes()[:100])  # truncated
    with pytest.raises(checkpoint.CheckpointError, match="cannot be read"):
        checkpoint.load_shards(tmp_path / "bytes", other, other_optimizer, groups)


def test_exporting_shards_whose_config_names_its_own_code_is_refused_before_reading(tmp_path):
    """--export reads a checkpoint's model/ as every model folder is read: a config with auto_map is refused."""
    model = tmp_path / "step" / "model"
    model.mkdir(parents=True)
    (model / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 8, "intermediate_size": 16,
                                                 "num_hidden_layers": 1, "num_attention_heads": 1, "vocab_size": 16,
                                                 "auto_map": {"AutoModel": "evil.Model"}}))
    with pytest.raises(models.ModelError, match="needs its own Python code"):
        checkpoint.export(tmp_path / "step", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_tokenizer_config_that_maps_to_its_own_code_is_refused(tmp_path):
    """The tokenizer's config can name code too (auto_map in tokenizer_config.json): refused like the model's."""
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"auto_map": {"AutoTokenizer": ["evil.Tok", None]}}))
    with pytest.raises(models.ModelError, match=r"needs its own Python code to load \(tokenizer_config.json has "
                                                r"auto_map: AutoTokenizer\)"):
        models.refuse_custom_code(tmp_path)
