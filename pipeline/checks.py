"""Checks made in the launching process before the pipeline starts, beyond what the plan reads from
files: the model against the inputs, and the output folder's writability.

``check_model`` loads the model here, once, so that a model that cannot take the inputs' samples fails
with a message naming a file instead of failing inside every worker. It imports TensorFlow; the plan
module itself stays importable without it.
"""

from __future__ import annotations

import uuid
from pathlib import Path

from transforms.errors import ModelError, OutputError
from transforms.readers import SourceFile
from transforms.spec import ModelSource


def check_model(model: ModelSource, files: list[SourceFile], tf_threads: int | None = None) -> tuple[str, tuple[int, ...]]:
    """Load the model, check it takes the inputs' samples; returns its weight fingerprint and output shape.

    Keras files load with ``safe_mode`` on; a Python factory runs only because the config names it.
    """
    import tensorflow as tf

    # The in-process runner's workers share this process: set TensorFlow's threads before its first op
    # (the workers' own attempt then finds them set). Where TensorFlow already runs (a caller's process),
    # the workers report that; nothing to add here.
    if tf_threads is not None:
        try:
            tf.config.threading.set_intra_op_parallelism_threads(tf_threads)
            tf.config.threading.set_inter_op_parallelism_threads(tf_threads)
        except RuntimeError:
            pass

    readable = [f for f in files if f.unreadable is None and f.num_samples]
    shape, first = readable[0].sample_shape, readable[0].path
    where = f"({first}{' and the other input files' if len(readable) > 1 else ''})"
    loaded = model.load()
    if len(loaded.input_names) != 1:
        raise ModelError(
            f"{loaded.source} takes inputs {list(loaded.input_names)}; jacobeam run feeds it one array per "
            f"sample, of shape {shape} {where}"
        )
    declared = loaded.input_shapes[0] if loaded.input_shapes else None
    if declared is not None and (
        len(declared) != len(shape) or any(d is not None and d != s for d, s in zip(declared, shape))
    ):
        raise ModelError(
            f"{loaded.source} expects samples of shape {tuple(declared)}; the inputs hold samples of shape "
            f"{shape} {where}"
        )
    try:
        output = loaded.call([tf.zeros((1, *shape), tf.float32)])
    except Exception as err:  # whatever the model raises for a shape it cannot take
        raise ModelError(
            f"{loaded.source}: cannot be called on samples of shape {shape} (the samples of {first}): {err}"
        ) from err
    return loaded.fingerprint(), tuple(int(d) for d in output.shape[1:])


def check_writable(folder: str | Path) -> None:
    """Create the output folder if needed and prove that files can be created in it (and in ``shards/``):
    permission bits say little on network file systems, read-only mounts or for root, so try it."""
    from transforms import storage

    if not storage.is_local(folder):
        _check_remote_writable(str(folder))
        return
    from transforms.shards import SHARDS_DIR

    root = Path(folder)
    if root.exists() and not root.is_dir():
        raise OutputError(f"output.path {root}: exists and is not a folder")
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise OutputError(f"output.path {root}: cannot create the folder: {err.strerror or err}") from err
    for place in (root, root / SHARDS_DIR):
        if not place.is_dir():
            continue
        probe = place / f".jacobeam-write-test-{uuid.uuid4().hex[:12]}"
        try:
            probe.write_bytes(b"")
        except OSError as err:
            raise OutputError(f"output.path {root}: cannot write in {place}: {err.strerror or err}") from err
        probe.unlink()


def _check_remote_writable(folder: str) -> None:
    """Create and delete a probe object: the only way to learn that credentials and bucket allow writes."""
    from transforms import storage

    probe = storage.join(folder, f".jacobeam-write-test-{uuid.uuid4().hex[:12]}")
    try:
        storage.write_bytes(probe, b"")
        storage.delete(probe)
    except Exception as err:  # Beam wraps every file-system failure in its own error types
        raise OutputError(f"output.path {folder}: cannot write there: {err}") from err
