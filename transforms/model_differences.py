"""How two model identities (``transforms.model_identity``) differ, in words a refusal can show: the layer
and key of the architecture that changed (``layer 'hidden': activation tanh there, relu now``), the
weights, the code."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from jacobeam.transforms.model_identity import layers_of, stored, without_names


def differences(theirs: Mapping[str, Any], ours: Mapping[str, Any]) -> list[str]:
    """What changed between two identities, in words: the layers and keys of the architecture, weights,
    code. Empty when they are the same model."""
    if stored(theirs) == stored(ours):
        return []
    if theirs.get("kind") != ours.get("kind"):
        return [f"a {theirs.get('kind')} model there, a {ours.get('kind')} model now"]
    if _by_source_only(theirs) and not _by_source_only(ours):
        return ["the factory's model was identified by its module's source file there (an earlier jacobeam), "
                "by the model it builds now: the two cannot be compared"]
    found = []
    if theirs.get("architecture") != ours.get("architecture"):
        old, new = theirs.get("architecture_config"), ours.get("architecture_config")
        layers = _layer_differences(old, new) if old is not None and new is not None else []
        found += layers[:3] or ["the architecture differs"]
        if len(layers) > 3:
            found.append(f"... and {len(layers) - 3} more changes of the architecture")
    if theirs.get("weights") != ours.get("weights"):
        found.append("the model's files differ" if ours.get("kind") == "saved_model" else "the weights differ")
    if theirs.get("code") != ours.get("code"):
        found.append(f"the {ours.get('kind')}'s source code differs")
    return found


def _by_source_only(identity: Mapping[str, Any]) -> bool:
    """A factory's identity as jacobeam recorded it before it was that of the built model: its module's
    source file alone."""
    return identity.get("kind") == "factory" and identity.get("weights") is None


def _shown(value: Any) -> str:
    text = _brief(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _brief(value: Any) -> str:
    """A value of a configuration in words: a serialized Keras object (an initializer, a dtype policy) as
    ``Class(key=value, ...)`` of the keys its config sets."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("class_name"), str) and isinstance(value.get("config"), dict):
        args = ", ".join(f"{key}={_brief(item)}" for key, item in sorted(value["config"].items()) if item is not None)
        return f"{value['class_name']}({args})"
    return json.dumps(value, sort_keys=True)


def _layer_differences(old: Any, new: Any, prefix: str = "") -> list[str]:
    """Layer by layer (in order, names aside): ``layer 'd': activation tanh there, relu now``."""
    old_layers, new_layers = layers_of(old), layers_of(new)
    if old_layers is None or new_layers is None:
        return []
    found = []
    if len(old_layers) != len(new_layers):
        found.append(f"{prefix}{len(old_layers)} layers there, {len(new_layers)} now")
    for there, now in zip(old_layers, new_layers):
        name = (now.get("config") or {}).get("name", "?")
        where = f"{prefix}layer {name!r}"
        if there.get("class_name") != now.get("class_name"):
            found.append(f"{where}: {there.get('class_name')} there, {now.get('class_name')} now")
            continue
        if layers_of(there) is not None and layers_of(now) is not None:  # a model inside the model
            found += _layer_differences(there, now, f"{where} > ")
            continue
        old_config, new_config = without_names(there.get("config") or {}), without_names(now.get("config") or {})
        for key in sorted(set(old_config) | set(new_config)):
            if key != "name" and old_config.get(key) != new_config.get(key):
                found.append(f"{where}: {key} {_shown(there['config'].get(key))} there, {_shown(now['config'].get(key))} now")
        for key in ("build_config", "inbound_nodes"):
            if without_names(there.get(key)) != without_names(now.get(key)):
                found.append(f"{where}: its {key.replace('_', ' ')} differs")
    return found
