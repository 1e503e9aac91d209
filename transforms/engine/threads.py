"""TensorFlow's thread pools: set once per process, before its first op."""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)


def configure_tf_threads(threads: int | None, warn: bool = True) -> None:
    """Set TensorFlow's intra- and inter-op pools to ``threads`` (None keeps TensorFlow's default).

    A no-op where they already have that size. Where TensorFlow already runs with other pools (a
    caller's process), they are kept, with a warning unless ``warn`` is False (the launcher sets them
    for the in-process runner's workers, which report it themselves).
    """
    if threads is None:
        return
    import tensorflow as tf

    threading_config = tf.config.threading
    if threading_config.get_intra_op_parallelism_threads() == threads:
        return
    try:
        threading_config.set_intra_op_parallelism_threads(threads)
        threading_config.set_inter_op_parallelism_threads(threads)
    except RuntimeError:  # TensorFlow already initialised in this process: keep its pools
        if warn:
            log.warning("TensorFlow already initialised; cannot set its threads to %d", threads)
