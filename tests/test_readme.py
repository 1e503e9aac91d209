"""The README's commands run as written, in order, on a fresh copy of the repository after the set-up,
and then the docs' ```python and ```sh blocks that run here (``tests/docs_snippets.py``: the others say
what they need), page by page, which use the files the README's quickstart writes.

Every ```sh block is run with bash (``make test`` excepted: it is what runs this), every ```python
block with the virtualenv's Python, in a copy of the tracked files whose ``.venv`` is this checkout's.
The YAML block is the config file it says it is.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest
import yaml

from tests.docs_snippets import snippets

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
BLOCKS = re.findall(r"^```(\w+)\n(.*?)^```$", README, re.M | re.S)
DOCS = [s for s in snippets() if s.page != "README.md" and s.how == "run" and s.kind in ("python", "sh")]


def test_the_readme_has_the_blocks_this_test_runs():
    kinds = [kind for kind, _ in BLOCKS]
    assert kinds.count("sh") >= 5 and "python" in kinds and "yaml" in kinds
    assert BLOCKS[0] == ("sh", BLOCKS[0][1]) and "make demo" in BLOCKS[0][1] and "make test" in BLOCKS[0][1]


def test_the_readmes_config_is_the_config_file():
    (text,) = [body for kind, body in BLOCKS if kind == "yaml"]
    assert yaml.safe_load(text) == yaml.safe_load((ROOT / "configs" / "mnist_cnn.yaml").read_text())


def _fresh_copy(target: Path) -> None:
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    for name in tracked:
        (target / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, target / name)  # keeps times: make must see .venv as up to date
    (target / ".venv").symlink_to(Path(sys.prefix))


@pytest.mark.slow
def test_every_readme_command_runs_as_written_on_a_fresh_copy(tmp_path):
    copy = tmp_path / "jacobeam"
    _fresh_copy(copy)
    for kind, body in BLOCKS:
        if kind == "sh":
            script = "\n".join(line for line in body.splitlines() if line.split("#")[0].strip() != "make test")
            command = ["bash", "-euo", "pipefail", "-c", script]
        elif kind == "python":
            command = [str(copy / ".venv" / "bin" / "python"), "-c", body]
        else:
            continue
        done = subprocess.run(command, cwd=copy, capture_output=True, text=True, timeout=900)
        output = f"--- stdout\n{done.stdout[-3000:]}\n--- stderr\n{done.stderr[-3000:]}"
        assert done.returncode == 0, f"README block failed ({done.returncode}):\n{body}\n{output}"
    # What the quickstart promises is there.
    with h5py.File(copy / "out" / "mnist_cnn" / "jacobians.h5") as f:
        assert f["jacobian"].shape == (1000, 10, 28, 28, 1) and f["output"].shape == (1000, 10)
    with h5py.File(copy / "out" / "saliency" / "jacobians.h5") as f:
        assert f["saliency"].shape == (1000, 1, 28, 28)
        saliency = f["saliency"][:, 0]
    # The trained stand-in's maps lie on the bars (an untrained one's spread over the whole image: about
    # a tenth of the mass near the bar, the area's share).
    images = np.load(copy / "data" / "mnist" / "digits.npy")[..., 0]
    near = np.zeros(images.shape, bool)
    for i, image in enumerate(images):
        row, col = np.argwhere(image > 0).min(axis=0)
        near[i, max(row - 2, 0) : row + 10, max(col - 2, 0) : col + 5] = True
    assert np.median((saliency * near).sum(axis=(1, 2)) / saliency.sum(axis=(1, 2))) > 0.9
    assert (copy / "saliency.png").stat().st_size > 0
    with h5py.File(copy / "out" / "own" / "jacobians.h5") as f:
        assert f["jacobian"].shape == (1000, 10, 28, 28, 1)
    assert {s.page for s in DOCS} >= {"docs/beam-api.md", "docs/output.md", "docs/usage.md"}
    env = {**os.environ, "PATH": f"{copy / '.venv' / 'bin'}{os.pathsep}{os.environ['PATH']}"}  # `jacobeam ...` as installed
    for snippet in DOCS:
        command = ([str(copy / ".venv" / "bin" / "python"), "-c", snippet.body] if snippet.kind == "python"
                   else ["bash", "-euo", "pipefail", "-c", snippet.body])
        done = subprocess.run(command, cwd=copy, capture_output=True, text=True, timeout=900, env=env)
        assert done.returncode == 0, f"{snippet.name} failed ({done.returncode}):\n{snippet.body}\n{done.stderr[-3000:]}"
    with h5py.File(copy / "out" / "own_pipeline" / "jacobians.h5") as f, h5py.File(copy / "out" / "own" / "jacobians.h5") as own:
        assert f["jacobian"].shape == (64, 10, 28, 28, 1) and np.isfinite(f["jacobian"][:]).all()
        np.testing.assert_allclose(f["output"][:], own["output"][:64], rtol=1e-4, atol=1e-6)  # the same samples
    # docs/usage.md's commands: a multi-process run, replaced by an argmax run (--overwrite), and its picture
    with h5py.File(copy / "out" / "usage" / "jacobians.h5") as f:
        assert f["jacobian"].shape == (1000, 1, 28, 28, 1) and f["output_index"].shape == (1000, 1)
    assert (copy / "usage.png").stat().st_size > 0
