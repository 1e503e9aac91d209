"""The engine's set-up decisions as plain JSON, so that a later engine of the same model, configuration,
TensorFlow and device can take them instead of probing again.

Set-up checks the model (it takes the samples; its samples do not interact inside a batch), probes and
compares paths (agreement with the reference path, XLA against the plain graph), times them where a
choice is open and shrinks sizes that ran out of memory. Each outcome is decided by the model, the
engine options, the operands, TensorFlow and the device: ``key`` holds all of them (the model by the
run's own model identity, ``transforms.model_identity``), so decisions reused under an equal key are
the decisions a new set-up would take (timed choices aside, which were right on this device). A model
whose structure cannot be named cheaply (not a Keras model, or one wrapped by hand whose configuration
does not serialise) has no key: its engine always probes.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import platform
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from jacobeam.transforms import model_identity
from jacobeam.transforms.engine.blocks import Path
from jacobeam.transforms.engine.budget import Sizes
from jacobeam.transforms.engine.executor import Plan
from jacobeam.transforms.engine.models import LoadedModel
from jacobeam.transforms.engine.operands import Operands
from jacobeam.transforms.spec import EngineOptions

FORMAT = 2  # 2: the model named by its identity (transforms.model_identity)


def _cpu() -> str:
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def _devices() -> list[str]:
    import tensorflow as tf

    found = [f"cpu {platform.machine()} {_cpu()} x{os.cpu_count()}"]
    for device in tf.config.list_physical_devices("GPU"):
        details = tf.config.experimental.get_device_details(device)
        found.append(f"{device.name} {details.get('device_name', '')} {details.get('compute_capability', '')}")
    return found


def key(model: LoadedModel, fingerprint: str, input_shapes: Sequence[tuple[int, ...]], options: EngineOptions) -> dict | None:
    """What decides the set-up's outcome (see the module docstring); None where it cannot be named."""
    if model.keras_model is None:
        return None
    import tensorflow as tf

    if model.identity:  # loaded from a source: the run's model identity (transforms.model_identity)
        named = model_identity.digest(model.identity)
    else:  # wrapped by hand: its configuration, as the identity of a Keras file names it
        try:
            named = model_identity.architecture_digest(json.loads(model.keras_model.to_json()))
        except Exception:  # noqa: BLE001 - a layer without a serialisable config (a Lambda, a custom layer)
            return None  # unnamed structure: always probe
    threading = tf.config.threading
    versions = model_identity.library_versions()
    found = {
        "format": FORMAT,
        **{name: versions[name] for name in ("jacobeam", "tensorflow", "keras")},
        "devices": _devices(),
        "threads": [threading.get_intra_op_parallelism_threads(), threading.get_inter_op_parallelism_threads()],
        "model_fingerprint": fingerprint,
        "model_identity": named,
        "input_shapes": [list(shape) for shape in input_shapes],
        "options": dataclasses.asdict(options),
    }
    return json.loads(json.dumps(found, default=str))  # as it reads back: tuples are lists


def operands_digest(operands: Operands) -> str:
    """The operands' matrices (vectors, projections, bases read from files): a file changed under the
    same configured path changes the blocks."""
    digest = hashlib.sha256(repr((operands.selection, operands.outputs, operands.sizes)).encode())
    for matrix in (operands.left, operands.right, operands.after):
        digest.update(b"-" if matrix is None else np.ascontiguousarray(matrix).tobytes() + str(matrix.shape).encode())
    return digest.hexdigest()


def encode(key: dict, output_shape: Sequence[int], activations: int, operands: Operands, plan: Plan, telemetry: Mapping) -> dict:
    return {
        "key": key,
        "output_shape": list(output_shape),
        "activations": activations,
        "operands": operands_digest(operands),
        "plan": {
            "mode": plan.path.mode,
            "jit_compile": plan.path.jit,
            "double_reverse": plan.path.double_reverse,
            "layer_rules": plan.path.layer_rules,
            "batch_size": plan.sizes.batch,
            "block_rows": [list(pair) for pair in plan.sizes.rows],
            "size_notes": list(plan.sizes.notes),
            "reasons": list(plan.reasons),
        },
        "candidates": list(telemetry.get("candidates", [])),
        "pfor_fallbacks": list(telemetry.get("pfor_fallbacks", [])),
    }


def decode_plan(decisions: Mapping[str, Any]) -> Plan:
    """The plan of ``encode``'s ``decisions``; KeyError, TypeError or ValueError where they are malformed."""
    plan = decisions["plan"]
    sizes = Sizes(
        int(plan["batch_size"]),
        tuple((int(k), int(rows)) for k, rows in plan["block_rows"]),
        tuple(str(note) for note in plan["size_notes"]),
    )
    if plan["mode"] not in ("reverse", "reverse_loop", "forward") or sizes.batch < 1 or any(r < 1 for _, r in sizes.rows):
        raise ValueError(f"not a plan: {plan}")
    path = Path(str(plan["mode"]), bool(plan["jit_compile"]), bool(plan["double_reverse"]), bool(plan["layer_rules"]))
    return Plan(path, sizes, tuple(str(reason) for reason in plan["reasons"]))
