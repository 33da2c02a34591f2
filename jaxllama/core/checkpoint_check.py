"""A converted checkpoint checked before anything is restored: its files against the list its writer made
(`check_files`, stat calls only), then its config.json against the arrays Orbax recorded (names, shapes, dtypes), read
from Orbax's metadata alone.

A checkpoint missing a file (deleted, or lost to an interrupted copy) is refused by `check_files`, naming the files
missing, whichever they are: a missing tokenizer.json would otherwise load a model that cannot read its prompts.

A config that does not match its arrays (edited by hand, copied from another model, or absurd) is refused here,
naming the file and the field: restoring would first build the model the config describes (a config of 10^6
layers takes minutes and gigabytes before Orbax notices) and then fail deep inside Orbax. Failures of the
restore itself (a truncated data file) come out of `restore_errors` as one CheckpointError too.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import stat
import warnings
from pathlib import Path

from jaxllama.core.blocks import BLOCK
from jaxllama.core.config import ModelConfig
from jaxllama.core.params import check_forms, stored_arrays_of
from jaxllama.core.regular_files import kind
from jaxllama.errors import CheckpointError


def listed_files(folder: Path) -> dict[str, int]:
    """{relative path: size in bytes} for every file under `folder`: what a checkpoint's writer records of it."""
    return {f.relative_to(folder).as_posix(): f.stat().st_size for f in sorted(folder.rglob("*")) if f.is_file()}


def check_files(folder: Path, files: dict[str, int], record: str, sized: str) -> None:
    """Raise CheckpointError unless each file of `files` (`listed_files` when `folder` was written, as the file
    `record` keeps them) is in `folder`, a regular file (a FIFO there would block the read that loads it, forever),
    and, under folder `sized` (the arrays, which nobody edits), has the size listed. One stat call a file."""
    missing, resized, irregular = [], [], []
    for name, size in files.items():
        try:
            found = os.stat(folder / name)
        except (FileNotFoundError, NotADirectoryError):
            missing.append(name)
            continue
        if not stat.S_ISREG(found.st_mode):
            irregular.append(f"{name} is {kind(found.st_mode)}")
        elif name.startswith(f"{sized}/") and found.st_size != size:
            resized.append(f"{name} is {found.st_size} bytes, {record} lists {size}")
    if missing or resized or irregular:
        some = lambda names: ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
        what = [f"{some(missing)} missing"] if missing else []
        what += [some(resized)] if resized else []
        what += [f"{some(irregular)}, not a regular file"] if irregular else []
        raise CheckpointError(
            f"{folder}: an incomplete checkpoint: {'; '.join(what)} (of the {len(files)} files {record} lists). "
            f"Convert its source again: python -m converters.llama SRC {folder} --overwrite"
        )


def stored_arrays(params_dir: Path) -> dict[str, tuple[tuple[int, ...], str]]:
    """{'layers_0/attention/wq': (shape, dtype name)} for every array of an Orbax checkpoint, from its metadata."""
    _check_readable(params_dir)
    with warnings.catch_warnings(), _held_logs(params_dir) as held:
        warnings.simplefilter("ignore")
        import orbax.checkpoint.experimental.v1 as ocp

        try:
            tree = ocp.pytree_metadata(params_dir).metadata
        except Exception as e:  # Orbax raises many kinds for a missing or garbled metadata file
            raise CheckpointError(f"{params_dir}: cannot read Orbax's metadata ({_first_line(e)})") from None
        if tree is None:  # Orbax logs why (a data file missing or truncated) and returns None
            why = held.messages[-1].rpartition("Error details: ")[2] if held.messages else "no details"
            raise CheckpointError(f"{params_dir}: cannot read Orbax's metadata ({_first_line(why)})")
    flat = {}

    def walk(node, prefix):
        if isinstance(node, dict):
            for key, child in node.items():
                walk(child, f"{prefix}{key}/")
        elif node is None:
            raise CheckpointError(f"{params_dir}: cannot read the metadata of {prefix[:-1]}")
        else:
            flat[prefix[:-1]] = (tuple(int(d) for d in node.shape), str(node.dtype))

    walk(tree, "")
    return flat


def check_stored(config: ModelConfig, config_file: Path, params_dir: Path) -> None:
    """Raise CheckpointError unless the arrays in `params_dir` are exactly those `config` describes.

    The layer count and the embedding are compared first, from the metadata alone: only then is the config
    trusted to build the model's layout (whose cost grows with its layers)."""
    stored = stored_arrays(params_dir)
    layers = len({name.partition("/")[0] for name in stored if name.startswith("layers_")})
    if layers != config.n_layers:
        raise CheckpointError(f"{config_file}: n_layers is {config.n_layers}, but {params_dir} holds {layers} layers")
    embedding = stored.get("embedding", (None,))[0]
    if "embedding/scales" in stored:  # blocks: the inputs are counted by their scales
        rows, blocks = stored["embedding/scales"][0]
        embedding = (rows, blocks * BLOCK)
    if embedding != (config.vocab_size, config.dim):
        raise CheckpointError(
            f"{config_file}: vocab_size is {config.vocab_size} and dim {config.dim}, but {params_dir} holds "
            + (f"an embedding of shape {embedding}" if embedding else "no embedding")
        )
    try:
        check_forms(config)
    except ValueError as e:
        raise CheckpointError(f"{config_file}: {e}") from None
    layout = stored_arrays_of(config)
    for name, (shape, expected) in layout.items():
        if name not in stored:
            raise CheckpointError(f"{params_dir}: {name} is missing (the model of {config_file} has it)")
        found, dtype = stored[name]
        if found != shape:
            raise CheckpointError(
                f"{config_file} does not match {params_dir}: {name} is stored with shape {found}, "
                f"the config gives {shape}"
            )
        if dtype != expected:
            weight = name.removesuffix("/quants").removesuffix("/scales")
            said = (
                f"dtype is {config.dtype}"
                if weight not in dict(config.stored_as)
                else f"stored_as gives {weight} as {config.form(weight)}"
            )
            raise CheckpointError(f"{config_file}: {said}, but {params_dir} stores {name} as {dtype}")
    extra = sorted(set(stored) - set(layout))
    if extra:
        raise CheckpointError(
            f"{params_dir}: holds {extra[0]}, which the model of {config_file} does not have"
            + (" (tie_embeddings is true)" if extra[0] == "output" else "")
        )


def _check_readable(params_dir: Path) -> None:
    """Read each array's metadata record (`NAME/zarr.json`) from the OCDBT stores Orbax writes, one at a time.

    Orbax reads them all at once, each in an asyncio task: when a data file is missing or truncated it gives up at
    the first failure and closes its event loop while the other reads are in flight, and those then print
    "RuntimeError: Event loop is closed" tracebacks from TensorStore's threads. Read here first, in order, a
    damaged file fails once, by name. A layout other than this one is left to Orbax."""
    import tensorstore as ts

    for manifest in sorted(params_dir.glob("*/manifest.ocdbt")):
        try:
            store = ts.KvStore.open({"driver": "ocdbt", "base": f"file://{manifest.parent}/"}).result()
            keys = [k.decode() for k in store.list().result()]
            for key in keys:
                if key.endswith("/zarr.json"):
                    store.read(key).result()
        except ValueError as e:  # TensorStore's errors name the file and the byte range it could not read
            raise CheckpointError(f"{params_dir}: cannot read {manifest.parent.name}/ ({_first_line(e)})") from None


@contextlib.contextmanager
def restore_errors(params_dir: Path):
    """Turn a failed restore (a truncated or missing data file) into one CheckpointError naming the checkpoint."""
    try:
        with _held_logs(params_dir):
            yield
    except (CheckpointError, MemoryError):
        raise
    except Exception as e:  # Orbax and TensorStore raise their own kinds, with the file in the message
        raise CheckpointError(f"{params_dir}: cannot restore ({_first_line(e)})") from None


class _KeepMessages(logging.Filter):
    def __init__(self):
        super().__init__()
        self.messages: list[str] = []

    def filter(self, record: logging.LogRecord) -> bool:
        self.messages.append(record.getMessage())
        return False


class _DropMentionsOf(logging.Filter):
    """Drops the records that mention a path."""

    def __init__(self, path: Path):
        super().__init__()
        self.path = str(path)

    def filter(self, record: logging.LogRecord) -> bool:
        return self.path not in record.getMessage()


@contextlib.contextmanager
def _held_logs(params_dir: Path):
    """Hold back what Orbax (through absl) and asyncio log while a checkpoint is read; the caller reports a failure
    once. Orbax reads each array in an asyncio task of its own: when a data file is damaged every array in it fails,
    and asyncio logs each failure nobody awaited as a traceback ("Task exception was never retrieved"), dozens for
    one file, when the task is collected. Tasks still in flight when Orbax gives up fail later, so after a failure
    asyncio's records about this checkpoint stay dropped."""
    held = _KeepMessages()
    loggers = [logging.getLogger("absl"), logging.getLogger("asyncio")]
    for log in loggers:
        log.addFilter(held)
    try:
        yield held
    except BaseException:
        logging.getLogger("asyncio").addFilter(_DropMentionsOf(params_dir))
        gc.collect()
        raise
    finally:
        for log in loggers:
            log.removeFilter(held)


def _first_line(e: Exception) -> str:
    """The part of an Orbax or TensorStore message that names the file and the problem (not the JSON spec of
    TensorStore's drivers that follows it)."""
    lines = str(e).strip().splitlines()
    return lines[0].partition(" [tensorstore_spec")[0] if lines else type(e).__name__
