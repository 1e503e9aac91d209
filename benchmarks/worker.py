"""One measurement in a fresh process, so that its peak RSS is its own and no framework's state (TF's
retained memory, a compiled cache) leaks from one row into the next.

``python -m benchmarks.worker TASK.json`` runs the task and writes ``result.json`` (and, for a row,
``jacobians.npy``: the Jacobians of the first samples, for verification) into the task's ``out``.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks import workloads
from benchmarks.measure import Budget, time_row
from benchmarks.rows import RowSpec, build, engine_modes


def matmul_peak(n: int, calls: int = 5) -> dict[str, float]:
    """This machine's float32 speed in GFLOP/s for an (n, n) @ (n, n) product, in TF and in numpy:
    the best of ``calls`` (a peak: on a shared machine the median measures the neighbours)."""
    import tensorflow as tf

    a = np.random.default_rng(0).standard_normal((n, n), dtype=np.float32)
    # Reducing in the graph makes the call wait for the product without copying it out.
    product = tf.function(lambda m: tf.reduce_sum(tf.matmul(m, m)))
    tensor = tf.constant(a)
    found = {}
    for name, call in (("tensorflow", lambda: product(tensor).numpy()), ("numpy", lambda: (a @ a).sum())):
        call()
        times = []
        for _ in range(calls):
            start = time.perf_counter()
            call()
            times.append(time.perf_counter() - start)
        found[name] = 2 * n**3 / min(times) / 1e9
    return found


def matmul(task: dict[str, Any]) -> dict[str, Any]:
    return matmul_peak(task["size"])


def modes(task: dict[str, Any]) -> dict[str, Any]:
    found, default = engine_modes()
    return {"modes": found, "default": default}


def row(task: dict[str, Any]) -> dict[str, Any]:
    workload = workloads.WORKLOADS[task["workload"]]
    spec = RowSpec(**task["row"])
    x = workloads.inputs(workload, task["samples"])
    timing, checked = time_row(lambda: build(spec, workload), x, Budget(**task["budget"]))
    np.save(Path(task["out"]) / "jacobians.npy", checked)
    return timing.to_dict()


def _record_first_jacobian(found: dict[str, Any]) -> None:
    """Note ``time.time()`` when an engine in this process first returns a batch's Jacobians
    (the in-process runner's worker runs here; worker processes of other runners are not seen)."""
    from jacobeam.transforms.engine import JacobianEngine

    compute = JacobianEngine.compute

    def timed(self, *args, **kwargs):
        result = compute(self, *args, **kwargs)
        found.setdefault("first_jacobian_at", time.time())
        return result

    JacobianEngine.compute = timed


def pipeline(task: dict[str, Any]) -> dict[str, Any]:
    """jacobeam's Beam pipeline through its Python API, as a user's program would call it."""
    from jacobeam.pipeline import config, runner

    found: dict[str, Any] = {}
    if not task["beam_args"]:
        _record_first_jacobian(found)
    cfg = config.validate(task["config"])
    start = time.perf_counter()
    result = runner.run(cfg, task["beam_args"], show_progress=False)
    seconds = time.perf_counter() - start
    latency = result.metrics["batch_latency_ms"]  # the engine's calls, summed over worker processes
    return {**found, "run_seconds": seconds, "engine_seconds": latency["count"] * latency["mean"] / 1000}


TASKS = {"matmul": matmul, "modes": modes, "row": row, "pipeline": pipeline}


def main(argv: list[str]) -> int:
    logging.basicConfig(level=logging.WARNING)
    task = json.loads(Path(argv[0]).read_text())
    result = TASKS[task["kind"]](task)
    (Path(task["out"]) / "result.json").write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
