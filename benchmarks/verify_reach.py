"""``jacobeam verify``'s reach: what ``--inputs sampled``, ``all`` and ``none`` read and cost, side by side.

A dataset large in bytes and small in samples (``tests.test_verify_reach``: sparse ``.npy`` files of 4 MB
samples, a linear model storing one number per sample, shards of 25 samples) is computed once; then
``verify --samples 8`` runs with each reach in turn, interleaved over the repeats, and the bytes each
read from the input files and its time are printed, with the time over that of ``--inputs none``.

    .venv/bin/python -m benchmarks.verify_reach              # 10 GB: 2,500 samples, 100 shards
    .venv/bin/python -m benchmarks.verify_reach --gb 1       # 1 GB

The holes of a sparse file read as zeros from memory, as a file in the page cache does: the times here
are hashing and copying at memory speed; from a disk or a bucket, multiply the bytes by its bandwidth.
Nothing here asserts a time (tests/test_verify_reach.py checks the bytes read).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

REACHES = ("none", "sampled", "all")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.verify_reach", description=__doc__.split("\n")[0])
    parser.add_argument("--gb", type=float, default=10.0, help="input bytes in GB (default 10)")
    parser.add_argument("--samples", type=int, default=8, help="verify --samples K (default 8)")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)

    from benchmarks.measure import interleaved
    from jacobeam.pipeline.verify import verify
    from tests.test_verify_reach import WIDER, make_dataset

    rows = 500
    files = max(1, round(args.gb * 1e9 / (WIDER * 4 * rows)))
    with tempfile.TemporaryDirectory() as tmp:
        started = time.perf_counter()
        data = make_dataset(Path(tmp), files, rows, WIDER, "wider_linear", 25)
        print(f"{files * rows:,} samples of {WIDER * 4 / 1e6:g} MB in {files} sparse file(s) "
              f"({files * rows * WIDER * 4 / 1e9:g} GB), {len(data['manifest']['shards'])} shards: "
              f"run {time.perf_counter() - started:.0f} s", flush=True)

        def timed(reach: str):
            def call():
                start = time.perf_counter()
                report = verify(data["out"], samples=args.samples, inputs=reach)
                assert report.ok, report.problems
                return time.perf_counter() - start, report.inputs

            return call

        found = interleaved({reach: timed(reach) for reach in REACHES}, args.repeats)
    base = statistics.median(seconds for seconds, _ in found["none"])
    print(f"verify --samples {args.samples}, median of {args.repeats}:")
    print(f"{'--inputs':<10} {'shards re-hashed':>17} {'re-hashed':>10} {'read in all':>12} {'seconds':>8} {'x none':>7}")
    for reach in REACHES:
        seconds = statistics.median(s for s, _ in found[reach])
        inputs = found[reach][-1][1]
        print(f"{reach:<10} {inputs['shards_rehashed']:>8} of {inputs['shards']:<6} {inputs['bytes_rehashed'] / 1e9:>8.3f} GB "
              f"{inputs['bytes_read'] / 1e9:>9.3f} GB {seconds:>8.1f} {seconds / base:>7.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
