"""Converted checkpoints: an Orbax checkpoint of the params plus `config.json`, written layer by layer
and restored straight onto any mesh.

Layout of a checkpoint folder::

    config.json                 ModelConfig
    params/                     Orbax checkpoint of the params pytree (names as in `params.param_layout`; a weight
                                stored as blocks is NAME/quants and NAME/scales, see `params.abstract_stored`)
    converter.json              the version of the converters that wrote it (`converters.VERSION`)
    tokenizer files, generation_config.json, chat template   (carried by the converter, read by `text`)
    format.json                 the checkpoint format's version (FORMAT) and every other file with its size
                                ("files"), written last

Nothing in it depends on a device count: `load_checkpoint` restores with target shardings, so each host
reads only the slices its devices hold.

A checkpoint is written whole or not at all (`CheckpointWriter`: a temporary folder renamed, or swapped, into place by
`folders.put_in_place`), and loaded only whole: `load_config` refuses one missing a file format.json lists, or holding
an array file of another size (`check_complete`), with stat calls alone, before anything is read. A checkpoint written
before format.json listed its files is checked by its arrays alone (`checkpoint_check.check_stored`).
"""

from __future__ import annotations

import json
import os
import shutil
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from jaxllama.core.blocks import Blocks, dequantize
from jaxllama.core.checkpoint_check import check_files, check_stored, listed_files, restore_errors
from jaxllama.core.config import BLOCK_FORMATS, CONFIG_FILE, ModelConfig
from jaxllama.core.folders import finish_swap, put_in_place, remove_stale_tmp, temporary_path
from jaxllama.core.params import abstract_stored, as_blocks, check_forms, param_layout, stored_arrays_of
from jaxllama.core.regular_files import read_regular
from jaxllama.errors import CheckpointError

PARAMS_DIR = "params"
FORMAT_FILE = "format.json"
FORMAT = 2  # 1: weights stored (in, out); 2: (out, in), as in model.py


def _orbax():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import orbax.checkpoint.experimental.v1 as ocp
    return ocp


def _format_record(path: Path) -> dict | None:
    """format.json's content, its "format" an int; None where it is missing, not a regular file (a FIFO's read would
    wait forever) or not such an object."""
    try:
        record = json.loads(read_regular(path / FORMAT_FILE))
        return record | {"format": int(record["format"])}
    except (OSError, ValueError, KeyError, TypeError):
        return None


def checkpoint_format(path: str | Path) -> int | None:
    """The format version of a converted checkpoint folder (1 for one written before versions were recorded),
    or None if the folder is not a checkpoint. A folder whose format.json lists its files is a checkpoint, whole or
    not (`check_complete` says)."""
    path = Path(path)
    record = _format_record(path)
    if record is not None and isinstance(record.get("files"), dict):
        return record["format"]
    if not ((path / CONFIG_FILE).is_file() and (path / PARAMS_DIR).is_dir()):
        return None
    return record["format"] if record is not None else 1


def checkpoint_files(path: str | Path) -> dict[str, int] | None:
    """The files format.json lists ({relative path: size}), or None for a checkpoint written before it listed them."""
    record = _format_record(Path(path))
    files = record.get("files") if record is not None else None
    return files if isinstance(files, dict) else None


def check_complete(path: str | Path) -> None:
    """Raise CheckpointError unless every file format.json lists is in the checkpoint, each array file with the size
    listed (the JSON and tokenizer files may be edited); stat calls only. A checkpoint written before format.json
    listed its files passes."""
    files = checkpoint_files(path)
    if files is not None:
        check_files(Path(path), files, FORMAT_FILE, sized=PARAMS_DIR)


def is_checkpoint(path: str | Path) -> bool:
    """A complete checkpoint this version of jaxllama reads."""
    if checkpoint_format(path) != FORMAT:
        return False
    try:
        check_complete(path)
    except CheckpointError:
        return False
    return True


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
    check=False skips that check, for a config known to have passed it (its file unchanged since). A checkpoint
    missing a file is refused either way (`check_complete`), after repairing a replacement of it that was killed
    half-way (`folders.finish_swap`)."""
    path = Path(path)
    finish_swap(path)
    _check_format(path)
    check_complete(path)
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
    and checked here; either way a checkpoint missing a file is refused (`check_complete`).
    """
    path = Path(path)
    if config is None:
        config = load_config(path)
    else:
        check_complete(path)
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


class CheckpointWriter:
    """Writes a checkpoint a few tensors at a time, so that converting never holds the whole model.

    Everything goes to a temporary folder beside `out_dir`, renamed into place by `commit()` once every
    parameter is written, format.json (listing every other file) last; an error (or `abort()`) removes it, so a
    half-written checkpoint never looks complete. With `overwrite`, the new folder replaces an existing `out_dir`
    so that `out_dir` is whole, old or new, at every instant (`folders.put_in_place`); without, `commit()` raises
    FileExistsError if another writer put an `out_dir` there meanwhile. The folder's name carries the writer's
    process id: one left by a killed conversion is removed by the next writer of the same `out_dir`.

        with CheckpointWriter(out, config) as w:
            w.write({"embedding": array, ...})     # flat names from `param_layout`
            w.write_file("tokenizer.json", text)
            w.commit()
    """

    def __init__(self, out_dir: str | Path, config: ModelConfig, overwrite: bool = False):
        self.out_dir = Path(out_dir)
        finish_swap(self.out_dir)
        if self.out_dir.exists() and any(self.out_dir.iterdir()) and not overwrite:
            raise FileExistsError(f"{self.out_dir}: already exists and is not empty (pass --overwrite to replace)")
        self.overwrite = overwrite
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
        record = {"format": FORMAT, "files": listed_files(self.tmp)}  # last: its list marks the checkpoint whole
        (self.tmp / FORMAT_FILE).write_text(json.dumps(record, indent=1) + "\n")
        put_in_place(self.tmp, self.out_dir, replace=self.overwrite)
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
