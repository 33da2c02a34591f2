"""A whole job's time before it runs: the engine's own scheduler admits, chunks, batches and decodes the job's
requests on an abstract model runner (`ModelRunner(abstract=True)`), whose every call compiles the programs the engine
would run, each shape once, and advances a clock by what they cost (`ClockedRunner`). Nothing is sampled: each request
generates its output length (its max_tokens, or an assumed mean), as a request that ignores end-of-generation
tokens does, so that the clock says how long the job's prompt and output sizes take on the target.

What a program costs is the caller's to say (`cost`): on a target that cannot run it (a TPU slice described on this
host), the compiler's estimates (`estimated_cost`); on the local devices, its measured time (`measured_cost`), so that
a prediction can be checked against a real run of the same job.

What it leaves out: the host's work between calls (tokenizing, detokenizing, stop strings, grammars), the time a
request waits to arrive (the whole job is queued at once), a stop string or end-of-generation token that ends an
answer before its max_tokens, and, with estimated costs, whatever the compiler's estimates leave out.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxllama.engine import aot
from jaxllama.engine.interface import LENGTH, RUNNING, PrefillRow, Sampled
from jaxllama.engine.model_runner import ModelRunner
from jaxllama.engine.programs import Compiled
from jaxllama.engine.request import Request, SamplingParams
from jaxllama.engine.scheduler import Scheduler
from jaxllama.engine.stats import EngineStats
from jaxllama.errors import RequestError

# A Pallas kernel's share of the chip's HBM bandwidth: the compiler estimates no cycles for a custom call, so a
# kernel is charged the bytes it reads at this share (vLLM TPU's ragged paged attention reports up to 86% of the
# bandwidth in decode, and jax-llm-examples' 70B decode step 85% over the whole step; this engine's kernels, on a TPU
# `backends/paged_attention.py` and on a GPU jax's, are taken a little below them). An assumption, stated as one.
KERNEL_BANDWIDTH_SHARE = 0.8
# The programs whose Pallas kernel reads the paged pool (a decode step's attention): a call reads what the backend's
# kernel reads of each row (`Ops.kernel_read`), not the whole pool its operands name.
POOL_READERS = ("decode_layers", "mixed_layers")
# What a collective costs besides its bytes over the chips' links, to synchronize: an assumption, bounded by the one
# measured decode step at hand. jax-llm-examples' Llama-3.1-70B on a v5e-16 (TP 16, batch 8 x 2,048) decodes 159
# tokens a second per sequence, a 6.29 ms step, at "85% of HBM bandwidth": its int8 weights' read takes 5.37 ms of
# it, which leaves 0.92 ms for everything else, among it the step's 160 all-reduces (two a layer): ~5.8 us each at
# most, were they run after the weights' read (on a TPU they run during it: `estimated_cost`).
COLLECTIVE_LATENCY_S = 5e-6
# Bytes a second a chip moves to its neighbours over ICI, all links together (Google Cloud's TPU pages: v5e 1,600
# Gbit/s, v6e 3,584 Gbit/s, v5p 4,800 Gbit/s, v4 2,400 Gbit/s).
ICI_BANDWIDTH = {"TPU v5e": 200e9, "TPU v6e": 448e9, "TPU v5p": 600e9, "TPU v4": 300e9}


class ClockedRunner:
    """`interface.ModelRunnerInterface` over an abstract `ModelRunner`: each call compiles what the runner would run
    and advances `now` by the cost of the programs it called; the tokens it gives are made up, each slot's request
    running to `outputs[request id]` tokens (at most what its context holds) and then finishing by length."""

    def __init__(self, runner: ModelRunner, cost: Callable[[Compiled, float], float], outputs: dict):
        if not runner.abstract:
            raise ValueError("a clocked runner runs over an abstract model runner")
        self.runner, self.cost, self.outputs = runner, cost, outputs
        for name in ("slots", "max_context", "decode_steps", "vocab_size", "eos_ids", "max_stop_ids", "row_multiple"):
            setattr(self, name, getattr(runner, name))
        for name in ("reuse_multiple", "packs_prompts", "joins_decode", "chunk_multiple", "pages"):
            setattr(self, name, getattr(runner, name))
        self.token = next(t for t in range(self.vocab_size) if t not in self.eos_ids)  # what every row "samples"
        self.now = 0.0
        self._left: dict[int, int] = {}  # slot -> tokens its request has still to generate

    def clock(self) -> float:
        return self.now

    def _timed(self, call, columns: Sequence[int] = ()) -> None:
        """Run `call` on the abstract runner; advance the clock by the programs it called, those that read the pool
        (`POOL_READERS`) by the share of it the decode rows `columns` hold (`_pool_read`)."""
        first = len(self.runner.programs.calls)
        read = self._pool_read(columns)
        call()
        called = self.runner.programs.calls[first:]
        self.now += sum(self.cost(c, read if c.kind in POOL_READERS else 1.0) for c in called)

    def _pool_read(self, columns: Sequence[int]) -> float:
        """The share of a paged pool a decode step's kernel reads for the slots `columns`: what the backend's kernel
        reads of each slot's positions (`Ops.kernel_read`); 1.0 over a contiguous cache."""
        pages = self.runner.pages
        if pages is None:
            return 1.0
        kernel_read = self.runner.ops.kernel_read
        read = sum(kernel_read(pages.positions(c), pages.page_size) for c in columns if c < self.slots)
        return min(1.0, read / (pages.pages * pages.page_size))

    def make_room(self, needed: int, lengths: dict[int, int]) -> int:
        kept = []
        self._timed(lambda: kept.append(self.runner.make_room(needed, lengths)))
        return kept[0]

    def prefill(self, rows: Sequence[PrefillRow], sample: bool = True, masks=None) -> Sampled | None:
        self._timed(lambda: self.runner.prefill(rows, sample))
        return self._started(rows) if sample else None

    def generate(self, columns: Sequence[int], params, cancelled: Sequence[int] = (), masks=None) -> Sampled:
        self._timed(lambda: self.runner.generate(columns, params, cancelled), columns)
        return self._decoded(columns, cancelled, self.decode_steps)

    def prefill_and_decode(self, rows, columns, params, cancelled=(), masks=None, decode_masks=None):
        self._timed(lambda: self.runner.prefill_and_decode(rows, columns, params, cancelled), columns)
        for slot in cancelled:  # stopped before the rows start, as the runner does: a row may refill its slot
            self._left.pop(slot, None)
        return self._started(rows), self._decoded(columns, (), 1)

    def _started(self, rows: Sequence[PrefillRow]) -> Sampled:
        """The first token of each final row: its slot then runs its request's output length."""
        finish = np.full((1, len(rows)), RUNNING, np.int32)
        for i, r in enumerate(rows):
            if r.final:
                room = self.max_context - len(r.request.prompt)
                self._left[r.slot] = min(self.outputs[r.request.id], room) - 1
                if self._left[r.slot] <= 0:
                    finish[0, i] = LENGTH
                    del self._left[r.slot]
        return self._sampled(finish, np.ones_like(finish, bool))

    def _decoded(self, columns: Sequence[int], cancelled: Sequence[int], steps: int) -> Sampled:
        for slot in cancelled:
            self._left.pop(slot, None)
        finish = np.full((steps, len(columns)), RUNNING, np.int32)
        emitted = np.zeros((steps, len(columns)), bool)
        for j, slot in enumerate(columns):
            for step in range(steps):
                if slot not in self._left:
                    break
                emitted[step, j] = True
                self._left[slot] -= 1
                if self._left[slot] <= 0:
                    finish[step, j] = LENGTH
                    del self._left[slot]
        return self._sampled(finish, emitted)

    def _sampled(self, finish: np.ndarray, emitted: np.ndarray) -> Sampled:
        return Sampled(np.full(finish.shape, self.token, np.int32), np.zeros(finish.shape, np.float32), emitted, finish)


@dataclasses.dataclass
class JobPrediction:
    """A job's predicted run: its wall time on the clock, tokens, rates, time to first token and slot occupancy, and
    with a price per chip-hour what the chips cost for it."""

    requests: int  # run (each of a line's n samples is one)
    refused: dict  # request index -> why the engine refuses it (a prompt past the context)
    prompt_tokens: int
    cached_tokens: int  # of the prompt tokens, those read from a cache (a prefix some slot or the pool held)
    output_tokens: int
    wall_s: float
    ttft_p50_s: float
    ttft_p95_s: float
    occupancy: float  # decoding slots over all slots, over the decode steps
    chips: int
    price_per_chip_hour: float | None
    programs: int  # programs compiled to predict it
    compile_s: float  # the host's seconds compiling them (not on the clock)

    @property
    def output_tok_s(self) -> float:
        return self.output_tokens / self.wall_s if self.wall_s else 0.0

    @property
    def total_tok_s(self) -> float:
        return (self.prompt_tokens + self.output_tokens) / self.wall_s if self.wall_s else 0.0

    @property
    def chip_hours(self) -> float:
        return self.chips * self.wall_s / 3600

    @property
    def cost_usd(self) -> float | None:
        return None if self.price_per_chip_hour is None else self.chip_hours * self.price_per_chip_hour

    def to_json(self) -> dict:
        return dataclasses.asdict(self) | {
            "output_tok_s": self.output_tok_s,
            "total_tok_s": self.total_tok_s,
            "chip_hours": self.chip_hours,
            "cost_usd": self.cost_usd,
        }

    def table(self) -> str:
        cost = f", ${self.cost_usd:,.2f} at ${self.price_per_chip_hour}/chip-hour" if self.cost_usd is not None else ""
        return "\n".join(
            [
                f"job: {self.requests} requests, {self.prompt_tokens:,} prompt + {self.output_tokens:,} output tokens"
                + (f" ({self.cached_tokens:,} prompt tokens read from the cache)" if self.cached_tokens else "")
                + (f" ({len(self.refused)} refused: {next(iter(self.refused.values()))})" if self.refused else ""),
                f"predicted wall time {self.wall_s:,.1f} s: {self.output_tok_s:,.1f} output tok/s, "
                f"{self.total_tok_s:,.1f} total tok/s",
                f"time to first token p50 {self.ttft_p50_s:.2f} s, p95 {self.ttft_p95_s:.2f} s; "
                f"slot occupancy {self.occupancy:.0%}",
                f"{self.chip_hours:.3f} chip-hours on {self.chips} chips{cost}",
                f"({self.programs} programs compiled in {self.compile_s:.0f} s to predict it)",
            ]
        )


def predict(
    runner: ModelRunner,
    jobs: Sequence[tuple[list[int], int]],
    cost: Callable[[Compiled, float], float],
    *,
    step_tokens: int,
    chips: int,
    price: float | None = None,
) -> JobPrediction:
    """The job of `jobs` (each request's prompt token ids and output length), queued at once, run by the engine's
    scheduler on `runner` (abstract), on the clock of `cost`."""
    outputs = {i: n for i, (_, n) in enumerate(jobs)}
    clocked = ClockedRunner(runner, cost, outputs)
    stats = EngineStats()
    scheduler = Scheduler(clocked, stats, step_tokens, clock=clocked.clock)
    refused = {}
    for i, (prompt, n) in enumerate(jobs):
        params = SamplingParams(max_tokens=max(1, n), temperature=0.0, ignore_eos=True)
        # longest first, as `jaxllama run` queues a job's lines
        request = Request(i, list(prompt), params, submitted=0.0, priority=params.max_tokens)
        try:
            scheduler.check(request)  # a prompt past the context, as `jaxllama run` refuses its line
        except RequestError as e:
            refused[i] = str(e)
            continue
        scheduler.add(request)
    started = time.perf_counter()
    compiled_before = len({id(c) for c in runner.programs.calls})
    ttft, outputs_done = [], 0
    while scheduler.has_work():
        for update in scheduler.step():
            if update.finish_reason is not None:
                ttft.append(update.timings.ttft_ms / 1e3)
                outputs_done += update.completion_tokens
    slots = stats.decode_steps * runner.slots
    return JobPrediction(
        requests=len(jobs) - len(refused),
        refused=refused,
        prompt_tokens=sum(len(p) for i, (p, _) in enumerate(jobs) if i not in refused),
        cached_tokens=stats.cached_tokens,
        output_tokens=outputs_done,
        wall_s=clocked.now,
        ttft_p50_s=_quantile(ttft, 0.5),
        ttft_p95_s=_quantile(ttft, 0.95),
        occupancy=stats.slot_steps / slots if slots else 0.0,
        chips=chips,
        price_per_chip_hour=price,
        programs=len({id(c) for c in runner.programs.calls}) - compiled_before,
        compile_s=time.perf_counter() - started,
    )


def _quantile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[round(q * 100) - 1]


def estimated_cost(chip) -> Callable[[Compiled, float], float]:
    """A program's seconds on `chip` by the compiler's estimates (`aot.py`), the call reading the share `read` of
    its Pallas kernels' operands: its HBM traffic but the kernels' over the chip's bandwidth, its cycle estimate over
    the chip's clock (where the compiler gives no cycles, a GPU's: its products' flops, read from the HLO, at the
    chip's peak; the cost model's where the HLO cannot be read), and its collectives (their bytes over the chip's ICI
    bandwidth and COLLECTIVE_LATENCY_S each): on a TPU the longer of the traffic and the cycles with the collectives
    after them, elsewhere the longer of the traffic and the compute with the collectives after it; then its kernels'
    bytes read at KERNEL_BANDWIDTH_SHARE of the bandwidth."""
    known: dict[int, aot.ProgramReport] = {}

    def cost(compiled: Compiled, read: float = 1.0) -> float:
        if id(compiled) not in known:
            known[id(compiled)] = aot.program_report(compiled, "job", 1)
        report = known[id(compiled)]
        hbm, kernel, compute = None, 0.0, None
        if report.hbm_bytes is not None:
            hbm = (report.hbm_bytes - report.kernel_bytes) / chip.hbm_bandwidth
            kernel = report.kernel_bytes * read / (KERNEL_BANDWIDTH_SHARE * chip.hbm_bandwidth)
        if report.cycles:
            compute = report.cycles / chip.clock_hz + report.uncosted_flops / chip.bf16_flops
        elif report.product_flops:  # no cycles (a GPU compiled for without one): its products at the chip's peak
            compute = report.product_flops / chip.bf16_flops
        ici = ICI_BANDWIDTH.get(chip.name)
        collectives = sum(
            c["count"] * COLLECTIVE_LATENCY_S + (c["bytes"] / ici if ici else 0.0) for c in report.collectives.values()
        )
        estimates = [t for t in (hbm, compute) if t is not None]
        if not estimates:
            return max(report.cost_model_s, 0.0) + kernel + collectives
        if report.cycles and hbm is not None:
            # A TPU program streams its weights into VMEM by DMAs it starts ahead of the products that read them
            # (`slice-start`, `copy-start`), across the collectives too: the core's cycles and the collectives run
            # while the weights stream. jax-llm-examples' measured 70B step (above: 6.29 ms) is 1.4% under the
            # step this clock gives so (6.38 ms), where adding the collectives after the stream gives 6.92 ms.
            return max(hbm, compute + collectives) + kernel
        return max(estimates) + collectives + kernel

    return cost


def measured_cost(repeats: int = 3) -> Callable[[Compiled, float], float]:
    """A program's seconds on the local devices, measured: run on zeros of its arguments' shapes, once to warm up and
    then `repeats` times, the median (whatever share of a paged pool the call reads). What depends on the values is
    left out: attention reads the positions a slot holds, and zeros hold none (the decode state's positions are
    zero), so long sequences' attention is undercounted."""

    known: dict[int, float] = {}

    def zeros(info, sharding):
        return jax.device_put(jnp.zeros(info.shape, info.dtype), sharding)

    def cost(compiled: Compiled, read: float = 1.0) -> float:
        if id(compiled) not in known:
            executable = compiled.executable
            shardings = executable.input_shardings[0]
            infos = executable.args_info[0]
            times = []
            for _ in range(repeats + 1):
                args = jax.tree.map(zeros, infos, shardings)
                start = time.perf_counter()
                jax.block_until_ready(executable(*args))
                times.append(time.perf_counter() - start)
            known[id(compiled)] = statistics.median(times[1:])
        return known[id(compiled)]

    return cost
