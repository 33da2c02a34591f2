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
at an offset aligned to ALIGN) and `index.json`, plain data (JSON):

    {"format": 2, "stamp": "SIZE MTIME_NS INODE CTIME_NS", "sha256": "...",
     "tree": {"node": "dict", "keys": ["embedding", ...], "children": [null, ...]},
     "arrays": [{"path": "['layers_0']['wq+wk+wv'].panels", "offset": 4096, "shape": [3, 64, 16],
                 "dtype": "float32", "spec": [null, null, null], "sha256": "9f2c..."}, ...]}

`tree` is the params' pytree structure (`_tree_data`): null for a leaf, else a node of NODES by name (dict, list,
tuple, None, and the weights' types: `matmul.Packed`, `Blocks`, `Int8`) with its children, a dict's keys, a
dataclass's static fields. `arrays` are its leaves in order: each one's key path (`jax.tree_util.keystr`), offset,
shape, dtype (one of DTYPES), partition spec (mesh axis names, None or lists of names; null: a single device's) and
the SHA-256 of its bytes, computed as it was written. `sha256` is the digest of the rest of the index. Reading an
entry runs no code: the structure is rebuilt from NODES alone, and a node, key, dtype or path out of place makes the
entry unusable.

The arrays' bytes are checked against their digests only when `weights.bin` may have been written since they last
were: `stamp` is its size, modification time, inode and status-change time (`checkpoint.file_stamp`) when they were,
and any write changes the status-change time, which no call can set back (`os.utime` sets it to now). An equal stamp
costs one `fstat` (a warm load takes the ~15-20 ms it took with a pickled index, the 1B shape's 164 arrays); another
one (a changed file, or a cache copied or restored from a backup) has every array hashed, on every core (SHA-256
with the SHA extensions: ~1.3 GB/s a core; the 3 GB of the 1B shape in bfloat16 took ~2 s on 2 busy cores), and,
where all match, the new stamp recorded. An index whose own digest does not match, an array whose digest does not,
or an index of another format (`index.pkl`, a pickle, of earlier versions: never read) is logged, the entry removed,
and the weights restored from the checkpoint and kept again. Neither check sees bytes changed without a write
through the file system (a failing disk, the raw device), the file changed while a process maps it, or an entry
whose index and weights were both rewritten to match: the cache is as trusted as the folder it is in (whose
`kernels` are code). An index or weights that are not a regular file (a FIFO, whose read would wait for a writer
forever) are never read (`regular_files`): the entry is unusable.

An entry is written to a temporary folder and renamed into place, so it is whole or absent. It exists only for a
checkpoint whose config was checked against its arrays and restored: the CHECKPOINT digest stands for that check
(`checked`). The KEEP entries used last are kept, the rest (and folders of other formats) removed.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import mmap
import os
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec, SingleDeviceSharding
from jax.tree_util import PyTreeDef, default_registry

from jaxllama.backends.cpu.matmul import Packed
from jaxllama.core.blocks import Blocks
from jaxllama.core.checkpoint import PARAMS_DIR, file_stamp, load_checkpoint, remove_stale_tmp, temporary_path
from jaxllama.core.config import CONFIG_FILE, ModelConfig
from jaxllama.core.int8_weights import Int8
from jaxllama.core.regular_files import open_regular, read_regular
from jaxllama.engine.programs import json_tuples, source_digest

log = logging.getLogger(__name__)

ALIGN = 4096  # a page: an array at such an offset starts page- and cache-line-aligned, as XLA:CPU needs to share it
KEEP = 3  # entries kept: each is the size of its model's prepared weights
WEIGHTS, INDEX = "weights.bin", "index.json"
FORMAT = 2  # of the index (1: index.pkl, a pickle)
# The pytree nodes an entry's structure may hold, by the names its index gives them: containers, and the weights'
# types (dataclasses whose static fields are ints, strings, booleans and tuples of them).
NODES = {
    "dict": dict,
    "list": list,
    "tuple": tuple,
    "None": type(None),
    "Packed": Packed,
    "Blocks": Blocks,
    "Int8": Int8,
}
NODE_NAMES = {node: name for name, node in NODES.items()}
LEAF = jax.tree.structure(0)
DTYPES = ("bool", "int8", "uint8", "int16", "uint16", "int32", "uint32", "float16", "bfloat16", "float32")


class Unusable(Exception):
    """An entry that cannot serve a load: damaged, changed, or of another format."""


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
    (a program's inputs' shardings are part of it: other ones would compile it again), or None where there is none
    (or it cannot serve: it is then removed, to be written again)."""
    entry = root / name
    try:
        try:
            index = json.loads(read_regular(entry / INDEX))  # a FIFO there: refused, not waited on
        except FileNotFoundError:
            if not entry.exists():
                return None
            raise Unusable(f"no {INDEX}: an entry of an earlier version") from None
        treedef, arrays = _read_index(index)
        with open_regular(entry / WEIGHTS) as f:
            stamp = file_stamp(os.fstat(f.fileno()))  # before the bytes are read: a later write changes it again
            weights = _mapped(f)
        views = []
        for a in arrays:
            if a["offset"] + a["nbytes"] > weights.size:
                raise Unusable(f"{WEIGHTS} is shorter than its index says")
            views.append(weights[a["offset"] : a["offset"] + a["nbytes"]].view(a["dtype"]).reshape(a["shape"]))
        if stamp != index["stamp"]:  # written since its digests were checked, or copied: check them now
            start = time.perf_counter()
            _verify(views, arrays)
            log.info("prepared weights in %s checked in %.2f s", entry, time.perf_counter() - start)
            try:
                _write_index(entry, index | {"stamp": stamp})
            except OSError as e:  # a read-only cache, say: checked again next time
                log.info("could not record the checked stamp of %s (%s)", entry, e)
        device = mesh.devices.flat[0]
        leaves = []
        for view, a in zip(views, arrays, strict=True):
            sharding = SingleDeviceSharding(device) if a["spec"] is None else NamedSharding(mesh, a["spec"])
            leaves.append(jax.device_put(view, sharding))
        os.utime(entry / INDEX)  # used now: `_evict` keeps the entries used last
    except Exception as e:  # damaged, changed, another version's: restored from the checkpoint and written again
        log.warning("prepared weights in %s unusable (%s); preparing them again", entry, e)
        shutil.rmtree(entry, ignore_errors=True)
        return None
    return jax.tree.unflatten(treedef, leaves)


def _read_index(index) -> tuple[PyTreeDef, list[dict]]:
    """(the params' structure, each array's path, offset, nbytes, shape, dtype, spec and digest) from an entry's
    index, once it is found whole (its own digest) and of this format."""
    if not isinstance(index, dict) or index.get("format") != FORMAT:
        raise Unusable(f"{INDEX} of another format")
    if index.get("sha256") != _index_digest(index):
        raise Unusable(f"{INDEX} changed since it was written (its SHA-256 differs)")
    treedef = _treedef(index["tree"])
    example = treedef.unflatten([0] * treedef.num_leaves)
    paths = [jax.tree_util.keystr(path) for path, _ in jax.tree_util.tree_flatten_with_path(example)[0]]
    if [a.get("path") for a in index["arrays"]] != paths:
        raise Unusable(f"{INDEX}: its arrays are not the leaves of its tree")
    arrays = []
    for a in index["arrays"]:
        shape, offset = a["shape"], a["offset"]
        if a["dtype"] not in DTYPES or not all(type(n) is int and n >= 0 for n in shape):
            raise Unusable(f"{INDEX}: {a['path']} is not an array of numbers")
        if type(offset) is not int or offset < 0 or offset % ALIGN:
            raise Unusable(f"{INDEX}: {a['path']} at offset {offset!r}")
        dtype = jnp.dtype(a["dtype"])
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        arrays.append(a | {"dtype": dtype, "shape": tuple(shape), "nbytes": nbytes, "spec": _spec(a["spec"])})
    return treedef, arrays


def _index_digest(index: dict) -> str:
    """The SHA-256 of an index without its own: a change to any of it (an offset, the stamp) is seen."""
    return hashlib.sha256(
        json.dumps({k: v for k, v in index.items() if k != "sha256"}, sort_keys=True).encode()
    ).hexdigest()


def _tree_data(treedef: PyTreeDef):
    """A pytree's structure as plain data: None for a leaf, else {"node": a name of NODES, "children": [...]}, with a
    dict's "keys" or a dataclass's "static" fields. ValueError for a node NODES does not name."""
    data = treedef.node_data()
    if data is None:
        return None
    node, aux = data
    if node not in NODE_NAMES:
        raise ValueError(f"a pytree node of type {node.__name__} cannot be kept")
    out = {"node": NODE_NAMES[node], "children": [_tree_data(c) for c in treedef.children()]}
    if node is dict:
        out["keys"] = list(aux)
    elif dataclasses.is_dataclass(node):
        out["static"] = aux
    return out


def _treedef(data) -> PyTreeDef:
    """The pytree structure `_tree_data` describes: only the nodes of NODES, with the keys, static fields and children
    each takes; Unusable for anything else."""
    if data is None:
        return LEAF
    node = NODES.get(data.get("node")) if isinstance(data, dict) else None
    children = data.get("children") if node is not None else None
    if not isinstance(children, list):
        raise Unusable(f"{INDEX}: not a pytree node: {str(data)[:80]}")
    children = [_treedef(c) for c in children]
    aux = None
    if node is dict:
        aux = data.get("keys")
        if not isinstance(aux, list) or len(aux) != len(children) or not all(isinstance(k, str) for k in aux):
            raise Unusable(f"{INDEX}: a dict of {len(children)} children with keys {str(aux)[:80]}")
    elif dataclasses.is_dataclass(node):
        static = [f for f in dataclasses.fields(node) if f.metadata.get("static")]
        aux = json_tuples(data.get("static"))
        if (
            not isinstance(aux, tuple)
            or len(aux) != len(static)
            or len(children) != len(dataclasses.fields(node)) - len(static)
        ):
            raise Unusable(f"{INDEX}: a {data['node']} of {len(children)} children with static fields {str(aux)[:80]}")
    elif node is type(None) and children:
        raise Unusable(f"{INDEX}: a None with children")
    return PyTreeDef.from_node_data_and_children(default_registry, (node, aux), children)


def _spec(value) -> PartitionSpec | None:
    """A partition spec as the index holds it (`_spec_data`)."""
    if value is None:
        return None
    name = lambda x: isinstance(x, str)
    if not isinstance(value, list) or not all(
        x is None or name(x) or (isinstance(x, list) and all(map(name, x))) for x in value
    ):
        raise Unusable(f"{INDEX}: a partition spec of mesh axis names expected, got {str(value)[:80]}")
    return PartitionSpec(*(tuple(x) if isinstance(x, list) else x for x in value))


def _spec_data(sharding) -> list | None:
    """An array's partition spec as plain data: axis names, None or lists of names (None: a single device's)."""
    if not isinstance(sharding, NamedSharding):
        return None
    spec = sharding.spec
    if spec.unreduced or spec.reduced or not all(x is None or isinstance(x, (str, tuple)) for x in spec):
        raise ValueError(f"a partition spec that cannot be kept: {spec}")
    return [list(x) if isinstance(x, tuple) else x for x in spec]


def _digest(view: np.ndarray) -> str:
    """The SHA-256 of an array's bytes (hashlib lets go of the GIL: arrays hash on several threads at once)."""
    return hashlib.sha256(np.ascontiguousarray(view).reshape(-1).view(np.uint8)).hexdigest()


def _verify(views: list[np.ndarray], arrays: list[dict]) -> None:
    """Raise Unusable where an array's bytes are not those its digest was computed from."""
    with ThreadPoolExecutor(os.cpu_count() or 1) as pool:
        for digest, a in zip(pool.map(_digest, views), arrays, strict=True):
            if digest != a["sha256"]:
                raise Unusable(f"{a['path']} changed since it was written (its SHA-256 differs)")


def _mapped(f) -> np.ndarray:
    """An open file's bytes, mapped read-only with its pages entered at once (MAP_POPULATE, where the OS has it): one
    pass of the kernel over the page cache, instead of a fault per page as the first products read them."""
    flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
    return np.frombuffer(mmap.mmap(f.fileno(), 0, flags=flags, prot=mmap.PROT_READ), np.uint8)


def _write_index(folder: Path, index: dict) -> None:
    """Write `folder`'s index with its digest, whole or not at all (a reader sees the old one or the new one)."""
    index = index | {"sha256": _index_digest(index)}
    tmp = folder / f".{INDEX}.tmp-{os.getpid()}"
    tmp.write_text(json.dumps(index))
    os.replace(tmp, folder / INDEX)


def save(root: Path, name: str, params) -> None:
    """Keep `params` (arrays on one CPU device) as entry `name`, each array's digest computed on a thread as it is
    written, then remove the entries beyond KEEP. A failure (a full disk, a read-only cache, a node NODES does not
    name) is logged and costs only the next load's time."""
    paths, treedef = jax.tree_util.tree_flatten_with_path(params)
    tmp = temporary_path(root / name)
    start = time.perf_counter()
    try:
        tree = _tree_data(treedef)
        if _treedef(json.loads(json.dumps(tree))) != treedef:  # static fields JSON does not give back
            raise ValueError(f"a pytree that cannot be kept: {treedef}")
        tmp.mkdir(parents=True)
        arrays, digests, offset = [], [], 0
        with ThreadPoolExecutor(os.cpu_count() or 1) as pool, open(tmp / WEIGHTS, "wb") as f:
            for path, array in paths:
                key = jax.tree_util.keystr(path)
                host = np.ascontiguousarray(array)  # on a CPU device, a view of the array's buffer: nothing copied
                if host.dtype.name not in DTYPES:
                    raise ValueError(f"{key}: an array of {host.dtype} cannot be kept")
                offset = -(-offset // ALIGN) * ALIGN
                digests.append(pool.submit(_digest, host))
                f.seek(offset)
                f.write(host.reshape(-1).view(np.uint8))
                shape, dtype, spec = list(host.shape), host.dtype.name, _spec_data(array.sharding)
                arrays.append({"path": key, "offset": offset, "shape": shape, "dtype": dtype, "spec": spec})
                offset += host.nbytes
        for a, digest in zip(arrays, digests, strict=True):
            a["sha256"] = digest.result()
        # The stamp of the file as written: renaming its folder into place leaves it as it is.
        stamp = file_stamp(os.stat(tmp / WEIGHTS))
        _write_index(tmp, {"format": FORMAT, "tree": tree, "stamp": stamp, "arrays": arrays})
        try:
            os.replace(tmp, root / name)
        except OSError:
            if not (root / name / INDEX).exists():
                raise
            shutil.rmtree(tmp, ignore_errors=True)  # another process (a replica beside this one) kept them first
            return
    except (OSError, ValueError, TypeError) as e:
        log.warning("could not keep the prepared weights in %s (%s)", root, e)
        shutil.rmtree(tmp, ignore_errors=True)
        return
    seconds = time.perf_counter() - start
    log.info("kept the prepared weights (%.2f GB) in %s in %.1f s", offset / 1e9, root / name, seconds)
    _evict(root)


def _evict(root: Path) -> None:
    """Remove all but the KEEP entries used last, entries of other formats (no INDEX), and temporary folders of
    writers that are gone."""
    entries = sorted(root.glob(f"*/{INDEX}"), key=lambda p: p.stat().st_mtime, reverse=True)
    for index in entries[KEEP:]:
        shutil.rmtree(index.parent, ignore_errors=True)
    for folder in root.iterdir():
        if folder.is_dir() and not folder.name.startswith(".") and not (folder / INDEX).exists():
            shutil.rmtree(folder, ignore_errors=True)
    remove_stale_tmp(root / "*")
