"""Whether a model fits, asked before it is loaded: a model too large for the machine is refused at once, with the
bytes it needs and the bytes there are, rather than found out by the kernel's out-of-memory killer minutes later.
"""

from __future__ import annotations

import jax.numpy as jnp
import psutil
from jax.sharding import Mesh

from jaxllama.core.config import ModelConfig
from jaxllama.core.ops import Ops
from jaxllama.errors import ModelTooLarge

# What a running engine holds besides its weights (compiled programs, XLA's buffers, the first KV cache, Python).
OVERHEAD = 1 << 30


def check_fits(config: ModelConfig, ops: Ops, dtype, mesh: Mesh, stored_dtype=None) -> None:
    """Raise ModelTooLarge unless the weights `ops` prepares from `dtype` ones, plus one layer being restored (in
    the checkpoint's `stored_dtype` and in `dtype`), plus OVERHEAD, fit: on the CPU in the host's available memory
    (a copy per replica along the mesh's `data` axis), on an accelerator in each device's memory (the weights split
    along `model`)."""
    weights = ops.weight_bytes(config, dtype)
    restoring = config.params_per_layer * (jnp.dtype(dtype).itemsize + jnp.dtype(stored_dtype or dtype).itemsize)
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
            f"{type(ops).__name__} runs them, from {jnp.dtype(dtype).name}), the {where} is {have / 2**30:.1f} GiB"
        )
