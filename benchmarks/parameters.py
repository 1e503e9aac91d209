"""The parameter side against its peers, on the same weights and batch, each row in a process of its own
(its peak RSS its own), the rows' processes run in turn ``--rounds`` times (load from other work falls on
every row alike); the median rate counts. Two tasks:

- ``--task trak`` (the default): TRAK's per-sample gradients of the margin, projected to 2,048 columns;
- ``--task grand``: GraNd scores, each sample's cross-entropy gradient norm.

``python -m benchmarks.parameters --model resnet20 --samples 512 --rounds 2``
``python -m benchmarks.parameters --task grand --model mlp --samples 4096 --rounds 3``

Rows (``trak``):
- ``jacobeam``: ``ParameterEngine`` at the defaults (``wrt: parameters``, ``objective: margin``, ``reduce:
  project``, dim 2,048, batch 256, memory budget 2 GiB);
- ``jacobeam_kronecker``: the same with ``project.structure: kronecker`` (LoGra's projection: another
  ``P``, with ``E[P P^T] = I`` as the dense one, far cheaper to apply);
- ``torch_trak``: ``torch.func.vmap(grad)`` and TRAK's ``BasicProjector`` (the ``traker`` package) as TRAK
  uses it on a CPU (block of 100 columns, regenerated per call);
- ``torch_trak_whole``: the same with the whole projection held (one block of 2,048 columns);
- ``jax``: ``jax.vmap(jax.grad)`` and a Rademacher projection held whole, jitted together.

Rows (``grand``): ``jacobeam`` (``objective: {loss: sparse_categorical_crossentropy}``, ``reduce:
frobenius``); ``jacobeam_xla``: the same with ``jit_compile: auto`` (XLA where it ran faster at set-up;
the path it took is printed); ``tf_privacy``: TF Privacy's ``compute_gradient_norms`` (its fast gradient clipping: a
registry of per-layer ghost norms, Dense and Embedding in 0.9.0, so the MLP only) on a ``tf_keras`` copy;
``torch`` and ``jax``: ``vmap(grad)`` and the norms of the gradients, jitted in JAX.

Each row is checked on two samples against a float64 tape of the Keras model, so that every row
computes the same thing: its per-sample gradients before projecting (``trak``), its norms (``grand``).
TF Privacy pins numpy 1.x and TensorFlow Probability 0.22, which would replace this environment's: it is
installed without its dependencies (``benchmarks/README.md``), its row run with ``TF_USE_LEGACY_KERAS=1`` (it needs Keras 2).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

import numpy as np

DIM, BATCH = 2048, 256
ROWS = {"trak": ("jacobeam", "jacobeam_kronecker", "torch_trak", "torch_trak_whole", "jax"),
        "grand": ("jacobeam", "jacobeam_xla", "tf_privacy", "torch", "jax")}


# The CIFAR-size ResNets by (blocks per stage, widths): the built-in cifar_resnet and a ResNet-18.
RESNETS = {"resnet20": (3, (16, 32, 64)), "resnet18": (2, (64, 128, 256, 512))}


def keras_model(name: str):
    from jacobeam.transforms.engine.models import build_cifar_resnet, build_mlp

    if name in RESNETS:
        blocks, widths = RESNETS[name]
        return build_cifar_resnet(blocks=blocks, widths=widths)
    return build_mlp()


def _stages(name: str):
    """``(name prefix, stride)`` of each residual block, in order."""
    blocks, widths = RESNETS[name]
    return [(f"stage{stage + 1}_block{block + 1}", 2 if stage and not block else 1)
            for stage in range(len(widths)) for block in range(blocks)]


def samples(name: str, n: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    shape = (32, 32, 3) if name in RESNETS else (784,)
    return rng.uniform(0, 1, (n, *shape)).astype(np.float32), rng.integers(0, 10, n)


def reference_gradients(name: str, x: np.ndarray, y: np.ndarray, task: str = "trak") -> np.ndarray:
    """The task's per-sample gradients (of the margin, or of the cross-entropy), float64, by a plain tape of
    the Keras model (weights in its order)."""
    import tensorflow as tf

    from jacobeam.transforms.engine.models import wrap_model

    model = wrap_model(keras_model(name), name).with_dtype("float64").keras_model
    found = []
    for xi, yi in zip(x, y):
        with tf.GradientTape() as tape:
            z = tf.reshape(model(xi[None].astype(np.float64), training=False), (-1,))
            if task == "trak":
                value = z[int(yi)] - tf.reduce_logsumexp(tf.concat([z[: int(yi)], z[int(yi) + 1:]], 0))
            else:
                value = tf.reduce_logsumexp(z) - z[int(yi)]
        found.append(np.concatenate([np.asarray(g).reshape(-1) for g in tape.gradient(value, model.trainable_variables)]))
    return np.stack(found)


# --- the rows -------------------------------------------------------------------------------------------

def jacobeam_row(name: str, batch: int = BATCH, task: str = "trak", structure: str = "dense", jit: bool | str = False):
    from jacobeam.transforms.engine.models import wrap_model
    from jacobeam.transforms.engine.parameters import ParameterEngine
    from jacobeam.transforms.spec import EngineOptions, ParameterSide, Reduction

    model = wrap_model(keras_model(name), name)
    shape = (32, 32, 3) if name in RESNETS else (784,)
    if task == "grand":
        side, reduction, result = ParameterSide(objective="loss", loss="sparse_categorical_crossentropy"), \
            Reduction(kind="frobenius"), "frobenius"
    else:
        side, result = ParameterSide(objective="margin"), "projection"
        reduction = Reduction(kind="project", project_dim=DIM, project_structure=structure)
    options = dict(batch_size=batch, parameters=side, reduce=reduction)
    engine = ParameterEngine(model, shape, EngineOptions(**options, jit_compile=jit))

    def compute(x, y):
        return engine.compute(x, y)[0][result]

    if task == "grand":
        return compute, None, {"path": engine.path + (" + XLA" if engine.jit else "")}
    full = ParameterEngine(model, shape, EngineOptions(**{**options, "reduce": Reduction(kind="none")}))

    def gradients(x, y):
        return full.compute(x, y)[0]["gradient"]

    return compute, gradients, {"path": engine.path}


def _torch_model(name: str):
    """The Keras model's weights in a torch function ``f(params, x) -> logits`` (channels last in, as Keras)."""
    import torch
    import torch.nn.functional as F

    model = keras_model(name)
    weights = [np.asarray(v) for v in model.trainable_variables]
    names = [v.path for v in model.trainable_variables]
    params = {n: torch.tensor(w) for n, w in zip(names, weights)}
    stats = {layer.name: (torch.tensor(np.asarray(layer.moving_mean)), torch.tensor(np.asarray(layer.moving_variance)),
                          layer.epsilon) for layer in model.layers if hasattr(layer, "moving_mean")}
    if name == "mlp":
        def f(p, x):
            h = torch.tanh(x @ p[names[0]] + p[names[1]])
            h = torch.tanh(h @ p[names[2]] + p[names[3]])
            return h @ p[names[4]] + p[names[5]]

        return f, params

    def conv(p, x, layer, stride):
        w = p[f"{layer}/kernel"].permute(3, 2, 0, 1)
        k, size = w.shape[-1], x.shape[-1]
        out = -(-size // stride)
        total = max((out - 1) * stride + k - size, 0)  # TensorFlow's SAME: the extra row and column after
        x = F.pad(x, (total // 2, total - total // 2, total // 2, total - total // 2))
        return F.conv2d(x, w, stride=stride)

    def norm(p, x, layer):
        mean, var, eps = stats[layer]
        return F.batch_norm(x, mean, var, p[f"{layer}/gamma"], p[f"{layer}/beta"], training=False, eps=eps)

    def f(p, x):
        x = x.permute(0, 3, 1, 2)
        x = F.relu(norm(p, conv(p, x, "stem_conv", 1), "stem_bn"))
        for at, stride in _stages(name):
            h = F.relu(norm(p, conv(p, x, f"{at}_conv1", stride), f"{at}_bn1"))
            h = norm(p, conv(p, h, f"{at}_conv2", 1), f"{at}_bn2")
            short = norm(p, conv(p, x, f"{at}_shortcut", stride), f"{at}_shortcut_bn") if stride != 1 else x
            x = F.relu(h + short)
        return x.mean(dim=(2, 3)) @ p["logits/kernel"] + p["logits/bias"]

    return f, params


def torch_row(name: str, whole: bool, task: str = "trak"):
    import torch
    from torch.func import grad, vmap

    torch.set_num_threads(2)
    f, params = _torch_model(name)
    keys = list(params)

    def objective(p, x, y):
        z = f(p, x[None])[0]
        hot = torch.arange(z.shape[0]) == y  # one_hot calls .item(), which vmap refuses
        if task == "grand":
            return torch.logsumexp(z, 0) - (z * hot).sum()
        return (z * hot).sum() - torch.logsumexp(z.masked_fill(hot, float("-inf")), 0)

    per_sample = vmap(grad(objective), in_dims=(None, 0, 0))

    def per_weight(x, y):
        with torch.no_grad():
            g = per_sample(params, torch.from_numpy(x), torch.from_numpy(y))
        return [g[k].reshape(len(x), -1) for k in keys]

    def gradients(x, y):
        return torch.cat(per_weight(x, y), 1).numpy()

    if task == "grand":
        def norms(x, y):
            return torch.sqrt(sum(g.square().sum(1) for g in per_weight(x, y))).numpy()

        return norms, gradients, {"torch": torch.__version__}
    from trak.projectors import BasicProjector, ProjectionType

    size = sum(v.numel() for v in params.values())
    projector = BasicProjector(size, DIM, seed=0, proj_type=ProjectionType.rademacher, device="cpu",
                               block_size=DIM if whole else 100)

    def project(x, y):
        return projector.project(torch.from_numpy(gradients(x, y)), model_id=0).numpy()

    return project, gradients, {"torch": torch.__version__}


def tf_privacy_row(name: str):
    """TF Privacy's per-sample cross-entropy gradient norms (``compute_gradient_norms``, its default layer
    registry) on a ``tf_keras`` copy of the MLP with the same weights."""
    if name != "mlp":
        raise SystemExit("tf_privacy: TF Privacy 0.9.0's registry has no Conv2D or BatchNormalization rule")
    sys.skip_tf_privacy_import = True  # the package's own switch: only the modules imported below, not its pins
    import tensorflow as tf
    import tf_keras
    from tensorflow_privacy.privacy.fast_gradient_clipping import clip_grads, layer_registry

    weights = [np.asarray(v) for v in keras_model(name).trainable_variables]
    legacy = tf.keras.Sequential([tf.keras.Input((784,)), tf.keras.layers.Dense(512, activation="tanh"),
                                  tf.keras.layers.Dense(512, activation="tanh"), tf.keras.layers.Dense(10)])
    legacy.set_weights(weights)
    registry = layer_registry.make_default_layer_registry()

    def loss(labels, logits, weights=None):
        return tf.keras.losses.sparse_categorical_crossentropy(labels, logits, from_logits=True)

    norms = tf.function(lambda x, y: clip_grads.compute_gradient_norms(legacy, registry, x, y, per_example_loss_fn=loss))
    return (lambda x, y: norms(x, y).numpy()), None, {"tf_keras": tf_keras.__version__}


def jax_row(name: str, task: str = "trak"):
    import jax
    import jax.numpy as jnp
    from jax import lax

    model = keras_model(name)
    names = [v.path for v in model.trainable_variables]
    params = {n: jnp.asarray(np.asarray(v)) for n, v in zip(names, model.trainable_variables)}
    stats = {layer.name: (jnp.asarray(np.asarray(layer.moving_mean)), jnp.asarray(np.asarray(layer.moving_variance)),
                          layer.epsilon) for layer in model.layers if hasattr(layer, "moving_mean")}

    if name == "mlp":
        def f(p, x):
            h = jnp.tanh(x @ p[names[0]] + p[names[1]])
            h = jnp.tanh(h @ p[names[2]] + p[names[3]])
            return h @ p[names[4]] + p[names[5]]
    else:
        def conv(p, x, layer, stride):
            return lax.conv_general_dilated(x, p[f"{layer}/kernel"], (stride, stride), "SAME",
                                            dimension_numbers=("NHWC", "HWIO", "NHWC"))

        def norm(p, x, layer):
            mean, var, eps = stats[layer]
            return (x - mean) / jnp.sqrt(var + eps) * p[f"{layer}/gamma"] + p[f"{layer}/beta"]

        def f(p, x):
            x = jax.nn.relu(norm(p, conv(p, x, "stem_conv", 1), "stem_bn"))
            for at, stride in _stages(name):
                h = jax.nn.relu(norm(p, conv(p, x, f"{at}_conv1", stride), f"{at}_bn1"))
                h = norm(p, conv(p, h, f"{at}_conv2", 1), f"{at}_bn2")
                short = norm(p, conv(p, x, f"{at}_shortcut", stride), f"{at}_shortcut_bn") if stride != 1 else x
                x = jax.nn.relu(h + short)
            return x.mean(axis=(1, 2)) @ p["logits/kernel"] + p["logits/bias"]

    def objective(p, x, y):
        z = f(p, x[None])[0]
        if task == "grand":
            return jax.nn.logsumexp(z) - z[y]
        return z[y] - jax.nn.logsumexp(jnp.where(jnp.arange(z.shape[0]) == y, -jnp.inf, z))

    def per_weight(x, y):
        g = jax.vmap(jax.grad(objective), in_axes=(None, 0, 0))(params, x, y)
        return [g[n].reshape(x.shape[0], -1) for n in names]

    @jax.jit
    def flat(x, y):
        return jnp.concatenate(per_weight(x, y), 1)

    if task == "grand":
        @jax.jit
        def norms(x, y):
            return jnp.sqrt(sum(jnp.sum(g**2, 1) for g in per_weight(x, y)))

        return (lambda x, y: np.asarray(norms(x, y))), None, {"jax": jax.__version__}
    size = sum(int(np.prod(v.shape)) for v in params.values())
    matrix = jax.random.rademacher(jax.random.PRNGKey(0), (size, DIM), dtype=jnp.float32) / np.sqrt(DIM)

    @jax.jit
    def projected(x, y):
        return flat(x, y) @ matrix

    return (lambda x, y: np.asarray(projected(x, y))), (lambda x, y: np.asarray(flat(x, y))), {"jax": jax.__version__}


def run_row(row: str, name: str, n: int, batch: int = BATCH, task: str = "trak") -> dict:
    """In this process: build the row, check it, time it on ``n`` samples in batches of ``batch`` (jacobeam's
    engine built for it: ``jacobian.batch_size``)."""
    began = time.perf_counter()
    if row.startswith("jacobeam"):
        compute, gradients, about = jacobeam_row(name, batch, task, "kronecker" if row.endswith("kronecker") else "dense",
                                                 "auto" if row.endswith("xla") else False)
    elif row == "jax":
        compute, gradients, about = jax_row(name, task)
    elif row == "tf_privacy":
        compute, gradients, about = tf_privacy_row(name)
    else:
        compute, gradients, about = torch_row(name, row == "torch_trak_whole", task)
    x, y = samples(name, n)
    compute(x[:batch], y[:batch])  # warm-up: traced, compiled, first-call costs
    first = time.perf_counter() - began
    truth = reference_gradients(name, x[:2], y[:2], task)
    if task == "grand":  # the norms themselves
        check, truth = np.asarray(compute(x[:2], y[:2]), np.float64), np.linalg.norm(truth, axis=1)
    else:  # the gradients before projecting: each row's projection is its own
        check = np.asarray(gradients(x[:2], y[:2]), np.float64).reshape(2, -1)
    error = float(np.abs(check - truth).max() / np.abs(truth).max())
    start = time.perf_counter()
    for lo in range(0, n, batch):
        out = compute(x[lo: lo + batch], y[lo: lo + batch])
    rate = n / (time.perf_counter() - start)
    assert np.asarray(out).shape[-1] == (DIM if task == "trak" else len(x[lo: lo + batch]))
    return {"row": row, "samples_per_second": rate, "first_call_seconds": first, "error": error,
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024, **about}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--task", choices=list(ROWS), default="trak")
    parser.add_argument("--model", choices=["mlp", *RESNETS], default="resnet20")
    parser.add_argument("--samples", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--rows", help="comma-separated (default: every row of the task)")
    parser.add_argument("--batch", type=int, default=BATCH, help="samples per call of every row (default 256)")
    parser.add_argument("--row", help=argparse.SUPPRESS)  # in a worker process: one row, JSON on stdout
    args = parser.parse_args(argv)
    if args.row:
        print(json.dumps(run_row(args.row, args.model, args.samples, args.batch, args.task)))
        return
    found: dict[str, list[dict]] = {}
    for _ in range(args.rounds):
        for row in (args.rows or ",".join(ROWS[args.task])).split(","):
            env = {**os.environ, "TF_USE_LEGACY_KERAS": "1"} if row == "tf_privacy" else None
            done = subprocess.run([sys.executable, "-m", "benchmarks.parameters", "--row", row, "--model", args.model,
                                   "--samples", str(args.samples), "--batch", str(args.batch), "--task", args.task],
                                  capture_output=True, text=True, env=env)
            if done.returncode:
                print(f"{row}: failed: {done.stderr.strip().splitlines()[-1] if done.stderr.strip() else done.returncode}")
                continue
            found.setdefault(row, []).append(json.loads(done.stdout.strip().splitlines()[-1]))
    base = statistics.median(r["samples_per_second"] for r in found.get("jacobeam", [{"samples_per_second": 1}]))
    what = f"TRAK margin gradients projected to {DIM}" if args.task == "trak" else "GraNd: cross-entropy gradient norms"
    print(f"{args.model}: {what}, {args.samples} samples in batches of {args.batch}, median of {args.rounds} round(s)")
    checked = "grad rel err" if args.task == "trak" else "norm rel err"
    print(f"{'row':18} {'samples/s':>10} {'x jacobeam':>10} {'first call s':>12} {'peak RSS MB':>11} {checked:>12}  path")
    for row, results in found.items():
        rate = statistics.median(r["samples_per_second"] for r in results)
        paths = ", ".join(sorted({r["path"] for r in results if "path" in r}))  # a timed choice may differ by round
        print(f"{row:18} {rate:10.1f} {rate / base:10.2f} {statistics.median(r['first_call_seconds'] for r in results):12.1f} "
              f"{max(r['peak_rss_mb'] for r in results):11,} {max(r['error'] for r in results):12.2g}  {paths}")


if __name__ == "__main__":
    main()
