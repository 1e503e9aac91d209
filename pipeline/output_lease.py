"""A run's hold on its output folder: the folder's lease (``transforms.output.lease``) and the local
folders created to hold it, which a failed run removes again (``runner.run`` takes it before planning)."""

from __future__ import annotations

import logging
import os

from jacobeam.transforms.errors import OutputError
from jacobeam.transforms.output import storage
from jacobeam.transforms.output.lease import Lease
from jacobeam.transforms.output.lease import supported as lease_supported

log = logging.getLogger(__name__)


def _missing_folders(folder: str) -> list[str]:
    """``folder`` and those of its parents that do not exist, deepest first."""
    missing, path = [], os.path.abspath(folder)
    while not os.path.lexists(path):
        missing.append(path)
        parent = os.path.dirname(path)
        if parent == path:
            break
        path = parent
    return missing


def take_lease(folder: str, wait: bool) -> tuple[Lease | None, list[str]]:
    """The output folder's lease (``transforms.output.lease``), and the local folders created to hold it
    (deepest first). None on a remote file system that has no lease yet (all but S3 and GCS): said once."""
    if not storage.is_local(folder):
        if not lease_supported(folder):
            log.warning("output.path %s: no lease on this file system yet (local, S3 and GCS folders have one): "
                        "nothing stops another run from writing this folder at the same time", folder)
            return None, []
        return Lease(storage.normalize(folder)).acquire(wait=wait), []
    root = storage.normalize(folder)
    if os.path.exists(root) and not os.path.isdir(root):
        raise OutputError(f"output.path {root}: exists and is not a folder")
    created = _missing_folders(root)
    try:
        os.makedirs(root, exist_ok=True)
    except OSError as err:
        raise OutputError(f"output.path {root}: cannot create the folder: {err.strerror or err}") from err
    try:
        return Lease(root).acquire(wait=wait), created
    except OSError as err:
        remove_created(created)
        raise OutputError(f"output.path {root}: cannot write in {root}: {err.strerror or err}") from err
    except BaseException:
        remove_created(created)
        raise


def remove_created(created: list[str]) -> None:
    """A failed run's folders that it created and left empty (its lease released): removed, deepest
    first, as a failed check leaves no output folder. A folder holding anything stays."""
    for path in created:
        try:
            os.rmdir(path)
        except OSError:
            return
