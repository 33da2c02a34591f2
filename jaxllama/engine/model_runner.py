"""The engine's model runner: the weights as the backend's products read them, the decode slots' KV cache and state,
and the compiled programs that advance them. A narrow interface in the spirit of JetStream's engine API:

- `prefill(rows)`: compute prompts (or the part of them past a prefix another slot holds), then `insert` them into
  decode slots with their first tokens;
- `generate(columns)`: advance the given slots by `decode_steps` tokens, a `decode_step` at a time (the decode state
  and the cache passed in and returned);
- `make_room(needed, lengths)`: a cache that holds what the next call writes.

The cache is either contiguous, a row of positions per slot that grows and shrinks by buckets (`kvcache.py`), or
paged (`page_size`): one pool of pages, allocated once at its full size, and a page table per slot
(`engine/pages.py`), where a prompt that starts with tokens the pool holds reads their pages instead of a copy of
them; the scheduler gives a prefill's rows their pages (`PageTable.assign_rows`), the runner reads the tables.

Typed batches in, tokens and a per-row finish code out (`step.FINISH`); which request runs where, and why, is the
scheduler's business (`scheduler.py`). Multi-host: host inputs become global arrays and the small outputs are
replicated, so every process gets the same answers.

Nothing runs on a device until the first call: the decode state is made then, and the cache on a thread (one
process) or then. An `abstract` runner holds ShapeDtypeStructs instead of arrays (weights, state, cache) and its
calls compile each program they would run and return nothing (`engine/aot.py`), so that the engine's programs can
be compiled for devices that cannot run them (a TPU topology described on a CPU host).
"""

from __future__ import annotations

import dataclasses
import functools
import random
from collections.abc import Callable, Sequence

import jax
import numpy as np
from jax.sharding import Mesh

from jaxllama.core.config import ModelConfig
from jaxllama.core.ops import Ops
from jaxllama.engine import buckets, kvcache, step
from jaxllama.engine.interface import PrefillRow, Sampled
from jaxllama.engine.layer_calls import LayerCalls, Weights
from jaxllama.engine.mesh_arrays import MeshArrays
from jaxllama.engine.options import EngineOptions
from jaxllama.engine.pages import PageTable
from jaxllama.engine.prefill_batch import MAX_STOP_IDS, PrefillBatch
from jaxllama.engine.programs import Programs
from jaxllama.engine.request import SamplingParams
from jaxllama.engine.runtime import agreed_seed
from jaxllama.engine.sampling import SamplerFlags
from jaxllama.engine.stats import EngineStats


class ModelRunner:
    """Runs the model for `options.max_slots` decode slots on a mesh, with the backend's operations `ops`; keeps
    `interface.ModelRunnerInterface`. Not thread-safe. `options`: resolved (`EngineOptions.resolved`), every field
    given.
    `donate_params`: preparing the weights may free the given ones it replaced. `abstract`: `params` are
    ShapeDtypeStructs and the programs are only compiled (`engine/aot.py`)."""

    max_stop_ids = MAX_STOP_IDS

    def __init__(
        self,
        config: ModelConfig,
        params,
        mesh: Mesh,
        options: EngineOptions,
        *,
        ops: Ops,
        eos_ids: Sequence[int],
        donate_params: bool = False,
        abstract: bool = False,
    ):
        if len(eos_ids) > MAX_STOP_IDS:
            raise ValueError(f"at most {MAX_STOP_IDS} end-of-generation ids, got {len(eos_ids)}")
        self.config, self.mesh, self.ops, self.stats = config, mesh, ops, EngineStats()
        slots, max_context, page_size = options.max_slots, options.max_context, options.page_size
        self.slots, self.max_context, self.decode_steps = slots, max_context, options.decode_steps
        cache_dtype = kvcache.dtype(options.kv_cache_dtype, None)
        self.eos_ids = tuple(eos_ids)
        self.vocab_size, self.row_multiple = config.vocab_size, mesh.shape["data"]
        self.cache_dtype, self.abstract = cache_dtype, abstract
        self.layout = _layout(ops.cache_layout, page_size, mesh, cache_dtype)
        self.pages = PageTable(slots, max_context, page_size) if page_size else None
        cache_sharding = kvcache.cache_sharding(config, mesh, self.layout, cache_dtype)  # one layer's (keys, values)
        self.arrays = MeshArrays(mesh, config, cache_sharding, abstract)
        self._seeds = random.Random(agreed_seed())  # for requests without a seed: the same on every process
        device = mesh.devices.flat[0]
        self.platform = device.platform
        one_device = mesh.size == 1 and jax.process_count() == 1 and self.platform == jax.default_backend()
        keep = one_device and not abstract
        self.programs = Programs(ops, self.stats, device, keep_exported=keep, abstract=abstract, mesh=mesh)
        # The weights as the backend's products read them, a run of `layers_per_program` layers at a time.
        self.weights = Weights.prepare(ops, params, config, options.layers_per_program, donate_params, abstract)
        self.params, self._outer = self.weights.params, self.weights.outer
        call = lambda *args: self.programs(*args)  # the programs the runner holds when called (a profile wraps them)
        self.layers = LayerCalls(config, ops, self.weights, call, self.arrays, self.layout, cache_dtype)
        self._state = None
        length = max_context if self.pages else buckets.bucket(options.min_cache, max_context)  # a pool never resizes
        self._cache = None
        make = kvcache.abstract if abstract else kvcache.allocate
        self._allocation = kvcache.Allocation(
            functools.partial(make, config, mesh, slots, length, cache_dtype, self.layout), on_thread=not abstract
        )

    # ---- the interface ----------------------------------------------------------------------------

    @property
    def cache(self) -> kvcache.KVCache:
        """The slots' KV cache: per layer, (keys, values)."""
        if self._cache is None:
            self._cache = self._allocation.result()
            self._allocation = None
        return self._cache

    @cache.setter
    def cache(self, cache: kvcache.KVCache) -> None:
        self._cache = cache

    @property
    def cache_length(self) -> int:
        """The positions a slot's row of a contiguous cache holds now."""
        return kvcache.length(self.cache)

    @property
    def packs_prompts(self) -> bool:
        """Whether a prefill runs its prompts as one packed batch of tokens (`LayerCalls.packed`)."""
        return self.ops.packed_prefill and not self.pages

    @property
    def joins_decode(self) -> bool:
        """Whether `prefill_and_decode` may run a prefill and a decode step (of one token) as one call: a packed
        prefill's batch takes a decode step's rows as they are, and over a paged cache a mixed step runs the prompt
        rows and the decode rows as one batch of tokens (`model.Mixed`). With `decode_steps` > 1 only the steps that
        admit no prompt decode several tokens a call."""
        return self.packs_prompts or self.pages is not None

    @property
    def chunk_multiple(self) -> int:
        """A prompt computed in chunks ends each chunk but its last at a multiple of this many positions: a paged
        cache's prompt rows write whole pages from a page boundary (`paged_kv.write`)."""
        return self.pages.page_size if self.pages and not self.packs_prompts else 1

    @property
    def reuse_multiple(self) -> int:
        """A prompt reuses a prefix another slot holds in multiples of this many positions (whole pages)."""
        return self.pages.page_size if self.pages else 1

    def make_room(self, needed: int, lengths: dict[int, int]) -> int:
        """Make the cache hold each slot's positions [0, lengths[slot]) and a prefill's rows' `needed` positions
        (over a paged cache the scheduler gave those their pages already: `PageTable.assign_rows`). A contiguous
        cache grows to the bucket
        of the longest, or shrinks to it when far shorter. Returns the positions every slot still holds: what a
        slot held past them is gone."""
        if self.pages:
            for slot, length in lengths.items():
                self.pages.reserve(slot, length)
            return self.max_context
        target = buckets.bucket(max(needed, *lengths.values(), 0), self.max_context)
        if target > self.cache_length or target <= self.cache_length // 4:
            self.resize(target)
        return self.cache_length

    @property
    def state(self) -> step.DecodeState:
        """The decode slots' state, made on first use."""
        if self._state is None:
            self._state = self.arrays.initial_state(self.slots, self.max_context)
        return self._state

    @state.setter
    def state(self, state: step.DecodeState) -> None:
        self._state = state

    def resize(self, length: int) -> None:
        """Give the cache `length` positions: zero-padded when growing, truncated when shrinking; a layer at a time,
        each layer's old arrays dropped (freed) as soon as its new ones are made, so that two caches never coexist."""
        fn = functools.partial(kvcache.resize_layer, length=length, layout=self.layout)
        cache = self.cache
        for i in range(len(cache)):  # no donation: the new arrays have another shape
            cache[i] = self._call("cache_resize", fn, (cache[i],), out=self.arrays.cache)
        if self.cache_length != length:  # a program compiled for another length ran
            raise RuntimeError(f"the KV cache was resized to {self.cache_length} positions, not {length}")

    def prefill(
        self, rows: Sequence[PrefillRow], sample: bool = True, masks: Callable[[], np.ndarray] | None = None
    ) -> Sampled | None:
        """Compute the rows' prompts into their slots' caches (the cache must hold start + the prompt bucket of
        every row; a paged cache's rows must have their pages, `PageTable.assign_rows`) and, with `sample`, put
        each row in its decode slot and sample its first token; without, only the caches are filled (a shared
        prefix) and nothing is returned. `masks`: gives the tokens each row's
        first token may be, [rows, ceil(vocab / 32)] int32 bitmasks; called while the device runs the layers."""
        batch = PrefillBatch.of(rows, self, masked=masks is not None)
        inputs = self.arrays.put(batch.arrays)
        x, self.cache = self._prompt_layers(rows, batch, inputs, self.cache)
        prompt = self.layers.prompt_logprobs(x, rows, batch, inputs) if batch.prompt_logprobs else None
        if not sample:
            if self.abstract:
                return None
            if prompt is None:
                jax.block_until_ready(x)
                return None
            none = np.zeros((0, len(rows)), np.int32)
            return Sampled(none, none.astype(np.float32), none.astype(bool), none, prompt=prompt)
        self.state, out = self.insert(self.state, x, batch, inputs, masks)
        return None if self.abstract else _first_tokens(len(rows), out, prompt)

    def prefill_and_decode(
        self,
        rows: Sequence[PrefillRow],
        columns: Sequence[int],
        params: Sequence[SamplingParams],
        cancelled: Sequence[int] = (),
        masks: Callable[[], np.ndarray] | None = None,
        decode_masks: Callable[[], np.ndarray] | None = None,
    ) -> tuple[Sampled, Sampled]:
        """`prefill(rows, masks=masks)` and `generate(columns, params, cancelled, decode_masks)` (of one token) as one
        call, where the runner packs prompts and decodes a token a call: the prompts' tokens and the next token of
        each slot of `columns` run through the layers as one batch (one pass over the weights), then the columns
        advance and the rows start decoding. The columns are slots already running, none of the rows'. Both masks
        are asked for while the device runs the layers. -> (the prefill's `Sampled`, the decode step's)."""
        if not self.joins_decode:
            raise ValueError("a prefill joins a decode step only with packed prompts or a paged cache")
        if not self.packs_prompts:
            return self._mixed_step(rows, columns, params, cancelled, masks, decode_masks)
        batch = PrefillBatch.of(rows, self, masked=masks is not None, columns=columns)
        inputs = self.arrays.put(batch.arrays)
        x, self.cache = self.layers.packed(inputs, batch.copies, self.cache, self.state)
        prompt = self.layers.prompt_logprobs(x, rows, batch, inputs) if batch.prompt_logprobs else None
        flags = dataclasses.replace(SamplerFlags.of(params), mask=decode_masks is not None)
        keep = _keep(self.slots, cancelled)
        x_decode = self._call("prefill_last", step.packed_last, (x, inputs["decode_at"]))
        mask = self._column_masks(decode_masks, columns)
        decoding = step.StepRows(self.arrays.put(keep), inputs["decode_slots"], mask)
        self.state, decoded = self._decode_outputs(self.state, x_decode, decoding, flags)
        self.state, out = self.insert(self.state, x, batch, inputs, masks)
        if self.abstract:
            return None
        return _first_tokens(len(rows), out, prompt), _sampled([decoded], flags)

    def _mixed_step(self, rows, columns, params, cancelled, masks, decode_masks) -> tuple[Sampled, Sampled]:
        """`prefill_and_decode` over a paged cache: the prompt rows (padded to their bucket, [r, t]) and the next token
        of each slot of `columns` as one batch of tokens through the layers (`model.Mixed`: the products read the
        weights once for both), then each part's outputs as its own call gives them."""
        batch = PrefillBatch.of(rows, self, masked=masks is not None)
        inputs = self.arrays.put(batch.arrays)
        flags = dataclasses.replace(SamplerFlags.of(params), mask=decode_masks is not None)
        keep = _keep(self.slots, cancelled)
        prompt_pages = self.arrays.put(self.pages.prefill_table(rows, len(batch.arrays["slots"]), batch.span))
        decode_slots, keep = self.arrays.put((np.asarray(columns, np.int32), keep))
        decode_pages = self.arrays.put(self.pages.decode_table(columns, self.max_context))
        pages = (prompt_pages, decode_pages)
        x_prompt, x_decode, self.cache = self.layers.mixed(self.state, inputs, batch, decode_slots, pages, self.cache)
        prompt_logprobs = self.layers.prompt_logprobs(x_prompt, rows, batch, inputs) if batch.prompt_logprobs else None
        mask = self._column_masks(decode_masks, columns)
        self.state, decoded = self._decode_outputs(self.state, x_decode, step.StepRows(keep, decode_slots, mask), flags)
        self.state, out = self.insert(self.state, x_prompt, batch, inputs, masks)
        if self.abstract:
            return None
        return _first_tokens(len(rows), out, prompt_logprobs), _sampled([decoded], flags)

    def insert(self, state, x, batch: PrefillBatch, inputs, masks=None):
        """Put a prefill's rows in their decode slots, from its last layer's output x, and sample their first tokens:
        the decode state in, and out -> (state, outputs on the device: `step.prefill_outputs`')."""
        if batch.packed:
            x = self._call("prefill_last", step.packed_last, (x, inputs["last"]))
        else:
            x = self._call("prefill_last", step.prefill_last, (x, inputs["lengths"]))
        if masks is not None:  # computed on the host while the layers run (dispatch is asynchronous)
            inputs["mask"] = self.arrays.put(_padded_masks(masks(), batch.arrays["mask"]))
        admitted = step.Admitted(**{f.name: inputs[f.name] for f in dataclasses.fields(step.Admitted)})
        fn = functools.partial(step.prefill_outputs, config=self.config, flags=batch.flags, ops=self.ops)
        out = self._outputs_sharding(state, 4)
        state, *out = self._call("prefill_outputs", fn, (self._outer, state, x, admitted), batch.flags, 1, out)
        return state, out

    def _prompt_layers(self, rows: Sequence[PrefillRow], batch: PrefillBatch, inputs, cache):
        """A prefill's layers, the cache in and out -> (x, cache): packed, or over its rows x prompt bucket (the rows'
        pages, or copies of their slots' rows)."""
        if batch.packed:
            return self.layers.packed(inputs, batch.copies, cache)
        fn = functools.partial(step.prefill_inputs, config=self.config)
        out = (self.arrays.tokens(inputs["tokens"].shape), self.arrays.activations)
        x, at = self._call("prefill_inputs", fn, (self._outer, inputs["tokens"], inputs["starts"]), out=out)
        at = dataclasses.replace(at, fresh=batch.fresh)
        if self.pages:
            table = self.arrays.put(self.pages.prefill_table(rows, len(batch.arrays["slots"]), batch.span))
            return self.layers.run("prefill_layers", x, dataclasses.replace(at, pages=table), cache)
        return self.layers.prefill(x, at, inputs, batch.span, cache)

    def generate(
        self,
        columns: Sequence[int],
        params: Sequence[SamplingParams],
        cancelled: Sequence[int] = (),
        masks: Callable[[], np.ndarray] | None = None,
    ) -> Sampled:
        """`decode_steps` decode steps over the slots `columns` (padded with the out-of-range index `slots`; all
        slots in order: every row), with a sampler compiled for the running requests' `params`; the slots
        `cancelled` are stopped first. The cache must hold every active slot's next `decode_steps` positions.
        `masks`: one step only, drawing each column's token among those its bitmask allows; it gives them,
        [columns, ceil(vocab / 32)] int32, and is called while the device runs the step's layers."""
        flags = dataclasses.replace(SamplerFlags.of(params), mask=masks is not None)
        every = list(columns) == list(range(self.slots))
        slots, keep, kept = self.arrays.put(
            (None if every else np.array(columns, np.int32), _keep(self.slots, cancelled), np.ones(self.slots, bool))
        )
        pages = self.arrays.put(self.pages.decode_table(columns, self.max_context)) if self.pages else None
        rows = step.StepRows(keep, slots)
        mask = functools.partial(self._column_masks, masks, columns) if masks else None
        steps = []
        for _ in range(1 if masks else self.decode_steps):  # no host round trip between steps
            # kept at each step: a step that raises leaves the last state whole, not one donated to it
            self.state, self.cache, out = self.decode_step(self.state, self.cache, rows, flags, pages, mask)
            steps.append(out)
            rows = step.StepRows(kept, slots)  # cancellations apply at the first step
        if self.abstract:
            return None
        return _sampled(steps, flags)

    def decode_step(self, state, cache, rows: step.StepRows, flags: SamplerFlags, pages=None, mask=None):
        """One decode step: the next token of each of `rows` embedded, the layers run over the slots' cache (`pages`:
        the rows' page tables, over a paged cache), a token sampled per row and the rows advanced. The decode state
        and the cache in, and out: -> (state, cache, outputs on the device: `step.decode_outputs`'). `mask`: gives
        the rows' token bitmasks on the device, asked for once the layers are dispatched."""
        inputs = functools.partial(step.decode_inputs, config=self.config)
        x, at = self._call("decode_inputs", inputs, (self._outer, state, rows.slots))
        x, cache = self.layers.run("decode_layers", x, dataclasses.replace(at, pages=pages), cache)
        rows = dataclasses.replace(rows, mask=mask()) if mask else rows
        state, out = self._decode_outputs(state, x, rows, flags)
        return state, cache, out

    def _column_masks(self, masks: Callable[[], np.ndarray] | None, columns: Sequence[int]):
        """The decode columns' token bitmasks on the device (a padding column's: every token), or None without
        `masks`; asked for once the layers are dispatched, so the host computes them while the device runs."""
        if masks is None:
            return None
        return self.arrays.put(_padded_masks(masks(), np.full((len(columns), self.mask_words), -1, np.int32)))

    def _decode_outputs(self, state, x, rows: step.StepRows, flags: SamplerFlags):
        """Sample a decode step's tokens from its last layer's output x and advance the rows (`step.decode_outputs`);
        -> (state, its outputs on the device)."""
        fn = functools.partial(step.decode_outputs, config=self.config, flags=flags, ops=self.ops)
        state, *out = self._call(
            "decode_outputs", fn, (self._outer, state, x, rows), flags, 1, self._outputs_sharding(state, 5)
        )
        return state, out

    def _call(self, kind: str, fn, args, static_key=None, donate: int | None = None, out=None):
        return self.programs(kind, fn, args, static_key, donate, self.arrays.activations if out is None else out)

    @property
    def mask_words(self) -> int:
        """int32 words of a token bitmask: one bit per token of the vocabulary."""
        return (self.vocab_size + 31) // 32

    def _outputs_sharding(self, state, n: int):
        """An `*_outputs` program's: the decode state as `state` is, then n small replicated outputs."""
        return (jax.tree.map(lambda x: x.sharding, state),) + (self.arrays.replicated,) * n

    def seed(self, params: SamplingParams) -> int:
        """The request's seed, or one drawn for it (the same on every process)."""
        return params.seed if params.seed is not None else self._seeds.getrandbits(63)


def _padded_masks(masks: np.ndarray, out: np.ndarray) -> np.ndarray:
    """out (all ones: any token) with its first rows replaced by `masks`."""
    out = out.copy()
    out[: len(masks)] = masks
    return out


def _first_tokens(rows: int, out, prompt) -> Sampled:
    """A prefill's first tokens (`ModelRunner.insert`'s outputs) for its first `rows` rows, read back."""
    first, logprobs, finish, top = jax.tree.map(lambda x: np.asarray(x)[None, :rows], jax.device_get(out))
    top_ids, top_logprobs = top if top is not None else (None, None)
    return Sampled(first, logprobs, np.ones_like(first, bool), finish, top_ids, top_logprobs, prompt)


def _sampled(steps: list, flags: SamplerFlags) -> Sampled:
    """The decode steps' outputs (`_decode_outputs`) as one `Sampled`."""
    tokens, logprobs, emitted, finish, top = (list(x) for x in zip(*jax.device_get(steps), strict=True))
    top_ids, top_logprobs = (np.stack(x) for x in zip(*top, strict=True)) if flags.top else (None, None)
    return Sampled(*(np.stack(x) for x in (tokens, logprobs, emitted, finish)), top_ids, top_logprobs)


def _keep(slots: int, cancelled: Sequence[int]) -> np.ndarray:
    """[slots] bool: false for the slots a decode call stops first."""
    keep = np.ones(slots, bool)
    keep[list(cancelled)] = False
    return keep


def _layout(layout, page_size: int | None, mesh: Mesh, cache_dtype):
    """The backend's cache layout, paged with `page_size` positions a page where given; a ValueError where the
    backend, the mesh or the cache's dtype cannot store it so."""
    if page_size:
        if layout.transposed_keys:
            raise ValueError("a paged KV cache is XLA's (a TPU, a GPU or a CPU without the CPU kernels)")
        if mesh.shape["data"] != 1:
            raise ValueError(f"a paged KV cache needs a mesh of data=1, not {mesh.shape['data']}")
        layout = dataclasses.replace(layout, page_size=page_size)
    kvcache.check_layout(cache_dtype, layout)
    return layout
