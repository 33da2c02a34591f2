"""A checkpoint written by an older jaxllama (another weight layout) is refused with the command that converts
it again, never read as garbage; the default model's copy is converted again by itself."""

from __future__ import annotations

import shutil

import pytest

from jaxllama.core.checkpoint import FORMAT, FORMAT_FILE, checkpoint_format, is_checkpoint, load_checkpoint
from jaxllama.default_model import resolve_model


def test_an_older_format_is_refused_with_the_command_that_converts_it(tiny_chat_checkpoint, tmp_path):
    assert checkpoint_format(tiny_chat_checkpoint) == FORMAT and is_checkpoint(tiny_chat_checkpoint)
    old = tmp_path / "old"
    shutil.copytree(tiny_chat_checkpoint, old)
    (old / FORMAT_FILE).unlink()  # as written before formats were recorded
    assert checkpoint_format(old) == 1 and not is_checkpoint(old)
    assert resolve_model(old) == old  # a checkpoint: loading it says what to do
    with pytest.raises(ValueError, match=rf"format 1; this jaxllama reads format {FORMAT}.*converters.llama SRC"):
        load_checkpoint(old)
    assert checkpoint_format(tmp_path) is None
    with pytest.raises(FileNotFoundError, match="not a jaxllama checkpoint"):
        load_checkpoint(tmp_path)
