"""Per-sample references that check the engine's batched results: pure TensorFlow, no Beam.

The engine differentiates whole batches in compiled, vectorised blocks (``batch_jacobian``, batched
JVPs). A reference differentiates one sample at a time, with nothing batched: ``jacobeam verify``
(``pipeline.verify``) and the run's self-check (``transforms.self_check``) both recompute samples with
``tape_function``, and judge the differences with the same tolerances (``tolerance``).
"""

from __future__ import annotations

import functools

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
    chunk: int = 8,
):
    """``(x_1, ..., x_k) -> (y, [dy/dx_j for j in wrt])`` for ``n`` samples of each model input (each
    ``(n, *shape)`` in ``dtype``): ``y`` ``(n, *out)`` and each Jacobian ``(n, *out, *in)`` (numpy), every sample's
    full Jacobian computed on its own, no batch assumption. ``wrt``: the inputs to differentiate by (default
    all). The function's ``graph`` is the traced computation (``foreign_float_op`` reads it).

    ``rows`` (reverse mode only): the function takes one more argument, the flat output indices ``(n, r)``
    of the rows to differentiate, each sample's own, and returns only those rows, each Jacobian
    ``(n, r, *in)``: for a selection from many outputs (a label of 1,000 classes) the full Jacobian of one
    ImageNet-size sample is a thousand backward passes and tens of GB, where the rows asked for are one.

    Reverse mode by default: each sample is copied once per output row, ``chunk`` copies per call, and each
    copy's one-hot cotangent pulled back in one compiled ``tape.gradient``: the samples of a call (a shard's
    checked samples) share its fixed cost, and no copy's gradient involves another (no vectorisation, no
    ``pfor``, nothing shared with the engine). ``pad=True`` in a call adds one more copy to every batch (its
    row dropped): the same derivatives computed with another batch shape, for which oneDNN may pick other
    kernels, which is a second, independent float32 computation of them (``transforms.self_check``).

    ``forward``: one forward-mode JVP per sample and input entry, each of a copy of the sample carrying that
    entry's one-hot tangent (no vectorisation), ``chunk`` copies per call, for runs whose engine used
    forward mode. Where the model is not differentiable (``sqrt`` at 0), the two modes put NaN and inf in
    different places, and the reference must fail where the run did. With ``directions`` ``(c, d)``
    (forward only, one input in ``wrt``), the JVPs run along its rows instead of the input entries: ``J R``
    as ``(n, *out, c)``.
    """
    import tensorflow as tf

    if rows and forward:
        raise ValueError("rows: reverse mode only")
    dtype = tf.as_dtype(dtype)
    wrt = list(range(len(shapes))) if wrt is None else list(wrt)

    # No autograph: no tensor-dependent Python control flow here, and converting the source costs the
    # first call (the self-check's one-time cost per worker) time for nothing (benchmarks/README.md).
    signature = [tf.TensorSpec((None, *shape), dtype) for shape in shapes]
    if forward:
        return _forward_reference(call, shapes, dtype, wrt, directions, chunk, signature)

    @tf.function(input_signature=[*signature, tf.TensorSpec((None,), tf.int32)], autograph=False)
    def pull(*args):
        """``(y, [d y_r / dx_j])`` for copies of samples, each seeded with its row ``r`` one-hot: ``y``
        ``(copies, *out)``, each pulled-back ``(copies, *in)``."""
        copies, chosen = list(args[:-1]), args[-1]
        with tf.GradientTape() as tape:
            for k in wrt:
                tape.watch(copies[k])
            y = tf.cast(call(copies), dtype)
        cotangent = tf.reshape(tf.one_hot(chosen, tf.size(y[0]), dtype=dtype), tf.shape(y))
        return y, tape.gradient(y, [copies[k] for k in wrt], output_gradients=cotangent,
                                unconnected_gradients=tf.UnconnectedGradients.ZERO)

    pull = pull.get_concrete_function()  # traced now; called directly, as per-chunk calls add up
    out = pull.structured_outputs[0].shape[1:]

    def many(*args, pad: bool = False):
        xs = [np.asarray(x, dtype.as_numpy_dtype) for x in args[: len(shapes)]]
        n = len(xs[0])
        if rows:
            index = np.asarray(args[-1], np.int32).reshape(n, -1)
        else:
            size = out.num_elements() if out.is_fully_defined() else int(
                tf.size(pull(*[x[:1] for x in xs], tf.constant([0], tf.int32))[0][0]))
            index = np.tile(np.arange(size, dtype=np.int32), (n, 1))
        width = index.shape[1]
        chosen = index.reshape(-1)
        y, *pulled = _by_copies(pull, xs, np.repeat(np.arange(n), width), lambda part: chosen[part], chunk, pad)
        y = y[::width]
        lead = (n, width) if rows else y.shape
        return y, [p.reshape(*lead, *shapes[k]) for p, k in zip(pulled, wrt)]

    def warm() -> None:
        """One call on zeros: TensorFlow optimises a function's graph at its first call (a second or more
        on ImageNet-size nets), which a check's first call then need not pay."""
        pull(*[tf.zeros((1, *shape), dtype) for shape in shapes], tf.constant([0], tf.int32))

    many.graph, many.warm = pull.graph, warm
    return many


def _by_copies(function, xs: list[np.ndarray], owner: np.ndarray, seeds, chunk: int, pad: bool = False):
    """``function`` (a traced reference) called on copies of samples, ``chunk`` at a time: copy ``i`` is
    sample ``owner[i]`` of ``xs`` with its seed (a row to pull back, a tangent), ``seeds(part)`` giving those
    of the copies ``part`` (a slice), made per call so that no more than a chunk's exist at once. ``pad``:
    one more copy per call (another batch shape), its outputs dropped. Returns each of ``function``'s
    outputs, one row per copy, in numpy."""
    import tensorflow as tf

    found = []
    for lo in range(0, len(owner), chunk):
        part = slice(lo, lo + chunk)
        copies, seed = owner[part], seeds(part)
        count = len(copies)
        if pad:
            copies, seed = np.append(copies, copies[0]), np.concatenate([seed, seed[:1]])
        outputs = function(*[tf.constant(np.take(x, copies, axis=0)) for x in xs], tf.constant(seed))
        found.append([output.numpy()[:count] for output in tf.nest.flatten(outputs)])
    return [np.concatenate(column) for column in zip(*found)]


def _forward_reference(call, shapes, dtype, wrt: list[int], directions, chunk: int, signature):
    """``tape_function``'s forward mode: per differentiated input, a traced ``push`` takes copies of samples,
    each with its own tangent (an input entry's one-hot, or a row of ``directions``), and returns each copy's JVP
    by one ``ForwardAccumulator`` pass; ``chunk`` copies per call. One copy per sample and column: a plain
    forward-mode JVP of that one sample along that one direction, nothing vectorised by pfor, and no loop in
    the graph (a ``map_fn`` over columns took 0.4 s to trace and 0.3 s to optimise on W4, per dtype)."""
    import tensorflow as tf

    def pusher(k: int):
        @tf.function(input_signature=[*signature, tf.TensorSpec((None, *shapes[k]), dtype)], autograph=False)
        def push(*args):
            copies, tangent = list(args[:-1]), args[-1]
            with tf.autodiff.ForwardAccumulator(copies[k], tangent) as accumulator:
                y = tf.cast(call(copies), dtype)
            return y, accumulator.jvp(y, unconnected_gradients=tf.UnconnectedGradients.ZERO)

        return push.get_concrete_function()  # traced now; called directly, as per-chunk calls add up

    pushes = {k: pusher(k) for k in wrt}
    numpy_dtype = dtype.as_numpy_dtype
    rows = None if directions is None else np.asarray(directions, numpy_dtype)

    def tangents(part: slice, column: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
        """The tangents ``(c, *shape)`` of the copies ``part``, whose columns are ``column[part]``: rows of
        ``directions``, or one-hots (never the identity whole)."""
        columns = column[part]
        if rows is not None:
            return rows[columns].reshape(-1, *shape)
        found = np.zeros((len(columns), int(np.prod(shape, dtype=np.int64))), numpy_dtype)
        found[np.arange(len(columns)), columns] = 1
        return found.reshape(-1, *shape)

    def along(*xs, pad: bool = False):
        xs = [np.asarray(x, numpy_dtype) for x in xs]
        n, y, found = len(xs[0]), None, []
        for k in wrt:
            shape = shapes[k]
            size = int(np.prod(shape, dtype=np.int64))
            count = size if rows is None else len(rows)
            seeds = functools.partial(tangents, column=np.tile(np.arange(count), n), shape=shape)
            y, jvp = _by_copies(pushes[k], xs, np.repeat(np.arange(n), count), seeds, chunk)
            y = y[::count]
            jvp = jvp.reshape(n, count, -1)  # (n, columns, m)
            tail = (count,) if rows is not None else shape
            found.append(np.moveaxis(jvp, 1, -1).reshape(*y.shape, *tail))
        return y, found

    def warm() -> None:
        for k, push in pushes.items():
            push(*[tf.zeros((1, *shape), dtype) for shape in shapes], tf.zeros((1, *shapes[k]), dtype))

    along.graph, along.warm = pushes[wrt[0]].graph, warm
    return along


def forward_function(call, shapes: list[tuple[int, ...]], dtype: str = "float32"):
    """``(x_1, ..., x_k) -> y``: the model's outputs at ``n`` samples (each ``(n, *shape)`` in ``dtype``),
    for the rows a check chooses from them (``argmax``, ``top_k``)."""
    import tensorflow as tf

    dtype = tf.as_dtype(dtype)

    @tf.function(input_signature=[tf.TensorSpec((None, *shape), dtype) for shape in shapes], autograph=False)
    def outputs(*xs):
        return tf.cast(call(list(xs)), dtype)

    return outputs.get_concrete_function()


def foreign_float_op(graph, dtype: str) -> str | None:
    """The first op of ``graph`` (a traced reference) that computes a floating-point result in another
    dtype than ``dtype``, as ``"name (type, dtype)"``, or None. Constants are left out (a float32
    epsilon cast up is a value of the model, not a computation in float32). A Keras 3 model rebuilt with
    float64 layers computes in float64 throughout; ``keras.config.set_floatx`` alone does not make one,
    and a layer that casts to float32 inside would silently make the "float64 truth" a float32 one."""
    import tensorflow as tf

    want = tf.as_dtype(dtype)
    for op in graph.get_operations():
        if op.type == "Const":
            continue
        for out in op.outputs:
            if out.dtype.is_floating and out.dtype != want:
                return f"{op.name} ({op.type}, {out.dtype.name})"
    return None
