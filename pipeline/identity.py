"""A run's identity: what decides the values stored for a sample id, and how ids are grouped into shards.

Two runs with the same identity (and the same input data, compared file by file) store the same bits,
so one can resume or extend what the other wrote.
"""

from __future__ import annotations

import json
from typing import Any


def run_identity(config: dict[str, Any]) -> dict[str, Any]:
    """What decides the values stored for a sample id, down to the last bit, and how ids are grouped
    into shards: the model source (and ``model.logits`` where true), ``input.key`` (and
    ``input.sample_shape``, ``input.image`` where given), ``output.samples_per_shard`` and the whole
    ``jacobian`` section but ``threads`` and ``self_check`` (flattened to dotted keys, for messages
    naming the key).

    Not part of it: threads (how fast), the self-check (how the results are checked, not what they
    are), compression (how stored), the input globs (an incremental run may add one; the files
    themselves are compared one by one) and ``on_bad_sample`` (a sample is rejected or not by the data
    alone; the policy only decides whether a run with rejections goes ahead).
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

    flatten("jacobian.", config.get("jacobian", {}))
    return identity


def identity_differences(theirs: dict[str, Any], ours: dict[str, Any]) -> list[str]:
    return [
        f"{key} is {json.dumps(theirs.get(key))} there, {json.dumps(ours.get(key))} in this run"
        for key in sorted(set(theirs) | set(ours))
        if theirs.get(key) != ours.get(key)
    ]
