"""Every tokenizer backend lets other Python threads run while it encodes a long text: the server prepares requests
on worker threads so that its event loop goes on answering, which helps only if tokenizing releases the GIL."""

from __future__ import annotations

import importlib.util
import threading
import time
from pathlib import Path

import pytest

from jaxllama.text.loading import load_tokenizer
from jaxllama.text.tokenizer import Tokenizer
from tests.helpers.text import train_sentencepiece

LLAMA3_TOKENIZER_MODEL = Path(importlib.util.find_spec("llama_models").submodule_search_locations[0]) / "llama3"
TEXT = "Llamas eat grass, hay and leaves; 12 of them ate 345 kg.\n" * 10_000  # about 0.5 MB


@pytest.fixture(scope="module", params=["hf", "tiktoken", "sentencepiece"])
def tokenizer(request, tmp_path_factory) -> Tokenizer:
    if request.param == "hf":
        return request.getfixturevalue("smollm2_tokenizer")  # tests/conftest.py
    folder = tmp_path_factory.mktemp(request.param)
    if request.param == "tiktoken":
        (folder / "tokenizer.model").symlink_to(LLAMA3_TOKENIZER_MODEL / "tokenizer.model")
        return load_tokenizer(folder)
    return load_tokenizer(train_sentencepiece(folder, model_type="bpe"))


@pytest.mark.slow
@pytest.mark.parametrize("allow_special", [True, False])
def test_encoding_lets_other_threads_run(tokenizer, allow_special):
    tokenizer.encode("warm up", allow_special=allow_special)  # build what backends build on first use
    finished, ticks = threading.Event(), []

    def encode():
        tokenizer.encode(TEXT, allow_special=allow_special)
        finished.set()

    def tick():  # what an event loop does: wake up often, run a little Python
        while not finished.is_set():
            time.sleep(0.002)
            ticks.append(time.perf_counter())

    ticker = threading.Thread(target=tick)
    ticker.start()
    time.sleep(0.05)
    start = time.perf_counter()
    encoder = threading.Thread(target=encode)
    encoder.start()
    encoder.join()
    elapsed = time.perf_counter() - start
    ticker.join()
    during = [t for t in ticks if start < t < start + elapsed]
    # Holding the GIL, the encoder lets the ticker run only when it has finished: no tick falls within.
    assert len(during) >= 3, f"{len(during)} ticks while encoding for {elapsed:.3f} s"
