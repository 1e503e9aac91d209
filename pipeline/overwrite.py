"""``--overwrite`` of a folder holding another run's result, with no moment at which it holds neither
(``transforms.replace``).

The new result is computed in a folder of its own inside the output folder, ``OUT/.jacobeam-overwrite``
(``staging``): a run like any other there, resumed there when interrupted. Until its manifest is
committed there, the old result is whole and readable, and a failed or interrupted overwrite leaves it
so. ``finish`` then moves the new result in (``replace.move_in``); a run stopped while moving is finished
by the next run of the folder, before it plans.
"""

from __future__ import annotations

import logging
from typing import Any

from jacobeam.pipeline.folder import read_folder
from jacobeam.transforms.output import fence, storage
from jacobeam.transforms.output.layout import SHARDS_DIR
from jacobeam.transforms.replace import move_in, pending, staging

__all__ = ["finish", "pending", "staging", "unfinished", "warn_unfinished"]

log = logging.getLogger(__name__)


def unfinished(root: str) -> str | None:
    """What an ``--overwrite`` of ``root`` that stopped before its result was complete left (None: nothing):
    its staging folder holds shards that only the same ``--overwrite`` uses."""
    shards = storage.listdir(storage.join(staging(root), SHARDS_DIR))
    if not shards:
        return None
    return (f"an --overwrite stopped before its result was complete left {len(shards)} file(s) in {staging(root)}: "
            "run it again to finish it, or remove that folder")


def warn_unfinished(root: str) -> None:
    """Say what an ``--overwrite`` of ``root`` stopped early left (``unfinished``), if it left anything."""
    left = unfinished(root)
    if left:
        log.warning("%s: %s", storage.normalize(root), left)


def finish(root: str, output_path: str, guard: fence.Fence | None) -> dict[str, Any] | None:
    """Replace ``root``'s result with the one an ``--overwrite`` committed in its staging folder, if one
    did (``pending``); returns the manifest now at the top (None: nothing to finish). ``output_path``:
    ``output.path`` as the run names the folder, which the moved manifest records."""
    return move_in(root, output_path, guard, lambda folder: read_folder(folder).owned)
