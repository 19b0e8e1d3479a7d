"""The house: the project's modules import each other without a cycle (function-local imports included)."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def project_imports() -> dict[str, set[str]]:
    """module -> the project modules it imports anywhere in its source (top level or inside functions)."""
    modules = {p.stem for p in ROOT.glob("*.py")}
    graph = {}
    for name in modules:
        found = set()
        for node in ast.walk(ast.parse((ROOT / f"{name}.py").read_text())):
            if isinstance(node, ast.Import):
                found |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                found.add(node.module.split(".")[0])
        graph[name] = (found & modules) - {name}
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
    assert {"train", "losses", "guards", "model", "task", "network"} <= set(graph)
    assert cycle(graph) is None, " -> ".join(cycle(graph))


def test_the_cycle_finder_finds_one():
    assert cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) is not None
    assert cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None
    assert {"model"} <= project_imports()["guards"]  # function-local imports are read too


def test_readme_objectives_table_matches_the_presets():
    """The preset values live in losses.PRESETS; the README's table restates them, so it is checked here."""
    import losses

    rows = {}
    for line in (ROOT / "README.md").read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split(" | ")]
        if len(cells) == 8 and cells[0].startswith("`") and cells[0].strip("`") in losses.PRESETS:
            rows[cells[0].strip("`")] = cells
    assert set(rows) == set(losses.PRESETS)
    for name, cfg in losses.PRESETS.items():
        _, _, _, eps, _, agg, beta, _ = rows[name]
        assert agg == f"`{cfg.loss_agg_mode}`", name
        assert float(beta) == cfg.beta, name
        if cfg.surrogate != "sapo":  # SAPO's clip range is unused; its cell names the temperatures
            low, high = (float(x.split()[0]) for x in eps.split(" / "))
            assert (low, high) == (cfg.epsilon, cfg.epsilon_high), name
        else:
            assert f"τ {cfg.sapo_tau_pos:g} / {cfg.sapo_tau_neg:g}" in eps
