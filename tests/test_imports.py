"""``import jacobeam`` changes nothing of a process's imports: a library others import must not. Each case
runs in a fresh interpreter, as which modules an import pulls in is decided once per process. The three
cases after the first reproduce what an import hook of jacobeam's once broke (it hid JAX and matplotlib
while TensorFlow imported)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest


def _run(script: str, **env: str) -> str:
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300, env={**os.environ, **env}
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def test_import_jacobeam_leaves_meta_path_and_modules_as_they_were():
    _run(
        "import sys\n"
        "finders, modules = list(sys.meta_path), set(sys.modules)\n"
        "import jacobeam\n"
        "assert sys.meta_path == finders, sys.meta_path\n"
        "added = set(sys.modules) - modules\n"
        "assert all(name == 'jacobeam' or name.startswith('jacobeam.') for name in added), sorted(added)\n"
        "assert 'tensorflow' not in sys.modules and 'apache_beam' not in sys.modules\n"
    )


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("matplotlib") is None, reason="matplotlib is not installed")
def test_another_thread_imports_matplotlib_while_tensorflow_imports():
    out = _run(
        "import threading, jacobeam\n"
        "errors = []\n"
        "def plot():\n"
        "    try:\n"
        "        import matplotlib.pyplot\n"
        "    except Exception as err:\n"
        "        errors.append(repr(err))\n"
        "thread = threading.Thread(target=plot)\n"
        "thread.start()\n"
        "import tensorflow\n"
        "thread.join()\n"
        "assert not errors, errors\n"
        "print('ok')\n"
    )
    assert out.splitlines()[-1] == "ok"


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("jax") is None, reason="jax is not installed (the bench extra)")
def test_keras_on_the_jax_backend_imports_after_jacobeam():
    out = _run("import jacobeam, keras\nprint(keras.backend.backend())\n", KERAS_BACKEND="jax")
    assert out.splitlines()[-1] == "jax"


@pytest.mark.slow
def test_an_import_hook_after_the_first_is_still_asked_for_tensorflow():
    """A finder that serves or watches TensorFlow's import (a vendoring tool, a profiler) is consulted."""
    out = _run(
        "import sys, jacobeam\n"
        "asked = []\n"
        "class Watch:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        asked.append(name)\n"
        "        return None\n"
        "sys.meta_path.insert(1, Watch())\n"
        "import tensorflow as tf\n"
        "assert 'tensorflow' in asked, asked[:5]\n"
        "print(float(tf.reduce_sum(tf.ones(3))))\n"
    )
    assert out.splitlines()[-1] == "3.0"
