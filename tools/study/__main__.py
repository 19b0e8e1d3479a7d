"""`python -m tools.study`: run the study's grid (resumable), pack the finished runs, write the report."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tools import study, sweep
from tools.study import ALL_SEEDS, COMMON, CELLS, grid, load, pack, with_models, write_report


@dataclass
class StudyArgs:
    seeds: tuple[int, ...] = ALL_SEEDS
    """which seeds to run (each cell runs the seeds RUN_ORDER gives it: stale16rep 5-9, the others 0-4)"""
    cells: tuple[str, ...] = tuple(CELLS)
    """which cells (regimes) to run"""
    parallel: int = 2
    """runs at a time; each gets cores/parallel threads"""
    output_dir: str = "sweeps"
    """runs go to <output_dir>/study/runs/<cell>-<arm>-s<seed>/; finished ones are packed into data_dir"""
    data_dir: str = "docs/study/data"
    report_dir: str = "docs/study"
    report_only: bool = False
    """skip running, only rebuild the report (and the README's study section) from data_dir"""


def main(argv: list[str] | None = None) -> None:
    import sys

    from plumbing import flags

    args = flags.parse(StudyArgs, study.__doc__, argv, program="python -m tools.study")
    runs_dir, data_dir = Path(args.output_dir) / "study" / "runs", Path(args.data_dir)
    if not args.report_only:
        unknown = sorted(set(args.cells) - set(CELLS))
        problem = (f"unknown cell {', '.join(unknown)}; the cells are {', '.join(CELLS)}" if unknown else
                   f"--parallel {args.parallel}: must be at least 1 (runs at a time)" if args.parallel < 1 else
                   f"--seeds {' '.join(map(str, sorted(set(args.seeds) - set(ALL_SEEDS))))}: the study's seeds are "
                   f"{', '.join(map(str, ALL_SEEDS))}" if set(args.seeds) - set(ALL_SEEDS) else None)
        if problem:
            print(f"error: {problem}", file=sys.stderr)
            sys.exit(2)
        sweep.run_grid(with_models(grid(args.cells, args.seeds)), "study", COMMON, runs_dir, args.parallel)
        print(f"packed {len(pack(runs_dir, data_dir))} new runs into {data_dir}")
    runs = load(data_dir)
    if not runs:
        print(f"error: no runs in {data_dir}; run the study first (without --report-only)", file=sys.stderr)
        sys.exit(2)
    write_report(runs, Path(args.report_dir), Path(__file__).resolve().parents[2] / "README.md")
    print(f"report: {Path(args.report_dir) / 'summary.md'}")


if __name__ == "__main__":
    main()
