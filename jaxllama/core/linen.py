"""The model's parameters as a Flax Linen module: `Llama(config, dtype).init(key)["params"]` is a random params
pytree whose leaves are `nn.LogicallyPartitioned` (boxed with their logical axes, for Flax's partitioning tools), as
its family declares them (`jaxllama/models/`). `params.init_params` unboxes and shards them. Nothing loads Flax to
run a model: shapes and axes come from the declarations themselves.
"""

from __future__ import annotations

import flax.linen as nn
import jax.numpy as jnp

from jaxllama.core.config import ModelConfig
from jaxllama.models import Declared, declarations

INITIALIZERS = {"normal": nn.initializers.normal(stddev=0.02), "ones": nn.initializers.ones}


class Scope(nn.Module):
    """Declares `params` (names relative to this scope, with their declarations) in order; a name with a folder
    declares it inside a sub-scope of that folder's name. Returns the declared tree."""

    params: tuple[tuple[str, Declared], ...]
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self) -> dict:
        tree, folders = {}, {}
        for name, d in self.params:
            folder, _, rest = name.partition("/")
            if rest:
                folders.setdefault(folder, []).append((rest, d))
            else:
                init = nn.with_logical_partitioning(INITIALIZERS[d.init], d.axes)
                tree[name] = self.param(name, init, d.shape, self.dtype)
        for folder, params in folders.items():
            tree[folder] = Scope(tuple(params), self.dtype, name=folder)()
        return tree


def Llama(config: ModelConfig, dtype=jnp.float32) -> Scope:
    """The whole model's params, as a Flax module."""
    return Scope(tuple(declarations(config).items()), jnp.dtype(dtype))
