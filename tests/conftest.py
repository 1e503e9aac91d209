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

# `make test` runs on two pytest-xdist processes with `--dist loadgroup`: each test file is one group
# (so its module-scoped fixtures are built once), except where a test gives its own `xdist_group`
# (one per architecture in test_real_architectures.py). The longest groups go first, so that the two
# processes finish together instead of one starting the longest file last.
LONGEST_FIRST = ("test_real_architectures", "test_differential", "test_faults", "test_s3", "test_readme")


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the groups
def pytest_collection_modifyitems(items):
    for item in items:
        if item.get_closest_marker("xdist_group") is None:
            item.add_marker(pytest.mark.xdist_group(item.module.__name__))

    def rank(item):
        name = item.module.__name__.rsplit(".", 1)[-1]
        return LONGEST_FIRST.index(name) if name in LONGEST_FIRST else len(LONGEST_FIRST)

    items.sort(key=rank)  # stable: within a file, the collected order is kept
