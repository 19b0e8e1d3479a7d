"""Documentation consistency: what the README and docs/ restate (the presets' table, the documented commands, the
tasks' answer lengths) is checked against the code."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


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
        if cfg.surrogate == "sapo":  # SAPO's and VESPO's clip range is unused; their cells name the gate and kernel
            assert f"τ {cfg.sapo_tau_pos:g} / {cfg.sapo_tau_neg:g}" in eps
        elif cfg.surrogate == "vespo":
            assert f"k, λ {cfg.vespo_k_pos:g}, {cfg.vespo_lambda_pos:g} / {cfg.vespo_k_neg:g}, " \
                   f"{cfg.vespo_lambda_neg:g}" in eps, name
        else:
            low, high = (float(x.split()[0]) for x in eps.split(" / "))
            assert (low, high) == (cfg.epsilon, cfg.epsilon_high), name


def test_losses_docstring_table_matches_the_presets():
    """losses.py's own table (read next to the papers) restates the presets too: level, ε, aggregation, β."""
    import losses

    rows = {}
    for line in losses.__doc__.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 6 and cells[0] in losses.PRESETS:
            rows[cells[0]] = cells
    assert set(rows) == set(losses.PRESETS)
    for name, cfg in losses.PRESETS.items():
        _, level, eps, _, agg, beta, *_ = rows[name]
        assert cfg.importance_sampling_level == level and cfg.loss_agg_mode == agg and float(beta) == cfg.beta, name
        if cfg.surrogate == "vespo":
            assert eps == f"({cfg.vespo_k_pos:g}, {cfg.vespo_lambda_pos:g} / {cfg.vespo_k_neg:g}, " \
                          f"{cfg.vespo_lambda_neg:g})", name
        elif cfg.surrogate != "sapo":
            low, high = (float(x.split()[0]) for x in eps.split(" / "))
            assert (low, high) == (cfg.epsilon, cfg.epsilon_high), name


def documented_train_commands() -> list[tuple[str, list[str], int]]:
    """(where, train.py's argv, processes) for every `python train.py` / `torchrun ... train.py` line in a ```bash
    block of the README and the docs it links, in reading order, then of every other page under docs/."""
    import re
    import shlex

    readme = (ROOT / "README.md").read_text()
    docs = ["README.md"] + list(dict.fromkeys(re.findall(r"\]\((docs/[\w/.-]+\.md)\)", readme)))
    docs += sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").rglob("*.md") if str(p.relative_to(ROOT)) not in docs)
    found = []
    for doc in docs:
        for block in re.findall(r"```bash\n(.*?)```", (ROOT / doc).read_text(), re.S):
            for line in block.replace("\\\n", " ").splitlines():
                for command in line.split("&&"):
                    words = shlex.split(command, comments=True)
                    if "train.py" in words and words[0] in ("python", "torchrun"):
                        procs = int(words[words.index("--nproc-per-node") + 1]) if "--nproc-per-node" in words else 1
                        found.append((f"{doc}: {shlex.join(words)}", words[words.index("train.py") + 1:], procs))
    return found


def test_documented_commands_run_in_order_without_a_refusal(monkeypatch):
    """Issue 25: each documented training command writes a run folder no earlier one wrote (a finished run is
    refused), unless it resumes or overwrites that run on purpose."""
    import tyro

    import train

    from plumbing import run as runs

    commands = documented_train_commands()
    assert len(commands) >= 8 and any(p == 2 for _, _, p in commands)  # the README's, the docs', torchrun's
    seen = {}
    for where, argv, procs in commands:
        monkeypatch.setattr(train.ddp, "world_size", lambda procs=procs: procs)
        args = tyro.cli(train.Args, args=argv)
        folder = Path(args.output_dir) / (args.run_name or runs.default_run_name(args))
        if folder in seen and not (args.resume or args.overwrite):
            raise AssertionError(f"{where} writes {folder}, which {seen[folder]} already wrote: it would be refused")
        seen.setdefault(folder, where)


def test_default_run_names_tell_model_dataset_and_processes_apart(monkeypatch):
    import train
    from plumbing import run as runs

    def name(procs=1, **kw):
        monkeypatch.setattr(train.ddp, "world_size", lambda: procs)
        return runs.default_run_name(train.Args(**kw))

    assert name() == "gspo-s0" and name(algo="dapo", seed=3) == "dapo-s3"
    assert name(model="/tmp/cache/warm-start-5f62601e1774") == "gspo-s0"  # a warm start is the embedded model
    assert name(model="Qwen/Qwen2.5-0.5B-Instruct", dataset="data/gsm8k.jsonl") == "gspo-Qwen2.5-0.5B-Instruct-gsm8k-s0"
    assert name(model="./SmolLM2-135M-Instruct.Q4_1.gguf") == "gspo-SmolLM2-135M-Instruct.Q4_1-s0"
    assert name(model="./my-checkpoint/", dataset="embedded-long") == "gspo-my-checkpoint-embedded-long-s0"
    assert name(procs=2, dataset="openai/gsm8k", dataset_config="main") == "gspo-gsm8k-main-np2-s0"
    assert name(lora_rank=16) == "gspo-lora16-s0"  # the LoRA command of docs/reference.md lands beside the default run
    # an evaluation alone never takes a training run's folder; a run's final model is named by its run
    assert name(total_steps=0) == "eval-s0" and name(total_steps=0, model="runs/gspo-s0/final") == "eval-gspo-s0-final-s0"
    assert name(model="runs/dapo-s1/checkpoints/step-000020/model") == "gspo-step-000020-model-s0"


def test_documented_answer_lengths_are_the_tasks():
    """The tasks' answer lengths have one home (task.py); the docs quote them and are checked here."""
    import task

    for long, old in ((False, "10-55"), (True, "20-300")):
        lens = [task.completion_tokens(task.solve(p)) for p in task.split(False, long) + task.split(True, long)]
        quoted = f"{min(lens)}-{max(lens)} tokens"
        assert quoted in (ROOT / "docs/short-task.md").read_text(), quoted  # the tasks' table
        held_out = len(task.default_splits(instruct=False, long=long)[1])
        assert f"tokens, {'2-36' if long else '1-4'} subtractions | {held_out} |" in (ROOT / "docs/short-task.md").read_text()
        for f in ["README.md", "train.py", "tools/study/__init__.py", "docs/study/protocol.md", "model.py", *map(str, (ROOT / "docs").glob("*.md"))]:
            assert f"{old} tokens" not in (ROOT / f).read_text() and f"{old}-token" not in (ROOT / f).read_text(), f


def test_the_objective_flags_take_their_types_from_losses_py():
    """Issue 46.4: Args spelled the objective's Literals again, so a surrogate added to losses.Surrogate but not to
    Args was silently unreachable. Each objective flag's choices are now the LossConfig field's own type (or None:
    from the preset), and --algo's choices are the presets."""
    import typing

    import losses
    import train

    def choices(hint) -> set:  # the values a Literal allows, or the types a union allows, None left out
        if typing.get_origin(hint) is typing.Literal:
            return set(typing.get_args(hint))
        args = typing.get_args(hint)
        return set().union(*(choices(a) for a in args)) if args else {hint} - {type(None)}

    hints, own = typing.get_type_hints(train.Args), typing.get_type_hints(losses.LossConfig)
    assert typing.get_args(hints["algo"]) == tuple(losses.PRESETS)
    for f in losses.OBJECTIVE_FIELDS:
        assert choices(hints[f]) == choices(own[f]), f


def test_what_documented_commands_run_exists():
    """Issue 50.1: every `python FILE`, `python -m MODULE` and `$(python -c 'CODE')` in a ```bash block of the README
    and docs/ names a file, module and names that exist (CODE's imports resolve and each attribute it reads of them
    is there), so no documented command fails on a path that moved."""
    import ast
    import importlib
    import re
    import shlex

    checked = 0
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]:
        for block in re.findall(r"```bash\n(.*?)```", doc.read_text(), re.S):
            for code in re.findall(r"\$\(python -c '([^']*)'\)", block):
                tree, names = ast.parse(code), {}
                for node in ast.walk(tree):
                    if isinstance(node, ast.Import):
                        names.update({a.asname or a.name: importlib.import_module(a.name) for a in node.names})
                    elif isinstance(node, ast.ImportFrom):
                        module = importlib.import_module(node.module)
                        names.update({a.asname or a.name: getattr(module, a.name, None)
                                      or importlib.import_module(f"{node.module}.{a.name}") for a in node.names})
                for node in ast.walk(tree):
                    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in names:
                        assert hasattr(names[node.value.id], node.attr), f"{doc.name}: {code}"
                checked += 1
            for line in re.sub(r"\$\([^)]*\)", "X", block.replace("\\\n", " ")).splitlines():
                for command in line.split("&&"):
                    words = shlex.split(command, comments=True)
                    if len(words) > 1 and words[0] == "python":
                        if words[1] == "-m":
                            assert importlib.util.find_spec(words[2]), f"{doc.name}: {command}"
                        elif not words[1].startswith("-"):
                            assert (ROOT / words[1]).is_file(), f"{doc.name}: {command}"
                        checked += 1
    assert checked >= 15, checked


def documented_tool_commands() -> list[tuple[str, str, list[str]]]:
    """(where, module, argv) of every `python -m tools.X ...` in a ```bash block or a code span of the README and
    docs/, and in the usage lines of each tool's docstring (its --help). A one-letter placeholder (N, P, r) stands
    for a number; PATH is a name; [--flag V] is given."""
    import ast
    import re
    import shlex

    lines = []
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]:
        text = doc.read_text()
        for block in re.findall(r"```bash\n(.*?)```", text, re.S):
            lines += [(doc.name, c) for line in block.replace("\\\n", " ").splitlines() for c in line.split("&&")]
        lines += [(doc.name, c) for c in re.findall(r"`(python -m tools[^`]*)`", without_code(text))]
    for py in sorted((ROOT / "tools").rglob("*.py")):
        usage = ast.get_docstring(ast.parse(py.read_text())) or ""
        lines += [(py.name, line.split("  #")[0]) for line in usage.splitlines()]
    found = []
    for where, command in lines:
        if command.strip().startswith("python -m tools."):
            words = shlex.split(command, comments=True)
            argv = [w.strip("[]") for w in words[3:]]  # a synopsis: [--flag V] optional, one letter a number
            found.append((f"{where}: {command.strip()}", words[2], ["2" if len(w) == 1 else w for w in argv]))
    return found


def test_documented_tool_commands_parse():
    """Every documented tools command is accepted as written: its flags exist and take the values given, and the
    tool's own checks pass (memory's and the sweep's settings, and the train.py flags the sweep passes on). Two
    usage lines of tools/memory.py's --help named flags it does not have (--glibc-default) or refuses without
    --model (--entropy-bonus)."""
    from plumbing import flags
    import train
    from tools import bench, compare, memory, recipes, step_lines, sweep
    from tools.study.__main__ import StudyArgs

    parsers = {"tools.memory": memory.settings,
               "tools.bench": lambda argv: flags.parse(bench.BenchArgs, "", argv),
               "tools.recipes": lambda argv: flags.parse(recipes.RecipesArgs, "", argv),
               "tools.step_lines": lambda argv: flags.parse(step_lines.StepLinesArgs, "", argv),
               "tools.compare": lambda argv: flags.parse(compare.CompareArgs, "", argv),
               "tools.study": lambda argv: flags.parse(StudyArgs, "", argv),
               "tools.sweep": lambda argv: flags.parse(train.Args, "", sweep.settings(argv)[1])}  # and what it passes on
    commands = documented_tool_commands()
    assert {module for _, module, _ in commands} <= set(parsers) and len(commands) >= 25, commands
    for where, module, argv in commands:
        if "--help" not in argv:
            try:
                parsers[module](argv)
            except (SystemExit, Exception) as e:
                raise AssertionError(f"{where}: {type(e).__name__} {e}") from e


def without_code(markdown: str) -> str:
    """The page with its fenced code blocks removed: what is in them is code, not prose, headings or links."""
    import re

    return re.sub(r"```.*?```", "", markdown, flags=re.S)


def prose_sentences(markdown: str) -> list[str]:
    """The sentences of a markdown page as rendered: code blocks, comments, tables, headings and images left out,
    a list item its own paragraph, a link its text, backticks and bold marks dropped."""
    import re

    markdown = re.sub(r"<!--.*?-->", "", without_code(markdown), flags=re.S)
    paragraphs, lines = [], []
    for line in markdown.splitlines() + [""]:
        s = line.strip()
        if not s or s.startswith(("|", "#", "![", "- ")):
            if lines:
                paragraphs.append(" ".join(lines))
            lines = [s[2:]] if s.startswith("- ") else []
        else:
            lines.append(s)
    rendered = (re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", p).replace("`", "").replace("**", "") for p in paragraphs)
    return [s for p in rendered for s in re.split(r"(?<=[.!?])\s+(?=[A-Z(-])", p)]


def test_readme_sentences_stay_short():
    """The README is a front page: no sentence over 300 characters as rendered (a long one is split or made a list).
    The splitter itself is checked on a made-up page: a 400-character sentence is found, two short ones are not."""
    page = "Short one. " + "X" * 400 + ".\n\n```\n" + "y" * 500 + "\n```\n- a [link](" + "z" * 400 + ") item."
    assert [len(s) for s in prose_sentences(page) if len(s) > 300] == [401]
    long = [s for s in prose_sentences((ROOT / "README.md").read_text()) if len(s) > 300]
    assert not long, [s[:80] for s in long]


def test_docs_sentences_stay_readable():
    """The pages under docs/ are reference, allowed longer sentences than the README, but none over 450 characters as
    rendered. The study's summary.md is left out: its verdict rows are generated, one sentence of numbers each."""
    pages = [p for p in sorted((ROOT / "docs").rglob("*.md")) if p != ROOT / "docs" / "study" / "summary.md"]
    long = [(p.name, len(s), s[:60]) for p in pages for s in prose_sentences(p.read_text()) if len(s) > 450]
    assert len(pages) >= 7 and not long, long


def test_the_code_the_docs_name_exists():
    """Every `module.name` of this project in backticks in the README and docs/ (`losses.policy_loss`,
    `rollout.HeadLogprobs`, `plumbing.checkpoint`, ...) imports and has that attribute, so no page names a function
    that was renamed or removed. File names (`train.py`, `metrics.jsonl`) are not references."""
    import importlib
    import re

    roots = {"train", "losses", "rollout", "rewards", "model", "task", "metrics", "plumbing", "tools", "base"}
    checked, missing = 0, []
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]:
        for code in re.findall(r"`([^`\n]+)`", doc.read_text()):
            for ref in re.findall(r"\b[a-z_]+(?:\.[A-Za-z_]\w*)+", code):
                parts = ref.split(".")
                if parts[0] not in roots or parts[-1] in ("py", "jsonl", "json", "md", "png", "csv", "pt"):
                    continue
                obj = importlib.import_module(parts[0])
                for name in parts[1:]:  # an attribute, or a module of a package (plumbing.checkpoint)
                    package = hasattr(obj, "__path__") and importlib.util.find_spec(f"{obj.__name__}.{name}")
                    obj = importlib.import_module(f"{obj.__name__}.{name}") if package else getattr(obj, name, None)
                missing += [f"{doc.name}: {ref}"] if obj is None else []
                checked += 1
    assert checked >= 20 and not missing, (checked, missing)


def test_links_between_the_pages_arrive():
    """Every relative link of the README and docs/ names a file that exists and, with #anchor, a heading of that page
    (GitHub's anchor: lower case, punctuation dropped, spaces as hyphens). Checked on a made-up page first."""
    import os
    import re

    def anchors(markdown: str) -> set[str]:
        headings = re.findall(r"^#+ (.*)$", without_code(markdown), re.M)
        return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}

    assert anchors("# On a GPU: `tests/gpu_check.py`\n```\n# not a heading\n```") == {"on-a-gpu-testsgpu_checkpy"}
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    broken, checked = [], 0
    for page in pages:
        for target in re.findall(r"\]\(([^)\s]+)\)", without_code(page.read_text())):
            if target.startswith(("http://", "https://", "mailto:")):
                continue
            path, _, anchor = target.partition("#")
            arrives = Path(os.path.normpath(page.parent / path)) if path else page
            checked += 1
            if not arrives.exists() or (anchor and arrives.suffix == ".md" and anchor not in anchors(arrives.read_text())):
                broken.append(f"{page.name}: {target}")
    assert checked >= 40 and not broken, (checked, broken)


def test_the_wandb_sweep_is_the_local_sweeps_grid():
    """docs/wandb-sweep.yaml runs the grid `python -m tools.sweep` runs by default: every preset, the same seeds, each
    parameter a train.py flag."""
    from dataclasses import fields

    import yaml

    import losses
    import train
    from tools import sweep

    spec = yaml.safe_load((ROOT / "docs" / "wandb-sweep.yaml").read_text())
    assert spec["program"] == "train.py" and set(spec["parameters"]) <= {f.name for f in fields(train.Args)}
    assert spec["parameters"]["algo"]["values"] == list(losses.PRESETS) == list(sweep.SweepArgs().algos)
    assert spec["parameters"]["seed"]["values"] == list(sweep.SweepArgs().seeds)


def short_task_table(csv_text: str) -> str:
    """docs/short-task.md's single-runs table, built from its committed measurements (docs/short-task-runs.csv)."""
    import csv

    rows = list(csv.DictReader(line for line in csv_text.splitlines() if not line.startswith("#")))
    lines = ["| `--algo` | seed | held-out accuracy before → after | gain (points) | minutes (whole command) | peak RSS | "
             "clip fraction (mean over steps) |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        gain = 100 * (float(r["after"]) - float(r["before"]))
        lines.append(f"| `{r['algo']}` | {r['seed']} | {r['before']} → {r['after']} | {gain:+.1f} | "
                     f"{float(r['wall_s']) / 60:.1f} | {int(r['peak_rss_kb']) / 2**20:.2f} GiB | {float(r['clip_frac_mean']):.3g} |")
        # (time -v's kbytes are KiB)
    return "\n".join(lines)


def test_the_single_runs_table_is_its_measurements():
    """The single-runs table of docs/short-task.md is the committed CSV of those runs, not numbers typed twice."""
    table = short_task_table((ROOT / "docs" / "short-task-runs.csv").read_text())
    assert table.count("\n") == 10 and "`gspo` | 0 | 0.212 → " in table  # nine presets, header and rule
    assert table in (ROOT / "docs" / "short-task.md").read_text()
