"""Device meshes, and the rules that map logical axes to mesh axes.

Parameters (declared by their family: `jaxllama/models/`) and the KV cache name their dimensions with logical axes.
A model's family says which mesh axis each of its parameters' axes is split over (`Family.sharding`: by default
tensor parallelism, `models.family.TENSOR_PARALLEL`: attention heads, MLP hidden units and the vocabulary over
`model`); `CACHE_RULES` adds the batch and the cache's own axes (`data` splits the batch). A dimension the `model`
axis does not divide is replicated instead when that is safe (KV heads, the vocabulary), and refused with the
constraint named when it is not (attention heads, MLP hidden units).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxllama.core.config import ModelConfig
from jaxllama.models import family_of

MESH_AXES = ("data", "model")

# logical axis -> mesh axis (None: replicated), of the axes that are no parameter's: the rows of a batch, and the
# positions and pages of the KV cache
CACHE_RULES: dict[str, str | None] = {"batch": "data", "cache_seq": None, "cache_pages": None}

# Dimensions replicated (rather than refused) when the model axis does not divide them.
_REPLICATE_IF_UNEVEN = ("kv_heads", "vocab")


def parse_mesh(spec: str | dict | None) -> dict[str, int] | None:
    """'data=2,model=4' (or a dict) -> {'data': 2, 'model': 4}; missing axes are 1."""
    if spec is None or spec == "":
        return None
    if isinstance(spec, str):
        sizes = {}
        for part in spec.split(","):
            name, sep, value = part.partition("=")
            name = name.strip()
            if not sep or name not in MESH_AXES or not value.strip().isdigit():
                raise ValueError(f"--mesh {spec!r}: expected 'data=N,model=M'")
            sizes[name] = int(value)
    else:
        sizes = dict(spec)
    bad = set(sizes) - set(MESH_AXES)
    if bad:
        raise ValueError(f"mesh axes must be {MESH_AXES}, got {sorted(bad)}")
    return {axis: int(sizes.get(axis, 1)) for axis in MESH_AXES}


def axis_sizes(config: ModelConfig) -> dict[str, int]:
    """The size of each logical axis the model shards."""
    return {
        "vocab": config.vocab_size,
        "heads": config.n_heads,
        "kv_heads": config.n_kv_heads,
        "mlp": config.ffn_dim,
    }


def check_mesh(config: ModelConfig, sizes: dict[str, int]) -> None:
    """Raise ValueError naming the constraint if the model cannot run on a mesh of these sizes."""
    model = sizes["model"]
    for name in ("heads", "mlp"):
        n = axis_sizes(config)[name]
        if n % model:
            raise ValueError(
                f"mesh model={model} does not divide the model's {name} ({n}); "
                f"choose a model axis size that divides {n}"
            )


def model_axes(config: ModelConfig, n_devices: int) -> list[int]:
    """The `model` axis sizes a mesh of `n_devices` devices may have for this model, smallest first."""
    out = []
    for model in range(1, n_devices + 1):
        if n_devices % model == 0:
            try:
                check_mesh(config, {"data": n_devices // model, "model": model})
            except ValueError:
                continue
            out.append(model)
    return out


def make_mesh(
    config: ModelConfig, spec: str | dict | None = None, devices: Sequence | None = None, model_axis: int = 1
) -> Mesh:
    """A `data` x `model` mesh over `devices` (default: all of them, on every host).

    Without a spec, every device is used, `model_axis` of them per model replica (the caller that knows the
    devices' memory chooses it: `engine/memory.plan`). A spec for fewer devices than there are takes the first ones
    (in one process: every process must hold a part of the mesh).
    """
    devices = list(devices if devices is not None else jax.devices())
    sizes = parse_mesh(spec)
    if sizes is None:
        sizes = {"data": max(1, len(devices) // model_axis), "model": model_axis}
    n = math.prod(sizes.values())
    name = f"mesh data={sizes['data']},model={sizes['model']}"
    if n > len(devices):
        raise ValueError(f"{name} needs {n} devices, {len(devices)} {'is' if len(devices) == 1 else 'are'} available")
    if n < len(devices) and jax.process_count() > 1:
        processes = jax.process_count()
        raise ValueError(f"{name} has {n} devices; across {processes} processes it must use all {len(devices)}")
    check_mesh(config, sizes)
    grid = np.array(devices[:n], dtype=object).reshape(sizes["data"], sizes["model"])
    return Mesh(grid, MESH_AXES)


def rules_for(config: ModelConfig, mesh: Mesh) -> dict[str, str | None]:
    """The model family's rules and `CACHE_RULES`, with uneven dimensions that may be replicated replicated."""
    rules = CACHE_RULES | dict(family_of(config).sharding)
    model = mesh.shape["model"]
    for name in _REPLICATE_IF_UNEVEN:
        if axis_sizes(config)[name] % model:
            rules[name] = None
    return rules


def logical_to_spec(axes: Sequence[str | None], rules: dict[str, str | None]) -> PartitionSpec:
    """Logical axis names -> PartitionSpec, each mesh axis used at most once."""
    used, out = set(), []
    for axis in axes:
        mesh_axis = rules[axis] if axis is not None else None
        if mesh_axis in used:
            mesh_axis = None
        used.add(mesh_axis)
        out.append(mesh_axis)
    return PartitionSpec(*out)


def named_sharding(mesh: Mesh, config: ModelConfig, axes: Sequence[str | None]) -> NamedSharding:
    return NamedSharding(mesh, logical_to_spec(axes, rules_for(config, mesh)))


def activations_spec(shape: Sequence[int], mesh_shape: dict[str, int] | None = None) -> PartitionSpec | None:
    """How activations [b, t, ...] are split over the `model` axis of a mesh of these axis sizes (default: the mesh
    of the context, `jax.set_mesh`) between products: by row where the rows' count divides it and no `data` axis
    takes the batch, so that each device holds whole prompts (their attention reads nothing from another device),
    or whole decode rows; else by token (sequence parallelism, as MaxText does), the batch over `data` where it
    divides. None where `model` is one device, where neither divides (a decode step of a few rows), or outside a
    mesh.

    Either way the elementwise passes between products (norms, residual additions) run on each device's share, not
    on every row on every device (otherwise a long prefill's cost half its products' time, and a decode step's of
    128 rows keep its cycles past its bytes), and the products' partial sums are reduce-scattered, not all-reduced. By
    row, the all-to-alls that move a token-split prompt's queries, keys and values to the devices of their heads and
    back are gone. `jaxllama compile --topology v5e:2x4 --model llama-3.1-8b --max-batch 128 --max-context 2048`:
    a prefill of 128 x 1,024 2,030 -> 1,757 ms by cycles, 5 decode layers 0.457 -> 0.421 ms; 8 x 512 on 64 slots
    47.2 -> 47.6 ms."""
    if mesh_shape is None:
        mesh = jax.sharding.get_abstract_mesh()
        mesh_shape = {} if mesh.empty else dict(mesh.shape)
    model = mesh_shape.get("model", 1)
    if model == 1 or len(shape) < 2:
        return None
    data = mesh_shape.get("data", 1)
    if data == 1 and shape[0] % model == 0:
        return PartitionSpec("model", None)
    if shape[1] % model:
        return None
    return PartitionSpec("data" if data > 1 and shape[0] % data == 0 else None, "model")


def split_activations(x: jax.Array) -> jax.Array:
    """x [b, t, ...] split by prompt or by token as `activations_spec` says under the mesh of the context; x as it is
    where the spec is None."""
    spec = activations_spec(x.shape)
    return x if spec is None else jax.lax.with_sharding_constraint(x, spec)
