"""Per-sample references that check the engine's batched results: pure TensorFlow, no Beam.

The engine differentiates whole batches in compiled, vectorised blocks (``batch_jacobian``, batched
JVPs). A reference differentiates one sample at a time, with nothing batched: ``jacobeam verify``
(``pipeline.verify``) and the run's self-check (``transforms.self_check``) both recompute samples with
``tape_function``, and judge the differences with the same tolerances (``tolerance``).
"""

from __future__ import annotations

import numpy as np

from jacobeam.transforms.engine.diagnostics import AGREEMENT

# Largest relative error between two computations of one derivative in the compute dtype that differ
# only in the order of operations (batched vs per sample): the engine's own agreement tolerance.
RTOL = AGREEMENT


def store_roundoff(name: str) -> float:
    """Twice the machine epsilon of the stored dtype ``name``: two computations that agree before
    rounding to it can differ by this much after (relative to their largest entry)."""
    if name == "bfloat16":
        import ml_dtypes

        return 2 * float(ml_dtypes.finfo(ml_dtypes.bfloat16).eps)
    return 2 * float(np.finfo(np.dtype(name)).eps)


def tolerance(rtol: float, store: str) -> float:
    """``rtol``, widened to what rounding to the stored dtype can add (float16, bfloat16; float32
    values of a float64 computation)."""
    return max(rtol, store_roundoff(store))


def tape_function(
    call,
    shapes: list[tuple[int, ...]],
    forward: bool = False,
    dtype: str = "float32",
    wrt: list[int] | None = None,
    directions: np.ndarray | None = None,
    rows: bool = False,
):
    """``(x_1, ..., x_k) -> (y, [dy/dx_j for j in wrt])`` for one sample of each model input (each
    ``(1, *shape)`` in ``dtype``), each ``(1, *out, 1, *in)``: the full Jacobian, no batch assumption.
    ``wrt``: the inputs to differentiate by (default all).

    ``rows`` (reverse mode only): the function takes one more argument, the flat output indices
    ``(1, k)`` int32 of the rows to differentiate, and returns only those rows, each ``(1, k, 1, *in)``:
    for a selection from many outputs (a label of 1,000 classes) the full Jacobian of one ImageNet-size
    sample is a thousand backward passes and tens of GB, where the rows asked for are one.

    Reverse mode by default: one vector-Jacobian product per output row, each a compiled ``tape.gradient``
    of the one sample seeded with that row's one-hot cotangent, called in a Python loop. Unlike
    ``tape.jacobian`` it shares no vectorisation (``pfor``) with the engine, holds one backward pass in
    memory whatever the number of rows, and its graph traces in a third of the time (the trace, once per
    worker, is most of the self-check's cost: benchmarks/README.md).

    ``forward``: one forward-mode JVP per input entry, in a sequential loop (no vectorisation), for runs whose
    engine used forward mode. Where the model is not differentiable (``sqrt`` at 0), the two modes put NaN and
    inf in different places, and the reference must fail where the run did. With ``directions`` ``(c, d)``
    (forward only, one input in ``wrt``), the JVPs run along its rows instead of the input entries: ``J R`` as
    ``(1, *out, c)``.
    """
    import tensorflow as tf

    if rows and forward:
        raise ValueError("rows: reverse mode only")
    dtype = tf.as_dtype(dtype)
    wrt = list(range(len(shapes))) if wrt is None else list(wrt)
    given = None if directions is None else tf.constant(np.asarray(directions), dtype)

    def jvp_columns(xs: list, k: int, y):
        shape = shapes[k]
        size = int(np.prod(shape, dtype=np.int64))
        count = size if given is None else int(given.shape[0])

        def column(i):
            direction = tf.one_hot(i, size, dtype=dtype) if given is None else tf.gather(given, i)
            tangent = tf.reshape(direction, (1, *shape))
            with tf.autodiff.ForwardAccumulator(xs[k], tangent) as accumulator:
                out = tf.cast(call(xs), dtype)
            jvp = accumulator.jvp(out, unconnected_gradients=tf.UnconnectedGradients.ZERO)
            return tf.reshape(jvp, [-1])

        columns = tf.map_fn(column, tf.range(count), fn_output_signature=dtype, parallel_iterations=1)
        tail = [count] if given is not None else [1, *shape]
        return tf.reshape(tf.transpose(columns), tf.concat([tf.shape(y), tail], 0))

    # No autograph: no tensor-dependent Python control flow here, and converting the source costs the
    # first call (the self-check's one-time cost per worker) time for nothing (benchmarks/README.md).
    signature = [tf.TensorSpec((1, *shape), dtype) for shape in shapes]
    if forward:

        @tf.function(input_signature=signature, autograph=False)
        def jvps(*xs):
            xs = list(xs)
            y = tf.cast(call(xs), dtype)
            return y, [jvp_columns(xs, k, y) for k in wrt]

        return jvps

    @tf.function(input_signature=[*signature, tf.TensorSpec((), tf.int32)], autograph=False)
    def row(*args):
        """``(y, [dy_row/dx_j])``: the one-hot cotangent of flat output ``row`` pulled back, each ``(1, *in)``."""
        xs = list(args[:-1])
        with tf.GradientTape() as tape:
            for k in wrt:
                tape.watch(xs[k])
            y = tf.cast(call(xs), dtype)
        cotangent = tf.reshape(tf.one_hot(args[-1], tf.size(y), dtype=dtype), tf.shape(y))
        return y, tape.gradient(y, [xs[k] for k in wrt], output_gradients=cotangent,
                                unconnected_gradients=tf.UnconnectedGradients.ZERO)

    row = row.get_concrete_function()  # traced now; called directly, as per-row calls add up

    def one(*args):
        xs = args[: len(shapes)]
        chosen = np.asarray(args[-1]).reshape(-1).tolist() if rows else [0]
        y, first = row(*xs, tf.constant(chosen[0], tf.int32))
        if not rows:
            chosen = range(int(np.prod(y.shape)))
        pulled = [first, *(row(*xs, tf.constant(i, tf.int32))[1] for i in chosen[1:])]
        lead = [1, len(chosen)] if rows else list(y.shape)
        return y, [tf.reshape(tf.stack([p[j] for p in pulled]), [*lead, 1, *shapes[k]]) for j, k in enumerate(wrt)]

    return one
