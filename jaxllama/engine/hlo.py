"""What a compiled program moves, read from its optimized HLO (`compiled.as_text()`): the bytes it reads and writes in
device memory (HBM), the compiler's own cycle estimate, and its collectives.

The compiler's cost analysis counts "bytes accessed" at every level, on-chip staging included, so it overstates what
a memory-bound program moves. Here each instruction the device runs in turn (the entry computation's, and a loop
body's times its trip count) is charged the bytes of its operands and result that live in HBM: a TPU layout marks
on-chip memory as `S(1)`, so a weight prefetched into VMEM is charged once, by its copy. An operand a fusion only
slices (a cache row gathered) is charged the slice; an update in place (a cache position written) the update, not
the whole buffer. Custom calls (a Pallas kernel) are charged their whole operands: they may read less, and what
they read of them is counted apart (`Traffic.kernel_bytes`), for a caller that knows the share a call reads (a
paged-attention kernel reads a row's pages up to its length, not the whole pool: `engine/job_clock.py`).
"""

from __future__ import annotations

import dataclasses
import math
import re

_ITEM_BITS = {"pred": 8, "s4": 4, "u4": 4, "s8": 8, "u8": 8, "s16": 16, "u16": 16, "f16": 16, "bf16": 16}
_ITEM_BITS |= {"s32": 32, "u32": 32, "f32": 32, "s64": 64, "u64": 64, "f64": 64, "c64": 64, "c128": 128}
_ARRAY = re.compile(r"([a-z]+[0-9a-z]*)\[([0-9,]*)\](?:\{([^}]*)\})?")
_NAME = re.compile(r"%([\w.\-]+)")
_FREE = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "after-all", "partition-id", "replica-id"}
_FREE |= {"opt-barrier", "add-dependency", "domain"}
COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute", "ragged-all-to-all")
_SLICES = {"dynamic-slice", "slice", "gather"}
_IN_PLACE = {"dynamic-update-slice", "scatter"}
_NO_ESTIMATE = 2**63 - 1  # the estimated_cycles of an instruction the compiler cannot cost
_GROUPED_KERNEL = "jit(gmm)/pallas_call"  # jax's megablox kernel: a mixture of experts' products on a TPU
_KERNEL = re.compile(r'custom_call_target="(tpu_custom_call|[^"]*triton[^"]*)"')  # Mosaic's (TPU), Triton's (GPU)


def _tuple_index(inst: Instruction) -> int:
    """The element a get-tuple-element takes; ValueError for another instruction."""
    m = re.search(r"\bindex=(\d+)", inst.attributes)
    if inst.opcode != "get-tuple-element" or not m:
        raise ValueError(inst.name)
    return int(m.group(1))


@dataclasses.dataclass(frozen=True)
class Array:
    dtype: str
    shape: tuple[int, ...]
    memory_space: int  # 0: HBM (device memory); 1: a TPU core's VMEM; others: semaphores, host memory

    @property
    def bytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * _ITEM_BITS.get(self.dtype, 8 if self.dtype.startswith("f8") else 0) // 8

    @property
    def hbm_bytes(self) -> int:
        return self.bytes if self.memory_space == 0 else 0


@dataclasses.dataclass
class Instruction:
    name: str
    arrays: list[Array]  # the result: one array, or a tuple's
    opcode: str
    operands: list[str]
    attributes: str
    args: str = ""  # the text between the opcode's parentheses (a parameter's index)

    def called(self, key: str) -> list[str]:
        m = re.search(rf"\b{key}=\{{?([^}},]*(?:,\s*%[^}},]*)*)\}}?", self.attributes)
        return _NAME.findall(m.group(1)) if m else []

    def config_number(self, key: str) -> int:
        """An integer field of the instruction's backend_config (searched at any depth), or 0."""
        m = re.search(rf'"{key}":(?:\{{"n":)?"(\d+)"', self.attributes)
        return int(m.group(1)) if m else 0


@dataclasses.dataclass
class Traffic:
    """What a program (or part of one) moves: HBM bytes, the compiler's estimated cycles (summed over the
    instructions that carry one), per collective kind {"count", "bytes"} (the bytes of their results), and the HBM
    bytes of its Pallas kernels' operands and results (among `hbm_bytes`; the compiler estimates no cycles for
    them). `uncosted_flops`: the products the compiler gives no cycles, counted as they run: of the fusions it marks
    as having no estimate (on a TPU, a `ragged_dot`'s, lowered as one masked product per group: every group's
    weights against every row), and of the megablox kernel (each row against its own group's weights alone)."""

    hbm_bytes: int = 0
    cycles: int = 0
    collectives: dict = dataclasses.field(default_factory=dict)
    kernel_bytes: int = 0
    uncosted_flops: int = 0
    product_flops: int = 0  # of every product (`dot`, fused or not): what a program without cycles is charged

    def add(self, other: Traffic, times: int = 1) -> None:
        self.hbm_bytes += other.hbm_bytes * times
        self.cycles += other.cycles * times
        self.kernel_bytes += other.kernel_bytes * times
        self.uncosted_flops += other.uncosted_flops * times
        self.product_flops += other.product_flops * times
        for kind, c in other.collectives.items():
            mine = self.collectives.setdefault(kind, {"count": 0, "bytes": 0})
            mine["count"] += c["count"] * times
            mine["bytes"] += c["bytes"] * times


def _split_type(text: str) -> tuple[str, str]:
    """'(a, b) opcode(...)...' or 'f32[2]{0} opcode(...)' -> (type, rest)."""
    if text.startswith("("):
        depth = 0
        for i, c in enumerate(text):
            depth += {"(": 1, ")": -1}.get(c, 0)
            if depth == 0:
                return text[: i + 1], text[i + 1 :].lstrip()
    head, _, rest = text.partition(" ")
    return head, rest


def _arrays(type_text: str) -> list[Array]:
    out = []
    for dtype, dims, layout in _ARRAY.findall(type_text):
        space = re.search(r"S\((\d+)\)", layout or "")
        shape = tuple(int(d) for d in dims.split(",") if d)
        out.append(Array(dtype, shape, int(space.group(1)) if space else 0))
    return out


def _instruction(line: str) -> Instruction | None:
    line = line.strip()
    if line.startswith("ROOT "):
        line = line[5:]
    name, sep, rest = line.partition(" = ")
    if not sep or not name.startswith("%"):
        return None
    type_text, rest = _split_type(rest)
    opcode, paren, rest = rest.partition("(")
    if not paren:
        return None
    depth, end = 1, len(rest)
    for i, c in enumerate(rest):
        depth += {"(": 1, ")": -1}.get(c, 0)
        if depth == 0:
            end = i
            break
    operands = _NAME.findall(rest[:end])
    return Instruction(name[1:], _arrays(type_text), opcode.strip(), operands, rest[end + 1 :], rest[:end])


class Module:
    """An optimized HLO module's computations, parsed from its text."""

    def __init__(self, text: str):
        self.computations: dict[str, list[Instruction]] = {}
        self.entry: str | None = None
        self.by_name: dict[str, Instruction] = {}
        current = None
        for line in text.splitlines():
            if not line.startswith(" ") and line.rstrip().endswith("{"):
                m = re.match(r"(ENTRY\s+)?%([\w.\-]+)", line)
                if m:
                    current = m.group(2)
                    self.computations[current] = []
                    if m.group(1):
                        self.entry = current
                continue
            if line.startswith("}"):
                current = None
                continue
            if current is not None and line.startswith(" "):
                inst = _instruction(line)
                if inst is not None:
                    self.computations[current].append(inst)
                    self.by_name[inst.name] = inst

    def traffic(self, computation: str | None = None) -> Traffic:
        """What running `computation` (default: the entry) moves, instruction by instruction."""
        total = Traffic()
        for inst in self.computations.get(computation or self.entry, []):
            total.add(self._instruction_traffic(inst))
        return total

    def heaviest(self, n: int = 5) -> list[dict]:
        """The entry computation's n instructions that move the most HBM bytes (a loop: its body's, times its trips),
        each with its opcode and the jax operation it came from: where a program's bytes go."""
        rows = []
        for inst in self.computations.get(self.entry, []):
            traffic = self._instruction_traffic(inst)
            if traffic.hbm_bytes:
                m = re.search(r'op_name="([^"]*)"', inst.attributes)
                name = m.group(1) if m else inst.name
                rows.append(
                    {"hbm_bytes": traffic.hbm_bytes, "cycles": traffic.cycles, "opcode": inst.opcode}
                    | {"op_name": name}
                )
        return sorted(rows, key=lambda r: -r["hbm_bytes"])[:n]

    def _instruction_traffic(self, inst: Instruction) -> Traffic:
        op = inst.opcode
        if op == "while":
            trips = self._trips(inst)
            body = Traffic()
            for name in inst.called("body"):
                body.add(self.traffic(name))
            out = Traffic()
            out.add(body, trips)
            return out
        if op == "call":
            out = Traffic()
            for name in inst.called("to_apply"):
                out.add(self.traffic(name))
            return out
        if op == "conditional":
            branches = [self.traffic(name) for name in inst.called("branch_computations")]
            return max(branches, key=lambda t: t.hbm_bytes, default=Traffic())
        if op in _FREE or op.endswith("-done"):
            return Traffic()
        cycles = inst.config_number("estimated_cycles")
        if op.endswith("-start"):  # an asynchronous copy, slice or collective
            destination = self._destination(inst)
            written = sum(a.hbm_bytes for a in destination)
            if op.removesuffix("-start") in _SLICES:  # reads the slice, not the whole operand
                read = sum(a.bytes for a in destination) if any(self._hbm(n) for n in inst.operands[:1]) else 0
            else:
                read = sum(self._hbm(name) for name in inst.operands)
        elif op == "fusion":
            read, written = self._fusion_bytes(inst)
        elif op in _IN_PLACE:
            update = sum(self._hbm(name) for name in inst.operands[1:])
            read, written = update, update
        else:
            read = sum(self._hbm(name) for name in inst.operands)
            written = sum(a.hbm_bytes for a in inst.arrays)
        out = Traffic(read + written, cycles)
        out.product_flops = self._dot_flops(inst)
        if cycles == _NO_ESTIMATE:
            out.cycles, out.uncosted_flops = 0, self._product_flops(inst)
        if op == "custom-call" and _KERNEL.search(inst.attributes):
            out.kernel_bytes = read + written
            if _GROUPED_KERNEL in inst.attributes:
                out.uncosted_flops = self._grouped_flops(inst)
        kind = op.removesuffix("-start")
        if kind in COLLECTIVES:
            out.collectives[kind] = {"count": 1, "bytes": sum(a.bytes for a in inst.arrays[:1])}
        return out

    def _product_flops(self, inst: Instruction) -> int:
        """The flops of a product of rows [m, k] by a stack of weights [..., n, k] into [m, n] (its largest operand
        the weights): 2 m n k for each matrix of the stack."""
        operands = [self.by_name[name].arrays[0] for name in inst.operands if name in self.by_name]
        if not operands or not inst.arrays or not inst.arrays[0].shape:
            return 0
        weights, result = max(operands, key=lambda a: math.prod(a.shape)), inst.arrays[0].shape
        return 2 * math.prod(result) * math.prod(weights.shape) // result[-1]

    def _dot_flops(self, inst: Instruction) -> int:
        """The flops of the products `inst` runs: a `dot` (2 x its result's elements x its contracted size), or those
        of the computation a fusion calls."""
        if inst.opcode == "fusion":
            return sum(self._dot_flops(i) for name in inst.called("calls") for i in self.computations.get(name, []))
        if inst.opcode != "dot" or not inst.arrays or not inst.operands or inst.operands[0] not in self.by_name:
            return 0
        lhs = self.by_name[inst.operands[0]].arrays[0].shape
        m = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", inst.attributes)
        contracted = math.prod(lhs[int(d)] for d in m.group(1).split(",") if d) if m else 1
        return 2 * math.prod(inst.arrays[0].shape) * contracted

    def _grouped_flops(self, inst: Instruction) -> int:
        """The flops of the megablox kernel's product of rows [m, k] into [m, n], each row against its own group's
        weights: 2 m n k (k read off the rows, the operand of m rows and two dims)."""
        result = inst.arrays[0].shape if inst.arrays else ()
        operands = [self.by_name[name].arrays[0].shape for name in inst.operands if name in self.by_name]
        rows = next((shape for shape in operands if len(shape) == 2 and result and shape[0] == result[0]), None)
        return 2 * math.prod(result) * rows[1] if rows and len(result) == 2 else 0

    def _trips(self, loop: Instruction) -> int:
        """A while loop's trip count: as the compiler gives it, or else read from the loop as XLA writes its counted
        loops (jax's `lax.map` and `fori_loop`, the compiler's collective matmuls): the condition compares a counter,
        an element of the loop's tuple, with a constant (`i < 4`); the counter starts from a constant and the body
        adds a constant to it (`i + 2`). 1 where the loop is not of that form (counted once: an estimate too low,
        never too high)."""
        known = loop.config_number("known_trip_count")
        if known:
            return known
        try:
            compare, (counter, limit), how = self._op(self.computations[loop.called("condition")[0]][-1])
            if compare != "compare" or "direction=LT" not in how:
                return 1
            index = _tuple_index(counter)
            start = self._constant(self.by_name[self.by_name[loop.operands[0]].operands[index]])
            body = self.computations[loop.called("body")[0]][-1]
            add, (counted, step), _ = self._op(self.by_name[body.operands[index]])
            if add != "add" or _tuple_index(counted) != index:
                return 1
            step_size, end = self._constant(step), self._constant(limit)
        except (IndexError, KeyError, ValueError):
            return 1
        if None in (start, step_size, end) or step_size <= 0:
            return 1
        return max(1, -(-(end - start) // step_size))

    def _op(self, inst: Instruction) -> tuple[str, list[Instruction], str]:
        """(opcode, operands, attributes) of `inst`, or of the root of the fusion `inst` is, its parameters read as
        the fusion's operands (a CPU program fuses a loop's compare and its counter's add)."""
        if inst.opcode != "fusion":
            return inst.opcode, [self.by_name[name] for name in inst.operands], inst.attributes
        fused = self.computations[inst.called("calls")[0]]
        params = {i.name: int(i.args) for i in fused if i.opcode == "parameter"}
        root = fused[-1]
        operands = [self.by_name[inst.operands[params[n]] if n in params else n] for n in root.operands]
        return root.opcode, operands, root.attributes

    def _constant(self, inst: Instruction) -> int | None:
        """The integer a scalar constant holds, through copies and bitcasts of it; None for anything else."""
        while inst.opcode in ("copy", "bitcast") and inst.operands:
            inst = self.by_name[inst.operands[0]]
        text = inst.args.strip()
        return int(text) if inst.opcode == "constant" and text.lstrip("-").isdigit() else None

    def _destination(self, inst: Instruction) -> list[Array]:
        """The arrays an asynchronous start writes: its result tuple less the aliases of its operands (whose position
        in the tuple differs by opcode) and its synchronization scalars."""
        left = [a for a in inst.arrays if a.shape or a.memory_space == 0]
        for name in inst.operands:
            source = self.by_name.get(name)
            for array in source.arrays[:1] if source else []:
                if array in left:
                    left.remove(array)
        return left

    def _hbm(self, name: str) -> int:
        inst = self.by_name.get(name)
        if inst is None:
            return 0
        if inst.opcode.endswith("-done") or inst.opcode == "get-tuple-element":
            return inst.arrays[0].hbm_bytes if inst.arrays else 0
        return sum(a.hbm_bytes for a in inst.arrays)

    def _fusion_bytes(self, inst: Instruction) -> tuple[int, int]:
        """(bytes read, bytes written) in HBM by a fusion: operands it only slices count as the slices; an operand
        updated in place (the fused root a dynamic-update-slice or scatter of it) counts neither as read nor as
        written, its update as written."""
        called = inst.called("calls")
        body = self.computations.get(called[0], []) if called else []
        params = {}
        for i in body:
            if i.opcode == "parameter" and i.args.strip().isdigit():
                params[i.name] = int(i.args)
        users: dict[str, list[Instruction]] = {name: [] for name in params}
        for i in body:
            for o in i.operands:
                if o in users:
                    users[o].append(i)
        root = body[-1] if body else None
        roots = [self.by_name[o] for o in root.operands if o in self.by_name] if root and root.opcode == "tuple" else []
        roots = roots or ([root] if root else [])
        in_place = {r.operands[0]: r for r in roots if r.opcode in _IN_PLACE and r.operands}
        read = 0
        for name, index in params.items():
            if index >= len(inst.operands):
                continue
            full = self._hbm(inst.operands[index])
            if name in in_place:
                continue
            uses = users[name]
            if uses and all(u.opcode in _SLICES and u.operands[:1] == [name] for u in uses):
                read += min(full, sum(sum(a.bytes for a in u.arrays) for u in uses)) if full else 0
            else:
                read += full
        written = 0
        results = inst.arrays
        for k, r in enumerate(roots):
            array = results[k] if k < len(results) else None
            if array is None or array.memory_space != 0:
                continue
            if r.opcode in _IN_PLACE:  # dynamic-update-slice(operand, update, ...), scatter(operand, indices, updates)
                update = r.operands[1 if r.opcode == "dynamic-update-slice" else 2 : 3][:1]
                written += sum(self._local_bytes(o, body) for o in update)
            else:
                written += array.bytes
        return read, written

    def _local_bytes(self, name: str, body: list[Instruction]) -> int:
        for i in body:
            if i.name == name:
                return sum(a.bytes for a in i.arrays)
        return 0


def program_traffic(hlo_text: str) -> Traffic:
    """What one run of a compiled program moves (`Module.traffic` of its entry computation)."""
    return Module(hlo_text).traffic()
