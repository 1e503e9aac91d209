"""A whole ``jacobeam run`` job in a Beam ``TestPipeline`` with the closed-form fake engine
(``transforms.testing.fake_engine``): its inputs (40 samples in three files, one of them bad), its
config, and the run, for the tests of the seams and of foreign folders."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from apache_beam.runners.portability.fn_api_runner import FnApiRunner
from apache_beam.testing import test_pipeline

from jacobeam.pipeline import config, runner
from jacobeam.transforms import ModelSource
from jacobeam.transforms.testing.fake_engine import FakeEngineFactory

FACTORY = FakeEngineFactory(outputs=3, seed=7, max_batch=5)
MODEL = ModelSource(factory="fake.model:closed_form")  # never loaded: the fake engine stands in for it
SHAPE = (2, 3)
SIZES = {"a": 7, "b": 13, "c": 20}  # 40 samples: not a multiple of samples_per_shard (16) nor of batches (6, 5)
BAD_ID = 10  # b.npy row 3: a NaN sample, rejected (on_bad_sample: skip)


def write_inputs(folder: Path) -> np.ndarray:
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    arrays = {name: rng.normal(size=(size, *SHAPE)).astype(np.float32) for name, size in SIZES.items()}
    arrays["b"][BAD_ID - SIZES["a"], 1, 2] = np.nan
    for name, array in arrays.items():
        np.save(folder / f"{name}.npy", array)
    return np.concatenate([arrays[name] for name in sorted(arrays)])


def run_config(data: Path, out: Path, samples_per_shard: int = 16):
    return config.validate(
        {
            "model": {"factory": MODEL.factory},
            "input": {"paths": [str(data / "*.npy")], "on_bad_sample": "skip"},
            # self_check recomputes with TensorFlow from the real engine: off for the fake engine
            "jacobian": {"batch_size": 6, "aggregate": ["mean", "jtj"], "self_check": {"samples": 0}},
            "output": {"path": str(out), "samples_per_shard": samples_per_shard},
        }
    )


def run_with_fake_engine(data: Path, out: Path, **kwargs) -> tuple[runner.RunResult, test_pipeline.TestPipeline]:
    pipeline = test_pipeline.TestPipeline(runner=FnApiRunner())
    result = runner.run(run_config(data, out, **kwargs), [], show_progress=False, pipeline=pipeline, engine_factory=FACTORY)
    return result, pipeline


def run_once(root: Path) -> tuple[Path, np.ndarray, runner.RunResult, test_pipeline.TestPipeline]:
    """The run into ``root / "out"`` of inputs in ``root / "data"``: (root, the samples in id order, its
    result, its pipeline)."""
    samples = write_inputs(root / "data")
    result, pipeline = run_with_fake_engine(root / "data", root / "out")
    return root, samples, result, pipeline
