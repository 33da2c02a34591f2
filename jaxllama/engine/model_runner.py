"""The engine's model runner: the weights as the backend's products read them, the decode slots' KV cache and state,
and the compiled programs that advance them. A narrow interface in the spirit of JetStream's engine API:

- `prefill(rows)`: compute prompts (or the part of them past a prefix another slot holds), insert them into decode
  slots and sample their first tokens;
- `generate(columns)`: advance the given slots by `decode_steps` tokens;
- `make_room(needed, lengths)`: a cache that holds what the next call writes.

The cache is either contiguous, a row of positions per slot that grows and shrinks by buckets (`kvcache.py`), or
paged (`page_size`): one pool of pages, allocated once at its full size, and a page table per slot
(`engine/pages.py`), where a prompt that starts with another slot's sequence reads that slot's pages instead of a
copy of them.

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
from concurrent.futures import ThreadPoolExecutor

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxllama.core.config import ModelConfig
from jaxllama.core.model import Mixed, Placement, layer_params
from jaxllama.core.ops import Ops
from jaxllama.core.sharding import named_sharding, tokens_spec
from jaxllama.engine import buckets, kvcache, step
from jaxllama.engine.interface import PrefillRow, PromptLogprobs, Sampled
from jaxllama.engine.options import EngineOptions
from jaxllama.engine.pages import PageTable
from jaxllama.engine.prefill_batch import MAX_STOP_IDS, PrefillBatch
from jaxllama.engine.programs import Programs
from jaxllama.engine.request import SamplingParams
from jaxllama.engine.runtime import agreed_seed
from jaxllama.engine.sampling import SamplerFlags, SamplingRows
from jaxllama.engine.stats import EngineStats

_ALLOCATOR = ThreadPoolExecutor(1, thread_name_prefix="jaxllama-kv-cache")


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
        self._replicated = NamedSharding(mesh, PartitionSpec())
        self._activations = NamedSharding(mesh, PartitionSpec("data"))  # [batch, ...], batch over `data`
        self.layout = ops.cache_layout
        self.pages = None
        if page_size:
            if self.layout.transposed_keys:
                raise ValueError("a paged KV cache is XLA's (a TPU, a GPU or a CPU without the CPU kernels)")
            if mesh.shape["data"] != 1:
                raise ValueError(f"a paged KV cache needs a mesh of data=1, not {mesh.shape['data']}")
            self.layout = dataclasses.replace(self.layout, page_size=page_size)
            self.pages = PageTable(slots, max_context, page_size)
        kvcache.check_layout(cache_dtype, self.layout)
        # one layer's (keys, values)
        self._cache_sharding = kvcache.cache_sharding(config, mesh, self.layout, cache_dtype)
        self._rows = named_sharding(mesh, config, ("batch",))
        self._seeds = random.Random(agreed_seed())  # for requests without a seed: the same on every process
        device = mesh.devices.flat[0]
        self.platform = device.platform
        one_device = mesh.size == 1 and jax.process_count() == 1 and self.platform == jax.default_backend()
        keep = one_device and not abstract
        self.programs = Programs(ops, self.stats, device, keep_exported=keep, abstract=abstract, mesh=mesh)
        # The weights as the backend's products read them (`params`), prepared a run of `layers_per_program` layers
        # at a time, and the params outside the layers (embedding, final norm, output): with `donate_params`, each
        # part's weights that preparing replaced are freed before the next part is prepared, so that the two copies
        # of the model never coexist.
        n = config.n_layers
        per = options.layers_per_program
        self._runs = [(a, min(a + per, n)) for a in range(0, n, per)]
        self._run_params = []
        for a, b in self._runs:
            self._run_params.append(_prepare(ops, layer_params(params, config, a, b), config, donate_params, abstract))
        outer = {k: v for k, v in params.items() if not k.startswith("layers_")}
        self._outer = _prepare(ops, outer, config, donate_params, abstract)
        self.params = dict(self._outer)
        for (a, _), run in zip(self._runs, self._run_params, strict=True):
            self.params |= {f"layers_{a + i}": p for i, p in enumerate(run)}
        self._state = None
        # In one process the cache is allocated on a thread: the first touch of its pages (on a CPU, ~1 s a GB) then
        # overlaps the host's work up to the first prefill, which loads its programs meanwhile.
        # A pool is never resized.
        length = max_context if self.pages else buckets.bucket(options.min_cache, max_context)
        shape = (config, mesh, slots, length, cache_dtype, self.layout)
        self._allocate = functools.partial(kvcache.allocate, *shape)
        self._cache, self._allocating = None, None
        if abstract:
            self._cache = kvcache.abstract(*shape)
        elif jax.process_count() == 1:
            self._allocating = _ALLOCATOR.submit(self._allocate)

    # ---- the interface ----------------------------------------------------------------------------

    @property
    def cache(self) -> kvcache.KVCache:
        """The slots' KV cache: per layer, (keys, values)."""
        if self._cache is None:
            self._cache = self._allocating.result() if self._allocating is not None else self._allocate()
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
        """Whether a prefill runs its prompts as one packed batch of tokens (`_packed_layers`)."""
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
        (a paged cache gives those their pages as the prefill assigns them). A contiguous cache grows to the bucket
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
            self._state = self._initial_state()
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
            cache[i] = self._call("cache_resize", fn, (cache[i],), out=self._cache_sharding)
        if self.cache_length != length:  # a program compiled for another length ran
            raise RuntimeError(f"the KV cache was resized to {self.cache_length} positions, not {length}")

    def prefill(
        self, rows: Sequence[PrefillRow], sample: bool = True, masks: Callable[[], np.ndarray] | None = None
    ) -> Sampled | None:
        """Compute the rows' prompts into their slots' caches (the cache must hold start + the prompt bucket of
        every row) and, with `sample`, put each row in its decode slot and sample its first token; without, only
        the caches are filled (a shared prefix) and nothing is returned. `masks`: gives the tokens each row's
        first token may be, [rows, ceil(vocab / 32)] int32 bitmasks; called while the device runs the layers."""
        batch = PrefillBatch.of(rows, self, masked=masks is not None)
        inputs = self._put(batch.arrays)
        x = self._packed_layers(inputs, batch.copies) if batch.packed else self._row_layers(rows, inputs, batch)
        prompt = self._prompt_logprobs(x, rows, batch, inputs) if batch.prompt_logprobs else None
        if not sample:
            if self.abstract:
                return None
            if prompt is None:
                jax.block_until_ready(x)
                return None
            none = np.zeros((0, len(rows)), np.int32)
            return Sampled(none, none.astype(np.float32), none.astype(bool), none, prompt=prompt)
        return self._start(rows, batch, inputs, x, prompt, masks)

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
        inputs = self._put(batch.arrays)
        x = self._packed_layers(inputs, batch.copies, decoding=True)
        prompt = self._prompt_logprobs(x, rows, batch, inputs) if batch.prompt_logprobs else None
        flags = dataclasses.replace(SamplerFlags.of(params), mask=decode_masks is not None)
        keep = self._keep(cancelled)
        x_decode = self._call("prefill_last", step.packed_last, (x, inputs["decode_at"]))
        mask = self._column_masks(decode_masks, columns)
        decoded = self._decode_outputs(flags, self._put(keep), x_decode, inputs["decode_slots"], mask)
        started = self._start(rows, batch, inputs, x, prompt, masks)
        if self.abstract:
            return None
        return started, self._sampled([decoded], flags)

    def _mixed_step(self, rows, columns, params, cancelled, masks, decode_masks) -> tuple[Sampled, Sampled]:
        """`prefill_and_decode` over a paged cache: the prompt rows (padded to their bucket, [r, t]) and the next token
        of each slot of `columns` as one batch of tokens through the layers (`model.Mixed`: the products read the
        weights once for both), then each part's outputs as its own call gives them."""
        batch = PrefillBatch.of(rows, self, masked=masks is not None)
        inputs = self._put(batch.arrays)
        flags = dataclasses.replace(SamplerFlags.of(params), mask=decode_masks is not None)
        keep = self._keep(cancelled)
        prompt_pages = self._put(self._prompt_table(rows, batch))
        decode_slots, keep = self._put((np.asarray(columns, np.int32), keep))
        decode_pages = self._put(self._decode_table(columns))
        fn = functools.partial(step.mixed_step_inputs, config=self.config)
        args = (self._outer, self.state, inputs["tokens"], inputs["starts"], decode_slots)
        r, t = batch.arrays["tokens"].shape
        x, at = self._call("mixed_inputs", fn, args, out=(self._tokens((1, r * t + len(columns))), self._activations))
        prompt = dataclasses.replace(at.prompt, pages=prompt_pages, fresh=batch.fresh)
        x = self._layers("mixed_layers", x, Mixed(prompt, dataclasses.replace(at.decode, pages=decode_pages)))
        parts = functools.partial(step.mixed_step_parts, rows=r, tokens=t)
        x_prompt, x_decode = self._call("mixed_parts", parts, (x,), out=(self._tokens((r, t)), self._activations))
        prompt_logprobs = self._prompt_logprobs(x_prompt, rows, batch, inputs) if batch.prompt_logprobs else None
        mask = self._column_masks(decode_masks, columns)
        decoded = self._decode_outputs(flags, keep, x_decode, decode_slots, mask)
        started = self._start(rows, batch, inputs, x_prompt, prompt_logprobs, masks)
        if self.abstract:
            return None
        return started, self._sampled([decoded], flags)

    def _prompt_table(self, rows: Sequence[PrefillRow], batch: PrefillBatch) -> np.ndarray:
        """Give a prefill's rows their pages (a reused prefix's shared) -> their page tables, as many pages as the
        batch's span: each row's slot's, a chunk's too (it lands in no decode slot, but its keys in its slot's pages);
        a padding row's none."""
        self.pages.assign([(r.slot, r.source, r.start, r.start + len(r.tokens)) for r in rows])
        cache_rows = [r.slot for r in rows] + [self.slots] * (len(batch.arrays["slots"]) - len(rows))
        return self.pages.table(cache_rows, self.pages.pages_for(batch.span))

    def _keep(self, cancelled: Sequence[int]) -> np.ndarray:
        """[slots] bool: false for the slots a decode call stops first."""
        keep = np.ones(self.slots, bool)
        keep[list(cancelled)] = False
        return keep

    def _decode_table(self, columns: Sequence[int]) -> np.ndarray:
        """The page tables of a decode step's columns: as many pages as the longest sequence's bucket of positions."""
        longest = max((self.pages.positions(c) for c in columns if c < self.slots), default=1)
        return self.pages.table(columns, self.pages.pages_for(buckets.bucket(longest, self.max_context)))

    def _start(self, rows: Sequence[PrefillRow], batch: PrefillBatch, inputs, x, prompt, masks=None) -> Sampled:
        """Put a prefill's rows in their decode slots, from its last layer's output x, and sample their first tokens
        (`prefill`)."""
        if batch.packed:
            x = self._call("prefill_last", step.packed_last, (x, inputs["last"]))
        else:
            x = self._call("prefill_last", step.prefill_last, (x, inputs["lengths"]))
        if masks is not None:  # computed on the host while the layers run (dispatch is asynchronous)
            inputs["mask"] = self._put(_padded_masks(masks(), batch.arrays["mask"]))
        admitted = step.Admitted(**{f.name: inputs[f.name] for f in dataclasses.fields(step.Admitted)})
        args = (self._outer, self.state, x, admitted)
        fn = functools.partial(step.prefill_outputs, config=self.config, flags=batch.flags, ops=self.ops)
        out = self._outputs_sharding(4)
        self.state, *out = self._call("prefill_outputs", fn, args, batch.flags, donate=1, out=out)
        if self.abstract:
            return None
        first, logprobs, finish, top = jax.tree.map(lambda x: np.asarray(x)[None, : len(rows)], jax.device_get(out))
        top_ids, top_logprobs = top if top is not None else (None, None)
        return Sampled(first, logprobs, np.ones_like(first, bool), finish, top_ids, top_logprobs, prompt)

    def _row_layers(self, rows: Sequence[PrefillRow], inputs, batch: PrefillBatch):
        """A prefill's layers over its rows x prompt bucket: the rows' pages, or copies of their slots' rows."""
        fn = functools.partial(step.prefill_inputs, config=self.config)
        out = (self._tokens(inputs["tokens"].shape), self._activations)
        x, at = self._call("prefill_inputs", fn, (self._outer, inputs["tokens"], inputs["starts"]), out=out)
        at = dataclasses.replace(at, fresh=batch.fresh)
        if self.pages:
            table = self._put(self._prompt_table(rows, batch))
            return self._layers("prefill_layers", x, dataclasses.replace(at, pages=table))
        return self._prefill_layers(x, at, inputs["sources"], inputs["slots"], batch.span)

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
        keep = self._keep(cancelled)
        every = len(columns) == self.slots
        slots, keep, kept = self._put((None if every else np.array(columns, np.int32), keep, np.ones(self.slots, bool)))
        if self.pages:
            table = self._put(self._decode_table(columns))
        inputs_fn = functools.partial(step.decode_inputs, config=self.config)
        steps = []
        for _ in range(1 if masks else self.decode_steps):  # no host round trip between steps
            x, at = self._call("decode_inputs", inputs_fn, (self._outer, self.state, slots))
            x = self._layers("decode_layers", x, at if not self.pages else dataclasses.replace(at, pages=table))
            mask = self._column_masks(masks, columns)
            steps.append(self._decode_outputs(flags, keep, x, slots, mask))
            keep = kept  # cancellations apply at the first step
        if self.abstract:
            return None
        return self._sampled(steps, flags)

    def _column_masks(self, masks: Callable[[], np.ndarray] | None, columns: Sequence[int]):
        """The decode columns' token bitmasks on the device (a padding column's: every token), or None without
        `masks`; asked for once the layers are dispatched, so the host computes them while the device runs."""
        if masks is None:
            return None
        return self._put(_padded_masks(masks(), np.full((len(columns), self.mask_words), -1, np.int32)))

    def _decode_outputs(self, flags: SamplerFlags, keep, x, slots, mask=None) -> list:
        """Sample a decode step's tokens from its last layer's output x and advance the slots (`step.decode_outputs`);
        -> its outputs, on the device."""
        fn = functools.partial(step.decode_outputs, config=self.config, flags=flags, ops=self.ops)
        args = (self._outer, self.state, keep, x, slots, mask)
        self.state, *out = self._call("decode_outputs", fn, args, flags, 1, self._outputs_sharding(5))
        return out

    @staticmethod
    def _sampled(steps: list, flags: SamplerFlags) -> Sampled:
        """The decode steps' outputs (`_decode_outputs`) as one `Sampled`."""
        tokens, logprobs, emitted, finish, top = (list(x) for x in zip(*jax.device_get(steps), strict=True))
        top_ids, top_logprobs = (np.stack(x) for x in zip(*top, strict=True)) if flags.top else (None, None)
        return Sampled(*(np.stack(x) for x in (tokens, logprobs, emitted, finish)), top_ids, top_logprobs)

    # ---- programs ---------------------------------------------------------------------------------

    def _prompt_logprobs(self, x, rows: Sequence[PrefillRow], batch: PrefillBatch, inputs) -> list[PromptLogprobs]:
        """Each row's `step.prompt_logprobs`, for its tokens after the first (a packed prefill's:
        `step.packed_prompt_logprobs`, from each row's first token's index in it)."""
        if batch.packed:
            firsts = batch.arrays["last"][: len(rows)] - [len(r.tokens) - 1 for r in rows]
            tokens = inputs["packed_tokens"]
        else:
            firsts, tokens = None, inputs["tokens"]
        fn = step.prompt_logprobs if firsts is None else step.packed_prompt_logprobs
        fn = functools.partial(fn, config=self.config, ops=self.ops)
        out = self._call("prompt_logprobs", fn, (self._outer, x, tokens), out=(self._replicated,) * 3)
        if self.abstract:
            return None
        logprobs, top_ids, top_logprobs = jax.device_get(out)
        n = [len(r.tokens) - 1 for r in rows]
        if firsts is not None:
            spans = [slice(a, a + k) for a, k in zip(firsts, n, strict=True)]
            return [PromptLogprobs(logprobs[s], top_ids[s], top_logprobs[s]) for s in spans]
        return [PromptLogprobs(logprobs[i, :k], top_ids[i, :k], top_logprobs[i, :k]) for i, k in enumerate(n)]

    def _tokens(self, shape) -> NamedSharding:
        """Activations [b, t, ...] between a prompt's programs: split by token (`sharding.tokens_spec`), as the layers
        compute on them, so that no program gathers them whole to hand them on (70B on v6e:2x4, prefill 8 x 512:
        3% of the layers' cycles); batch over `data` where the spec is None (a decode step's)."""
        spec = tokens_spec(shape, dict(self.mesh.shape))
        return self._activations if spec is None else NamedSharding(self.mesh, spec)

    def _call(self, kind: str, fn, args, static_key=None, donate: int | None = None, out=None):
        return self.programs(kind, fn, args, static_key, donate, self._activations if out is None else out)

    @property
    def mask_words(self) -> int:
        """int32 words of a token bitmask: one bit per token of the vocabulary."""
        return (self.vocab_size + 31) // 32

    def _outputs_sharding(self, n: int):
        """An `*_outputs` program's: the decode state as it is, then n small replicated outputs."""
        return (jax.tree.map(lambda x: x.sharding, self.state),) + (self._replicated,) * n

    def _layers(self, kind: str, x, at: Placement):
        """Every layer of a step over tokens x placed as `at` says (`step.step_layers`), one program call per run of
        layers; each call updates its layers' cache."""
        fn = functools.partial(step.step_layers, config=self.config, ops=self.ops)
        for (a, b), params in zip(self._runs, self._run_params, strict=True):
            out = (self._tokens(x.shape), [self._cache_sharding] * (b - a))
            x, self.cache[a:b] = self._call(kind, fn, (params, x, at, self.cache[a:b]), donate=3, out=out)
        return x

    def _packed_layers(self, inputs, copies: bool, decoding: bool = False):
        """Every layer of a packed prefill over the slots' cache in place: the reused prefixes copied into the slots
        that reuse another's (`kvcache.copy_rows`, where there are `copies`), then every prompt token as a
        row of one batch that writes and attends to its slot's row, as a decode step's rows do; `decoding`: with
        them, the next token of each slot of `decode_slots` (`step.mixed_inputs`)."""
        if copies:
            copy = functools.partial(kvcache.copy_rows, layout=self.layout)
            caches = [self._cache_sharding] * len(self.cache)
            args = (self.cache, inputs["copy_from"], inputs["copy_to"], inputs["copy_lengths"])
            self.cache = self._call("prefill_copy", copy, args, None, 0, caches)
        if decoding:
            fn = functools.partial(step.mixed_inputs, config=self.config)
            names = ("packed_tokens", "packed_positions", "decode_slots", "decode_at")
            x, at = self._call("mixed_inputs", fn, (self._outer, self.state, *(inputs[k] for k in names)))
        else:
            fn = functools.partial(step.prefill_inputs, config=self.config)
            args = (self._outer, _column(inputs["packed_tokens"]), inputs["packed_positions"])
            x, at = self._call("prefill_inputs", fn, args)
        return self._layers("prefill_packed", x, dataclasses.replace(at, rows=inputs["packed_slots"]))

    def _prefill_layers(self, x, at: Placement, sources, slots, span: int):
        """Every layer of a prefill, a run of layers at a time (`step.prefill_layers`): the rows' caches start empty
        (`at.fresh`) or as copies of the first `span` positions of slots `sources`, and end in slots `slots`."""
        take = functools.partial(kvcache.take_rows, span=span, layout=self.layout)
        put = functools.partial(kvcache.put_rows, span=span, layout=self.layout)
        cache_dtype = jnp.dtype(self.cache_dtype).name  # a static argument: a name, not a dtype object
        run_layers = functools.partial(step.prefill_layers, config=self.config, ops=self.ops, cache_dtype=cache_dtype)
        for (a, b), params in zip(self._runs, self._run_params, strict=True):
            caches = [self._cache_sharding] * (b - a)
            rows = None if at.fresh else self._call("prefill_take", take, (self.cache[a:b], sources), span, out=caches)
            out = (self._tokens(x.shape), caches)
            x, rows = self._call("prefill_layers", run_layers, (params, x, at, rows), out=out)
            self.cache[a:b] = self._call("prefill_put", put, (self.cache[a:b], rows, slots), span, 0, caches)
        return x

    # ---- device state -----------------------------------------------------------------------------

    def _initial_state(self) -> step.DecodeState:
        s, v = self.slots, self.config.vocab_size
        host = dict(
            tokens=np.zeros(s, np.int32),
            positions=np.zeros(s, np.int32),
            active=np.zeros(s, bool),
            remaining=np.zeros(s, np.int32),
            limit=np.full(s, self.max_context, np.int32),
            step=np.zeros(s, np.int32),
            stop_ids=np.full((s, MAX_STOP_IDS), -1, np.int32),
        )
        rows = SamplingRows(**SamplingRows.from_params([SamplingParams(temperature=0.0)] * s, [0] * s))
        if self.abstract:
            counts, seen = (jax.ShapeDtypeStruct((s, v), t, sharding=self._rows) for t in (jnp.int32, jnp.bool_))
        else:
            zeros = jax.jit(
                lambda: (jnp.zeros((s, v), jnp.int32), jnp.zeros((s, v), bool)), out_shardings=(self._rows,) * 2
            )
            counts, seen = zeros()
        return step.DecodeState(
            rows=jax.tree.map(self._put_rows, rows),
            counts=counts,
            seen=seen,
            **{k: self._put_rows(x) for k, x in host.items()},
        )

    def _put_rows(self, x):
        x = np.asarray(x)
        spec = PartitionSpec("data", *([None] * (x.ndim - 1)))
        return self._global(x, NamedSharding(self.mesh, spec))

    def _put(self, xs):
        return jax.tree.map(lambda x: self._global(np.asarray(x), self._replicated), xs)

    def _global(self, x: np.ndarray, sharding: NamedSharding):
        """A host array (the same on every process) as a global array with this sharding (an abstract device's:
        its shape, dtype and sharding)."""
        if self.abstract:
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)
        return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])

    def seed(self, params: SamplingParams) -> int:
        """The request's seed, or one drawn for it (the same on every process)."""
        return params.seed if params.seed is not None else self._seeds.getrandbits(63)


def _column(x):
    """x [n] as [n, 1] (an abstract runner's ShapeDtypeStruct too: its shape, dtype and sharding)."""
    if isinstance(x, jax.ShapeDtypeStruct):
        return jax.ShapeDtypeStruct((*x.shape, 1), x.dtype, sharding=x.sharding)
    return x[:, None]


def _padded_masks(masks: np.ndarray, out: np.ndarray) -> np.ndarray:
    """out (all ones: any token) with its first rows replaced by `masks`."""
    out = out.copy()
    out[: len(masks)] = masks
    return out


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
