"""A scheduled job's small increment against its floor: ``jacobeam run`` of a few new samples beside a
result already computed, on the README quickstart's model, against a fresh process that imports what
that command imports and computes one batch.

``python -m benchmarks.incremental [--base 1000] [--new 128] [--repeats 3]``

The quickstart's CNN (seeded weights, saved as ``.keras``) and its bar images: ``--base`` samples in one
``.npy`` computed once at the defaults (self-check on), the folder kept; then, each repeat, that folder
restored, a second ``.npy`` of ``--new`` samples added, and ``python -m jacobeam run -q`` timed from
process start to exit (it plans, computes only the new samples, checks them, writes the shard, the view
and the manifest). The floor, in a fresh process: import TensorFlow, Beam and jacobeam's CLI, load the
model, and compute the new samples' full Jacobian in one hand-written ``tf.function`` batch (traced
there, as a fresh process must). The two alternate after one warm-up of each; printed: medians, their
ratio (issue 38's goal: at most 2x), the floor's parts and ``jacobeam --version`` (the CLI alone).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks.workloads import bars

FLOOR = """
import os, time  # noqa: E401
began = time.perf_counter()
import apache_beam, tensorflow as tf, jacobeam.pipeline.cli  # noqa: F401, E401 - what `jacobeam run` imports
import keras, numpy as np
imported = time.perf_counter()
model = keras.models.load_model({model!r})
x = tf.constant(np.load({samples!r}))

@tf.function
def jacobian(x):
    with tf.GradientTape() as tape:
        tape.watch(x)
        y = model(x)
    return tape.batch_jacobian(y, x)

jacobian(x).numpy()
print(imported - began, time.perf_counter() - imported, flush=True)
os._exit(0)  # as `jacobeam run` ends: TensorFlow's teardown at exit is not part of either
"""


def quickstart_model(path: Path) -> None:
    """The README quickstart's CNN (``workloads.quickstart``), saved as ``.keras``."""
    from benchmarks.workloads import quickstart

    quickstart().save(path)


def _timed(command: list[str], env: dict[str, str]) -> tuple[float, str]:
    began = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, env=env, check=False)
    if done.returncode:
        raise SystemExit(f"{' '.join(command[:4])} ... exited {done.returncode}: {done.stderr.strip()[-500:]}")
    return time.perf_counter() - began, done.stdout


def measure(base: int, new: int, repeats: int) -> dict:
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"}
    with tempfile.TemporaryDirectory(prefix="jacobeam-incremental-") as temp:
        root = Path(temp)
        (root / "data").mkdir()
        quickstart_model(root / "model.keras")
        np.save(root / "data" / "day1.npy", bars(base, 0))
        np.save(root / "day2.npy", bars(new, 1))
        out = root / "out"
        config = root / "job.yaml"
        config.write_text(json.dumps({
            "model": {"path": str(root / "model.keras")},
            "input": {"paths": [str(root / "data" / "*.npy")]},
            "output": {"path": str(out)},
        }))
        run = [sys.executable, "-m", "jacobeam", "run", "-q", str(config)]
        _timed(run, env)
        shutil.copytree(out, root / "day1")
        floor = [sys.executable, "-c", FLOOR.format(model=str(root / "model.keras"), samples=str(root / "day2.npy"))]

        def increment() -> float:
            shutil.rmtree(out)
            shutil.copytree(root / "day1", out)
            shutil.copy(root / "day2.npy", root / "data" / "day2.npy")
            seconds, _ = _timed(run, env)
            computed = json.loads((out / "manifest.json").read_text())["run"]["samples_computed"]
            if computed != new:
                raise SystemExit(f"the increment computed {computed} samples, not the {new} new ones")
            (root / "data" / "day2.npy").unlink()
            return seconds

        found: dict[str, list] = {"run": [], "floor": [], "imports": [], "batch": []}
        increment(), _timed(floor, env)  # warm-up: the page cache
        for repeat in range(repeats):
            for side in ("run", "floor") if repeat % 2 == 0 else ("floor", "run"):
                if side == "run":
                    found["run"].append(increment())
                else:
                    seconds, printed = _timed(floor, env)
                    imports, batch = (float(v) for v in printed.split())
                    found["floor"].append(seconds)
                    found["imports"].append(imports)
                    found["batch"].append(batch)
        version, _ = _timed([sys.executable, "-m", "jacobeam", "--version"], env)
    medians = {key: statistics.median(values) for key, values in found.items()}
    return {**medians, "runs": found["run"], "floors": found["floor"], "version": version}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.incremental", description=__doc__.splitlines()[0])
    parser.add_argument("--base", type=int, default=1000, help="samples computed before the increment")
    parser.add_argument("--new", type=int, default=128, help="samples the increment adds")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    found = measure(args.base, args.new, args.repeats)
    ratio = found["run"] / found["floor"]
    print(
        f"{args.new} new samples beside {args.base:,} (the README quickstart's CNN), median of {args.repeats}, "
        f"load average {' '.join(f'{v:.1f}' for v in os.getloadavg())}:\n"
        f"  jacobeam run (process start to exit)  {found['run']:.2f} s  ({', '.join(f'{t:.2f}' for t in found['runs'])})\n"
        f"  floor: imports + one batch            {found['floor']:.2f} s  ({', '.join(f'{t:.2f}' for t in found['floors'])}); "
        f"in it, imports {found['imports']:.2f} s, the model and its batch {found['batch']:.2f} s\n"
        f"  ratio {ratio:.2f}x (goal at most 2x: {'met' if ratio <= 2 else 'missed'}); "
        f"jacobeam --version alone {found['version']:.2f} s",
        flush=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
