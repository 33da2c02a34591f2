"""Converted checkpoints: an Orbax checkpoint of the params plus `config.json`, written layer by layer
and restored straight onto any mesh.

Layout of a checkpoint folder::

    config.json                 ModelConfig
    params/                     Orbax checkpoint of the params pytree (names as in `params.param_layout`; a weight
                                stored as blocks is NAME/quants and NAME/scales, see `params.abstract_stored`)
    format.json                 the checkpoint format's version (FORMAT)
    converter.json              the version of the converters that wrote it (`converters.VERSION`)
    tokenizer files, generation_config.json, chat template   (carried by the converter, read by `text`)

Nothing in it depends on a device count: `load_checkpoint` restores with target shardings, so each host
reads only the slices its devices hold.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from jaxllama.core.blocks import Blocks, dequantize
from jaxllama.core.checkpoint_check import check_stored, restore_errors
from jaxllama.core.config import BLOCK_FORMATS, CONFIG_FILE, ModelConfig
from jaxllama.core.params import abstract_stored, as_blocks, check_forms, param_layout, stored_arrays_of

PARAMS_DIR = "params"
FORMAT_FILE = "format.json"
FORMAT = 2  # 1: weights stored (in, out); 2: (out, in), as in model.py


def _orbax():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import orbax.checkpoint.experimental.v1 as ocp
    return ocp


def checkpoint_format(path: str | Path) -> int | None:
    """The format version of a converted checkpoint folder (1 for one written before versions were recorded),
    or None if the folder is not a checkpoint."""
    path = Path(path)
    if not ((path / CONFIG_FILE).is_file() and (path / PARAMS_DIR).is_dir()):
        return None
    try:
        return int(json.loads((path / FORMAT_FILE).read_text())["format"])
    except (OSError, ValueError, KeyError, TypeError):
        return 1


def is_checkpoint(path: str | Path) -> bool:
    """A complete checkpoint this version of jaxllama reads."""
    return checkpoint_format(path) == FORMAT


def _check_format(path: Path) -> None:
    found = checkpoint_format(path)
    if found is None:
        raise FileNotFoundError(f"{path}: not a jaxllama checkpoint (expected {CONFIG_FILE} and {PARAMS_DIR}/)")
    if found != FORMAT:
        raise ValueError(
            f"{path}: a checkpoint of format {found}; this jaxllama reads format {FORMAT}. Convert its source "
            f"again: python -m converters.llama SRC {path} --overwrite"
        )


def load_config(path: str | Path, check: bool = True) -> ModelConfig:
    """The config of a converted checkpoint, checked against the arrays stored (their number, shapes and dtypes,
    from Orbax's metadata) before anything of the size it says is built or restored; CheckpointError if not.
    check=False skips that check, for a config known to have passed it (its file unchanged since)."""
    path = Path(path)
    _check_format(path)
    config = ModelConfig.load(path)
    if check:
        check_stored(config, path / CONFIG_FILE, path / PARAMS_DIR)
    return config


def load_checkpoint(
    path: str | Path, mesh: Mesh | None = None, dtype=None, prepare=None, config: ModelConfig | None = None
) -> tuple[ModelConfig, dict]:
    """Restore (config, params) from a converted checkpoint, a part at a time: the params outside the layers, then
    runs of layers (`_parts`). The weights come back as the checkpoint stores them (bfloat16 as bfloat16, blocks as
    `Blocks`), and the config returned describes them.

    mesh: restore each array with its sharding on this mesh (from the logical-axis rules); None restores
    onto the default device. dtype: every weight in this dtype instead (blocks dequantized, others cast), once,
    here, a part at a time; the config returned then says so (`ModelConfig.with_dtype`). prepare: applied to each
    part as it is restored (a backend's `Ops.prepare`), so that weights a backend replaces (packs, quantizes) are
    never all held twice. config: the checkpoint's config as `load_config` gave it (checked already), else read
    and checked here.
    """
    path = Path(path)
    config = config or load_config(path)
    stored = abstract_stored(config, mesh)
    if mesh is None:
        device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        stored = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=device), stored)
    convert = dtype is not None and config != config.with_dtype(jnp.dtype(dtype).name)
    params: dict = {}
    for names in _parts(stored, config):
        part = as_blocks(_restore_part(path, stored, names), config)
        if convert:
            part = jax.tree.map(lambda w: _as_dtype(w, dtype), part, is_leaf=lambda w: isinstance(w, Blocks))
        params |= prepare(part) if prepare is not None else part
    return (config.with_dtype(jnp.dtype(dtype).name) if dtype is not None else config), params


@jax.jit
def _dequantized(w: Blocks) -> jax.Array:
    return dequantize(w, jnp.float32)


def _as_dtype(w, dtype) -> jax.Array:
    # Blocks are widened through float32, exactly as gguf's dequantizer does.
    return (_dequantized(w) if isinstance(w, Blocks) else w).astype(dtype)


# Layers restored per call, up to this many bytes: each call costs a fixed ~0.1 s, and a part is held twice at most.
PART_BYTES = 256 << 20


def _parts(stored: dict, config: ModelConfig) -> list[list[str]]:
    """The top-level names restored together: the params outside the layers, then runs of consecutive layers of at
    most PART_BYTES (at least one layer each)."""
    parts = [[k for k in stored if not k.startswith("layers_")]]
    layer_bytes = sum(s.size * s.dtype.itemsize for s in jax.tree.leaves(stored["layers_0"]))
    per_part = max(1, PART_BYTES // max(1, layer_bytes))
    for start in range(0, config.n_layers, per_part):
        parts.append([f"layers_{i}" for i in range(start, min(start + per_part, config.n_layers))])
    return parts


def _restore_part(path: Path, stored: dict, names: list[str]) -> dict:
    """The params named `names` (top-level keys), restored alone: Orbax skips the leaves given as placeholders."""
    ocp = _orbax()
    wanted = {k: v if k in names else jax.tree.map(lambda _: ocp.PLACEHOLDER, v) for k, v in stored.items()}
    with warnings.catch_warnings(), restore_errors(path / PARAMS_DIR):
        warnings.simplefilter("ignore")
        restored = ocp.load_pytree(path / PARAMS_DIR, wanted)
    return {k: restored[k] for k in names}


def _uncompressed():
    """Orbax's context for writing arrays as they are: zstd (its default) saves nothing on quantized weights and a
    third on bfloat16 ones (random ones of the Llama-3.2-1B shape: 2.1 GB -> 1.4 GB), but costs its compression at
    every conversion and its decompression at every load (that shape's conversion took 2.7x as long with it)."""
    context = _orbax().Context()
    context.array.saving.use_compression = False
    return context


def temporary_path(out_dir: Path) -> Path:
    """Where a writer of `out_dir` writes before renaming it into place: `.NAME.tmp-PID-RANDOM` beside it, so that
    `remove_stale_tmp` can tell a writer at work (its process running) from one that was killed."""
    return out_dir.with_name(f".{out_dir.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")


def remove_stale_tmp(out_dir: str | Path) -> list[Path]:
    """Remove the temporary folders of writers of `out_dir` that are gone (killed before they could clean up):
    those whose name carries the id of no running process, or none (written before names carried one). `out_dir`'s
    name may be a glob pattern ("*": the writers of every folder beside it). Returns what was removed."""
    out_dir = Path(out_dir)
    removed = []
    for tmp in out_dir.parent.glob(f".{out_dir.name}.tmp-*"):
        owner = tmp.name.rpartition(".tmp-")[2].split("-")[0]
        if owner.isdigit() and process_alive(int(owner)):
            continue  # a writer at work, maybe another conversion racing for the same name
        shutil.rmtree(tmp, ignore_errors=True)
        removed.append(tmp)
    return removed


def process_alive(pid: int) -> bool:
    """Whether process `pid` exists (someone else's counts)."""
    try:
        os.kill(pid, 0)  # signal 0: nothing is sent, the process is only looked up
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process
    return True


class CheckpointWriter:
    """Writes a checkpoint a few tensors at a time, so that converting never holds the whole model.

    Everything goes to a temporary folder beside `out_dir`, renamed into place by `commit()` once every
    parameter is written; an error (or `abort()`) removes it, so a half-written checkpoint never looks
    complete. The folder's name carries the writer's process id: one left by a killed conversion is removed
    by the next writer of the same `out_dir`.

        with CheckpointWriter(out, config) as w:
            w.write({"embedding": array, ...})     # flat names from `param_layout`
            w.write_file("tokenizer.json", text)
            w.commit()
    """

    def __init__(self, out_dir: str | Path, config: ModelConfig, overwrite: bool = False):
        self.out_dir = Path(out_dir)
        if self.out_dir.exists() and any(self.out_dir.iterdir()) and not overwrite:
            raise FileExistsError(f"{self.out_dir}: already exists and is not empty (pass --overwrite to replace)")
        self.config = config
        check_forms(config)
        self.layout = param_layout(config)
        self.arrays = stored_arrays_of(config)
        remove_stale_tmp(self.out_dir)
        self.tmp = temporary_path(self.out_dir)
        self.tmp.mkdir(parents=True)
        self.written: set[str] = set()
        self.committed = False

    def write(self, tensors: dict[str, np.ndarray | Blocks]) -> None:
        """Write some parameters ({flat name: array, or Blocks for those the config stores as blocks}); each is
        checked against the layout and cast to the dtype the config stores it in."""
        tree: dict = {}
        for name, array in tensors.items():
            if name not in self.layout:
                raise ValueError(f"unexpected parameter {name!r}")
            if name in self.written:
                raise ValueError(f"parameter {name!r} written twice")
            shape, form = self.layout[name][0], self.config.form(name)
            if tuple(array.shape) != shape:
                raise ValueError(f"parameter {name}: shape {tuple(array.shape)}, expected {shape}")
            if isinstance(array, Blocks) != (form in BLOCK_FORMATS) or getattr(array, "format", form) != form:
                raise ValueError(f"parameter {name}: {getattr(array, 'format', 'an array')}, stored as {form}")
            node = tree
            *parents, leaf = name.split("/")
            for p in parents:
                node = node.setdefault(p, {})
            if isinstance(array, Blocks):
                node[leaf] = {"quants": np.asarray(array.quants), "scales": np.asarray(array.scales)}
            else:
                node[leaf] = np.asarray(array).astype(jnp.dtype(self.arrays[name][1]), copy=False)
        with warnings.catch_warnings(), _uncompressed():
            warnings.simplefilter("ignore")
            _orbax().partial.save(self.tmp / PARAMS_DIR, tree)
        self.written.update(tensors)

    def write_file(self, name: str, content: str | bytes) -> None:
        target = self.tmp / name
        if isinstance(content, bytes):
            target.write_bytes(content)
        else:
            target.write_text(content)

    def copy_file(self, source: str | Path, name: str | None = None) -> None:
        shutil.copyfile(source, self.tmp / (name or Path(source).name))

    def commit(self) -> Path:
        missing = sorted(set(self.layout) - self.written)
        if missing:
            raise ValueError(f"parameters never written: {', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}")
        with warnings.catch_warnings(), _uncompressed():
            warnings.simplefilter("ignore")
            _orbax().partial.finalize(self.tmp / PARAMS_DIR)
        self.config.save(self.tmp)
        (self.tmp / FORMAT_FILE).write_text(json.dumps({"format": FORMAT}) + "\n")
        if self.out_dir.exists():
            shutil.rmtree(self.out_dir)
        self.tmp.rename(self.out_dir)
        self.committed = True
        return self.out_dir

    def abort(self) -> None:
        shutil.rmtree(self.tmp, ignore_errors=True)
        for leftover in self.tmp.parent.glob(f"{self.tmp.name}*"):
            shutil.rmtree(leftover, ignore_errors=True)

    def __enter__(self) -> CheckpointWriter:
        return self

    def __exit__(self, *exc) -> None:
        if not self.committed:
            self.abort()


def file_stamp(stat: os.stat_result) -> str:
    """What identifies a file's content without reading it: size, modification time, inode and status-change time.
    Writing a file updates its status-change time, and no call can set it back."""
    return f"{stat.st_size} {stat.st_mtime_ns} {stat.st_ino} {stat.st_ctime_ns}"
