"""What the parameters are: shapes, dtypes, logical axes and shardings, all derived from the
declarations in `model.py` (never written down twice)."""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from jaxllama.core.config import ModelConfig
from jaxllama.core.model import Llama, empty_cache
from jaxllama.core.sharding import named_sharding


def _init(config: ModelConfig, dtype, key):
    tokens = jnp.zeros((1, 1), jnp.int32)
    return Llama(config, dtype).init(key, tokens, tokens, empty_cache(config, 1, 1, dtype))["params"]


@functools.lru_cache(maxsize=16)
def _boxed_abstract(config: ModelConfig, dtype_name: str):
    return jax.eval_shape(functools.partial(_init, config, jnp.dtype(dtype_name)), jax.random.key(0))


def _is_boxed(x) -> bool:
    return isinstance(x, nn.LogicallyPartitioned)


def param_layout(config: ModelConfig) -> dict[str, tuple[tuple[int, ...], tuple[str, ...]]]:
    """Flat {'layers_0/attention/wq': (shape, logical_axes)} for every parameter."""
    boxed = _boxed_abstract(config, "float32")
    flat = jax.tree_util.tree_flatten_with_path(boxed, is_leaf=_is_boxed)[0]
    return {"/".join(k.key for k in path): (tuple(leaf.value.shape), tuple(leaf.names)) for path, leaf in flat}


def logical_axes(config: ModelConfig):
    """Pytree (like params) of logical axis-name tuples."""
    return jax.tree.map(lambda b: tuple(b.names), _boxed_abstract(config, "float32"), is_leaf=_is_boxed)


def param_shardings(config: ModelConfig, mesh: Mesh):
    """Pytree (like params) of NamedSharding on `mesh`."""
    return jax.tree.map(
        lambda axes: named_sharding(mesh, config, axes),
        logical_axes(config),
        is_leaf=lambda x: isinstance(x, tuple),
    )


def abstract_params(config: ModelConfig, dtype, mesh: Mesh | None = None):
    """Pytree of ShapeDtypeStruct (with shardings when `mesh` is given): the target for a restore."""
    boxed = _boxed_abstract(config, jnp.dtype(dtype).name)
    shapes = jax.tree.map(lambda b: b.value, boxed, is_leaf=_is_boxed)
    if mesh is None:
        return shapes
    return jax.tree.map(
        lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
        shapes,
        param_shardings(config, mesh),
    )


def init_params(config: ModelConfig, key: jax.Array, dtype=jnp.float32, mesh: Mesh | None = None):
    """Random parameters (normal(0.02) weights, unit norms), sharded on `mesh` when given."""
    init = functools.partial(_init, config, jnp.dtype(dtype))
    if mesh is None:
        return nn.meta.unbox(jax.jit(init)(key))
    shardings = param_shardings(config, mesh)
    return jax.jit(lambda k: nn.meta.unbox(init(k)), out_shardings=shardings)(key)
