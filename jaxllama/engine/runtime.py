"""Process-level set-up: multi-host initialization, and the persistent caches of compiled and exported programs
and of prepared weights.

A cache folder that cannot be written (a read-only file system, another user's folder) is not an error: the run goes
on without that cache, with one warning naming the folder, as pip and the Hugging Face hub do.
"""

from __future__ import annotations

import logging
import os
import tempfile
from pathlib import Path

import jax
import numpy as np

log = logging.getLogger(__name__)


def cache_dir() -> Path:
    """The user's cache folder for jaxllama ($JAXLLAMA_CACHE, else $XDG_CACHE_HOME/jaxllama, else ~/.cache/jaxllama)."""
    if os.environ.get("JAXLLAMA_CACHE"):
        return Path(os.environ["JAXLLAMA_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "jaxllama"


def kernel_dir() -> Path:
    """Where the CPU kernels are built, once per machine and version."""
    return cache_dir() / "kernels"


_root: Path | None = None
_programs: Path | None = None
_prepared: Path | None = None
# Each cache under the root: its folder, and what a run without it goes without.
CACHES = {"xla": "compiled programs", "programs": "exported programs", "prepared": "prepared weights"}


def enable_compilation_cache(root: str | Path | None = None) -> Path:
    """Keep the engine's programs on disk under `root` (default: `cache_dir()`), so that running a job again
    neither compiles them again (XLA's persistent cache, in root/xla) nor traces them again (exported, in
    root/programs: `engine/programs.py`), and the weights prepared for the CPU kernels (root/prepared:
    `engine/prepared.py`), so that loading the same model again only maps them. Each of those folders that cannot
    be written is left unused, with one warning naming them."""
    global _root, _programs, _prepared
    if root is None and _root is not None:
        return _root  # on already (where the application or a test run put it): kept there
    root = Path(root) if root else cache_dir()
    unwritable = {name: error for name in CACHES if (error := _unwritable(root / name)) is not None}
    if unwritable:
        names = ", ".join(f"{CACHES[name]} ({name})" for name in unwritable)
        reasons = "; ".join(dict.fromkeys(unwritable.values()))
        log.warning("cannot write in the cache folder %s (%s): running without its %s", root, reasons, names)
    if "xla" not in unwritable:
        jax.config.update("jax_compilation_cache_dir", str(root / "xla"))
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    _root = root
    _programs = None if "programs" in unwritable else root / "programs"
    _prepared = None if "prepared" in unwritable else root / "prepared"
    return root


def _unwritable(folder: Path) -> str | None:
    """Why `folder` (made where it is missing) cannot be written, or None where it can: a file is made in it and
    removed (unnamed, where the system can), so that what a cache's writes would meet (a read-only mount,
    permissions, a full disk's inodes) is met here first."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as e:
        return e.strerror or str(e)
    return None


def program_cache() -> Path | None:
    """Where the engine keeps exported programs: set by `enable_compilation_cache`, else None (none kept)."""
    return _programs


def prepared_cache() -> Path | None:
    """Where loads keep prepared weights: set by `enable_compilation_cache`, else None (none kept)."""
    return _prepared


def initialize_distributed(
    coordinator: str | None = None, num_processes: int | None = None, process_id: int | None = None
) -> None:
    """Join a multi-host run through `jax.distributed` (JAX's own multi-controller runtime).

    Arguments fall back to JAX's usual environment variables (JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES,
    JAX_PROCESS_ID); with none of them set this is a single-process run and nothing happens. On CPU the
    processes exchange data over gloo.
    """
    coordinator = coordinator or os.environ.get("JAX_COORDINATOR_ADDRESS")
    if num_processes is None and os.environ.get("JAX_NUM_PROCESSES"):
        num_processes = int(os.environ["JAX_NUM_PROCESSES"])
    if process_id is None and os.environ.get("JAX_PROCESS_ID"):
        process_id = int(os.environ["JAX_PROCESS_ID"])
    if coordinator is None and not num_processes:
        return
    if jax.distributed.is_initialized():  # joined already (the command takes its output's lock first)
        return
    if coordinator is None or num_processes is None or process_id is None:
        raise ValueError("a multi-host run needs --coordinator HOST:PORT, --num-processes N and --process-id I")
    if jax.config.jax_platforms in (None, "", "cpu") or jax.config.jax_platforms.startswith("cpu"):
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=coordinator, num_processes=num_processes, process_id=process_id)


def is_main_process() -> bool:
    return jax.process_index() == 0


def broadcast_from_main(x: np.ndarray) -> np.ndarray:
    """Process 0's value of a host array, on every process (the array itself in a single-process run). Every
    process must call it, with an array of the same shape and dtype."""
    if jax.process_count() == 1:
        return x
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.broadcast_one_to_all(x))


def agreed_seed() -> int:
    """A random 63-bit seed, the same on every process (process 0's): whatever is sampled from it is too."""
    words = broadcast_from_main(np.frombuffer(os.urandom(8), np.uint32).copy())
    return (int(words[0]) << 31) | (int(words[1]) >> 1)
