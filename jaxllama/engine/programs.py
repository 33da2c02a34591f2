"""The engine's compiled programs: `Programs` compiles each (kind, argument shapes, static switches) once, ahead of
time, and on one device keeps it on disk as exported StableHLO (`jax.export`), so that a later run skips tracing and
lowering it again (XLA's persistent cache, `runtime.enable_compilation_cache`, skips only the compilation). A file
is found again only by the same program of the same jaxllama source, jax version and configuration; one that cannot
be read is exported again.

A file is MAGIC, its key (the name it must have: a file copied or renamed over another's is another program), the
SHA-256 of the rest, then `Exported.serialize()`: jax's own flatbuffer, whose `out_tree` is the
pytree of the program's outputs (tuples, lists, dicts, None, and the dataclasses of KEPT_NODES, registered with jax's
serialization, their static fields as JSON). Reading one runs no Python code of the file's (no pickle, as files of
earlier versions held: those, a damaged file or one whose digest does not match are exported again); what it runs is
the program itself, as trusted as the cache folder it is in.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import json
import logging
import os
import tempfile
import time
from pathlib import Path

import jax
import jaxlib
from jax import export

from jaxllama.core.int8_kv import Int8KV
from jaxllama.core.model import Placement
from jaxllama.core.ops import Ops
from jaxllama.core.regular_files import read_regular
from jaxllama.engine.runtime import program_cache
from jaxllama.engine.sampling import SamplingRows
from jaxllama.engine.stats import EngineStats
from jaxllama.engine.step import DecodeState

log = logging.getLogger(__name__)

PACKAGE = Path(__file__).resolve().parents[1]
MAGIC = b"jaxllama exported program 3\n"
# The dataclasses a kept program's outputs may hold besides tuples, lists, dicts and None. A program whose outputs
# hold another node runs, but is not kept.
KEPT_NODES = (DecodeState, SamplingRows, Int8KV, Placement)


def json_tuples(value):
    """JSON's lists as the tuples they were (a pytree node's static field is hashable: it holds no list)."""
    return tuple(json_tuples(x) for x in value) if isinstance(value, list) else value


for _node in KEPT_NODES:
    export.register_pytree_node_serialization(
        _node,
        serialized_name=f"{_node.__module__}.{_node.__qualname__}",
        serialize_auxdata=lambda aux: json.dumps(aux).encode(),
        deserialize_auxdata=lambda data: json_tuples(json.loads(data)),
    )


@functools.cache
def source_digest() -> str:
    """A digest of jaxllama's Python source: any change to it may change a traced program."""
    digest = hashlib.sha256()
    for path in sorted(PACKAGE.rglob("*.py")):
        digest.update(str(path.relative_to(PACKAGE)).encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


def preload_imports() -> None:
    """Import what the first call of an exported program imports: jax registers its CPU LAPACK handlers then, which
    imports scipy.linalg (~0.5 s). A model's loader calls this on a thread, while the weights load."""
    import scipy.linalg  # noqa: F401


def program_identity(fn) -> tuple:
    """What of fn shapes its program besides its arguments: the function and its keyword arguments (config, flags,
    lengths). fn: a module-level function of jaxllama, or a partial of one with keyword arguments only (frozen values,
    whose reprs are whole), so that nothing outside the key (a closure, a positional argument) shapes a program."""
    func = fn.func if isinstance(fn, functools.partial) else fn
    if (isinstance(fn, functools.partial) and fn.args) or func.__closure__ or "<" in func.__qualname__:
        raise ValueError(f"{fn!r}: a kept program must be a module-level function, with keyword arguments only")
    keywords = tuple(sorted(fn.keywords.items())) if isinstance(fn, functools.partial) else ()
    return f"{func.__module__}.{func.__qualname__}", keywords


def program_key(fn, args, donate: int | None, static_key) -> str:
    """The file name of fn's program on args (shapes, dtypes and their pytree, which holds static fields), with
    fn's identity (`program_identity`), the donated argument, the caller's static switches, and what else shapes a
    trace: jaxllama's source, jax's and jaxlib's versions and jax's configuration, the backend."""
    leaves, tree = jax.tree.flatten(args)
    name, keywords = program_identity(fn)
    parts = (source_digest(), jax.__version__, jaxlib.__version__, sorted(jax.config.values.items()))
    parts += (jax.default_backend(),)
    parts += (name, list(keywords), tree, [(x.shape, str(x.dtype)) for x in leaves])
    parts += (donate, static_key)
    return hashlib.sha256(repr(parts).encode()).hexdigest()[:32]


@dataclasses.dataclass(eq=False)  # by identity: one per compiled program
class Compiled:
    """One compiled program: the engine's name for it (`kind`), its arguments' shapes (by leaf, in order), the
    compiled executable and the seconds its compilation took."""

    kind: str
    shapes: tuple
    executable: object
    seconds: float
    hlo_text: str | None  # the optimized HLO, as the compiler wrote it


def _compile_with_text(lowered, options: dict):
    """(the compiled program, its optimized HLO text or None). Printing a compiled program back (`as_text()`) fails
    for some TPU programs (a RET_CHECK on async updates, on v6e): the text the compiler dumped is read then, the
    final one (after code generation, which holds its cycle estimates) where there is one."""
    with tempfile.TemporaryDirectory(prefix="jaxllama-hlo-") as dump:
        compiled = lowered.compile(compiler_options={**options, "xla_dump_to": dump})
        try:
            return compiled, compiled.as_text()
        except Exception as e:
            for pattern in ("*.after_codegen.txt", "*.after_optimizations.txt"):
                texts = sorted(Path(dump).glob(pattern), key=lambda p: p.stat().st_size)
                if texts:
                    return compiled, texts[-1].read_text()
            log.warning("could not read the optimized HLO of a program (%s)", e)
            return compiled, None


class Programs:
    """The compiled programs of one engine, by everything that shapes one: its kind, the function and its keyword
    arguments (`program_identity`: a resize's target length, a prefill's span, the sampler's flags), the arguments'
    pytree, shapes and dtypes, the donated argument, the caller's static switches and the outputs' shardings; in
    memory as on disk, so that no call runs a program compiled for another.
    Compilation is counted and timed in `stats`, for `device`, the mesh's first (its compiler options). `keep_exported`:
    keep programs on disk where the compilation cache is on (one device of the default backend in one process).
    `abstract`: the arguments are ShapeDtypeStructs; a call compiles its program, records it in `calls` and returns
    its outputs' ShapeDtypeStructs (`engine/aot.py`)."""

    def __init__(self, ops: Ops, stats: EngineStats, device, keep_exported: bool, abstract: bool = False, mesh=None):
        self.ops, self.stats, self.device, self.mesh = ops, stats, device, mesh
        self.keep_exported, self.abstract = keep_exported, abstract
        self._compiled: dict = {}
        self.calls: list[Compiled] = []  # abstract: every call, in order

    def __call__(self, kind: str, fn, args, static_key, donate: int | None, out):
        """fn(*args) through its program, compiled on first use with outputs sharded as `out` (on one device, `out`
        is what the export gives anyway); `donate`: the index of an argument whose buffers the outputs reuse."""
        leaves, tree = jax.tree.flatten(args)
        shardings, placed = jax.tree.flatten(out)
        shapes = tuple((x.shape, x.dtype) for x in leaves)
        key = (kind, program_identity(fn), tree, shapes, donate, static_key, placed, tuple(shardings))
        if key not in self._compiled:
            if not self._compiled:  # say why the first requests take a while
                log.info("compiling the engine's programs, each shape once (a later run loads them from the cache)")
            start = time.perf_counter()
            options = self.ops.compiler_options(kind, self.device)
            compiled = None
            if (folder := program_cache()) is not None and self.keep_exported:
                compiled = compile_program(folder, fn, args, donate, static_key, options, self.ops.custom_calls)
            jitted = jax.jit(fn, donate_argnums=() if donate is None else (donate,), out_shardings=out)
            if compiled is None:
                # traced in the mesh's context, where the model's sharding constraints name its axes
                with contextlib.nullcontext() if self.mesh is None else jax.set_mesh(self.mesh):
                    lowered = jitted.lower(*args)
                if self.abstract:
                    compiled, text = _compile_with_text(lowered, options)
                    compiled = Compiled(kind, shapes, compiled, time.perf_counter() - start, text)
                else:
                    compiled = lowered.compile(compiler_options=options)
            seconds = time.perf_counter() - start
            self._compiled[key] = compiled
            self.stats.compiles += 1
            self.stats.compile_s += seconds
        if self.abstract:
            self.calls.append(self._compiled[key])
            return self._compiled[key].executable.out_info
        return self._compiled[key](*args)


def compile_program(folder: Path, fn, args, donate: int | None, static_key, options: dict, custom_calls=()):
    """fn compiled for args on one device, as a function of args like fn: from its exported program in `folder`,
    else exported there now. The compilation itself goes through XLA's persistent cache. None where the program
    cannot be exported (the caller then compiles it directly). `custom_calls`: the FFI targets the program may call."""
    leaves, in_tree = jax.tree.flatten(args)
    key = program_key(fn, args, donate, static_key)
    path = folder / f"{key}.jaxprog"
    exported = _read(path, key, leaves)
    if exported is None:

        def flat(*xs):  # the arguments' leaves in, fn's outputs out: `exported.out_tree` is their pytree
            return fn(*in_tree.unflatten(xs))

        checks = [export.DisabledSafetyCheck.custom_call(target) for target in custom_calls]
        try:
            exported = export.export(jax.jit(flat), disabled_checks=checks)(*leaves)
        except Exception as e:  # e.g. a custom call jax.export does not take on this backend
            log.warning("could not export program %s (%s); compiling it directly", path.name, e)
            return None
        _write(path, key, exported)
    donated = () if donate is None else tuple(_leaf_range(args, donate))
    compiled = jax.jit(exported.call, donate_argnums=donated).lower(*leaves).compile(compiler_options=options)

    def run(*call_args):
        return compiled(*jax.tree.leaves(call_args))

    return run


def _leaf_range(args, index: int) -> range:
    """The positions among args' leaves of argument `index`'s leaves."""
    start = sum(len(jax.tree.leaves(a)) for a in args[:index])
    return range(start, start + len(jax.tree.leaves(args[index])))


def _read(path: Path, key: str, leaves):
    """The program kept in `path` for `key`, taking arguments `leaves`, or None where there is none or it cannot be
    read, is not a regular file, or is another program's (logged)."""
    try:
        data = read_regular(path)  # a FIFO under its name would block the read
    except FileNotFoundError:
        return None
    except OSError as e:  # another user's file, say: export it again (and keep it if we may)
        log.warning("exported program %s unreadable (%s); exporting it again", path, e)
        return None
    try:
        if not data.startswith(MAGIC):
            raise ValueError("not a program of this version")
        header = len(MAGIC) + len(key)
        found, digest, blob = data[len(MAGIC) : header], data[header : header + 32], data[header + 32 :]
        if found != key.encode():
            raise ValueError("it is another program's file")
        if hashlib.sha256(blob).digest() != digest:
            raise ValueError("its SHA-256 differs: changed since it was written")
        exported = export.deserialize(bytearray(blob))
        if [(a.shape, a.dtype) for a in exported.in_avals] != [(x.shape, x.dtype) for x in leaves]:
            raise ValueError("it takes other arguments")
        return exported
    except Exception as e:  # a damaged or foreign file: export the program again
        log.warning("exported program %s unreadable (%s); exporting it again", path, e)
        return None


def _write(path: Path, key: str, exported) -> None:
    temporary = None
    try:
        blob = bytes(exported.serialize())
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path.parent, delete=False) as f:
            temporary = f.name
            f.write(MAGIC + key.encode() + hashlib.sha256(blob).digest() + blob)
        os.replace(temporary, path)  # atomic: processes writing at once each leave a whole file
    except Exception as e:  # a read-only cache, an output node jax cannot serialize: the program runs, not kept
        log.warning("could not keep program %s (%s)", path, e)
        if temporary is not None:
            Path(temporary).unlink(missing_ok=True)
