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


SLOW_SECONDS = Path(__file__).parent / "slow_seconds.json"  # each slow test's seconds, as last measured


def pytest_addoption(parser):
    parser.addoption("--record-slow-seconds", action="store_true",
                     help=f"write the seconds of each slow test that ran (its call) into {SLOW_SECONDS.name}, "
                          "keeping the others' entries")


def pytest_collection_modifyitems(config, items):
    """The slow tests first, longest first (run_order), then the quick ones."""
    seconds = json.loads(SLOW_SECONDS.read_text()) if SLOW_SECONDS.is_file() else {}
    items[:] = run_order(items, lambda item: item.get_closest_marker("slow") is not None, seconds)


def run_order(items: list, is_slow, seconds: dict) -> list:
    """The slow tests first, longest first by their measured seconds (keyed by node id; one not measured yet counts as
    the longest), then the quick ones, each kind in its files' order otherwise. Under -n 2, xdist's worksteal hands
    each worker one half of this list, and a worker that runs out takes the back half of the other's queue: one
    works through the long tests while the other runs quick ones, then takes slow ones from the short end, so neither
    is left alone at the end with a long test (measured before, with the slow tests in their files' order: the full
    suite on 2 cores lost 34 s of its 878 that way). Dealing the long tests to both workers at once was measured once
    too (838 s against 809 s, within this machine's spread) and not kept."""
    def key(item):
        node = getattr(item, "nodeid", item)
        return (0, -seconds.get(node, float("inf"))) if is_slow(item) else (1, 0)
    return sorted(items, key=key)  # (stable)


@pytest.hookimpl(trylast=True)
def pytest_runtest_logreport(report):
    """--record-slow-seconds: each slow test's call (on the controller under xdist, which receives every worker's
    reports; a session fixture's set-up is paid once per worker whatever the order, and would land on whichever test
    came first)."""
    if RECORD is not None and report.when == "call" and "slow" in report.keywords:
        RECORD[report.nodeid] = report.duration


RECORD: dict | None = None


def pytest_configure(config):
    global RECORD
    if config.getoption("record_slow_seconds") and not hasattr(config, "workerinput"):
        RECORD = {}


def pytest_sessionfinish(session):
    if RECORD:
        seconds = json.loads(SLOW_SECONDS.read_text()) if SLOW_SECONDS.is_file() else {}
        seconds.update({k: round(v, 1) for k, v in RECORD.items()})
        SLOW_SECONDS.write_text(json.dumps(dict(sorted(seconds.items())), indent=0) + "\n")


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
    out, err = proc.communicate(timeout=timeout)
    return proc.returncode, out, err
