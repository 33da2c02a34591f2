"""The CPU kernels' shared library: every `*.cc` here, built on first use with the system's C++ compiler (`$CXX`,
else `c++`) for this machine's CPU (-march=native, or the target JAXLLAMA_CPU_MARCH names), kept in a folder the
caller names under a name that hashes everything the build depends on, and registered with XLA as FFI targets.
Where no compiler works, or `JAXLLAMA_CPU_KERNELS=0`, `load` says so and callers keep XLA's own code.
"""

from __future__ import annotations

import ctypes
import hashlib
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
    and CPU is there already. RuntimeError where there is no compiler or it fails."""
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
    target = folder / f"cpu_kernels-{key.hexdigest()[:16]}.so"
    if target.exists():
        return target
    folder.mkdir(parents=True, exist_ok=True)
    log.info("building the CPU kernels into %s (once per machine and version)", folder)
    with tempfile.TemporaryDirectory(dir=folder) as tmp:
        built = Path(tmp) / target.name
        command = [*compiler, *flags, "-I", include, *map(str, SOURCES), "-o", str(built)]
        done = subprocess.run(command, capture_output=True, text=True, timeout=300)
        if done.returncode != 0:
            names = ", ".join(p.name for p in SOURCES)
            raise RuntimeError(f"{' '.join(compiler)} failed on {names}:\n{done.stderr[-2000:]}")
        os.replace(built, target)  # atomic: processes building at once each install a whole library
    return target


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
