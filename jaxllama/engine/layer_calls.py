"""The model's layers as the engine's program calls: the weights as the backend's products read them, prepared a run
of `layers_per_program` layers at a time (`Weights`), and the calls that take a step's activations through every run
(`LayerCalls`), each given the slots' KV cache and returning it updated, as JetStream's engine passes its decode
state in and out: a decode or mixed step's over the cache in place, a prefill's over rows copied out of the cache
and back, a packed prefill's over the cache in place after copying its reused prefixes.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp

from jaxllama.core.config import ModelConfig
from jaxllama.core.model import Mixed, Placement, layer_params
from jaxllama.core.ops import Ops
from jaxllama.engine import kvcache, step
from jaxllama.engine.interface import PrefillRow, PromptLogprobs
from jaxllama.engine.mesh_arrays import MeshArrays
from jaxllama.engine.prefill_batch import PrefillBatch


@dataclasses.dataclass
class Weights:
    """The model's weights prepared for the backend: per run of layers [a, b), its layers' params; the params outside
    the layers (embedding, final norm, output) as `outer`."""

    runs: list[tuple[int, int]]
    per_run: list[list]
    outer: dict

    @staticmethod
    def prepare(ops: Ops, params, config: ModelConfig, per: int, donate: bool, abstract: bool) -> Weights:
        """Prepared a run of `per` layers at a time, then the outer params: with `donate`, each part's weights that
        preparing replaced are freed before the next part is prepared, so that the two copies of the model never
        coexist. `abstract`: params are ShapeDtypeStructs (`ops.prepare_abstract`)."""
        n = config.n_layers
        runs = [(a, min(a + per, n)) for a in range(0, n, per)]
        per_run = [_prepare(ops, layer_params(params, config, a, b), config, donate, abstract) for a, b in runs]
        outer = {k: v for k, v in params.items() if not k.startswith("layers_")}
        return Weights(runs, per_run, _prepare(ops, outer, config, donate, abstract))

    @property
    def params(self) -> dict:
        """Every prepared param, by the checkpoint's names (`layers_i` for layer i)."""
        params = dict(self.outer)
        for (a, _), run in zip(self.runs, self.per_run, strict=True):
            params |= {f"layers_{a + i}": p for i, p in enumerate(run)}
        return params


class LayerCalls:
    """Every layer of a step, as calls of the compiled programs (`call(kind, fn, args, static_key, donate, out)`,
    `Programs.__call__`) over `weights`, laid out as `arrays` says; the cache stored as `layout` and `cache_dtype`
    say."""

    def __init__(
        self, config: ModelConfig, ops: Ops, weights: Weights, call: Callable, arrays: MeshArrays, layout, cache_dtype
    ):
        self.config, self.ops, self.weights, self.call, self.arrays = config, ops, weights, call, arrays
        self.layout, self.cache_dtype = layout, cache_dtype

    def run(self, kind: str, x, at: Placement, cache: list) -> tuple[jax.Array, list]:
        """Every layer over tokens x placed as `at` says (`step.step_layers`), one program call per run of layers,
        each writing its layers' cache (donated) -> (x after the last layer, the cache). The list `cache` is the one
        returned, its layers replaced as each call returns them: a call that fails leaves every layer usable."""
        fn = functools.partial(step.step_layers, config=self.config, ops=self.ops)
        for (a, b), params in zip(self.weights.runs, self.weights.per_run, strict=True):
            out = (self.arrays.tokens(x.shape), [self.arrays.cache] * (b - a))
            x, cache[a:b] = self.call(kind, fn, (params, x, at, cache[a:b]), None, 3, out)
        return x, cache

    def packed(self, inputs: dict, copies: bool, cache: list, state=None) -> tuple[jax.Array, list]:
        """Every layer of a packed prefill over the slots' cache in place: the reused prefixes copied into the slots
        that reuse another's (`kvcache.copy_rows`, where there are `copies`), then every prompt token as a row of one
        batch that writes and attends to its slot's row, as a decode step's rows do; with the decode `state`, with
        them the next token of each slot of `decode_slots` (`step.mixed_inputs`)."""
        if copies:
            copy = functools.partial(kvcache.copy_rows, layout=self.layout)
            args = (cache, inputs["copy_from"], inputs["copy_to"], inputs["copy_lengths"])
            cache = self.call("prefill_copy", copy, args, None, 0, [self.arrays.cache] * len(cache))
        outer = self.weights.outer
        if state is not None:
            fn = functools.partial(step.mixed_inputs, config=self.config)
            names = ("packed_tokens", "packed_positions", "decode_slots", "decode_at")
            x, at = self._call("mixed_inputs", fn, (outer, state, *(inputs[k] for k in names)))
        else:
            fn = functools.partial(step.prefill_inputs, config=self.config)
            x, at = self._call(
                "prefill_inputs", fn, (outer, _column(inputs["packed_tokens"]), inputs["packed_positions"])
            )
        return self.run("prefill_packed", x, dataclasses.replace(at, rows=inputs["packed_slots"]), cache)

    def mixed(self, state, inputs: dict, batch: PrefillBatch, decode_slots, pages: tuple, cache: list):
        """A mixed step over a paged cache: a prefill's rows (padded to their bucket, [r, t]) and the next token of
        each of `decode_slots` as one batch of tokens through the layers (`model.Mixed`: the products read the
        weights once for both), their pages the (prompt, decode) page tables `pages` -> (the prompt rows' x [r, t,
        dim], the decode rows' x, the cache)."""
        r, t = batch.arrays["tokens"].shape
        fn = functools.partial(step.mixed_step_inputs, config=self.config)
        args = (self.weights.outer, state, inputs["tokens"], inputs["starts"], decode_slots)
        out = (self.arrays.tokens((1, r * t + decode_slots.shape[0])), self.arrays.activations)
        x, at = self.call("mixed_inputs", fn, args, None, None, out)
        prompt = dataclasses.replace(at.prompt, pages=pages[0], fresh=batch.fresh)
        x, cache = self.run("mixed_layers", x, Mixed(prompt, dataclasses.replace(at.decode, pages=pages[1])), cache)
        parts = functools.partial(step.mixed_step_parts, rows=r, tokens=t)
        out = (self.arrays.tokens((r, t)), self.arrays.activations)
        x_prompt, x_decode = self.call("mixed_parts", parts, (x,), None, None, out)
        return x_prompt, x_decode, cache

    def prefill(self, x, at: Placement, inputs: dict, span: int, cache: list) -> tuple[jax.Array, list]:
        """Every layer of a prefill over rows of `span` positions, a run of layers at a time (`step.prefill_layers`):
        the rows' caches start empty (`at.fresh`) or as copies of slots `inputs["sources"]`, and end in slots
        `inputs["slots"]`."""
        take = functools.partial(kvcache.take_rows, span=span, layout=self.layout)
        put = functools.partial(kvcache.put_rows, span=span, layout=self.layout)
        cache_dtype = jnp.dtype(self.cache_dtype).name  # a static argument: a name, not a dtype object
        run_layers = functools.partial(step.prefill_layers, config=self.config, ops=self.ops, cache_dtype=cache_dtype)
        for (a, b), params in zip(self.weights.runs, self.weights.per_run, strict=True):
            caches = [self.arrays.cache] * (b - a)
            rows = None
            if not at.fresh:
                rows = self.call("prefill_take", take, (cache[a:b], inputs["sources"]), span, None, caches)
            x, rows = self.call(
                "prefill_layers", run_layers, (params, x, at, rows), None, None, (self.arrays.tokens(x.shape), caches)
            )
            cache[a:b] = self.call("prefill_put", put, (cache[a:b], rows, inputs["slots"]), span, 0, caches)
        return x, cache

    def prompt_logprobs(self, x, rows: Sequence[PrefillRow], batch: PrefillBatch, inputs) -> list[PromptLogprobs]:
        """Each row's `step.prompt_logprobs`, for its tokens after the first (a packed prefill's:
        `step.packed_prompt_logprobs`, from each row's first token's index in it); None where abstract."""
        if batch.packed:
            firsts = batch.arrays["last"][: len(rows)] - [len(r.tokens) - 1 for r in rows]
            tokens = inputs["packed_tokens"]
        else:
            firsts, tokens = None, inputs["tokens"]
        fn = step.prompt_logprobs if firsts is None else step.packed_prompt_logprobs
        fn = functools.partial(fn, config=self.config, ops=self.ops)
        out = self.call(
            "prompt_logprobs", fn, (self.weights.outer, x, tokens), None, None, (self.arrays.replicated,) * 3
        )
        if self.arrays.abstract:
            return None
        logprobs, top_ids, top_logprobs = jax.device_get(out)
        n = [len(r.tokens) - 1 for r in rows]
        if firsts is not None:
            spans = [slice(a, a + k) for a, k in zip(firsts, n, strict=True)]
            return [PromptLogprobs(logprobs[s], top_ids[s], top_logprobs[s]) for s in spans]
        return [PromptLogprobs(logprobs[i, :k], top_ids[i, :k], top_logprobs[i, :k]) for i, k in enumerate(n)]

    def _call(self, kind: str, fn, args):
        return self.call(kind, fn, args, None, None, self.arrays.activations)


def _column(x):
    """x [n] as [n, 1] (an abstract runner's ShapeDtypeStruct too: its shape, dtype and sharding)."""
    if isinstance(x, jax.ShapeDtypeStruct):
        return jax.ShapeDtypeStruct((*x.shape, 1), x.dtype, sharding=x.sharding)
    return x[:, None]


def _prepare(ops: Ops, params, config: ModelConfig, donate: bool, abstract: bool = False):
    """`ops.prepare(params)` (abstract params: `ops.prepare_abstract`); with `donate`, the arrays of params that the
    prepared tree does not hold are deleted."""
    if abstract:
        return ops.prepare_abstract(params, config)
    prepared = ops.prepare(params, config)
    if donate:
        kept = {id(x) for x in jax.tree.leaves(prepared)}
        for x in jax.tree.leaves(params):
            if id(x) not in kept and isinstance(x, jax.Array):
                x.delete()
    return prepared
