"""The engine compiled ahead of time for a target it need not run on: does a model fit, and how fast would it decode?

`compile_engine` builds the engine with abstract weights (shapes, dtypes and shardings only) on the target's devices
(a TPU topology described on this host, or the local devices), then compiles every program the engine runs for a
full cache: the cache's last growth, a decode step over every slot, and prefills of the given sizes (rows x prompt
tokens), each through the engine's own code path (`ModelRunner` with `abstract=True`), so the programs are the ones it
would run. Each program is read for what the compiler says of it (memory per device, flops, its cost model's time)
and what its optimized HLO moves (`hlo.py`: HBM bytes, the compiler's cycle estimate, collectives).

A decode step is bound by HBM bandwidth: its ideal time is the bytes no implementation can avoid reading per device
(the weights split over the `model` axis, the live KV cache split over every device) over the chip's bandwidth
(`core/chips.py`). Each estimate (HBM traffic / bandwidth, the compiler's cycles / clock) is reported beside it,
with the tokens per second per sequence and in all that it implies.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import re
import time
from collections.abc import Sequence
from pathlib import Path

from jaxllama.core.chips import GPUS, Chip, chip_of
from jaxllama.core.config import BLOCK_FORMATS, ModelConfig
from jaxllama.core.params import (
    abstract_stored,
    as_blocks,
    block_in_dims,
    param_layout,
)
from jaxllama.engine import buckets, hlo, kvcache, memory
from jaxllama.engine.engine import Engine
from jaxllama.engine.interface import PrefillRow
from jaxllama.engine.load_plan import LoadPlan, plan_load
from jaxllama.engine.options import EngineOptions
from jaxllama.engine.programs import Compiled
from jaxllama.engine.request import Request, SamplingParams
from jaxllama.errors import ModelTooLarge

log = logging.getLogger(__name__)


@dataclasses.dataclass
class ProgramReport:
    """One compiled program: per device, its memory (arguments, outputs, temporaries, code), flops, the compiler's
    "bytes accessed" (staging included: an upper bound) and cost-model seconds; from its HLO, the HBM bytes it moves,
    the compiler's cycle estimate and its collectives; how many times the phase calls it."""

    kind: str
    phase: str
    calls: int
    shapes: str
    compile_s: float
    argument_bytes: int
    output_bytes: int
    alias_bytes: int
    temp_bytes: int
    code_bytes: int
    flops: float
    bytes_accessed: float
    cost_model_s: float
    hbm_bytes: int | None
    cycles: int | None
    collectives: dict
    heaviest: list  # the instructions that move the most HBM bytes (`hlo.Module.heaviest`)
    kernel_bytes: int = 0  # of hbm_bytes, its Pallas kernels' operands and results (`hlo.Traffic.kernel_bytes`)
    uncosted_flops: int = 0  # of the products the compiler gives no cycles (`hlo.Traffic.uncosted_flops`)
    product_flops: int = 0  # of every product, read from the HLO (`hlo.Traffic.product_flops`)
    hlo_text: str | None = dataclasses.field(default=None, repr=False)  # the optimized HLO (not in `to_json`)


@dataclasses.dataclass
class PhaseReport:
    """A decode step or a prefill, all its program calls together (per device), and its ideal time."""

    name: str
    tokens: int  # tokens it yields (decode: one per slot) or computes (prefill)
    flops: float
    hbm_bytes: int | None
    cycles: int | None
    cost_model_s: float
    ideal_s: float
    collectives: dict
    chip: Chip | None
    # Time the compiler's cycles leave out, at its least (added to the cycles' estimate): a prompt's attention
    # kernel's flops (Pallas), and the products it could not cost (a mixture of experts' ragged products), at the
    # chip's peak.
    kernel_s: float = 0.0

    def estimates(self) -> dict[str, float]:
        """Seconds per run by each estimate that could be made."""
        out = {"ideal": self.ideal_s}
        if self.chip and self.hbm_bytes is not None:
            out["hbm_traffic"] = self.hbm_bytes / self.chip.hbm_bandwidth
        if self.chip and self.cycles:
            out["cycles"] = self.cycles / self.chip.clock_hz + self.kernel_s
        if "hbm_traffic" in out and "cycles" in out:
            # the compiler's cycles leave out what its DMA engines move (weights fetched ahead): the longer of the two
            out["estimate"] = max(out["hbm_traffic"], out["cycles"])
        if self.cost_model_s > 0:
            out["cost_model"] = self.cost_model_s
        return out


@dataclasses.dataclass
class EngineReport:
    """What `compile_engine` found: the target, the mesh, what each device holds and whether it fits, each program,
    the decode step and the prefills."""

    target: str
    devices: int
    mesh: dict
    slots: int
    context: int
    chip: Chip | None
    footprint: memory.Footprint
    device_memory: int | None
    programs: list[ProgramReport]
    decode: PhaseReport
    prefills: list[PhaseReport]
    compile_s: float
    kv_cache: str = "contiguous"  # or "paged, N-position pages"
    decode_attention: str = "XLA"  # or "Pallas kernel": a custom call, which the compiler's cycles leave out
    prompt_kernel: list = dataclasses.field(default_factory=list)  # the prefills whose attention a kernel runs

    @property
    def fits(self) -> bool:
        return self.device_memory is None or self.footprint.total <= self.device_memory

    def to_json(self) -> dict:
        """The report as one JSON object (times per step in seconds, bytes per device)."""
        d = self.decode
        seconds = d.estimates()
        step = {
            "memory_per_chip_bytes": self.footprint.total,
            "memory": dataclasses.asdict(self.footprint),
            "hbm_bytes": d.hbm_bytes,
            "hbm_traffic_s": seconds.get("hbm_traffic"),
            "cycles_s": seconds.get("cycles"),
            "cost_model_s": seconds.get("cost_model"),
            "estimate_s": seconds.get("estimate"),
            "ideal_s": d.ideal_s,
            "flops": _known(d.flops),
            "tok_s_per_sequence": {k: 1 / s for k, s in seconds.items()},
            "tok_s_total": {k: self.slots / s for k, s in seconds.items()},
            "collectives": d.collectives,
        }
        prefills = [
            {
                "name": p.name,
                "tokens": p.tokens,
                "flops": _known(p.flops),
                "hbm_bytes": p.hbm_bytes,
                "collectives": p.collectives,
                "kernel_s": p.kernel_s,
            }
            | {f"{k}_s": s for k, s in p.estimates().items()}
            for p in self.prefills
        ]
        return {
            "target": self.target,
            "devices": self.devices,
            "chip": dataclasses.asdict(self.chip) if self.chip else None,
            "mesh": self.mesh,
            "slots": self.slots,
            "context": self.context,
            "kv_cache": self.kv_cache,
            "decode_attention": self.decode_attention,
            "prompt_kernel": self.prompt_kernel,
            "fits": self.fits,
            "device_memory_bytes": self.device_memory,
            "compile_s": self.compile_s,
            "programs": [{k: v for k, v in dataclasses.asdict(p).items() if k != "hlo_text"} for p in self.programs],
            "decode_step": step,
            "prefills": prefills,
        }

    def write_hlo(self, folder) -> list:
        """Each program's optimized HLO in `folder`, as PHASE-KIND-N.hlo.txt (for reading where its bytes and cycles
        go); the paths written."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        paths = []
        for i, p in enumerate(self.programs):
            if p.hlo_text is not None:
                paths.append(folder / f"{p.phase.replace(' ', '_')}-{p.kind}-{i}.hlo.txt")
                paths[-1].write_text(p.hlo_text)
        return paths

    def table(self) -> str:
        """The report as text for people: the programs, then the decode step against its ideal."""
        gib = 2**30
        mesh = f"data={self.mesh['data']},model={self.mesh['model']}"
        chip = self.chip.name if self.chip else "unknown chip"
        have = f"{self.device_memory / gib:.1f} GiB" if self.device_memory else "?"
        lines = [
            f"target: {self.target} ({self.devices} x {chip}), mesh {mesh}, "
            f"{self.slots} slots x {self.context} positions",
            f"memory per device: {self.footprint.total / gib:.2f} GiB of {have} "
            f"({'fits' if self.fits else 'DOES NOT FIT'}): {self.footprint.describe()}",
            f"KV cache: {self.kv_cache}; decode attention: {self.decode_attention}"
            + (
                " (the compiler's cycles leave the kernel out; its HBM traffic counts its operands whole)"
                if self.decode_attention != "XLA"
                else ""
            ),
            *(
                [
                    f"prompt attention by a Pallas kernel in {', '.join(self.prompt_kernel)}: its flops at the chip's "
                    "peak added to the cycles"
                ]
                if self.prompt_kernel
                else []
            ),
            "",
            f"{'program':<16}{'phase':<14}{'calls':>5}{'args GiB':>10}{'temp GiB':>10}{'GFLOP':>10}"
            f"{'HBM GiB':>10}{'cycles ms':>11}{'compile s':>11}  collectives",
        ]
        clock = self.chip.clock_hz if self.chip else None
        for p in self.programs:
            hbm = f"{p.hbm_bytes / gib:.3f}" if p.hbm_bytes is not None else "?"
            cycles = f"{p.cycles / clock * 1e3:.3f}" if p.cycles and clock else "?"
            lines.append(
                f"{p.kind:<16}{p.phase:<14}{p.calls:>5}{p.argument_bytes / gib:>10.3f}{p.temp_bytes / gib:>10.3f}"
                f"{_gflop(p.flops):>10}{hbm:>10}{cycles:>11}{p.compile_s:>11.1f}  {_collectives(p.collectives)}"
            )
        lines += ["", "per device, per run  " + f"{'HBM GiB':>9}{'GFLOP':>9}   time by estimate (x ideal): tok/s"]
        for phase in [self.decode, *self.prefills]:
            seconds = phase.estimates()
            hbm = f"{phase.hbm_bytes / gib:.2f}" if phase.hbm_bytes is not None else "?"
            parts = []
            for name, s in seconds.items():
                rate = phase.tokens / s
                parts.append(f"{name} {s * 1e3:.2f} ms ({s / phase.ideal_s:.1f}x): {rate:,.0f}")
            lines.append(f"{phase.name:<21}{hbm:>9}{_gflop(phase.flops):>9}   " + "; ".join(parts))
            if phase is self.decode:
                per_sequence = ", ".join(f"{name} {1 / s:,.1f}" for name, s in seconds.items())
                lines.append(f"{'':<21}tok/s per sequence: {per_sequence}")
                lines.append(f"{'':<21}collectives: {_collectives(phase.collectives) or 'none'}")
        return "\n".join(lines)


def _gflop(flops: float) -> str:
    return "?" if math.isnan(flops) else f"{flops / 1e9:.1f}"


def _known(x: float) -> float | None:
    """x, or None for NaN (JSON has none)."""
    return None if math.isnan(x) else x


def _collectives(c: dict) -> str:
    return ", ".join(f"{k} {v['count']}x {v['bytes'] / 2**20:.1f}MiB" for k, v in sorted(c.items()))


def target_devices(topology: str | None):
    """The devices of a TPU topology ("v5e:2x4", compiled for on this host; needs libtpu), of GPUs ("h100:8": 8 on
    one host, "h100:2x8": 2 hosts of 8; needs jax's CUDA plugin), or the local devices."""
    import jax

    if topology is None:
        return jax.devices(), jax.devices()[0].device_kind
    if topology.partition(":")[0].lower() in GPUS:
        return _gpu_devices(topology), topology
    try:
        from jax.experimental import topologies

        devices = topologies.get_topology_desc(topology_name=topology, platform="tpu").devices
    except Exception as e:
        if "lockfile" in str(e).lower():  # libtpu lets one process at a time use it
            raise ValueError(f"topology {topology!r}: another process on this host holds libtpu ({e})") from None
        raise ValueError(
            f"topology {topology!r}: {e}. Names look like v5e:2x4, v6e:4x4 or v5p:2x2x2; compiling for a TPU "
            "topology needs libtpu (pip install -e '.[tpu]')"
        ) from None
    return devices, topology


def _gpu_devices(topology: str):
    """The devices of GPUs described by name and count (`chips.GPUS`): XLA's GPU compiler told what they are by a
    target config, through jax's CUDA plugin, on a host without them."""
    from jax.experimental import topologies

    name, _, count = topology.partition(":")
    hosts, _, per_host = count.rpartition("x")
    if not per_host.isdigit() or not (hosts or "1").isdigit() or int(per_host) < 1 or int(hosts or 1) < 1:
        raise ValueError(f"topology {topology!r}: expected NAME:GPUS or NAME:HOSTSxGPUS, e.g. h100:8 or h100:2x8")
    shape = f"1x{int(hosts or 1)}x{int(per_host)}"  # slices x hosts x GPUs a host
    try:
        target = dict(target_config=GPUS[name.lower()].target_config(), topology=shape)
        return topologies.get_topology_desc(platform="cuda", topology_name="", **target).devices
    except Exception as e:
        raise ValueError(
            f"topology {topology!r}: {e}. Compiling for GPUs without them needs jax's CUDA plugin "
            "(pip install -e '.[gpu]'); GPUs known: " + ", ".join(GPUS)
        ) from None


def quantized(config: ModelConfig, form: str) -> ModelConfig:
    """`config` with every product's weight (not the embedding) stored as blocks of `form` (q8_0 or q4_0), as a
    checkpoint converted from a GGUF of that type holds them."""
    if form not in BLOCK_FORMATS:
        raise ValueError(f"stored_as={form!r}: expected one of {', '.join(BLOCK_FORMATS)}")
    names = [n for n in param_layout(config) if block_in_dims(n) and n != "embedding"]
    return dataclasses.replace(config, stored_as=tuple((n, form) for n in names))


def compile_engine(
    config: ModelConfig,
    devices: Sequence,
    options: EngineOptions | None = None,
    *,
    target: str,
    mesh: str | dict | None = None,
    prefills: Sequence[tuple[int, int]] | None = None,
    **fields,
) -> EngineReport:
    """Compile the engine's programs for `config` (as restored) on `devices` with `options` (fields given as keywords
    replace its own) and report them (see the module's docstring). `prefills`: (rows, prompt tokens) of the prefills
    to compile; default one row of the whole context and min(8, slots) rows of 512 tokens. ModelTooLarge before
    compiling anything where no mesh fits."""
    started = time.perf_counter()
    options = dataclasses.replace(options or EngineOptions(), **fields)
    options = dataclasses.replace(options, decode_steps=1)  # the report's decode step is one step, one call
    engine, where = abstract_engine(config, devices, options, mesh)
    phases = _compile_phases(engine.runner, where, target, prefills)
    return _engine_report(config, engine, where, phases, target, len(devices), time.perf_counter() - started)


def _compile_phases(runner, where: LoadPlan, target: str, prefills) -> dict[str, list[Compiled]]:
    """Compile what each of the report's phases runs on the abstract `runner` (the cache's growth, where it grows;
    the decode step; each prefill of `prefills`) -> the programs each called, by phase."""
    programs, phases = runner.programs, {}

    def phase(name: str, run) -> None:
        log.info("compiling %s", name)
        first = len(programs.calls)
        try:
            run()
        except Exception as e:  # the compiler's own verdict: a program that cannot fit the device's memory
            if "HbmOom" not in str(e) and "RESOURCE_EXHAUSTED" not in str(e):
                raise
            message = str(e).splitlines()[0]
            raise ModelTooLarge(f"{name} on {target} with mesh {dict(where.mesh.shape)}: {message}") from None
        phases[name] = programs.calls[first:]

    context = where.context
    if runner.pages:  # a pool allocated once: every slot given a full context's pages
        runner.make_room(0, dict.fromkeys(range(runner.slots), context))
    else:
        before = max(buckets.MIN_BUCKET, _previous_bucket(context))
        runner.cache = kvcache.abstract(
            where.config, where.mesh, runner.slots, before, where.cache_dtype, runner.layout
        )
        phase("cache growth", lambda: runner.resize(context))
    phase("decode step", lambda: runner.generate(list(range(runner.slots)), [SamplingParams()]))
    if prefills is None:
        prefills = [(1, context - 1), (min(8, runner.slots), min(512, context - 1))]
    for rows, length in dict.fromkeys(prefills):
        if not 0 < rows <= runner.slots or not 0 < length < context:
            raise ValueError(f"prefill {rows}x{length}: rows must be 1..{runner.slots}, tokens 1..{context - 1}")
        requests = [Request(None, [1] * length, SamplingParams()) for _ in range(rows)]
        batch = [PrefillRow(r, r.prompt, 0, slot, slot) for slot, r in enumerate(requests)]
        phase(f"prefill {rows}x{length}", lambda batch=batch: runner.prefill(batch))
    return phases


def _engine_report(own: ModelConfig, engine: Engine, where: LoadPlan, phases: dict, target, devices: int, seconds):
    """The report of the programs compiled by phase (`_compile_phases`) of `engine`, the engine of the model `own`
    (its own KV heads: what no implementation can avoid reading) as `where` plans it on `devices` of `target`."""
    config, cache_dtype, runner, context = where.config, where.cache_dtype, engine.runner, where.context
    chip = chip_of(where.mesh.devices.flat[0])
    reports, by_program = [], {}
    for name, calls in phases.items():
        for compiled in dict.fromkeys(calls):
            report = program_report(compiled, name, calls.count(compiled))
            reports.append(report)
            by_program[(name, id(compiled))] = report
    temporaries = max(p.temp_bytes + p.code_bytes for p in reports)
    fp = memory.footprint(
        config, where.mesh, runner.slots, context, cache_dtype, ops=engine.ops, grows=not runner.pages
    )
    fp = dataclasses.replace(fp, temporaries=temporaries)
    data, model = where.mesh.shape["data"], where.mesh.shape["model"]
    kv_bytes = kvcache.bytes_per_layer(own, runner.slots, context, cache_dtype, runner.layout) * own.n_layers
    weights = memory.per_device_bytes(engine.ops.prepare_abstract(as_blocks(abstract_stored(own), own), own))
    ideal_bytes = weights / model + kv_bytes / (data * model)
    bandwidth = chip.hbm_bandwidth if chip else float("nan")
    decode = _phase("decode step", runner.slots, phases["decode step"], by_program, ideal_bytes / bandwidth, chip)
    prefill_reports, prompt_kernel = [], []
    for name, calls in phases.items():
        if name.startswith("prefill"):
            rows, length = (int(x) for x in name.split()[1].split("x"))
            tokens = rows * length
            flops = tokens * config.flops_per_token(length // 2) / (data * model)
            ideal = max(flops / chip.bf16_flops, ideal_bytes / bandwidth) if chip else float("nan")
            report = _phase(name, tokens, calls, by_program, ideal, chip)
            if _charge_kernels(report, calls, config, length // 2, data * model):
                prompt_kernel.append(name)
            prefill_reports.append(report)
    return EngineReport(
        target=target,
        devices=devices,
        mesh=dict(where.mesh.shape),
        slots=runner.slots,
        context=context,
        chip=chip,
        footprint=fp,
        device_memory=where.memory.device_memory,
        programs=reports,
        decode=decode,
        prefills=prefill_reports,
        compile_s=seconds,
        kv_cache=f"paged, {runner.pages.page_size}-position pages" if runner.pages else "contiguous",
        decode_attention="Pallas kernel" if _kernels(phases["decode step"]) - {"gmm"} else "XLA",
        prompt_kernel=prompt_kernel,
    )


def abstract_engine(
    config: ModelConfig, devices: Sequence, options: EngineOptions, mesh: str | dict | None = None
) -> tuple[Engine, LoadPlan]:
    """An engine of `config` (as restored) with abstract weights on `devices` (a target's, which this host may be
    unable to run), on the plan `load_plan` makes for them (the mesh and context its memory plan chooses), and that
    plan; ModelTooLarge before compiling anything where no mesh fits. Its programs are compiled as it runs, never
    run."""
    plan = plan_load(config, devices, mesh, options, abstract=True)
    params = as_blocks(abstract_stored(plan.config, plan.mesh), plan.config)
    return Engine.planned(plan, params, eos_ids=[0]), plan


def _kernels(calls: Sequence[Compiled]) -> set[str]:
    """The Pallas kernels (Mosaic's on a TPU, Triton's on a GPU) compiled programs call, by the name of the function
    that made each ("flash_attention", "paged_attention", "gmm"; "" where the HLO does not say)."""
    names = set()
    for compiled in calls:
        text = compiled.hlo_text or ""
        if "tpu_custom_call" in text or "triton" in text:
            names |= {m.group(1) or "" for m in re.finditer(r"(?:jit\((\w+)\)/)?pallas_call", text)} or {""}
    return names


def _charge_kernels(phase: PhaseReport, calls, config: ModelConfig, context: int, devices: int) -> bool:
    """Add to a phase's `kernel_s` what the compiler's cycles leave out of a prompt's attention by the flash kernel
    (attending over `context` positions on average), at the chip's peak flops (a grouped product's kernel is counted
    from the HLO: `hlo.Traffic.uncosted_flops`). Whether the prompt's attention ran the kernel."""
    kernels, tokens = _kernels(calls), phase.tokens
    if phase.chip is None:
        return False
    if "flash_attention" in kernels:
        attention = tokens * (config.flops_per_token(context) - config.flops_per_token(0))
        phase.kernel_s += attention / devices / phase.chip.bf16_flops
    return "flash_attention" in kernels


def _previous_bucket(context: int) -> int:
    """The cache length before its last growth to `context`."""
    size = buckets.MIN_BUCKET
    while buckets.bucket(size + 1, context) < context:
        size = buckets.bucket(size + 1, context)
    return size


def program_report(compiled: Compiled, phase: str, calls: int) -> ProgramReport:
    executable = compiled.executable
    m = executable.memory_analysis()
    cost = executable.cost_analysis() or {}
    if isinstance(cost, list):  # older jax: one dict per device program
        cost = cost[0] if cost else {}
    traffic, heaviest = None, []
    if compiled.hlo_text is not None:
        module = hlo.Module(compiled.hlo_text)
        traffic, heaviest = module.traffic(), module.heaviest()
    shapes = " ".join("x".join(map(str, s)) or "()" for s, _ in compiled.shapes[-3:])
    return ProgramReport(
        kind=compiled.kind,
        phase=phase,
        calls=calls,
        shapes=shapes,
        compile_s=compiled.seconds,
        argument_bytes=m.argument_size_in_bytes,
        output_bytes=m.output_size_in_bytes,
        alias_bytes=m.alias_size_in_bytes,
        temp_bytes=m.temp_size_in_bytes,
        code_bytes=m.generated_code_size_in_bytes,
        flops=float(cost.get("flops", math.nan)),  # NaN: no cost analysis (a GPU compiled for without one)
        bytes_accessed=float(cost.get("bytes accessed", 0.0)),
        cost_model_s=float(cost.get("optimal_seconds", -1.0)),
        hbm_bytes=traffic.hbm_bytes if traffic else None,
        cycles=traffic.cycles if traffic else None,
        collectives=traffic.collectives if traffic else {},
        heaviest=heaviest,
        kernel_bytes=traffic.kernel_bytes if traffic else 0,
        uncosted_flops=traffic.uncosted_flops if traffic else 0,
        product_flops=traffic.product_flops if traffic else 0,
        hlo_text=compiled.hlo_text,
    )


def _phase(name, tokens, calls, by_program, ideal_s, chip) -> PhaseReport:
    total, flops, cost_s, complete, costed = hlo.Traffic(), 0.0, 0.0, True, True
    for compiled in dict.fromkeys(calls):
        p = by_program[(name, id(compiled))]
        if p.hbm_bytes is None:
            complete = False
        else:
            total.add(hlo.Traffic(p.hbm_bytes, p.cycles or 0, p.collectives, uncosted_flops=p.uncosted_flops), p.calls)
        flops += p.flops * p.calls
        costed = costed and p.cost_model_s >= 0
        cost_s += p.cost_model_s * p.calls
    return PhaseReport(
        name=name,
        tokens=tokens,
        flops=flops,
        hbm_bytes=total.hbm_bytes if complete else None,
        cycles=total.cycles if complete else None,
        cost_model_s=cost_s if costed else -1.0,
        ideal_s=ideal_s,
        collectives=total.collectives,
        chip=chip,
        kernel_s=total.uncosted_flops / chip.bf16_flops if chip else 0.0,
    )


__all__ = ["EngineReport", "abstract_engine", "compile_engine", "program_report", "quantized", "target_devices"]
