"""The built-in demo: seeded input files and the seeded built-in CNN, run end to end.

Needs nothing but the install. ``configs/demo.yaml`` is the same configuration as a file.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

DEMO_ROOT = "jacobeam-demo"
FILE_SIZES = (700, 500, 848)  # unequal on purpose: shards straddle file boundaries
SEED = 0


def demo_config(root: str = DEMO_ROOT) -> dict[str, Any]:
    return {
        "model": {"builtin": "cnn"},
        "input": {"paths": [f"{root}/inputs/*.npy"]},
        "jacobian": {"batch_size": 128},
        "output": {"path": f"{root}/out", "samples_per_shard": 512},
    }


def write_inputs(folder: str | Path, sizes: tuple[int, ...] = FILE_SIZES, seed: int = SEED) -> list[Path]:
    """Seeded 28x28x1 float32 images in [0, 1), one ``.npy`` file per entry of ``sizes``."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    paths = []
    for index, size in enumerate(sizes):
        path = folder / f"part-{index:03d}.npy"
        np.save(path, rng.random((size, 28, 28, 1), dtype=np.float32))
        paths.append(path)
    return paths
