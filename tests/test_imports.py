"""``jacobeam.tensorflow_import``: TensorFlow imported after ``jacobeam`` skips JAX and matplotlib, which
stay importable afterwards. Each case runs in a fresh interpreter: which modules an import pulls in is
decided once per process."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest

OPTIONAL = [name for name in ("jax", "matplotlib") if importlib.util.find_spec(name) is not None]

REPORT = """
import json, sys
{imports}
print(json.dumps({{name: name in sys.modules for name in {names!r}}}))
"""


def _modules_after(imports: str) -> dict[str, bool]:
    script = REPORT.format(imports=imports, names=OPTIONAL)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.splitlines()[-1])


@pytest.mark.slow
@pytest.mark.skipif(not OPTIONAL, reason="neither jax nor matplotlib is installed")
def test_tensorflow_after_jacobeam_imports_neither_jax_nor_matplotlib_which_stay_importable():
    plain = _modules_after("import tensorflow")
    pulled = [name for name, imported in plain.items() if imported]
    if not pulled:
        pytest.skip(f"TensorFlow's own import no longer imports {OPTIONAL}: jacobeam.tensorflow_import can go")
    # keras first: its import of TensorFlow runs inside its own, and both are covered.
    after = _modules_after(
        "import jacobeam, keras, tensorflow as tf\n"
        "from jacobeam import tensorflow_import\n"
        "assert not any(isinstance(f, tensorflow_import._Finder) for f in sys.meta_path)\n"
        "assert not isinstance(tf.__spec__.loader, tensorflow_import._HidingLoader)\n"
        "assert float(tf.reduce_sum(tf.ones(3))) == 3.0"
    )
    assert not any(after[name] for name in pulled), after
    later = _modules_after("import jacobeam, tensorflow\n" + "\n".join(f"import {name}" for name in pulled))
    assert all(later[name] for name in pulled), later
