"""Checks made in the launching process before the pipeline starts, beyond what the plan reads from
files: the model against the inputs, and the output folder's writability.

``check_model`` loads the model here, once, so that a model that cannot take the inputs' samples fails
with a message naming a file instead of failing inside every worker; the plan takes the model's identity
from that load (a factory's is that of the model it built: ``transforms.model_identity``), as each
worker does from its own. It imports TensorFlow; the plan module itself stays importable without it.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from jacobeam.transforms.errors import ModelError, OutputError
from jacobeam.transforms.inputs.types import SourceFile
from jacobeam.transforms.output.layout import SHARDS_DIR, WRITE_PROBE_PREFIX
from jacobeam.transforms.spec import ModelSource


def check_model(model: ModelSource, files: list[SourceFile]) -> tuple[str, tuple[int, ...], dict[str, Any]]:
    """Load the model, check it takes the inputs' samples (one array per model input); returns its
    weight fingerprint, output shape and identity (``transforms.model_identity.model_identity`` of the
    model loaded: for a factory, of the model it built, which is then not built a second time). A Keras
    file's model is kept for the run's engine in this process (``models.load``'s ``keep``): loaded once.

    Keras files load with ``safe_mode`` on; a Python factory runs only because the config names it.
    """
    import tensorflow as tf

    from jacobeam.transforms.engine.model_checks import resolve_inputs

    readable = [f for f in files if f.unreadable is None and f.num_samples]
    shape, first = readable[0].sample_shape, readable[0].path
    where = f" ({first}{' and the other input files' if len(readable) > 1 else ''})"
    loaded = model.load(keep=True)  # for an engine this process builds (``models.load``)
    if isinstance(shape, Mapping) and len(loaded.input_names) == 1:
        raise ModelError(
            f"{loaded.source} takes one input; input.key maps inputs {list(shape)} to arrays: give input.key "
            "as the name of one array"
        )
    _, shapes = resolve_inputs(loaded, shape, where)
    try:
        output = loaded.call([tf.zeros((1, *s), tf.float32) for s in shapes])
    except Exception as err:  # whatever the model raises for a shape it cannot take
        raise ModelError(
            f"{loaded.source}: cannot be called on samples of shape {shape} (the samples of {first}): {err}"
        ) from err
    return loaded.fingerprint(), tuple(int(d) for d in output.shape[1:]), loaded.identity


def check_writable(folder: str | Path) -> None:
    """Create the output folder if needed and prove that files can be created in it (and in ``shards/``):
    permission bits say little on network file systems, read-only mounts or for root, so try it."""
    from jacobeam.transforms.output import storage

    if not storage.is_local(folder):
        _check_remote_writable(str(folder))
        return

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
        probe = place / (WRITE_PROBE_PREFIX + uuid.uuid4().hex[:12])
        try:
            probe.write_bytes(b"")
        except OSError as err:
            raise OutputError(f"output.path {root}: cannot write in {place}: {err.strerror or err}") from err
        probe.unlink()


def _check_remote_writable(folder: str) -> None:
    """Create and delete a probe object: the only way to learn that credentials and bucket allow writes.

    The probe is empty on purpose: an empty object is the hardest write the output needs (``rejected.jsonl``
    when no sample is rejected), one that S3 refuses through a multipart upload (``storage.S3_PUT_BYTES``
    says how ``storage`` writes it instead), so a store that cannot take it fails here, before any work."""
    from jacobeam.transforms.output import storage

    probe = storage.join(folder, WRITE_PROBE_PREFIX + uuid.uuid4().hex[:12])
    try:
        storage.write_bytes(probe, b"")
        storage.delete(probe)
    except Exception as err:  # Beam wraps every file-system failure in its own error types
        raise OutputError(f"output.path {folder}: cannot write there: {err}") from err
