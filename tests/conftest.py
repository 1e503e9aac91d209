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
