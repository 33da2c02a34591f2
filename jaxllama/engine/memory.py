"""Whether a model fits, asked before it is loaded: a model too large for the machine is refused at once, with the
bytes it needs and the bytes there are, rather than found out by the kernel's out-of-memory killer minutes later.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import psutil
from jax.sharding import Mesh

from jaxllama.core.config import ModelConfig
from jaxllama.core.ops import Ops
from jaxllama.core.params import stored_arrays_of
from jaxllama.errors import ModelTooLarge

# What a running engine holds besides its weights (compiled programs, XLA's buffers, the first KV cache, Python).
OVERHEAD = 1 << 30


def check_fits(config: ModelConfig, ops: Ops, dtype, mesh: Mesh, stored: ModelConfig | None = None) -> None:
    """Raise ModelTooLarge unless the weights `ops` prepares from those `config` describes (`dtype`: the form of its
    products, `params.product_form`),
    plus one layer being restored (as the checkpoint `stored` holds it, and as restored), plus OVERHEAD, fit: on the
    CPU in the host's available memory (a copy per replica along the mesh's `data` axis), on an accelerator in each
    device's memory (the weights split along `model`)."""
    weights = ops.weight_bytes(config, dtype)
    restoring = _layer_bytes(config) + _layer_bytes(stored or config)
    device = mesh.devices.flat[0]
    if device.platform == "cpu":
        need = weights * mesh.shape["data"] + restoring + OVERHEAD
        have, where = psutil.virtual_memory().available, "available memory"
    else:
        limit = (device.memory_stats() or {}).get("bytes_limit")
        if limit is None:
            return
        need = weights // mesh.shape["model"] + restoring + OVERHEAD
        have, where = limit, f"memory of each {device.platform} device"
    if need > have:
        raise ModelTooLarge(
            f"the model needs about {need / 2**30:.1f} GiB ({weights / 2**30:.1f} GiB of weights as "
            f"{type(ops).__name__} runs them), the {where} is {have / 2**30:.1f} GiB"
        )


def _layer_bytes(config: ModelConfig) -> int:
    """The bytes of one layer of weights as `config` stores them."""
    return sum(
        int(np.prod(shape)) * jnp.dtype(dtype).itemsize
        for name, (shape, dtype) in stored_arrays_of(config).items()
        if name.startswith("layers_0/")
    )
