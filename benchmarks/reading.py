"""What reading a job's inputs costs the thread that computes: every range of a W1 job read by
``read.shard_batches`` (as ``ComputeShards`` reads them), nothing computed or written.

``python -m benchmarks.reading --samples 20480 --repeats 7``
    one ``.npy`` of standard normal float32 W1 samples, ``batch_size: 256``, shards of 4,096; prints the
    medians (after one warm-up) of the wall time, the CPU of the reading thread (``time.thread_time``:
    what the engine's caller spends between batches) and of the whole process (with ``tf.data``'s thread).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path


def measure(samples: int, repeats: int) -> dict[str, float]:
    from benchmarks import target_inputs
    from jacobeam.pipeline import plan
    from jacobeam.transforms.engine.threads import configure_tf_threads
    from jacobeam.transforms.read import shard_batches

    configure_tf_threads(2)
    x, _ = target_inputs.samples_of("mlp", samples)
    with tempfile.TemporaryDirectory(prefix="jacobeam-reading-") as temp:
        glob = target_inputs.write_inputs(x, None, Path(temp) / "in")
        spec = plan.make_job(target_inputs.run_config("mlp", glob, Path(temp) / "out"), check_model=False).spec
        found: dict[str, list[float]] = {"wall": [], "thread": [], "process": []}
        for repeat in range(repeats + 1):
            began, thread, process = time.perf_counter(), time.thread_time(), time.process_time()
            read = sum(len(batch) for shard in spec.ranges() for batch in shard_batches(spec, shard))
            if read != samples:
                raise RuntimeError(f"read {read} samples of {samples}")
            if repeat:  # the first is a warm-up
                found["wall"].append(time.perf_counter() - began)
                found["thread"].append(time.thread_time() - thread)
                found["process"].append(time.process_time() - process)
    return {name: statistics.median(values) for name, values in found.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.reading", description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=20_480)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args(argv)
    found = measure(args.samples, args.repeats)
    print(
        f"{args.samples:,} W1 samples read, median of {args.repeats}: wall {found['wall']:.3f} s, reading thread "
        f"{found['thread']:.3f} s, process CPU {found['process']:.3f} s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
