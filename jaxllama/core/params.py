"""What the parameters are: shapes, dtypes, logical axes and shardings, all derived from the declarations of the
model's family (`jaxllama/models/`, never written down twice), and how a checkpoint stores each of them, derived from
its config (`ModelConfig.form`). Random init goes through Flax (`linen.py`), imported only then.

A weight stored as blocks (`core/blocks.py`) is two arrays in a checkpoint, `NAME/quants` and `NAME/scales`, and a
`Blocks` once restored. Its quants and scales are split like the weight's out axes; along its inputs where the mesh
axis of its first input axis leaves each device whole blocks (`wo` over heads, `w2` over the MLP's hidden units).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from jaxllama.core.blocks import BLOCK, Blocks
from jaxllama.core.config import BLOCK_FORMATS, ModelConfig
from jaxllama.core.products import PRODUCT_IN_DIMS
from jaxllama.core.sharding import logical_to_spec, named_sharding, rules_for
from jaxllama.models import declarations


@functools.lru_cache(maxsize=16)
def param_layout(config: ModelConfig) -> dict[str, tuple[tuple[int, ...], tuple[str, ...]]]:
    """Flat {'layers_0/attention/wq': (shape, logical_axes)} for every parameter, in the order of the params
    pytree's leaves (each level's names sorted, as jax orders a dict's keys)."""
    declared = declarations(config)
    return {name: declared[name][:2] for name in sorted(declared, key=lambda name: name.split("/"))}


def _tree(config: ModelConfig, leaf) -> dict:
    """The params pytree's shape, with `leaf(name, shape, axes)` at each parameter."""
    tree: dict = {}
    for name, (shape, axes) in param_layout(config).items():
        node = tree
        *folders, last = name.split("/")
        for folder in folders:
            node = node.setdefault(folder, {})
        node[last] = leaf(name, shape, axes)
    return tree


def param_shardings(config: ModelConfig, mesh: Mesh):
    """Pytree (like params) of NamedSharding on `mesh`."""
    return _tree(config, lambda name, shape, axes: named_sharding(mesh, config, axes))


def block_in_dims(name: str) -> int | None:
    """The input dims of the weight of flat name `name` if it may be stored as blocks (every product's weight and the
    embedding, whose lookup dequantizes the rows it gathers), else None."""
    leaf = name.rpartition("/")[2]
    return 1 if leaf == "embedding" else PRODUCT_IN_DIMS.get(leaf)


def _blocks_shapes(shape: tuple[int, ...], in_dims: int, format: str) -> dict[str, jax.ShapeDtypeStruct]:
    out, n_in = shape[: len(shape) - in_dims], int(np.prod(shape[len(shape) - in_dims :]))
    quants = (*out, n_in) if format == "q8_0" else (*out, n_in // 2)
    return {
        "quants": jax.ShapeDtypeStruct(quants, jnp.int8 if format == "q8_0" else jnp.uint8),
        "scales": jax.ShapeDtypeStruct((*out, n_in // BLOCK), jnp.float16),
    }


def check_forms(config: ModelConfig) -> None:
    """ValueError unless every weight `config.stored_as` names exists and may be stored as it says."""
    layout = param_layout(config)
    for name, form in config.stored_as:
        if name not in layout:
            raise ValueError(f"stored_as: {name} is not a parameter of this model")
        if form in BLOCK_FORMATS:
            in_dims = block_in_dims(name)
            if in_dims is None:
                raise ValueError(f"stored_as: {name} cannot be stored as blocks")
            shape = layout[name][0]
            n_in = int(np.prod(shape[len(shape) - in_dims :]))
            if n_in % BLOCK:
                raise ValueError(f"stored_as: {name} has {n_in} inputs, not a multiple of {BLOCK}")


def stored_arrays_of(config: ModelConfig) -> dict[str, tuple[tuple[int, ...], str]]:
    """{flat array name: (shape, dtype name)} of every array a checkpoint of `config` holds."""
    arrays = {}
    for name, (shape, _) in param_layout(config).items():
        form = config.form(name)
        if form in BLOCK_FORMATS:
            for part, s in _blocks_shapes(shape, block_in_dims(name), form).items():
                arrays[f"{name}/{part}"] = (s.shape, s.dtype.name)
        else:
            arrays[name] = (shape, form)
    return arrays


def stored_bytes(config: ModelConfig) -> int:
    """The bytes of the weights as `config` stores them."""
    return sum(int(np.prod(shape)) * jnp.dtype(dtype).itemsize for shape, dtype in stored_arrays_of(config).values())


def abstract_stored(config: ModelConfig, mesh: Mesh | None = None):
    """Pytree of ShapeDtypeStruct (with shardings when `mesh` is given) of the arrays a checkpoint of `config`
    holds, shaped like params, a {"quants", "scales"} dict in place of each weight stored as blocks: the target of a
    restore (`as_blocks` turns the dicts into `Blocks`)."""
    rules = rules_for(config, mesh) if mesh is not None else None

    def leaf(name, shape, axes):
        form = config.form(name)
        if form not in BLOCK_FORMATS:
            sharding = None if mesh is None else named_sharding(mesh, config, axes)
            return jax.ShapeDtypeStruct(shape, jnp.dtype(form), sharding=sharding)
        in_dims = block_in_dims(name)
        parts = _blocks_shapes(shape, in_dims, form)
        if mesh is None:
            return parts
        out_axes, first_in = axes[: len(axes) - in_dims], axes[len(axes) - in_dims]
        spec = logical_to_spec((*out_axes, first_in), rules)
        split = spec[-1]
        n_in = int(np.prod(shape[len(shape) - in_dims :]))
        if split is not None and (n_in % mesh.shape[split] or (n_in // mesh.shape[split]) % BLOCK):
            split = None  # a device would hold part of a block
        sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*spec[:-1], split))
        return {k: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding) for k, s in parts.items()}

    return _tree(config, leaf)


def as_blocks(tree: dict, config: ModelConfig) -> dict:
    """A restored (part of a) params tree with each weight stored as blocks as a `Blocks`."""
    layout, forms = param_layout(config), dict(config.stored_as)

    def walk(node: dict, prefix: str) -> dict:
        out = {}
        for key, value in node.items():
            name = f"{prefix}{key}"
            if forms.get(name) in BLOCK_FORMATS:
                shape, in_dims = layout[name][0], block_in_dims(name)
                out[key] = Blocks(value["quants"], value["scales"], forms[name], tuple(shape[len(shape) - in_dims :]))
            else:
                out[key] = walk(value, f"{name}/") if isinstance(value, dict) else value
        return out

    return walk(tree, "")


def activation_dtype_of(config: ModelConfig):
    """The dtype a model of `config` computes in (as restored): its embedding's, float32 for an embedding stored as
    blocks (`model.activation_dtype`, for the arrays themselves)."""
    form = config.form("embedding")
    return jnp.dtype(jnp.float32) if form in BLOCK_FORMATS else jnp.dtype(form)


def product_form(config: ModelConfig) -> str:
    """The form most of the model's product weights are stored in (a dtype name or a block format): what a backend
    is chosen for."""
    forms = [config.form(name) for name in param_layout(config) if block_in_dims(name) and name != "embedding"]
    return max(sorted(set(forms)), key=forms.count)


def init_params(config: ModelConfig, key: jax.Array, dtype=jnp.float32, mesh: Mesh | None = None):
    """Random parameters (normal(0.02) weights, unit norms), sharded on `mesh` when given."""
    import flax.linen as nn

    from jaxllama.core.linen import Llama

    def init(key):
        return nn.meta.unbox(Llama(config, dtype).init(key)["params"])

    if mesh is None:
        return jax.jit(init)(key)
    return jax.jit(init, out_shardings=param_shardings(config, mesh))(key)
