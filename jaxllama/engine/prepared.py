"""Weights prepared for a backend, kept on disk and mapped back: a later load of the same checkpoint for the same
backend maps the prepared arrays from a file instead of restoring the checkpoint and preparing (packing) its weights
again. The arrays share the file's pages (XLA:CPU reads an aligned host buffer in place), so a load costs a few
milliseconds, the operating system reads the weights as the first products touch them, and processes running the
same model share one copy in the page cache, as llama.cpp's mapped GGUF files do.

Only host memory can be backed by a file: `Ops.prepared_on_host` says which backends hold it (the CPU kernels, on one
device of one process). An entry is a folder in the cache (`runtime.prepared_cache`) named
`CHECKPOINT-BACKEND`, two digests: CHECKPOINT of what the arrays are read from (the checkpoint's resolved path, its
config.json, and the size and modification time of each stored file), BACKEND of how they were prepared (the
backend's value, the dtype asked for, jaxllama's source and jax's version). It holds `weights.bin` (each array's bytes
at an offset aligned to ALIGN) and `index.pkl` (the pytree's structure, each array's offset, shape, dtype and
partition spec). It is
written to a temporary folder and renamed into place, so an entry is whole or absent; one that cannot be read is
written again. An entry exists only for a checkpoint whose config was checked against its arrays and restored: the
CHECKPOINT digest stands for that check (`checked`). The KEEP entries used last are kept, the rest removed.
"""

from __future__ import annotations

import hashlib
import logging
import mmap
import os
import pickle
import shutil
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, SingleDeviceSharding

from jaxllama.core.checkpoint import PARAMS_DIR, file_stamp, load_checkpoint, remove_stale_tmp, temporary_path
from jaxllama.core.config import CONFIG_FILE, ModelConfig
from jaxllama.engine.programs import source_digest

log = logging.getLogger(__name__)

ALIGN = 4096  # a page: an array at such an offset starts page- and cache-line-aligned, as XLA:CPU needs to share it
KEEP = 3  # entries kept: each is the size of its model's prepared weights
WEIGHTS, INDEX = "weights.bin", "index.pkl"


def restore(root: Path | None, name: str | None, checkpoint: Path, config: ModelConfig, mesh, dtype, ops) -> dict:
    """The params of `checkpoint` (whose `config` was checked: `load_config`) restored onto `mesh` in `dtype` and
    prepared by `ops` (`load_checkpoint`), or mapped from entry `name` (`entry_name`) in `root` made by an earlier
    such load, which is made now where there is none. `root` or `name` None, a backend that does not prepare host
    arrays, or more than one device or process: restored and prepared, nothing kept."""
    prepare = lambda part: ops.prepare(part, config.with_dtype(jnp.dtype(dtype).name) if dtype else config)
    if root is None or name is None or not ops.prepared_on_host or mesh.size != 1 or jax.process_count() != 1:
        return load_checkpoint(checkpoint, mesh=mesh, dtype=dtype, prepare=prepare, config=config)[1]
    params = load(root, name, mesh)
    if params is None:
        params = load_checkpoint(checkpoint, mesh=mesh, dtype=dtype, prepare=prepare, config=config)[1]
        save(root, name, params)
    return params


def entry_name(digest: str, ops, dtype) -> str:
    """The entry of the weights of the checkpoint of `checkpoint_digest` `digest` prepared by `ops` in `dtype`."""
    return f"{digest}-{backend_digest(ops, dtype)}"


def checkpoint_digest(checkpoint: Path) -> str:
    """A digest of a converted checkpoint as stored: any rewrite of its config or of its arrays changes it (its
    arrays' files by size, times and inode: `default_model.file_stamp`)."""
    checkpoint = checkpoint.resolve()
    digest = hashlib.sha256(str(checkpoint).encode())
    digest.update((checkpoint / CONFIG_FILE).read_bytes())
    for file in sorted((checkpoint / PARAMS_DIR).rglob("*")):
        if file.is_file():
            stat = file.stat()
            digest.update(f"{file.relative_to(checkpoint)} {file_stamp(stat)}\n".encode())
    return digest.hexdigest()[:24]


def backend_digest(ops, dtype) -> str:
    """A digest of how weights are prepared: the backend's value (with its quantization), the dtype asked for, and
    the code that prepares them."""
    parts = (repr(ops), None if dtype is None else jnp.dtype(dtype).name, source_digest(), jax.__version__)
    return hashlib.sha256(repr(parts).encode()).hexdigest()[:24]


def checked(root: Path, digest: str) -> bool:
    """Whether some entry in `root` was made from the checkpoint of `checkpoint_digest` `digest`, as it is stored now:
    its config was checked against its arrays then."""
    return root.is_dir() and any(root.glob(f"{digest}-*/{INDEX}"))


def load(root: Path, name: str, mesh) -> dict | None:
    """The params kept in entry `name`, mapped onto `mesh` (of one CPU device) with the shardings they were kept with
    (a program's inputs' shardings are part of it: other ones would compile it again), or None where there is none (or
    it cannot be read: it is then removed, to be written again)."""
    entry = root / name
    try:
        with open(entry / INDEX, "rb") as f:
            treedef, leaves = pickle.load(f)
        weights = _mapped(entry / WEIGHTS)
        arrays = []
        for offset, shape, dtype, spec in leaves:
            dtype = jnp.dtype(dtype)
            sharding = SingleDeviceSharding(mesh.devices.flat[0]) if spec is None else NamedSharding(mesh, spec)
            size = int(np.prod(shape)) * dtype.itemsize
            if offset + size > weights.size:
                raise ValueError(f"{WEIGHTS} is shorter than its index says")
            view = weights[offset : offset + size].view(dtype).reshape(shape)
            arrays.append(jax.device_put(view, sharding))
        os.utime(entry / INDEX)  # used now: `_evict` keeps the entries used last
    except FileNotFoundError:
        return None
    except Exception as e:  # a damaged entry (a truncated file, another version's index): write it again
        log.warning("prepared weights in %s unreadable (%s); preparing them again", entry, e)
        shutil.rmtree(entry, ignore_errors=True)
        return None
    return jax.tree.unflatten(treedef, arrays)


def _mapped(path: Path) -> np.ndarray:
    """A file's bytes, mapped read-only with its pages entered at once (MAP_POPULATE, where the OS has it): one pass
    of the kernel over the page cache, instead of a fault per page as the first products read them."""
    with open(path, "rb") as f:
        flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
        return np.frombuffer(mmap.mmap(f.fileno(), 0, flags=flags, prot=mmap.PROT_READ), np.uint8)


def save(root: Path, name: str, params) -> None:
    """Keep `params` (arrays on one CPU device) as entry `name`, then remove the entries beyond KEEP. A failure (a full
    disk, a read-only cache) is logged and costs only the next load's time."""
    arrays, treedef = jax.tree.flatten(params)
    tmp = temporary_path(root / name)
    start = time.perf_counter()
    try:
        tmp.mkdir(parents=True)
        leaves, offset = [], 0
        with open(tmp / WEIGHTS, "wb") as f:
            for array in arrays:
                host = np.asarray(array)  # on a CPU device, a view of the array's buffer: nothing is copied
                offset = -(-offset // ALIGN) * ALIGN
                f.seek(offset)
                f.write(memoryview(np.ascontiguousarray(host)).cast("B"))
                spec = array.sharding.spec if isinstance(array.sharding, NamedSharding) else None
                leaves.append((offset, host.shape, host.dtype.name, spec))
                offset += host.nbytes
        with open(tmp / INDEX, "wb") as f:
            pickle.dump((treedef, leaves), f)
        os.replace(tmp, root / name)
    except OSError as e:
        log.warning("could not keep the prepared weights in %s (%s)", root, e)
        shutil.rmtree(tmp, ignore_errors=True)
        return
    seconds = time.perf_counter() - start
    log.info("kept the prepared weights (%.2f GB) in %s in %.1f s", offset / 1e9, root / name, seconds)
    _evict(root)


def _evict(root: Path) -> None:
    """Remove all but the KEEP entries used last, and temporary folders of writers that are gone."""
    entries = sorted(root.glob(f"*/{INDEX}"), key=lambda p: p.stat().st_mtime, reverse=True)
    for index in entries[KEEP:]:
        shutil.rmtree(index.parent, ignore_errors=True)
    remove_stale_tmp(root / "*")
