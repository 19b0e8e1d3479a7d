import json
import os
import sys
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")  # one torch thread per test process, train.py subprocesses included:
import pytest  # noqa: E402  on a machine shared with another job, torch's one thread per core thrashes (issue 36:
import torch  # noqa: E402  one test file took 411 s with the default and 27 s with one thread)

torch.set_num_threads(1)

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the project's modules live at the top level

import model as models  # noqa: E402
import task  # noqa: E402
from plumbing.ddp import World  # noqa: E402

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
TINY = dict(version=1, steps=150, batch_size=32, lr=3e-3, slip_prob=0.5, hidden=64, layers=2)
# The small run most tests train: 4 prompts x 4 completions, 24 new tokens, 2 minibatches, 8 held-out problems.
SMALL_ARGS = dict(num_prompts=4, num_generations=4, max_new_tokens=24, num_minibatches=2, eval_every=2, eval_size=8,
                  lr=1e-3, warmup_steps=0, wandb_mode="disabled")
SMALL = [x for k, v in SMALL_ARGS.items() for x in (f"--{k.replace('_', '-')}", str(v))]  # the same as flags


class TwoRanks(World):
    """One of two ranks, the other rank's part given, no process group: sum adds `other_sum` (nothing when None) and
    keeps this rank's values in `mine`; gather returns both objects in rank order. For unit tests of what the
    collectives feed (a step's normalisers, gathered rows, the evaluation's sums)."""

    def __init__(self, rank: int = 0, other_sum: list[float] | None = None, other_obj=None):
        super().__init__(rank=rank, size=2)
        self.other_sum, self.other_obj, self.mine = other_sum, other_obj, None

    def sum(self, values):
        self.mine = list(values)
        return [a + b for a, b in zip(values, self.other_sum or [0.0] * len(values))]

    def gather(self, obj):
        return [obj, self.other_obj] if self.rank == 0 else [self.other_obj, obj]


def metrics_without_timing(run_dir: Path) -> list[dict]:
    """A run's metrics.jsonl rows without the perf/ (wall-clock) keys: what two equal runs must agree on."""
    return [{k: v for k, v in json.loads(line).items() if not k.startswith("perf/")}
            for line in (run_dir / "metrics.jsonl").open()]


def final_weights(run_dir: Path) -> dict:
    """The tensors a run saved in final/: the whole model, or a LoRA run's adapter."""
    from safetensors.torch import load_file

    lora = run_dir / "final" / "adapter_model.safetensors"
    return load_file(lora if lora.is_file() else run_dir / "final" / "model.safetensors")


def pytest_collection_modifyitems(items):
    """The slow tests first, in their files' order: the two workers of -n 2 share them out and the 800 quick tests fill
    the end, so that neither worker waits on a long test the other began last. Most torchrun tests (tests/plumbing/)
    come first and stay with one worker, while the other runs quick tests and then takes slow ones from the back
    (tests/tools/ and the top level's, one process each). Two other orders were tried (2026-12-07, one run each, on a
    machine whose speed moved ~20% within the hour): the slow tests longest first, 999 s of pytest on a clean clone,
    against 932 s for this order in the next run; dealt longest first to both workers at once, 838 s, against 809 s
    for this order half an hour earlier. Neither was faster."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)


@pytest.fixture(scope="session")
def tiny_policy_dir(tmp_path_factory) -> Path:
    """A tiny model after 150 supervised steps (3 s): it writes the answer format, so rewards vary within groups."""
    return models.warm_start(seed=0, settings=TINY, cache=tmp_path_factory.mktemp("cache"), quiet=True)


@pytest.fixture(scope="session")
def random_chat_model_dir(tmp_path_factory) -> Path:
    """A randomly initialised model whose tokenizer has a chat template and pad == eos, like many hub models."""
    tok = models.build_tokenizer()
    tok.chat_template = CHAT_TEMPLATE
    model = models.build_tiny_model(tok, seed=1, hidden=32, layers=2)
    tok.pad_token = tok.eos_token
    model.config.pad_token_id = tok.eos_token_id
    out = tmp_path_factory.mktemp("random_chat")
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def jsonl_dataset(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("data") / "task.jsonl"
    train, test = task.default_splits()
    task.write_jsonl(path, train[:40] + test[:10])
    return path


@pytest.fixture
def cpu():
    return torch.device("cpu")


@pytest.fixture
def float64():
    """Exact comparisons need double precision; restored after each test so other modules are unaffected."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(previous)


# torchrun from the tests (test_ddp.py, test_fsdp.py): 2 CPU processes, gloo, one thread each
TORCHRUN_SMALL = ["--num-prompts", "4", "--num-generations", "4", "--eval-size", "8", "--wandb-mode", "disabled",
                  "--num-minibatches", "2"]


def torchrun(n: int, script: str, argv: list[str], **kw):
    import subprocess

    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(n), "--standalone",
                             script, *argv], cwd=Path(__file__).resolve().parents[1], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)


def finish(proc, timeout: float = 300) -> tuple[int, str, str]:
    """Wait for a torchrun job; past `timeout` seconds (a hang) kill it and its workers, then raise TimeoutExpired."""
    import signal
    import subprocess

    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        for pid in children(proc.pid) + [proc.pid]:  # its workers too: torchrun killed alone leaves them running
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        proc.communicate()
        raise
    return proc.returncode, out, err


def children(parent: int) -> list[int]:
    """The processes whose parent is `parent` (read from /proc: torchrun starts its workers in sessions of their own,
    so a process group misses them)."""
    found = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            if int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1]) == parent:
                found.append(int(proc.name))
        except (OSError, ValueError, IndexError):
            continue
    return found
