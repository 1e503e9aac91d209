import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np
import pytest


@pytest.fixture
def rng():
    return np.random.default_rng(1234)


# Registers the fakegcs:// test file system (Beam finds file systems by subclass) in this process;
# runner.run passes it on to worker processes in --beam_plugins.
import tests.remote_fs  # noqa: E402,F401

# `make test` runs on two pytest-xdist processes with `--dist loadfile --no-loadscope-reorder`: each
# test file goes to one process (so its module-scoped fixtures are built once), in the order collected
# here, the longest files first, so that the two processes finish together instead of one starting the
# longest file last. (Not `--dist loadgroup`: with pytest 9.2 it no longer groups, pytest-xdist#1386.)
LONGEST_FIRST = (
    "test_real_architectures", "test_float64_copies", "test_mutants", "test_mutant_runs",
    "test_s3", "test_faults", "test_differential", "test_terminal", "test_readme", "test_dask",
    "test_workers", "test_remote", "test_lease", "test_benchmarks",
    # then the longest of `make test-fast`
    "test_engine_modes", "test_inspect_plot", "test_layer_rules", "test_multi_input", "test_bad_data", "test_resume",
    "test_engine_memory", "test_images",
    "test_more_inputs", "test_self_check", "test_store", "test_verify", "test_pipeline", "test_engine",
)


def pytest_collection_modifyitems(items):
    def rank(item):
        name = item.module.__name__.rsplit(".", 1)[-1]
        return LONGEST_FIRST.index(name) if name in LONGEST_FIRST else len(LONGEST_FIRST)

    items.sort(key=rank)  # stable: within a file, the collected order is kept
