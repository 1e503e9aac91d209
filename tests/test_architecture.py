"""The import rules of docs/architecture.md, checked on the source: the layers, and no import cycle.

Module-level imports only (an import inside a function is how a light module defers a heavy one);
``if TYPE_CHECKING:`` blocks are not imports at run time.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FOLDERS = {"jacobeam.pipeline": ROOT / "pipeline", "jacobeam.transforms": ROOT / "transforms", "jacobeam": ROOT / "jacobeam"}


def _modules() -> dict[str, Path]:
    found = {}
    for package, folder in FOLDERS.items():
        for path in folder.rglob("*.py"):
            parts = path.relative_to(folder).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join((package, *parts))] = path
    return found


MODULES = _modules()


def _runtime_imports(path: Path) -> set[str]:
    """The modules a file imports when it is imported (top level, outside ``if TYPE_CHECKING:``)."""
    names: set[str] = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            continue
        for inner in ast.walk(node) if isinstance(node, (ast.If, ast.Try)) else (node,):
            if isinstance(inner, ast.Import):
                names.update(alias.name for alias in inner.names)
            elif isinstance(inner, ast.ImportFrom) and inner.module and not inner.level:
                modules = {f"{inner.module}.{alias.name}" for alias in inner.names} & set(MODULES)
                # "from package import module" is an import of the module; of the package otherwise.
                names.update(modules if len(modules) == len(inner.names) else {inner.module, *modules})
    return names


def _jacobeam_imports(module: str) -> set[str]:
    return {name for name in _runtime_imports(MODULES[module]) if name in MODULES and name != module}


def test_the_scan_sees_the_packages():
    assert {"jacobeam.transforms.engine.facade", "jacobeam.transforms.inputs.types", "jacobeam.pipeline.cli"} <= set(MODULES)
    assert "jacobeam.transforms.inputs.types" in _jacobeam_imports("jacobeam.transforms.inputs.arrays")


def test_no_import_cycle():
    graph = {module: _jacobeam_imports(module) for module in MODULES}
    done: set[str] = set()

    def visit(module: str, path: list[str]) -> None:
        if module in path:
            pytest.fail("import cycle: " + " -> ".join([*path[path.index(module):], module]))
        if module in done:
            return
        for imported in sorted(graph[module]):
            visit(imported, [*path, module])
        done.add(module)

    for module in sorted(graph):
        visit(module, [])


@pytest.mark.parametrize(
    "package, forbidden",
    [
        (
            "jacobeam.transforms.engine",
            ("apache_beam", "jacobeam.pipeline", "jacobeam.transforms.inputs", "jacobeam.transforms.output"),
        ),
        (
            "jacobeam.transforms.inputs",
            (
                "apache_beam.pipeline",
                "apache_beam.transforms",
                "jacobeam.pipeline",
                "jacobeam.transforms.engine",
                "tensorflow",
            ),
        ),
        (
            "jacobeam.transforms.output",
            (
                "apache_beam.pipeline",
                "apache_beam.transforms",
                "jacobeam.pipeline",
                "jacobeam.transforms.engine",
                "tensorflow",
            ),
        ),
        ("jacobeam.transforms", ("jacobeam.pipeline",)),
    ],
)
def test_layers_import_only_what_they_may(package, forbidden):
    """engine/ is pure TensorFlow; inputs/ and output/ are neither Beam nor the engine (Beam's file
    systems are allowed: remote storage goes through them) and import TensorFlow only inside the
    functions that decode; nothing under transforms/ imports the command line. Every layer may take
    names from output/layout.py, which imports nothing."""
    broken = [
        f"{module} imports {name}"
        for module in MODULES
        if module == package or module.startswith(package + ".")
        for name in _runtime_imports(MODULES[module])
        if any(name == f or name.startswith(f + ".") for f in forbidden)
        and not name.startswith("jacobeam.transforms.output.layout")
    ]
    assert not broken


@pytest.mark.parametrize("module", ["jacobeam.transforms.output.layout", "jacobeam.transforms.inputs.types"])
def test_the_shared_fact_modules_import_nothing_of_jacobeam(module):
    assert not [name for name in _runtime_imports(MODULES[module]) if name.startswith("jacobeam")]
