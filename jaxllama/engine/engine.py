"""Continuous batching: a queue of requests, a fixed number of decode slots, and the loop that keeps them full.

Each `step()` admits waiting requests into free slots (the highest `priority` first, then in order of
arrival; one `prefill` call per prompt-length bucket), then runs `decode_steps` decode steps for every slot
and returns the new tokens of each request. A finished sequence frees its slot for the next request at once;
nobody waits for the longest one.

A prompt that starts with tokens some slot's cache already holds (a shared system prompt, the earlier
turns of a conversation) reuses their keys/values and computes only the rest (`prefix.py`); the reused
count is reported as `cached_tokens`.

Multi-host: every process runs the same loop on the same requests in the same order; host inputs become
global arrays and the small per-step outputs are replicated, so every process makes the same decisions.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import heapq
import random
import time
from collections.abc import Iterable, Iterator

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxllama.core.config import ModelConfig
from jaxllama.core.model import layer_params, pack_weights
from jaxllama.core.sharding import named_sharding
from jaxllama.engine import kvcache, programs
from jaxllama.engine.prefix import ResidentPrefixes, shared_prefixes
from jaxllama.engine.request import Request, SamplingParams, Timings, Update
from jaxllama.engine.runtime import agreed_seed, cache_dir, program_cache
from jaxllama.engine.sampling import SamplerFlags, SamplingRows
from jaxllama.engine.step import (
    DecodeState,
    decode_inputs,
    decode_layers,
    decode_outputs,
    prefill_inputs,
    prefill_last,
    prefill_layers,
    prefill_outputs,
)
from jaxllama.kernels import library as kernels
from jaxllama.kernels.matmul import check_quantization

MAX_STOP_IDS = 32
# Decode slots by default. On SmolLM2 on a 2-core CPU, 64 slots ran the 256-request mixed job in 377 s against
# 398 s with 32 (larger products run nearer the matmul peak); a slot's cache grows only as its sequence does.
DEFAULT_SLOTS = 64
# Decoder layers per compiled program (`step.py`): SmolLM2's 30 layers run as 6 calls of one program.
LAYERS_PER_PROGRAM = 5
ROW_BUCKETS = (1, 8, 16, 32, 64)  # decode batch sizes below the slot count (see `Engine._decode_rows`)
# XLA:CPU runs matrix products through YNNPACK, whose kernels are set up on each program's first call in a
# process (0.2-0.5 s for a program of 5 SmolLM2 layers, even when the compiled program comes from the cache).
# Worth it for decode layers, which run every step (a step over 32 rows: 0.30 s against 0.60 s without). Not
# for prefills: a job runs most prefill shapes once or a few times, and one prefill (6 calls of a 5-layer
# program) costs more with YNNPACK's set-up than it saves (1 row x 32 tokens: 0.43 s against 0.28; 32 x 16:
# 2.00 against 2.03); only shapes that recur dozens of times, as one-row admissions do in a long mixed job,
# would repay it. Nor for the outputs, whose [rows, vocab] product XLA runs faster (32 rows: 38.7 ms against
# 45.6). With the CPU kernels (`Engine._use_cpu_kernels`) no program has a product left for YNNPACK.
XLA_KERNELS = {"xla_cpu_experimental_ynn_fusion_type": ""}  # compiler options: YNNPACK off


@dataclasses.dataclass
class _Slot:
    request: Request
    length: int  # tokens in the cache after the last step (prompt + sampled - 1 pending input)
    generated: int = 0
    prefill_start: float = 0.0
    first_token: float = 0.0
    cached: int = 0
    tokens: list[int] = dataclasses.field(default_factory=list)  # generated so far


@dataclasses.dataclass
class EngineStats:
    prefill_calls: int = 0
    prefill_tokens: int = 0  # computed; cached ones are not
    cached_tokens: int = 0
    prefill_s: float = 0.0
    decode_calls: int = 0
    decode_steps: int = 0
    decode_s: float = 0.0
    generated_tokens: int = 0
    slot_steps: int = 0  # active slots summed over decode steps
    compiles: int = 0
    compile_s: float = 0.0
    cache_resizes: int = 0

    def occupancy(self, slots: int) -> float:
        return self.slot_steps / max(1, self.decode_steps * slots)


class Engine:
    """Generates for many requests at once on a mesh. Not thread-safe: one thread drives `step()`."""

    def __init__(
        self,
        config: ModelConfig,
        params,
        mesh: Mesh,
        *,
        eos_ids: Iterable[int] = (),
        max_slots: int = DEFAULT_SLOTS,
        max_context: int | None = None,
        decode_steps: int = 1,
        min_cache: int = kvcache.MIN_BUCKET,
        layers_per_program: int = LAYERS_PER_PROGRAM,
        cpu_kernels: bool = True,
        quantize: str | None = None,
        kv_cache_dtype: str | None = None,
    ):
        check_quantization(quantize)
        self.config, self.params, self.mesh = config, params, mesh
        self.eos_ids = tuple(sorted(set(int(i) for i in eos_ids)))
        data = mesh.shape["data"]
        self.slots = max(data, -(-max_slots // data) * data)  # a multiple of the data axis
        self.max_context = min(max_context or config.max_seq_len, config.max_seq_len)
        self.decode_steps = decode_steps
        self.dtype = jax.tree.leaves(params)[0].dtype
        self.cache_dtype = kvcache.dtype(kv_cache_dtype, self.dtype)
        self.stats = EngineStats()
        self.queue: collections.deque[Request] = collections.deque()
        self.active: dict[int, _Slot] = {}
        self.prefixes = ResidentPrefixes(self.slots)
        self.cancelled: set[int] = set()
        self._compiled: dict = {}
        # Products and attention through the CPU kernels (`_use_cpu_kernels`), else XLA's own code.
        self._kernels = cpu_kernels and self._use_cpu_kernels()
        if quantize is not None and not self._kernels:
            raise ValueError(
                f"quantize={quantize!r} runs through the CPU kernels: one CPU device, float32 weights "
                f"(here: {jax.default_backend()}, {mesh.size} device(s), {self.dtype})"
            )
        # One device of the default backend in one process: programs can be kept exported (`programs.py`).
        platform = mesh.devices.flat[0].platform
        self._one_device = mesh.size == 1 and jax.process_count() == 1 and platform == jax.default_backend()
        self._replicated = NamedSharding(mesh, PartitionSpec())
        self._activations = NamedSharding(mesh, PartitionSpec("data"))  # [batch, ...], batch over `data`
        self._cache_sharding = kvcache.cache_sharding(config, mesh)  # one layer's (keys, values)
        self._rows = named_sharding(mesh, config, ("batch",))
        self._seeds = random.Random(agreed_seed())  # for requests without a seed: the same on every process
        # The params outside the layers (embedding, final norm, output), and the layers' in runs of
        # `layers_per_program`; for the CPU kernels, with their products' weights packed (`pack_weights`).
        self._outer = {k: v for k, v in params.items() if not k.startswith("layers_")}
        n = config.n_layers
        if not isinstance(layers_per_program, int) or layers_per_program < 1:
            raise ValueError(f"layers_per_program={layers_per_program!r}: must be a positive integer")
        self._runs = [(a, min(a + layers_per_program, n)) for a in range(0, n, layers_per_program)]
        self._run_params = [layer_params(params, config, a, b) for a, b in self._runs]
        if self._kernels:
            self._outer = pack_weights(self._outer, config, quantize)
            self._run_params = [pack_weights(p, config, quantize) for p in self._run_params]
        self.state = self._initial_state()
        self.cache = kvcache.allocate(
            self.config, mesh, self.slots, kvcache.bucket(min_cache, self.max_context), self.cache_dtype
        )

    # ---- public API -------------------------------------------------------------------------------

    def check(self, request: Request) -> None:
        """Raise ValueError if the request can never run (the caller reports it for that request alone)."""
        request.params.validate()
        n = len(request.prompt)
        if n == 0:
            raise ValueError("prompt is empty")
        if n >= self.max_context:
            raise ValueError(
                f"prompt is {n} tokens, the context limit is {self.max_context} "
                "(prompt plus at least one generated token)"
            )
        bad = [t for t in request.prompt if not 0 <= t < self.config.vocab_size]
        if bad:
            raise ValueError(f"token id {bad[0]} is outside the vocabulary (0..{self.config.vocab_size - 1})")
        if len(self.eos_ids) + len(request.params.stop_token_ids) > MAX_STOP_IDS:
            raise ValueError(f"at most {MAX_STOP_IDS - len(self.eos_ids)} extra stop token ids")
        bad = [t for t in request.params.stop_token_ids if not 0 <= t < self.config.vocab_size]
        if bad:
            raise ValueError(
                f"stop_token_ids={list(request.params.stop_token_ids)}: {bad[0]} is outside the vocabulary "
                f"(0..{self.config.vocab_size - 1})"
            )

    def add(self, request: Request) -> None:
        """Queue a request (ValueError if it can never run). A max_tokens past the context or a top_k past the
        vocabulary means the limit: they are capped to it (the device holds them as int32)."""
        self.check(request)
        p = request.params
        max_tokens, top_k = min(p.max_tokens, self.max_context), min(p.top_k, self.config.vocab_size)
        if (max_tokens, top_k) != (p.max_tokens, p.top_k):
            request = dataclasses.replace(request, params=dataclasses.replace(p, max_tokens=max_tokens, top_k=top_k))
        self.queue.append(request)

    def cancel(self, request_id) -> None:
        """Stop a request (queued or running); its slot is freed at the next step."""
        for i, r in enumerate(self.queue):
            if r.id == request_id:
                del self.queue[i]
                return
        for slot, s in self.active.items():
            if s.request.id == request_id:
                self.cancelled.add(slot)

    def has_work(self) -> bool:
        return bool(self.queue or self.active)

    def generate(self, requests: Iterable[Request]) -> Iterator[Update]:
        """Run requests to completion, yielding updates as they come."""
        for r in requests:
            self.add(r)
        while self.has_work():
            yield from self.step()

    def step(self) -> list[Update]:
        updates = self._release_cancelled()
        updates += self._admit()
        if self.active:
            updates += self._decode()
        return updates

    # ---- scheduling -------------------------------------------------------------------------------

    def _release_cancelled(self) -> list[Update]:
        out = []
        for slot in sorted(self.cancelled):
            if slot in self.active:
                s = self.active.pop(slot)
                self._release(slot, s)
                out.append(self._finished(s, [], [], "cancelled", None))
        self._keep = np.ones(self.slots, bool)
        for slot in self.cancelled:
            self._keep[slot] = False
        self.cancelled.clear()
        return out

    def _admit(self) -> list[Update]:
        free = [i for i in range(self.slots) if i not in self.active]
        take = self._next_requests(len(free))
        if not take:
            return []
        self._compute_shared_prefixes(take, free)
        by_bucket = collections.defaultdict(list)
        for r in take:
            reuse = self.prefixes.best(r.prompt)[1]
            by_bucket[kvcache.prompt_bucket(len(r.prompt) - reuse, self.max_context)].append(r)
        updates = []
        for _, group in sorted(by_bucket.items()):
            rows = []
            for r in group:
                # Sources are chosen just before each call: the cache then holds what `prefixes` says.
                source, start = self.prefixes.best(r.prompt)
                slot = source if source in free else min(free, key=lambda i: len(self.prefixes.tokens[i]))
                free.remove(slot)
                rows.append((r, r.prompt[start:], start, source if source is not None else slot, slot))
            updates += self._prefill(rows)
        return updates

    def _next_requests(self, n: int) -> list[Request]:
        """Take up to n queued requests: the highest priority first, in order of arrival among equals."""
        if len({r.priority for r in self.queue}) <= 1:
            return [self.queue.popleft() for _ in range(min(n, len(self.queue)))]
        chosen = set(heapq.nsmallest(n, range(len(self.queue)), key=lambda i: (-self.queue[i].priority, i)))
        take = [r for i, r in enumerate(self.queue) if i in chosen]
        self.queue = collections.deque(r for i, r in enumerate(self.queue) if i not in chosen)
        return sorted(take, key=lambda r: -r.priority)

    def _compute_shared_prefixes(self, requests: list[Request], free: list[int]) -> None:
        """Prompts admitted together that share a prefix no slot holds: compute it once, into a free slot
        that the first of them will then take."""
        rows = []
        for members, n in shared_prefixes([r.prompt for r in requests]):
            if self.prefixes.best(requests[members[0]].prompt)[1] >= n or len(rows) == len(free):
                continue
            slot = sorted(free, key=lambda i: len(self.prefixes.tokens[i]))[len(rows)]
            prefix = requests[members[0]].prompt[:n]
            rows.append((Request(None, prefix, SamplingParams(temperature=0.0, max_tokens=1)), prefix, 0, slot, slot))
        if rows:
            self._prefill(rows, warm=True)

    def _prefill(self, rows: list[tuple[Request, list[int], int, int, int]], warm: bool = False) -> list[Update]:
        """rows: (request, tokens to compute, start position, source slot, destination slot). `warm`: only
        fill the caches (shared prefixes); nothing is reported."""
        q = kvcache.prompt_bucket(max(len(t) for _, t, *_ in rows), self.max_context)
        needed = max(start + q for _, _, start, _, _ in rows)
        fresh = all(start == 0 for _, _, start, _, _ in rows)  # no row reuses a prefix
        span = q if fresh else kvcache.bucket(needed, self.max_context)
        self._ensure_cache(needed)
        n = _pow2(len(rows))
        n = -(-n // self.mesh.shape["data"]) * self.mesh.shape["data"]
        tokens = np.zeros((n, q), np.int32)
        starts = np.zeros(n, np.int32)
        lengths = np.ones(n, np.int32)
        sources = np.full(n, self.slots, np.int32)
        slot_ids = np.full(n, self.slots, np.int32)  # padding rows land nowhere
        stop_ids = np.full((n, MAX_STOP_IDS), -1, np.int32)
        params, seeds = [], []
        for i, (r, todo, start, source, slot) in enumerate(rows):
            tokens[i, : len(todo)] = todo
            lengths[i], starts[i], sources[i], slot_ids[i] = len(todo), start, source, slot
            ids = sorted(set(self.eos_ids) | set(r.params.stop_token_ids))
            stop_ids[i, : len(ids)] = ids
            params.append(r.params)
            seeds.append(r.params.seed if r.params.seed is not None else self._seeds.getrandbits(63))
        params += [SamplingParams(temperature=0.0)] * (n - len(rows))
        seeds += [0] * (n - len(rows))
        sampling = SamplingRows(**SamplingRows.from_params(params, seeds))
        max_tokens = np.array([p.max_tokens for p in params], np.int32)
        limits = np.full(n, self.max_context, np.int32)
        flags = SamplerFlags.of(params) | SamplerFlags(kernel=self._kernels)
        seen = np.zeros((n, self.config.vocab_size if flags.penalize else 1), bool)
        if flags.penalize:
            for i, (r, *_) in enumerate(rows):
                seen[i, r.prompt] = True
        compiling = self.stats.compile_s
        start = time.perf_counter()
        tokens, starts, lengths_d, sources, slot_ids, seen, sampling, max_tokens, limits, stop_ids = self._put(
            (tokens, starts, lengths, sources, slot_ids, seen, sampling, max_tokens, limits, stop_ids)
        )
        inputs = functools.partial(prefill_inputs, config=self.config)
        x, positions, rope = self._run("prefill_inputs", inputs, (self._outer, tokens, starts))
        x = self._prefill_layers(x, positions, rope, sources, slot_ids, span, fresh)
        if warm:  # only the caches: no token to sample
            jax.block_until_ready(x)
        else:
            x = self._run("prefill_last", prefill_last, (x, lengths_d))
            args = (self._outer, self.state, x, starts, lengths_d, slot_ids, seen, sampling, max_tokens, limits)
            args += (stop_ids,)
            fn = functools.partial(prefill_outputs, config=self.config, flags=flags)
            self.state, first, logprobs, still = self._run("prefill_outputs", fn, args, flags, donate=1)
            first, logprobs, still = jax.device_get((first, logprobs, still))
        now = time.perf_counter()
        self.stats.prefill_calls += 1
        self.stats.prefill_tokens += int(lengths[: len(rows)].sum())
        self.stats.prefill_s += now - start - (self.stats.compile_s - compiling)
        for r, _, _, _, slot in rows:
            if not warm:  # a cancelled slot refilled now: the cancel must not hit its new request
                self._keep[slot] = True
            self.prefixes.hold(slot, r.prompt)
        if warm:
            return []
        updates = []
        for i, (r, _, cached, _, slot) in enumerate(rows):
            self.stats.cached_tokens += cached
            tok, lp = int(first[i]), float(logprobs[i])
            s = _Slot(r, len(r.prompt), 1, start, now, cached, [tok])
            if still[i]:
                self.active[slot] = s
                updates.append(Update(r.id, [tok], [lp], prompt_tokens=len(r.prompt), cached_tokens=cached))
            else:
                self._release(slot, s)
                updates.append(self._finished(s, [tok], [lp], *self._reason(s, tok)))
        return updates

    def _decode(self) -> list[Update]:
        n_steps = self.decode_steps
        self._ensure_cache(max(s.length + s.generated for s in self.active.values()) + n_steps)
        flags = SamplerFlags(kernel=self._kernels)
        for s in self.active.values():
            flags = flags | SamplerFlags.of([s.request.params])
        columns = self._decode_rows()
        compiling = self.stats.compile_s
        start = time.perf_counter()
        slots, keep, kept = self._put(
            (None if len(columns) == self.slots else np.array(columns, np.int32), self._keep, np.ones(self.slots, bool))
        )
        inputs_fn = functools.partial(decode_inputs, config=self.config)
        layers_fn = functools.partial(decode_layers, config=self.config, kernel=self._kernels)
        outputs_fn = functools.partial(decode_outputs, config=self.config, flags=flags)
        steps = []
        for _ in range(n_steps):  # no host round trip between steps: each reads the last one's state on device
            x, positions, rope = self._run("decode_inputs", inputs_fn, (self._outer, self.state, slots))
            x = self._decode_layers(layers_fn, x, positions, rope, slots)
            args = (self._outer, self.state, keep, x, slots)
            self.state, *out = self._run("decode_outputs", outputs_fn, args, flags, donate=1)
            steps.append(out)
            keep = kept  # cancellations apply at the first step
        tokens, logprobs, emitted = (np.stack(x) for x in zip(*jax.device_get(steps), strict=True))
        self.stats.decode_s += time.perf_counter() - start - (self.stats.compile_s - compiling)
        self.stats.decode_calls += 1
        self.stats.decode_steps += n_steps
        self.stats.slot_steps += int(emitted.sum())
        self._keep = np.ones(self.slots, bool)
        updates = []
        for column, slot in enumerate(columns):
            if slot not in self.active:
                continue
            s = self.active[slot]
            steps = np.flatnonzero(emitted[:, column])
            toks = [int(t) for t in tokens[steps, column]]
            lps = [float(x) for x in logprobs[steps, column]]
            s.generated += len(toks)
            s.tokens += toks
            self.stats.generated_tokens += len(toks)
            reason, stop_token = self._reason(s, toks[-1] if toks else None)
            if reason is None:
                updates.append(Update(s.request.id, toks, lps))
            else:
                del self.active[slot]
                self._release(slot, s)
                updates.append(self._finished(s, toks, lps, reason, stop_token))
        return updates

    def _decode_rows(self) -> list[int]:
        """The slots a decode step runs: every slot, or, when few are active, just those (padded with the
        out-of-range index `slots` to the next of ROW_BUCKETS): on XLA:CPU a step over 32 rows costs ~7x one
        over 1 row and ~2x one over 8 (SmolLM2, `benchmarks/README.md`)."""
        active = sorted(self.active)
        data = self.mesh.shape["data"]
        for size in ROW_BUCKETS:
            size = -(-size // data) * data
            if len(active) <= size < self.slots:
                return active + [self.slots] * (size - len(active))
        return list(range(self.slots))

    def _use_cpu_kernels(self) -> bool:
        """Whether the model's products and attention run through the CPU kernels (`kernels/`): on one CPU
        device, in float32, where they build (once per machine; the build counts as compilation). SmolLM2: a
        32-row product at 55-65 GFLOP/s against XLA's 45-50; decode attention over 64 rows x 384 positions in 3
        ms per layer against 8."""
        start = time.perf_counter()
        float32 = all(x.dtype == np.float32 for x in jax.tree.leaves(self.params))
        usable = jax.default_backend() == "cpu" and self.mesh.size == 1 and float32
        usable = usable and kernels.load(cache_dir() / "kernels")
        self.stats.compile_s += time.perf_counter() - start
        return usable

    def _release(self, slot: int, s: _Slot) -> None:
        """The slot is free; its cache keeps the sequence (all but the last token, never fed back)."""
        self.prefixes.hold(slot, s.request.prompt + s.tokens[:-1])

    def _reason(self, s: _Slot, last: int | None) -> tuple[str | None, int | None]:
        """Mirror of the device's end-of-generation test, to tell why a slot stopped."""
        if last is not None and (last in self.eos_ids or last in s.request.params.stop_token_ids):
            return "stop", last
        if s.generated >= s.request.params.max_tokens or s.length + s.generated >= self.max_context:
            return "length", None
        return None, None

    def _finished(self, s: _Slot, toks, lps, reason, stop_token) -> Update:
        now = time.perf_counter()
        r = s.request
        decode_s = now - s.first_token if s.first_token else 0.0
        timings = Timings(
            queue_ms=1e3 * max(0.0, s.prefill_start - r.submitted),
            prefill_ms=1e3 * (s.first_token - s.prefill_start),
            ttft_ms=1e3 * (s.first_token - r.submitted),
            decode_ms=1e3 * decode_s,
            decode_tokens_per_s=(s.generated - 1) / decode_s if decode_s > 0 and s.generated > 1 else 0.0,
            total_ms=1e3 * (now - r.submitted),
        )
        return Update(
            r.id,
            toks,
            lps,
            reason,
            stop_token,
            prompt_tokens=len(r.prompt),
            completion_tokens=s.generated,
            cached_tokens=s.cached,
            timings=timings,
        )

    # ---- device state -----------------------------------------------------------------------------

    def _initial_state(self) -> DecodeState:
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
        zeros = jax.jit(
            lambda: (jnp.zeros((s, v), jnp.int32), jnp.zeros((s, v), bool)), out_shardings=(self._rows,) * 2
        )
        counts, seen = zeros()
        return DecodeState(
            rows=jax.tree.map(lambda x: self._put_rows(x), rows),
            counts=counts,
            seen=seen,
            **{k: self._put_rows(x) for k, x in host.items()},
        )

    def _ensure_cache(self, needed: int) -> None:
        """Grow the cache to hold `needed` positions (and every active sequence's next steps), or shrink it
        when far more than that."""
        for s in self.active.values():
            needed = max(needed, s.length + s.generated + self.decode_steps)
        current = kvcache.length(self.cache)
        target = kvcache.bucket(needed, self.max_context)
        if target > current or target <= current // 4:
            start = time.perf_counter()
            resize = jax.jit(
                kvcache.resize,
                static_argnums=1,  # no donation: the new cache has another shape
                out_shardings=[self._cache_sharding] * self.config.n_layers,
            )
            self.cache = resize(self.cache, target)
            self.prefixes.truncate(target)
            self.stats.cache_resizes += 1
            self.stats.decode_s += time.perf_counter() - start

    def _put_rows(self, x):
        x = np.asarray(x)
        spec = PartitionSpec("data", *([None] * (x.ndim - 1)))
        return _global(x, NamedSharding(self.mesh, spec))

    def _put(self, xs):
        return jax.tree.map(lambda x: _global(np.asarray(x), self._replicated), xs)

    def _decode_layers(self, fn, x, positions, rope, slots):
        """Every layer of a decode step, one program call per run of layers; each call updates its layers' cache."""
        for (a, b), params in zip(self._runs, self._run_params, strict=True):
            args = (params, x, positions, rope, self.cache[a:b], slots)
            out = (self._activations, [self._cache_sharding] * (b - a))
            x, self.cache[a:b] = self._run("decode_layers", fn, args, donate=4, out=out)
        return x

    def _prefill_layers(self, x, positions, rope, sources, slots, span: int, fresh: bool):
        """Every layer of a prefill, a run of layers at a time (`step.prefill_layers`): the rows' caches start empty
        (`fresh`) or as copies of the first `span` positions of slots `sources`, and end in slots `slots`."""
        take = functools.partial(kvcache.take_rows, span=span)
        put = functools.partial(kvcache.put_rows, span=span)
        cache_dtype = jnp.dtype(self.cache_dtype).name  # a static argument: a name, not a dtype object
        run_layers = functools.partial(
            prefill_layers, config=self.config, kernel=self._kernels, cache_dtype=cache_dtype
        )
        for (a, b), params in zip(self._runs, self._run_params, strict=True):
            caches = [self._cache_sharding] * (b - a)
            rows = None if fresh else self._run("prefill_take", take, (self.cache[a:b], sources), span, out=caches)
            out = (self._activations, caches)
            x, rows = self._run("prefill_layers", run_layers, (params, x, positions, rope, rows), out=out)
            self.cache[a:b] = self._run("prefill_put", put, (self.cache[a:b], rows, slots), span, donate=0, out=caches)
        return x

    def _run(self, kind: str, fn, args, static_key=None, donate: int | None = None, out=None):
        """Call fn on args through its compiled program for (kind, the shapes of args, static switches), compiled
        ahead of time on first use (and timed for the statistics). On one device, the program is kept exported on
        disk where the compilation cache is on (`programs.py`); on a mesh, its outputs get `out` shardings, by
        default (state, replicated...) for `*_outputs` and activations otherwise."""
        leaves, tree = jax.tree.flatten(args)
        key = (kind, tree, tuple((x.shape, x.dtype) for x in leaves), static_key)
        if key not in self._compiled:
            start = time.perf_counter()
            ynnpack = kind == "decode_layers" and not self._kernels
            options = XLA_KERNELS if jax.default_backend() == "cpu" and not ynnpack else {}
            compiled = None
            if (folder := program_cache()) is not None and self._one_device:
                compiled = programs.compile_program(folder, fn, args, donate, static_key, options)
            if compiled is None:
                if out is None:
                    state = jax.tree.map(lambda x: x.sharding, self.state)
                    out = (state,) + (self._replicated,) * 3 if kind.endswith("outputs") else self._activations
                jitted = jax.jit(fn, donate_argnums=() if donate is None else (donate,), out_shardings=out)
                compiled = jitted.lower(*args).compile(compiler_options=options)
            self._compiled[key] = compiled
            self.stats.compiles += 1
            self.stats.compile_s += time.perf_counter() - start
        return self._compiled[key](*args)


def _pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


def _global(x: np.ndarray, sharding: NamedSharding) -> jax.Array:
    """A host array (the same on every process) as a global array with this sharding."""
    return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])
