"""Run by tests/plumbing/test_fsdp.py under `torchrun --nproc-per-node 2`: train.py's start-up under --fsdp, with
every call that reads a model's weights (model.load_model) recorded per rank, and each rank's host memory high-water
mark (VmHWM) at the end of start-up (when it prints its start-up lines) and at the end.

    torchrun --nproc-per-node 2 tests/plumbing/fsdp_loading.py OUT_DIR TRAIN_FLAGS...

Each rank writes OUT_DIR/rank<r>.json: the paths it loaded so far (rewritten at each load, so a rank that torchrun
stops leaves its record) and its VmHWM in bytes (`startup`, `end`: where it gets there).
"""

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import model as models  # noqa: E402
import train  # noqa: E402
from plumbing import logs  # noqa: E402

loaded, real, startup_lines, peaks = [], models.load_model, logs.startup_lines, {}


def write() -> None:
    (Path(sys.argv[1]) / f"rank{os.environ['RANK']}.json").write_text(json.dumps({"loaded": loaded, **peaks}))


def recorded(name, device, dtype):
    loaded.append(str(name))
    write()
    return real(name, device, dtype)


def high_water() -> int:
    return next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith("VmHWM"))


def at_startup_end(*args, **kwargs):
    peaks["startup"] = high_water()
    return startup_lines(*args, **kwargs)


if __name__ == "__main__":
    write()
    models.load_model, logs.startup_lines = recorded, at_startup_end
    train.main(sys.argv[2:])
    peaks["end"] = high_water()
    write()
