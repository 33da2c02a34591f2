"""A source changed in place, its size and modification time put back (`touch -r`), is a new source: its cached
conversion (`default_model.source_key`) and a converted checkpoint's prepared weights (`prepared.checkpoint_digest`)
are not reused."""

from __future__ import annotations

import os

from jaxllama.default_model import source_key
from jaxllama.engine.prepared import checkpoint_digest


def _change_in_place_keeping_size_and_times(path) -> None:
    stat = path.stat()
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    after = path.stat()
    assert (after.st_size, after.st_mtime_ns) == (stat.st_size, stat.st_mtime_ns)


def test_a_gguf_changed_in_place_is_a_new_source(tmp_path):
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(os.urandom(4096))
    before = source_key(gguf)
    assert source_key(gguf) == before  # unchanged: the same conversion
    _change_in_place_keeping_size_and_times(gguf)
    assert source_key(gguf) != before


def test_a_checkpoint_changed_in_place_is_prepared_again(tiny_chat_checkpoint, tmp_path):
    import shutil

    ckpt = tmp_path / "ckpt"
    shutil.copytree(tiny_chat_checkpoint, ckpt)
    before = checkpoint_digest(ckpt)
    assert checkpoint_digest(ckpt) == before
    biggest = max((p for p in (ckpt / "params").rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    _change_in_place_keeping_size_and_times(biggest)
    assert checkpoint_digest(ckpt) != before
