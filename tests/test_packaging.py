"""The distribution installs one import root, ``jacobeam``, from a built wheel as from the editable install."""

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_the_wheel_holds_only_jacobeam_and_runs_from_it(tmp_path):
    # Built from a copy: setuptools leaves a build/ folder in the tree it builds.
    source = tmp_path / "source"
    shutil.copytree(REPO, source, ignore=shutil.ignore_patterns(".venv", ".git", "build", "*.egg-info", "__pycache__"))
    built = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(tmp_path), str(source)],
        capture_output=True, text=True, timeout=300,
    )
    assert built.returncode == 0, built.stderr[-2000:]
    (wheel,) = tmp_path.glob("jacobeam-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert {name.split("/")[0] for name in names} == {"jacobeam", "jacobeam-0.1.0.dist-info"}
    for module in ("jacobeam/__main__.py", "jacobeam/pipeline/cli.py", "jacobeam/transforms/engine/facade.py",
                   "jacobeam/transforms/inputs/arrays.py", "jacobeam/transforms/output/shards.py",
                   "jacobeam/transforms/testing/faults.py"):
        assert module in names
    entry_points = zipfile.ZipFile(wheel).read("jacobeam-0.1.0.dist-info/entry_points.txt").decode()
    assert "jacobeam = jacobeam.pipeline.cli:main" in entry_points

    # Unpacked on the path ahead of the editable install, from a folder without the repository's.
    unpacked = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(unpacked)
    probe = (
        "import importlib.util, jacobeam, jacobeam.transforms.engine.facade as f; "
        "print(jacobeam.__file__); print(f.__file__); "
        "print(importlib.util.find_spec('transforms'), importlib.util.find_spec('pipeline'))"
    )
    env = {"PYTHONPATH": str(unpacked), "TF_CPP_MIN_LOG_LEVEL": "3", "PATH": "/usr/bin:/bin"}
    shown = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert shown.returncode == 0, shown.stderr[-2000:]
    lines = shown.stdout.split("\n")
    assert lines[0].startswith(str(unpacked)) and lines[1].startswith(str(unpacked))
    assert lines[2] == "None None"  # neither "transforms" nor "pipeline" is a top-level name
    helped = subprocess.run([sys.executable, "-m", "jacobeam", "--help"], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=300)
    assert helped.returncode == 0 and "usage: jacobeam" in helped.stdout, helped.stderr[-2000:]
