"""Rows timed side by side in one process, their repeats interleaved, so that load from other work on a
shared machine falls on every row alike (the suite runs each row in its own process, one after the
other: a burst of load lands on whichever row runs then).

``python -m benchmarks.sidebyside --workload mlp --rows engine,jax_jacrev,torch_jacrev``
    in-memory rows (ids as in the suite); the first row is the baseline of the ratio column.
``python -m benchmarks.sidebyside --workload mlp --end-to-end 20480``
    the pipeline (``runner.run``, in-process, on a ``.npy`` of that many samples) against the engine
    in memory on the same samples, alternating after one warm-up run of each; the pipeline's
    samples/s is the manifest's (planning to manifest).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from benchmarks.measure import interleaved
from benchmarks.rows import build, engine_modes, row_specs
from benchmarks.suite import write_inputs
from benchmarks.workloads import WORKLOADS, Workload, inputs
from jacobeam.transforms.engine.diagnostics import relative_error

BATCH = 256


def in_memory(workload: Workload, row_ids: list[str], samples: int, repeats: int) -> list[dict]:
    """Median samples/s of each row over ``samples`` samples in batches of 256, its ratio to the first
    row, and its Jacobians' max relative error against the first row's (first 4 samples)."""
    modes, default = engine_modes()
    specs = {spec.id: spec for spec in row_specs(modes, default, {"jax": True, "torch": True}) if spec.in_memory}
    x = inputs(workload, samples)
    built = {row_id: build(specs[row_id], workload) for row_id in row_ids}
    checked = {row_id: np.asarray(row.jacobians(x[:BATCH]))[:4] for row_id, row in built.items()}  # warm-up

    def timed(row) -> Callable[[], float]:
        def call() -> float:
            began = time.perf_counter()
            for lo in range(0, samples, BATCH):
                row.jacobians(x[lo : lo + BATCH])
            return samples / (time.perf_counter() - began)

        return call

    speeds = interleaved({row_id: timed(row) for row_id, row in built.items()}, repeats)
    base, reference = statistics.median(speeds[row_ids[0]]), checked[row_ids[0]]
    return [
        {
            "row": row_id,
            "samples_per_second": statistics.median(speeds[row_id]),
            "ratio": statistics.median(speeds[row_id]) / base,
            "max_rel_error": relative_error(checked[row_id], reference),
        }
        for row_id in row_ids
    ]


def end_to_end(workload: Workload, samples: int, repeats: int) -> list[dict]:
    """The in-process pipeline and the engine in memory on the same samples, alternating."""
    from jacobeam.pipeline import config, runner
    from jacobeam.transforms.engine import JacobianEngine
    from jacobeam.transforms.engine.models import load

    with tempfile.TemporaryDirectory(prefix="jacobeam-sidebyside-") as temp:
        glob = write_inputs(workload, samples, Path(temp) / "data")
        x = np.load(Path(temp) / "data" / "x.npy")
        cfg = config.validate(
            {
                "model": {"factory": workload.factory},
                "input": {"paths": [glob]},
                "jacobian": {"batch_size": BATCH},
                "output": {"path": str(Path(temp) / "out"), "samples_per_shard": 4096},
            }
        )
        engines: list[JacobianEngine] = []  # built after the first run, which sets TensorFlow's threads

        def pipeline() -> float:
            manifest = runner.run(cfg, [], show_progress=False).manifest
            for shard in (Path(temp) / "out" / "shards").glob("*.h5"):
                shard.unlink()  # the next run (a resume of this one) computes every shard again
            return manifest["run"]["samples_per_second"]

        def memory() -> float:
            if not engines:
                engines.append(
                    JacobianEngine(load(factory=workload.factory), workload.input_shape, cfg.jacobian.engine_options())
                )
            engine = engines[0]
            began = time.perf_counter()
            for lo in range(0, samples, engine.batch_size):
                engine.compute(x[lo : lo + engine.batch_size])
            return samples / (time.perf_counter() - began)

        calls = {"pipeline, in-process": pipeline, "engine in memory": memory}
        interleaved(calls, 1)  # warm-up: imports, tracing, first-touch memory
        speeds = interleaved(calls, repeats)
    base = statistics.median(speeds["engine in memory"])
    return [
        {"row": name, "samples_per_second": statistics.median(found), "ratio": statistics.median(found) / base}
        for name, found in speeds.items()
    ]


def _print(title: str, rows: list[dict]) -> None:
    print(title)
    for row in rows:
        error = f"  max rel err {row['max_rel_error']:.1e}" if "max_rel_error" in row else ""
        print(f"  {row['row']:24s} {row['samples_per_second']:10,.0f}/s  x{row['ratio']:.2f}{error}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.sidebyside", description=__doc__.splitlines()[0])
    parser.add_argument("--workload", choices=sorted(WORKLOADS), default="mlp")
    parser.add_argument("--rows", default="engine,engine_jit_auto,tf_batch_jacobian", help="in-memory row ids")
    parser.add_argument("--samples", type=int, default=2048, help="samples per timed repeat (in memory)")
    parser.add_argument("--end-to-end", type=int, default=0, metavar="N", help="pipeline vs engine on N samples")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    workload = WORKLOADS[args.workload]
    if args.end_to_end:
        rows = end_to_end(workload, args.end_to_end, args.repeats)
        _print(f"{workload.key} {workload.name}: {args.end_to_end:,} samples, median of {args.repeats}", rows)
    else:
        rows = in_memory(workload, args.rows.split(","), args.samples, args.repeats)
        _print(f"{workload.key} {workload.name}: {args.samples:,} samples per repeat, median of {args.repeats}", rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
