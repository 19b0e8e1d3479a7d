"""The study: each paper's claim about the importance ratio, tested on long answers with a verdict rule that has power.

    python -m tools.study                      # every run below (resumable: finished runs are skipped), then the report
    python -m tools.study --report-only        # rebuild docs/study/ and the README's study section from docs/study/data/

Every run is `train.py --dataset embedded-long --num-prompts 8` (correct answers of 20-295 tokens, 8 prompts x 8
completions per rollout) for 40 RL steps, held-out greedy accuracy every 5 steps, up to 5 seeds (design.RUN_ORDER
decides which arms get them first; the report counts what ran). A seed is one warm start: every arm of a seed starts
from the same policy, so contrasts are paired by seed. Fourteen cells (regimes); base120 is base run three times as long
(claim 4's drift needs a horizon), smollm2 and smollm2long have their own model, task and horizon (SMOLLM2_FLAGS,
SMOLLM2_LONG_FLAGS; a seed there is the same pretrained start, its sampling and prompt order):

    base      lr 5e-5, 4 minibatches per rollout (the papers' regime)        claims 1, 2, 4, 6a, 9
    stale16   lr 5e-5, 16 minibatches per rollout (staler ratios, and 4x more  claims 1, 3, 5, 6b, 7, 8
              optimizer steps per rollout, each on fewer rows)
    base120   base for 120 RL steps, held-out accuracy every 60              claim 4 at the longer horizon
    smollm2   SmolLM2-135M-Instruct on embedded-add, lr 2e-5, 16 minibatches claim 5, where ε_high binds
    smollm2long  SmolLM2-135M-Instruct on embedded-long-instruct (its working  claims 1 and 2a on a real model
              in prose, 10-300 tokens), T 1, lr 2e-5, 16 minibatches, 3 steps
    stale16rep  stale16's two β = 0 arms at seeds 5-9 (new warm starts)      claim 3 at β = 0 replicated
    smollm2prefix  smollm2long's runs made again with --log-prefix-spread     claim 1 inside each sequence, 2a in
              (one more forward pass after each update)                      tokens (issue 49)
    smollm2prefix1  smollm2prefix's one first step, at seeds 5-9             claim 1 inside each sequence where
              (each run stops after step 1, its answers still long)          its check can hold
    base2     base's gspo arm made again at the code claim 9's LUSPO ran   claim 9's GSPO
    stale16v  stale16's regime: GRPO β = 0 and VESPO, made on one machine    claim 10
    stale16vrep  stale16v's two arms at seeds 5-9 (new warm starts)          claim 10 replicated
    stale16vlr  stale16v at lr 1e-5 (5x lower), seeds 0-4                   claim 11
    stale64vlr  stale16vlr with 4 passes over each rollout (64 optimizer      claim 12
              steps per rollout)
    stale16vmid  stale16v at lr 3e-5, seeds 0-4                              claim 13

and in each, arms meant to change as little as possible (summary.md lists every setting each contrast changes;
every arm at β = 0 unless its name says otherwise; the GRPO
preset's β 0.04 would otherwise ride along with the ratio level):

    base:     grpo-b0, gspo, grpo-b0-sumnorm (GRPO with Dr.GRPO's aggregation only), dr_grpo, cispo, sapo, gmpo,
              luspo (GSPO with LUSPO's aggregation only)
    stale16:  grpo-b0, gspo, dapo, dapo-eh0.2 (clip-higher off), grpo (β 0.04), gspo-b0.04, cispo, sapo, gmpo
    base120:  grpo-b0, grpo-b0-sumnorm
    smollm2:  grpo-b0, grpo-b0-eh0.28 (clip-higher on, nothing else)
    smollm2long: grpo-b0, gspo
    stale16rep: grpo-b0, gspo
    smollm2prefix: grpo-b0, gspo
    smollm2prefix1: grpo-b0, gspo
    base2:    gspo
    stale16v: grpo-b0, vespo
    stale16vrep: grpo-b0, vespo
    stale16vlr: grpo-b0, vespo
    stale64vlr: grpo-b0, vespo
    stale16vmid: grpo-b0, vespo

(the successors' presets are at β = 0, like grpo-b0 and gspo, which they are compared with).

The protocol (probes, the verdict rule, the run order, what is reported): docs/study/protocol.md.
"""

from tools.study.claims import CLAIMS, MANIPULATION, SECTIONS, Claim, judge, write_figures
from tools.study.data import (MISLOGGED, NAME, PER_RUN, STOPS, arm_runs, by_seed, clip_differs, collapsed, drift,
                              entropy_last10, final_accuracy, length_exponent, length_spread, load, pack, peak_drop,
                              run_mean)
from tools.study.design import (ALL_SEEDS, CELLS, COMMON, EVAL_EVERY, LONG_STEPS, PROMPTS, REPLICATION_SEEDS,
                                RUN_ORDER, SEEDS, SMOLLM2_FLAGS, SMOLLM2_STEPS, STEPS, grid, with_models)
from tools.study.report import README_BEGIN, README_END, readme_section, table, write_report
from tools.study.stats import (VERDICT_RULE, Estimate, estimate, fmt_est, holm, level, p_value, paired, seed_drops,
                               verdict, words)
