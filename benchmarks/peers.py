"""The workloads in JAX and PyTorch, built from the same numpy weights as the Keras models.

Each builder returns a per-sample function ``f(x[*input_shape]) -> y[*output_shape]``, the form that
``vmap(jacrev(f))`` / ``vmap(jacfwd(f))`` want. Samples keep Keras' channels-last layout, so every
framework's Jacobian has the same shape ``[*output_shape, *input_shape]``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from benchmarks.workloads import Conv, Coupling, Dense, Flatten, MaxPool, Permute, Workload


def jax_function(workload: Workload, params: list[list[np.ndarray]]) -> Callable[[Any], Any]:
    """``f(x[*input_shape]) -> y[*output_shape]`` in jax.numpy."""
    import jax.numpy as jnp
    from jax import lax

    activations = {"tanh": jnp.tanh, "relu": lambda v: jnp.maximum(v, 0.0), None: lambda v: v}
    arrays = [[jnp.asarray(a) for a in layer] for layer in params]

    def f(x):
        for layer, p in zip(workload.layers, arrays):
            if isinstance(layer, Dense):
                x = activations[layer.activation](x @ p[0] + p[1])
            elif isinstance(layer, Conv):
                y = lax.conv_general_dilated(x[None], p[0], (1, 1), "VALID", dimension_numbers=("NHWC", "HWIO", "NHWC"))
                x = activations[layer.activation](y[0] + p[1])
            elif isinstance(layer, MaxPool):
                x = lax.reduce_window(x, -jnp.inf, lax.max, (2, 2, 1), (2, 2, 1), "VALID")
            elif isinstance(layer, Flatten):
                x = x.reshape(-1)
            elif isinstance(layer, Coupling):
                half = x.shape[0] // 2
                st = jnp.tanh(x[:half] @ p[0] + p[1]) @ p[2] + p[3]
                x = jnp.concatenate([x[:half], x[half:] * jnp.exp(st[:half]) + st[half:]])
            elif isinstance(layer, Permute):
                x = x[p[0]]
        return x

    return f


def torch_function(workload: Workload, params: list[list[np.ndarray]]) -> Callable[[Any], Any]:
    """``f(x[*input_shape]) -> y[*output_shape]`` in torch, as a torch user would write it: images
    are turned channels-first once for the convolutions and back before ``Flatten`` (whose order the
    Dense weights expect)."""
    import torch
    import torch.nn.functional as F

    activations = {"tanh": torch.tanh, "relu": torch.relu, None: lambda v: v}
    tensors = []
    for layer, arrays in zip(workload.layers, params):
        found = [torch.from_numpy(a) for a in arrays]
        if isinstance(layer, Conv):  # HWIO -> OIHW
            found[0] = found[0].permute(3, 2, 0, 1).contiguous()
        tensors.append(found)

    def f(x):
        channels_first = False
        for layer, p in zip(workload.layers, tensors):
            if isinstance(layer, Dense):
                x = activations[layer.activation](x @ p[0] + p[1])
            elif isinstance(layer, (Conv, MaxPool)):
                if not channels_first:
                    x, channels_first = x.permute(2, 0, 1), True
                if isinstance(layer, Conv):
                    x = activations[layer.activation](F.conv2d(x, p[0], p[1]))
                else:
                    x = F.max_pool2d(x, 2)
            elif isinstance(layer, Flatten):
                x = (x.permute(1, 2, 0) if channels_first else x).reshape(-1)
            elif isinstance(layer, Coupling):
                half = x.shape[0] // 2
                st = torch.tanh(x[:half] @ p[0] + p[1]) @ p[2] + p[3]
                x = torch.cat([x[:half], x[half:] * torch.exp(st[:half]) + st[half:]])
            elif isinstance(layer, Permute):
                x = x[p[0]]
        return x

    return f
