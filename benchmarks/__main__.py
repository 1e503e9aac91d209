"""``python -m benchmarks [targets] [--quick] [--only KINDS] [--json F]``: the round-four targets, each with
its measured ratio (``benchmarks.targets``).

``python -m benchmarks run [--workloads mlp,cnn,wide,flow] [--quick] [--json out.json] [--rows ID,...]``: every
row of the suite (``benchmarks.suite``), a table per workload."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

from benchmarks import report as tables
from benchmarks.suite import Plan, Report, run_suite
from benchmarks.workloads import WORKLOADS


def _names(text: str) -> tuple[str, ...]:
    names = tuple(name.strip() for name in text.split(",") if name.strip())
    unknown = [name for name in names if name not in WORKLOADS]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown workload(s) {unknown}; choose from {sorted(WORKLOADS)}")
    return names


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    run = commands.add_parser("run", help="measure every row of the chosen workloads")
    run.add_argument("--workloads", type=_names, default=tuple(WORKLOADS), help="comma-separated (default: all)")
    run.add_argument("--quick", action="store_true", help="short repeats; end-to-end rows on W1 only, one run each")
    run.add_argument("--json", type=Path, default=None, help="also write every figure to this JSON file")
    run.add_argument("--rows", default=None, help="only these row ids, comma-separated (the reference always runs)")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] != "run":
        from benchmarks import targets

        return targets.main(argv[1:] if argv and argv[0] == "targets" else argv)
    args = _parser().parse_args(argv)
    plan = Plan.quick(args.workloads) if args.quick else Plan(workloads=args.workloads)
    if args.rows:
        plan = replace(plan, rows=tuple(args.rows.split(",")))

    def show(name: str, report: Report) -> None:
        print("\n" + tables.workload_table(name, report) + "\n", flush=True)

    report = run_suite(plan, say=lambda line: print(line, file=sys.stderr, flush=True), on_workload=show)
    if report.scaling:
        print(tables.scaling_table(report) + "\n")
    for note in report.notes:
        print(f"note: {note}")
    if args.json:
        args.json.write_text(json.dumps(report.to_dict(), indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
