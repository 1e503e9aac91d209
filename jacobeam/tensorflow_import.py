"""TensorFlow's import without the optional packages it imports for features jacobeam never uses.

Importing TensorFlow imports JAX where JAX is installed (``tf.lite``'s converter of JAX functions looks for
it) and ``matplotlib.pyplot`` where matplotlib is (``keras.visualization``): about a second each on this
project's machines, out of a TensorFlow import of 2.5-8 s, paid by every command and every worker process
(benchmarks/README.md, "Round four: imports"). ``install`` (called when ``jacobeam`` is imported) puts a finder on
``sys.meta_path`` that, while ``tensorflow`` or ``keras`` executes its first import, hides the ones of
``HIDDEN`` that are not imported yet, so that both take their own "not installed" path, and shows them
again as soon as that import is done: later imports of JAX or matplotlib (``jacobeam plot``, a user's
code) are unchanged. Only ``tf.lite``'s JAX converter and ``keras.visualization`` keep seeing them as
absent. Where TensorFlow was imported before ``jacobeam``, nothing changes.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys

HIDDEN = ("jax", "matplotlib")
IMPORTERS = ("tensorflow", "keras")


class _HidingLoader(importlib.abc.Loader):
    """Executes the wrapped loader's module with the ``HIDDEN`` packages hidden, then hands the module
    its own loader back."""

    def __init__(self, loader):
        self.loader = loader

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module) -> None:
        hidden = [name for name in HIDDEN if name not in sys.modules]  # a nested import finds them hidden
        for name in hidden:
            sys.modules[name] = None  # `import name` raises ImportError
        try:
            self.loader.exec_module(module)
        finally:
            for name in hidden:
                if sys.modules.get(name, 0) is None:
                    del sys.modules[name]
            module.__loader__ = module.__spec__.loader = self.loader


class _Finder(importlib.abc.MetaPathFinder):
    """Finds ``IMPORTERS`` as the path would, with a hiding loader; leaves ``sys.meta_path`` once both are
    imported."""

    def find_spec(self, name, path=None, target=None):
        if name not in IMPORTERS:
            return None
        if all(other in sys.modules for other in IMPORTERS if other != name):
            sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is not None and spec.loader is not None:
            spec.loader = _HidingLoader(spec.loader)
        return spec


def install() -> None:
    """Puts the finder first on ``sys.meta_path``, once, unless TensorFlow is imported already."""
    if "tensorflow" in sys.modules or any(isinstance(finder, _Finder) for finder in sys.meta_path):
        return
    sys.meta_path.insert(0, _Finder())
