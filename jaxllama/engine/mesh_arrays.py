"""Where the model runner's arrays lie on the mesh, and how its host arrays get there: the shardings of its
activations, of the decode state's rows, of the small replicated outputs and of one layer's cache, and host arrays
(the same on every process) made into global arrays, or, for an abstract runner (`engine/aot.py`), into
ShapeDtypeStructs of the same shape, dtype and sharding. The decode state's first value is made here too.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxllama.core.config import ModelConfig
from jaxllama.core.sharding import activations_spec, named_sharding
from jaxllama.engine import step
from jaxllama.engine.prefill_batch import MAX_STOP_IDS
from jaxllama.engine.request import SamplingParams
from jaxllama.engine.sampling import SamplingRows


@dataclasses.dataclass(frozen=True)
class MeshArrays:
    """The shardings of a model runner's arrays on `mesh`, and its host arrays put there."""

    mesh: Mesh
    config: ModelConfig
    cache: object  # one layer's (keys, values) sharding (`kvcache.cache_sharding`)
    abstract: bool = False

    @functools.cached_property
    def replicated(self) -> NamedSharding:
        return NamedSharding(self.mesh, PartitionSpec())

    @functools.cached_property
    def activations(self) -> NamedSharding:
        """[batch, ...], batch over `data`."""
        return NamedSharding(self.mesh, PartitionSpec("data"))

    @functools.cached_property
    def rows(self) -> NamedSharding:
        """The decode state's [slots, vocab] arrays."""
        return named_sharding(self.mesh, self.config, ("batch",))

    def tokens(self, shape) -> NamedSharding:
        """Activations [b, t, ...] between programs: split by row or by token as the layers compute on them
        (`sharding.activations_spec`), so that no program gathers them whole to hand them on (70B on v6e:2x4, prefill
        8 x 512: 3% of the layers' cycles); batch over `data` where the spec is None (a decode step of a few rows)."""
        spec = activations_spec(shape, dict(self.mesh.shape))
        return self.activations if spec is None else NamedSharding(self.mesh, spec)

    def put(self, xs):
        """Host arrays (a pytree of them), replicated."""
        return jax.tree.map(lambda x: self.of(np.asarray(x), self.replicated), xs)

    def put_rows(self, x):
        """A host array [slots, ...], its rows over `data`."""
        x = np.asarray(x)
        return self.of(x, NamedSharding(self.mesh, PartitionSpec("data", *([None] * (x.ndim - 1)))))

    def of(self, x: np.ndarray, sharding: NamedSharding):
        """A host array (the same on every process) as a global array with this sharding (an abstract runner's:
        its shape, dtype and sharding)."""
        if self.abstract:
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)
        return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])

    def initial_state(self, slots: int, max_context: int) -> step.DecodeState:
        """The decode state of `slots` empty slots."""
        s, v = slots, self.config.vocab_size
        host = dict(
            tokens=np.zeros(s, np.int32),
            positions=np.zeros(s, np.int32),
            active=np.zeros(s, bool),
            remaining=np.zeros(s, np.int32),
            limit=np.full(s, max_context, np.int32),
            step=np.zeros(s, np.int32),
            stop_ids=np.full((s, MAX_STOP_IDS), -1, np.int32),
        )
        rows = SamplingRows(**SamplingRows.from_params([SamplingParams(temperature=0.0)] * s, [0] * s))
        if self.abstract:
            counts, seen = (jax.ShapeDtypeStruct((s, v), t, sharding=self.rows) for t in (jnp.int32, jnp.bool_))
        else:
            zeros = jax.jit(
                lambda: (jnp.zeros((s, v), jnp.int32), jnp.zeros((s, v), bool)), out_shardings=(self.rows,) * 2
            )
            counts, seen = zeros()
        return step.DecodeState(
            rows=jax.tree.map(self.put_rows, rows),
            counts=counts,
            seen=seen,
            **{k: self.put_rows(x) for k, x in host.items()},
        )
