"""Converted checkpoints: an Orbax checkpoint of the params plus `config.json`, written layer by layer
and restored straight onto any mesh.

Layout of a checkpoint folder::

    config.json                 ModelConfig
    params/                     Orbax checkpoint of the params pytree (names as in `params.param_layout`)
    format.json                 the checkpoint format's version (FORMAT)
    tokenizer files, generation_config.json, chat template   (carried by the converter, read by `text`)

Nothing in it depends on a device count: `load_checkpoint` restores with target shardings, so each host
reads only the slices its devices hold.
"""

from __future__ import annotations

import json
import shutil
import uuid
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from jaxllama.core.config import CONFIG_FILE, ModelConfig
from jaxllama.core.params import abstract_params, param_layout

PARAMS_DIR = "params"
FORMAT_FILE = "format.json"
FORMAT = 2  # 1: weights stored (in, out); 2: (out, in), as in model.py


def _orbax():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import orbax.checkpoint.experimental.v1 as ocp
    return ocp


def runtime_dtype(backend: str | None = None) -> jnp.dtype:
    """float32 on CPU (XLA:CPU runs bf16 matmuls ~10x slower than f32), bfloat16 on GPU and TPU."""
    backend = backend or jax.default_backend()
    return jnp.dtype(jnp.float32 if backend == "cpu" else jnp.bfloat16)


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


def load_checkpoint(path: str | Path, mesh: Mesh | None = None, dtype=None) -> tuple[ModelConfig, dict]:
    """Restore (config, params) from a converted checkpoint.

    mesh: restore each array with its sharding on this mesh (from the logical-axis rules); None restores
    onto the default device. dtype: the runtime dtype (default `runtime_dtype()`); a checkpoint stored
    in another dtype is cast once, here.
    """
    path = Path(path)
    _check_format(path)
    config = ModelConfig.load(path)
    dtype = jnp.dtype(dtype or runtime_dtype())
    stored = abstract_params(config, config.dtype, mesh)
    if mesh is None:
        device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        stored = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=device), stored)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        params = _orbax().load_pytree(path / PARAMS_DIR, stored)
    if jnp.dtype(config.dtype) != dtype:
        params = jax.tree.map(lambda x: x.astype(dtype), params)
    return config, params


class CheckpointWriter:
    """Writes a checkpoint a few tensors at a time, so that converting never holds the whole model.

    Everything goes to a temporary folder beside `out_dir`, renamed into place by `commit()` once every
    parameter is written; an error (or `abort()`) removes it, so a half-written checkpoint never looks
    complete.

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
        self.layout = param_layout(config)
        self.dtype = np.dtype(jnp.dtype(config.dtype))
        self.tmp = self.out_dir.with_name(f".{self.out_dir.name}.tmp-{uuid.uuid4().hex[:8]}")
        self.tmp.mkdir(parents=True)
        self.written: set[str] = set()
        self.committed = False

    def write(self, tensors: dict[str, np.ndarray]) -> None:
        """Write some parameters ({flat name: array}); each is checked against the layout and cast."""
        tree: dict = {}
        for name, array in tensors.items():
            if name not in self.layout:
                raise ValueError(f"unexpected parameter {name!r}")
            if name in self.written:
                raise ValueError(f"parameter {name!r} written twice")
            shape = self.layout[name][0]
            if tuple(array.shape) != shape:
                raise ValueError(f"parameter {name}: shape {tuple(array.shape)}, expected {shape}")
            node = tree
            *parents, leaf = name.split("/")
            for p in parents:
                node = node.setdefault(p, {})
            node[leaf] = np.asarray(array).astype(self.dtype, copy=False)
        with warnings.catch_warnings():
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
        with warnings.catch_warnings():
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
