"""A run's identity: what decides the values stored for a sample id, and how ids are grouped into shards.

Two runs with the same identity (and the same input data, compared file by file) store the same bits,
so one can resume or extend what the other wrote. Where a file is named, its spelling is not what
counts: a model file is compared by its content (``transforms.model_identity``), so ``m.keras``,
``./m.keras``, its absolute path and a copy of the folder that holds it are one model; the files of
``jacobian.vectors`` and ``jacobian.basis`` are compared by path, resolved (``spelled``).
"""

from __future__ import annotations

import json
import os
from typing import Any

# What the identity holds for ``model.path``: the model is compared by its content, which the manifest
# and each shard record apart (``model_identity``), not by where the file is or how its path is spelled.
MODEL_FILE = "(a model file: compared by its content)"
# The identity's keys naming a file other than the model's: compared by path, ``spelled``.
_PATH_KEYS = ("jacobian.vectors", "jacobian.basis.input", "jacobian.basis.output", "jacobian.labels.table")


def spelled(path: str) -> str:
    """A local path as one spelling, whatever way it was written: relative to the working directory when
    the file is under it (``./v.npy``, ``v.npy`` and its absolute path all give ``v.npy``; so does a copy
    of the folder, run from the copy), else absolute; a remote URL as it is."""
    if "://" in path:
        return path
    absolute = os.path.abspath(path)
    relative = os.path.relpath(absolute, os.getcwd())
    return absolute if relative == os.pardir or relative.startswith(os.pardir + os.sep) else relative


def comparable(identity: dict[str, Any]) -> dict[str, Any]:
    """An identity (this run's, or one a folder recorded, however old) with its file names as the
    comparison takes them: the model file by its content (``MODEL_FILE``), other files ``spelled``; and the
    layers of ``wrt: {parameters: [...]}`` sorted, each once (their order and repeats change nothing)."""
    found = dict(identity)
    if found.get("model.path") is not None:
        found["model.path"] = MODEL_FILE
    for key in _PATH_KEYS:
        if isinstance(found.get(key), str):
            found[key] = spelled(found[key])
    layers = found.get("jacobian.wrt.parameters")
    if isinstance(layers, list):  # a set: its weights are taken once each, in the model's order
        found["jacobian.wrt.parameters"] = sorted(set(layers))
    return found


def run_identity(config: dict[str, Any]) -> dict[str, Any]:
    """What decides the values stored for a sample id, down to the last bit, and how ids are grouped
    into shards: the model source (and ``model.logits`` where true), ``input.key`` (and
    ``input.sample_shape``, ``input.image`` where given), ``output.samples_per_shard`` and the whole
    ``jacobian`` section but ``threads`` and ``self_check`` (flattened to dotted keys, for messages
    naming the key).

    Not part of it: threads (how fast), the self-check (how the results are checked, not what they
    are), compression (how stored), the input globs (an incremental run may add one; the files
    themselves are compared one by one) and ``on_bad_sample`` (a sample is rejected or not by the data
    alone; the policy only decides whether a run with rejections goes ahead). Files are named as
    ``comparable`` takes them: ``model.path`` by its content, the others ``spelled``.
    """
    identity = {
        "model.path": config["model"].get("path"),
        "model.factory": config["model"].get("factory"),
        "model.builtin": config["model"].get("builtin"),
        "input.key": config["input"].get("key"),
        "output.samples_per_shard": config["output"]["samples_per_shard"],
    }
    # Keys added later enter only where given, so that an older run's identity (and run_key) stays valid.
    for key in ("sample_shape", "image"):
        if config["input"].get(key) is not None:
            identity[f"input.{key}"] = config["input"][key]
    if config["model"].get("logits"):  # false, the default, is what a run without the key computed
        identity["model.logits"] = True

    def flatten(prefix: str, section: dict[str, Any]) -> None:
        for key, value in section.items():
            if isinstance(value, dict):
                flatten(f"{prefix}{key}.", value)
            elif f"{prefix}{key}" != "jacobian.threads" and not prefix.startswith("jacobian.self_check."):
                identity[f"{prefix}{key}"] = value

    jacobian = dict(config.get("jacobian", {}))
    if jacobian.get("objective") == "outputs":  # the default, what a run without the key (added later) computed
        del jacobian["objective"]
    project = jacobian.get("project")
    if isinstance(project, dict) and project.get("structure") == "dense":  # likewise
        jacobian["project"] = {k: v for k, v in project.items() if k != "structure"}
    flatten("jacobian.", jacobian)
    return comparable(identity)


# Keys an identity leaves out at their default (``run_identity``): a message says the default, not null.
_LEFT_OUT = {"jacobian.objective": "outputs", "jacobian.project.structure": "dense", "model.logits": False}


def identity_differences(theirs: dict[str, Any], ours: dict[str, Any]) -> list[str]:
    """How two identities differ, one line per key; file names compared as ``comparable`` takes them (a
    folder's recorded identity may spell them as its run's config did). A key given as a word on one side
    and as a mapping on the other (``objective: margin``, ``objective: {loss: ...}``) is one line."""
    theirs, ours = _folded(comparable(theirs), comparable(ours))
    return [
        f"{key} is {json.dumps(theirs.get(key, _LEFT_OUT.get(key)))} there, "
        f"{json.dumps(ours.get(key, _LEFT_OUT.get(key)))} in this run"
        for key in sorted(set(theirs) | set(ours))
        if theirs.get(key, _LEFT_OUT.get(key)) != ours.get(key, _LEFT_OUT.get(key))
    ]


def _folded(theirs: dict[str, Any], ours: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Both identities with the dotted keys under a key the other side gives as a value folded into a mapping
    under that key."""
    parents = {key for one, other in ((theirs, ours), (ours, theirs)) for key in one
               if any(k.startswith(key + ".") for k in other)}
    if not parents:
        return theirs, ours

    def fold(identity: dict[str, Any]) -> dict[str, Any]:
        found = {}
        for key, value in identity.items():
            parent = next((p for p in parents if key.startswith(p + ".")), None)
            if parent is None:
                found[key] = value
            else:
                found.setdefault(parent, {})[key[len(parent) + 1:]] = value
        return found

    return fold(theirs), fold(ours)
