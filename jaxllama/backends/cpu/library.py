"""The CPU kernels' shared library: every `*.cc` here, built on first use with the system's C++ compiler (`$CXX`,
else `c++`) for this machine's CPU (-march=native, or the target JAXLLAMA_CPU_MARCH names), kept in a folder the
caller names under a name that hashes everything the build depends on, and registered with XLA as FFI targets.
Where no compiler works, or `JAXLLAMA_CPU_KERNELS=0`, `load` says so and callers keep XLA's own code.

A library is loaded only as it was built: beside `cpu_kernels-KEY.so` its build writes `cpu_kernels-KEY.json`, its
size and SHA-256 (the library is ~0.5 MB: hashed in a millisecond), and a library that does not match (truncated, or
a FIFO or anything else than a regular file), or has no record, is built again. Loading a truncated library maps pages
past its end, and the first of them touched kills the process (SIGBUS), before any message and at every run after.
Both files are written in a temporary folder and renamed into place, the library first: processes building at once
each install whole files, and one that reads a library with another build's record (the two renames apart) builds it
again. Where the folder cannot be written (a read-only cache), the library is built, once a process, in a temporary
folder removed at exit, with a warning naming the folder.
"""

from __future__ import annotations

import atexit
import ctypes
import hashlib
import json
import logging
import os
import platform
import shlex
import shutil
import subprocess
import tempfile
from pathlib import Path

import jax

from jaxllama.backends.cpu import decode_attention, matmul, row_stats
from jaxllama.core.regular_files import open_regular, read_regular

HERE = Path(__file__).parent
SOURCES = sorted(HERE.glob("*.cc"))
HEADERS = sorted(HERE.glob("*.h"))
# FFI target -> the library's handler. -ffp-contract=fast: multiply-adds as FMA instructions.
TARGETS = {
    decode_attention.TARGET: "JaxllamaDecodeAttention",
    matmul.TARGET: "JaxllamaMatmul",
    matmul.GATED_TARGET: "JaxllamaGatedMatmul",
    row_stats.TARGET: "JaxllamaRowStats",
}
FLAGS = ("-O3", "-ffp-contract=fast", "-std=c++17", "-shared", "-fPIC", "-Wno-psabi")
# The CPU the kernels are compiled for: this one, unless JAXLLAMA_CPU_MARCH names another target that this CPU also
# runs (x86-64-v3: AVX2 and FMA, no AVX-512), so that one machine can test and measure each instruction set's path.
MARCH = "JAXLLAMA_CPU_MARCH"

log = logging.getLogger(__name__)


_loaded: bool | None = None  # what the process's first `load` came to
_library: ctypes.CDLL | None = None


def load(folder: Path) -> bool:
    """Build the kernels into `folder` (once per machine and version) and register them with XLA. XLA takes one
    handler per target and process, so the process's first call decides for all. False, with a warning saying
    why, where they cannot be built or loaded, or where `JAXLLAMA_CPU_KERNELS=0`."""
    global _loaded, _library
    if os.environ.get("JAXLLAMA_CPU_KERNELS", "1") == "0":
        return False
    if _loaded is None:
        try:
            path = build(Path(folder))
            try:
                library = ctypes.cdll.LoadLibrary(str(path))
            except OSError:  # a damaged library left by an earlier build: build it again
                path.unlink(missing_ok=True)
                library = ctypes.cdll.LoadLibrary(str(build(Path(folder))))
            for target, handler in TARGETS.items():
                jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(library, handler)), platform="cpu")
            _loaded, _library = True, library
        except Exception as e:  # no compiler, a failed build, a library XLA refuses: XLA's code instead
            log.warning("CPU kernels unavailable, using XLA's code: %s", e)
            _loaded = False
    return _loaded


def attends_in_bfloat16(head_dim: int) -> bool:
    """Whether the loaded kernels compute attention over a bfloat16 cache, for heads of `head_dim` dims, in bfloat16
    products (vdpbf16ps, on a CPU with AVX-512 BF16), rather than in float32."""
    return bool(_library is not None and _library.JaxllamaAttendsInBfloat16(ctypes.c_int64(head_dim)))


def build(folder: Path) -> Path:
    """The shared library, compiled into `folder` unless a build of the same source, compiler, flags, XLA FFI headers
    and CPU is there already, whole (`_verified`); into a temporary folder where `folder` cannot be written.
    RuntimeError where there is no compiler or it fails."""
    compiler = shlex.split(os.environ.get("CXX") or "c++")  # "ccache g++" too
    if not compiler or shutil.which(compiler[0]) is None:
        raise RuntimeError(f"no C++ compiler ({os.environ.get('CXX') or 'c++'!r}; set $CXX)")
    version = subprocess.run([*compiler, "--version"], capture_output=True, text=True, timeout=60).stdout
    include = jax.ffi.include_dir()
    key = hashlib.sha256()
    sources = [p.read_bytes() for p in (*SOURCES, *HEADERS)]
    flags = _flags()
    command = " ".join([*compiler, *flags]).encode()
    for part in (*sources, version.encode(), command, _headers(include), _cpu().encode()):
        key.update(part)
    name = f"cpu_kernels-{key.hexdigest()[:16]}.so"
    target = folder / name
    if _verified(target):
        return target
    arguments = [*flags, "-I", include, *map(str, SOURCES)]
    try:
        folder.mkdir(parents=True, exist_ok=True)
        tmp = tempfile.TemporaryDirectory(dir=folder)
    except OSError as e:  # a read-only cache, say: built for this process alone
        why = e.strerror or e
        log.warning("cannot write the CPU kernels' folder %s (%s); building them in a temporary folder", folder, why)
        return _compile(compiler, arguments, _temporary_folder() / name)
    log.info("building the CPU kernels into %s (once per machine and version)", folder)
    with tmp:
        built = _compile(compiler, arguments, Path(tmp.name) / name)
        Path(tmp.name, _record(target).name).write_text(json.dumps(_measure(built)) + "\n")
        os.replace(built, target)  # atomic: processes building at once each install a whole library
        os.replace(Path(tmp.name) / _record(target).name, _record(target))
    return target


def _compile(compiler: list[str], arguments: list[str], out: Path) -> Path:
    """`out`, compiled by `compiler` with `arguments` (its flags and the sources); RuntimeError where it fails."""
    done = subprocess.run([*compiler, *arguments, "-o", str(out)], capture_output=True, text=True, timeout=300)
    if done.returncode != 0:
        names = ", ".join(p.name for p in SOURCES)
        raise RuntimeError(f"{' '.join(compiler)} failed on {names}:\n{done.stderr[-2000:]}")
    return out


_temporary: Path | None = None


def _temporary_folder() -> Path:
    """A folder of this process's own, removed when it exits."""
    global _temporary
    if _temporary is None:
        _temporary = Path(tempfile.mkdtemp(prefix="jaxllama-kernels-"))
        atexit.register(shutil.rmtree, _temporary, True)
    return _temporary


def _record(library: Path) -> Path:
    """Where the size and SHA-256 of `library` are kept as built."""
    return library.with_suffix(".json")


def _measure(library: Path) -> dict:
    """A library's record: its size and SHA-256 (a regular file's only: `regular_files`)."""
    with open_regular(library) as f:
        return {"size": os.fstat(f.fileno()).st_size, "sha256": hashlib.file_digest(f, "sha256").hexdigest()}


def _verified(library: Path) -> bool:
    """Whether `library` is there as its build left it: a regular file of the size and SHA-256 its record says.
    Neither file is opened unless it is a regular file (`regular_files`: a FIFO's read waits forever)."""
    try:
        found = _measure(library)
        record = json.loads(read_regular(_record(library)))
        if record != found:
            size, digest = found["size"], found["sha256"][:16]
            raise ValueError(f"{size} bytes of SHA-256 {digest}..., its record says {str(record)[:120]}")
    except FileNotFoundError:
        return False  # not built yet (or built before builds were recorded: built again)
    except (OSError, ValueError) as e:
        log.warning("the CPU kernels in %s are not as built (%s); building them again", library, e)
        return False
    return True


def _headers(include: str) -> bytes:
    return Path(include, "xla", "ffi", "api", "c_api.h").read_bytes()


def _flags() -> tuple[str, ...]:
    return (*FLAGS, f"-march={os.environ.get(MARCH) or 'native'}")


def _cpu() -> str:
    """What -march=native compiles for: the CPU model and its feature flags where the system says them."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.machine() + platform.processor()
    wanted = [x for x in lines if x.startswith(("model name", "flags", "Features"))]
    return platform.machine() + "\n".join(dict.fromkeys(wanted))
