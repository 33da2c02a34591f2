"""The README's Python API examples run as written, on the tiny chat model instead of the default one."""

from __future__ import annotations

import numpy as np
import pytest

from tests.readme import code_blocks


@pytest.mark.slow
def test_python_api_examples(tiny_chat_checkpoint, monkeypatch, capsys):
    from jaxllama.llm import LLM

    load = LLM.load.__func__

    def load_tiny(cls, path=None, **kwargs):
        # the test session's compilation cache (tests/conftest.py), not the user's; the server tests' engine shape
        shape = {"max_slots": 8, "max_context": 64, "compilation_cache": False}
        return load(cls, tiny_chat_checkpoint, **{**kwargs, **shape})

    monkeypatch.setattr(LLM, "load", classmethod(load_tiny))
    (block,) = code_blocks("Python", "python")
    namespace = {}
    exec(compile(block, "README.md (## Python)", "exec"), namespace)
    llm, logits = namespace["llm"], namespace["logits"]
    assert isinstance(llm, LLM) and llm.path == tiny_chat_checkpoint
    assert logits.shape == (2, 3, llm.config.vocab_size) and np.isnan(logits[1, 2]).all()
    assert capsys.readouterr().out  # the streamed story
    scores = namespace["scores"]
    assert [len(s.token_ids) for s in scores] == [len(llm.encode(c, add_bos=False)) for c in (" Paris", " Rome")]
