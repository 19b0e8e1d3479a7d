"""The house: core files at the top level, plumbing and research tools in their folders, and no import cycle
(function-local imports included)."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CORE = {"train", "rollout", "losses", "rewards", "model", "task", "metrics"}
FOLDERS = ("base", "plumbing", "tools")


def project_modules() -> dict[str, Path]:
    """Dotted module name -> file: the top level's modules and the folders' (plumbing.ddp, tools.sweep, ...)."""
    found = {p.stem: p for p in ROOT.glob("*.py")}
    for folder in FOLDERS:
        for p in (ROOT / folder).rglob("*.py"):
            parts = p.relative_to(ROOT).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = p  # tools.study, tools.study.stats
    return found


def project_imports() -> dict[str, set[str]]:
    """module -> the project modules it imports anywhere in its source (top level or inside functions)."""
    modules = project_modules()
    graph = {}
    for name, path in modules.items():
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                subs = {f"{node.module}.{a.name}" for a in node.names} & set(modules)  # from plumbing import ddp
                found |= subs or {node.module}  # from losses import StepNorm
        graph[name] = (found & set(modules)) - {name}
    return graph


def cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as a path, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(node, path):
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path + [node, nxt]
            if nxt not in state and (found := visit(nxt, path + [node])):
                return found
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (found := visit(start, [])):
            return found
    return None


def test_no_import_cycle():
    graph = project_imports()
    assert CORE | {"base.errors", "plumbing.flags", "plumbing.lifecycle", "base.network"} <= set(graph)
    assert cycle(graph) is None, " -> ".join(cycle(graph))


def test_the_cycle_finder_finds_one():
    assert cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) is not None
    assert cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None
    assert {"model", "train"} <= project_imports()["tools.sweep"]  # function-local imports are read too


def floor(module: str) -> int:
    """The house from the ground up: base/ (what every layer needs), the core files but train.py, plumbing/ (what
    serves the loop), train.py (the loop), tools/ (research built on it)."""
    if module.startswith("base"):
        return 0
    if module in CORE - {"train"}:
        return 1
    return {"plumbing": 2, "train": 3, "tools": 4}[module.split(".")[0]]


def test_no_arrow_runs_back_up():
    """Each module imports only from its own floor or below: the ground floor imports nothing of the project, the
    core nothing of plumbing/, plumbing/ nothing of train.py or tools/, train.py nothing of tools/ (issue 46.2: the
    core imported plumbing's errors and network while plumbing imported the core, and plumbing/logs.py imported
    tools/diagnostics.py)."""
    graph = project_imports()
    up = sorted(f"{a} -> {b}" for a, targets in graph.items() for b in targets if floor(b) > floor(a))
    assert up == [], up
    assert all(graph[m] == set() for m in graph if m.startswith("base"))
    assert floor("base.errors") < floor("model") < floor("plumbing.run") < floor("train") < floor("tools.sweep")


def test_the_top_level_holds_the_design():
    """The top level is the algorithm's files; everything else is in a folder that says what it is."""
    assert {p.stem for p in ROOT.glob("*.py")} == CORE


@pytest.mark.slow
def test_the_readme_quotes_the_lines_one_rl_step_reads():
    """tools/step_lines.py runs two steps of the default run and of DAPO and counts, from each run, the core lines
    the first step executes and the first iteration of the loop followed the whole way; the README's reading order
    quotes both, which must be the measured ones (no gate on the counts themselves: code is never moved to meet one)."""
    from tools import step_lines

    (counted, whole_gspo), (counted_dapo, whole_dapo) = step_lines.both_paths("gspo"), step_lines.both_paths("dapo")
    assert set(counted) <= {"train", "rollout", "rewards", "losses"}, set(counted)
    assert "policy_loss" in counted["losses"]["functions"] and "generate" in counted["rollout"]["functions"]
    assert "dynamic_sampling" in counted_dapo["train"]["functions"] and "ratio_diagnostics" in whole_gspo["losses"][
        "functions"] and "ratio_diagnostics" not in counted["losses"]["functions"]  # the logs' own calls: whole only
    whole = {"gspo": whole_gspo, "dapo": whole_dapo}
    lines_and_files = {a: (sum(c["lines"] for c in w.values()), len(w)) for a, w in whole.items()}
    # the README's reading order quotes these numbers: they are the measured ones
    readme = " ".join((ROOT / "README.md").read_text().split())
    assert (f"is **{lines_and_files['gspo'][0]} lines in {lines_and_files['gspo'][1]} files** "
            f"({lines_and_files['dapo'][0]} for DAPO)") in readme, lines_and_files
    split = step_lines.roles(whole["gspo"], counted)
    assert sum(split.values()) == lines_and_files["gspo"][0], split  # the four roles add up to the whole path
    assert (f"Of the {lines_and_files['gspo'][0]}, {split['the step']} are the step's, {split['what it logs']} compute "
            f"what it logs") in readme and (f"{split['the loop']} are the loop around it and {split['plumbing']} are "
                                            "`plumbing/`") in readme, split
    lines = {m: c["lines"] for m, c in counted.items()}
    quoted = (f"**{sum(lines.values())} lines of these four files** (train {lines['train']}, rollout {lines['rollout']}, "
              f"losses {lines['losses']}, rewards {lines['rewards']}; ")
    assert quoted in readme, quoted
    dapo = sum(c["lines"] for c in counted_dapo.values())
    assert f"; {dapo} with DAPO's dynamic sampling)" in readme, dapo


def test_step_lines_splits_the_whole_path_by_role():
    """Each function of the whole path counts once, in one role: on the core reader's path, the step; off it, in
    plumbing/ or base/, plumbing; in metrics.py or losses.py, what the step logs; in another core file, the loop."""
    from tools import step_lines

    core = {"train": {"firsts": {10: 5}}, "losses": {"firsts": {1: 3}}, "rollout": {"firsts": {40: 9}}}
    whole = {"train": {"firsts": {10: 5, 40: 7}}, "losses": {"firsts": {1: 3, 20: 11}}, "metrics": {"firsts": {1: 2}},
             "plumbing.ddp": {"firsts": {3: 4}}, "base.errors": {"firsts": {1: 1}}, "rollout": {"firsts": {5: 6, 40: 9}}}
    assert step_lines.roles(whole, core) == {"the step": 17, "what it logs": 13, "the loop": 13, "plumbing": 5}


def test_the_folders_maps_name_what_is_there():
    """base/ and plumbing/ say in their __init__ docstring what each of their modules does: every module is named.
    lifecycle.py and flags.py open with a map (name, then what it does): every name in it exists in the module."""
    import importlib
    import re

    for folder in ("base", "plumbing"):
        doc = importlib.import_module(folder).__doc__
        modules = {p.stem for p in (ROOT / folder).glob("*.py")} - {"__init__"}
        assert modules and not {m for m in modules if not re.search(rf"\b{m}\b", doc)}, folder
    for name in ("plumbing.lifecycle", "plumbing.flags"):
        module = importlib.import_module(name)
        first_columns = re.findall(r"^ {4}(\S.*?)\s{2,}\S", module.__doc__, re.M)
        named = [t for col in first_columns for t in re.findall(r"[A-Za-z_]\w*", re.sub(r"\([^)]*\)", "", col))]
        assert len(named) >= 5 and not [t for t in named if not hasattr(module, t)], (name, named)
