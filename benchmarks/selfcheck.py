"""What the run's self-check costs: the in-process pipeline with ``jacobian.self_check.samples`` at its
default (4) against ``0`` (off), on the same inputs, alternating after one warm-up run of each.

``python -m benchmarks.selfcheck [--workload mlp] [--samples 20480] [--samples-per-shard 4096] [--repeats 5] [--checks 4]``

Each run is a fresh pipeline as a user starts one (``runner.run``, in-process): its worker builds its
engine and, with the self-check on, builds and traces the references on a thread beside the first
batches (``SelfChecker.prepare``), so every "on" run pays that one-time cost. Printed: the median wall
time of each (the manifest's ``run.wall_seconds``, planning to manifest), their ratio and the difference
as a share of the "on" run (the whole cost, the references' building included wherever it ran), which
on a shared machine are as noisy as any two runs; and the checks' own time inside the "on" runs (the
manifest's ``self_check.seconds``: every check, a first one's wait for the references included), as a
share of the run's wall time, which is not noisy but leaves out what the preparing thread took from the
batches.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

from benchmarks.suite import write_inputs
from benchmarks.workloads import WORKLOADS, Workload
from jacobeam.pipeline.self_check_report import precision_line
from jacobeam.transforms.spec import SelfCheck

BATCH = 256


def measure(workload: Workload, samples: int, samples_per_shard: int, repeats: int, on: int = SelfCheck().samples) -> dict:
    from jacobeam.pipeline import config, runner

    with tempfile.TemporaryDirectory(prefix="jacobeam-selfcheck-") as temp:
        glob = write_inputs(workload, samples, Path(temp) / "data")

        def run(checks: int) -> dict:
            out = Path(temp) / f"out-{checks}"
            shutil.rmtree(out, ignore_errors=True)
            cfg = config.validate(
                {
                    "model": {"factory": workload.factory},
                    "input": {"paths": [glob]},
                    "jacobian": {"batch_size": BATCH, "self_check": {"samples": checks}},
                    "output": {"path": str(out), "samples_per_shard": samples_per_shard},
                }
            )
            return runner.run(cfg, [], show_progress=False).manifest

        run(on), run(0)  # warm-up: imports, first-touch memory
        found: dict[int, list[dict]] = {on: [], 0: []}
        for repeat in range(repeats):
            for checks in (on, 0) if repeat % 2 == 0 else (0, on):  # alternating which goes first
                found[checks].append(run(checks))
    found[1] = found.pop(on)  # the "on" runs
    on = [m["run"]["wall_seconds"] for m in found[1]]
    off = [m["run"]["wall_seconds"] for m in found[0]]
    checking = [m["self_check"]["seconds"] for m in found[1]]
    first = [
        c["timing"]["seconds"]
        for m in found[1]
        for s in m["shards"]
        for c in s.get("self_check", [])
        if c["timing"]["traced"]
    ]
    later = [
        c["timing"]["seconds"]
        for m in found[1]
        for s in m["shards"]
        for c in s.get("self_check", [])
        if not c["timing"]["traced"]
    ]
    summary = found[1][-1]["self_check"]
    return {
        "workload": workload.key,
        "samples": samples,
        "shards": len(found[1][-1]["shards"]),
        "walls_on": on,
        "walls_off": off,
        "wall_on": statistics.median(on),
        "wall_off": statistics.median(off),
        "ratio": statistics.median(on) / statistics.median(off),
        "checking": statistics.median(checking),
        "share": statistics.median(c / w for c, w in zip(checking, on)),
        "first_check": statistics.median(first) if first else None,
        "later_check": statistics.median(later) if later else None,
        "max_rel_error": summary["max_rel_error"],
        "precision": summary["precision"],
        "tolerance": summary["tolerance"],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.selfcheck", description=__doc__.splitlines()[0])
    parser.add_argument("--workload", choices=sorted(WORKLOADS), default="mlp")
    parser.add_argument("--samples", type=int, default=20480)
    parser.add_argument("--samples-per-shard", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--checks", type=int, default=SelfCheck().samples, help="self_check.samples of the 'on' runs")
    args = parser.parse_args(argv)
    workload = WORKLOADS[args.workload]
    found = measure(workload, args.samples, args.samples_per_shard, args.repeats, args.checks)
    later = "n/a" if found["later_check"] is None else f"{1000 * found['later_check']:.1f} ms"
    first = "none, prepared beside the batches" if found["first_check"] is None else f"{1000 * found['first_check']:.0f} ms"
    print(
        f"{workload.key} {workload.name}: {args.samples:,} samples, {found['shards']} shards of "
        f"{args.samples_per_shard:,}, median of {args.repeats}"
    )
    each = lambda walls: ", ".join(f"{w:.2f}" for w in walls)  # noqa: E731
    print(f"  self_check.samples {args.checks}   {found['wall_on']:7.2f} s  ({each(found['walls_on'])})")
    print(f"  self_check.samples 0   {found['wall_off']:7.2f} s  ({each(found['walls_off'])})")
    print(f"  ratio on/off           {found['ratio']:7.3f}  (on - off = {100 * (1 - 1 / found['ratio']):.1f}% of the on "
          "run; wall times: as noisy as any two runs)")
    print(
        f"  checking inside a run  {found['checking']:7.3f} s = {100 * found['share']:.1f}% of its wall time "
        f"(a first check that built the references: {first}; each later one: {later})"
    )
    print(f"  max relative error     {found['max_rel_error']} (tolerance {found['tolerance']:g})")
    print(f"  precision              {precision_line({'precision': found['precision']}, 'float32')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
