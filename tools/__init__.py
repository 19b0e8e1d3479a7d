"""Research tools built on train.py: sweep (grids of runs and their report), study (the papers' claims, judged),
bench (one RL step here and in TRL), memory (what fits on one GPU), diagnostics (the study's per-step
instrumentation). Run them from the repository root: `python -m tools.sweep`, `python -m tools.study`, ...
"""
