"""The engine's set-up decisions as plain JSON, so that a later engine of the same model, configuration,
TensorFlow and device can take them instead of probing again.

Set-up checks the model (it takes the samples; its samples do not interact inside a batch), probes and
compares paths (agreement with the reference path, XLA against the plain graph), times them where a
choice is open and shrinks sizes that ran out of memory. Each outcome is decided by the model's
structure and weights, the engine options, the operands, TensorFlow and the device: ``key`` holds all
of them, so decisions reused under an equal key are the decisions a new set-up would take (timed
choices aside, which were right on this device). A model whose structure cannot be named cheaply (not
a Keras model, or one whose configuration does not serialise) has no key: its engine always probes.
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

from jacobeam.transforms.engine.blocks import Path
from jacobeam.transforms.engine.budget import Sizes
from jacobeam.transforms.engine.executor import Plan
from jacobeam.transforms.engine.models import LoadedModel
from jacobeam.transforms.engine.operands import Operands
from jacobeam.transforms.spec import EngineOptions, version

FORMAT = 1


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


def _structure(keras_model) -> str:
    """The model's configuration with every name (of a layer, an input, the model) replaced by the
    order it first appears in: Keras numbers default names per process (``dense_3``), which says
    nothing of the model, and connections refer to layers by name."""
    config = json.loads(keras_model.to_json())
    names: dict[str, str] = {}

    def collect(value) -> None:
        if isinstance(value, dict):
            if isinstance(value.get("name"), str):
                names.setdefault(value["name"], f"#{len(names)}")
            for item in value.values():
                collect(item)
        elif isinstance(value, list):
            for item in value:
                collect(item)

    def renamed(value):
        if isinstance(value, dict):
            return {k: renamed(v) for k, v in value.items()}
        if isinstance(value, list):
            return [renamed(v) for v in value]
        return names.get(value, value) if isinstance(value, str) else value

    collect(config)
    return json.dumps(renamed(config), sort_keys=True)


def key(model: LoadedModel, fingerprint: str, input_shapes: Sequence[tuple[int, ...]], options: EngineOptions) -> dict | None:
    """What decides the set-up's outcome (see the module docstring); None where it cannot be named."""
    if model.keras_model is None:
        return None
    import keras
    import tensorflow as tf

    try:
        structure = hashlib.sha256(_structure(model.keras_model).encode()).hexdigest()
    except Exception:  # noqa: BLE001 - a layer without a serialisable config (a Lambda, a custom layer)
        return None  # unnamed structure: always probe
    threading = tf.config.threading
    found = {
        "format": FORMAT,
        "jacobeam": version(),
        "tensorflow": tf.__version__,
        "keras": keras.__version__,
        "devices": _devices(),
        "threads": [threading.get_intra_op_parallelism_threads(), threading.get_inter_op_parallelism_threads()],
        "model_fingerprint": fingerprint,
        "model_structure": structure,
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
