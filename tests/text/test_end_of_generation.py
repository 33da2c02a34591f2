"""End-of-generation ids: real vocabularies (Meta Llama 3, SmolLM2) and the set's rules on a small stand-in."""

from __future__ import annotations

import importlib.util
import json
import pathlib
from dataclasses import dataclass, field

import numpy as np
import pytest

from jaxllama.text.builtin_templates import BUILTIN_TEMPLATES
from jaxllama.text.end_of_generation import end_of_generation_ids, load_generation_config
from jaxllama.text.loading import load_tokenizer

LLAMA_MODELS_DIR = pathlib.Path(importlib.util.find_spec("llama_models").submodule_search_locations[0])
LLAMA3_TOKENIZER_MODEL = LLAMA_MODELS_DIR / "llama3" / "tokenizer.model"
LLAMA31_GENERATION_CONFIG = {"bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009]}


@dataclass
class SmallTokenizer:
    """The part of the Tokenizer interface that end_of_generation_ids reads, over a made-up vocabulary."""

    eos_id: int | None = 1
    vocab_size: int = 10
    vocab: dict[str, int] = field(default_factory=lambda: {"</s>": 1, "<|im_end|>": 5, "<|eot_id|>": 6})

    def token_to_id(self, token: str) -> int | None:
        return self.vocab.get(token)


@pytest.fixture(scope="module")
def llama3_tokenizer(tmp_path_factory: pytest.TempPathFactory):
    folder = tmp_path_factory.mktemp("llama3")
    (folder / "tokenizer.model").symlink_to(LLAMA3_TOKENIZER_MODEL)
    return load_tokenizer(folder)


@pytest.fixture(scope="module")
def meta_stop_tokens() -> list[int]:
    from llama_models.llama3.tokenizer import Tokenizer

    return Tokenizer(LLAMA3_TOKENIZER_MODEL).stop_tokens


@pytest.mark.parametrize(
    "generation_config, template",
    [(None, "llama3"), (LLAMA31_GENERATION_CONFIG, "llama3"), (LLAMA31_GENERATION_CONFIG, "raw")],
)
def test_llama3_ends_on_meta_stop_tokens(
    llama3_tokenizer, meta_stop_tokens: list[int], generation_config: dict | None, template: str
) -> None:
    ids = end_of_generation_ids(
        llama3_tokenizer, generation_config=generation_config, template_text=BUILTIN_TEMPLATES[template]
    )
    assert ids == frozenset(meta_stop_tokens) == {128001, 128008, 128009}


def test_llama3_without_template_or_config_ends_on_eos_only(llama3_tokenizer) -> None:
    assert end_of_generation_ids(llama3_tokenizer, generation_config=None, template_text=None) == {128001}


def test_smollm2_chatml_ends_on_im_end(smollm2_tokenizer) -> None:
    tokenizer = smollm2_tokenizer
    assert tokenizer.token_to_id("<|im_end|>") == tokenizer.eos_id == 2
    ids = end_of_generation_ids(tokenizer, generation_config={}, template_text=BUILTIN_TEMPLATES["chatml"])
    assert ids == {2}


def test_union_of_eos_generation_config_and_template_tokens() -> None:
    ids = end_of_generation_ids(
        SmallTokenizer(), generation_config={"eos_token_id": 7}, template_text="{{ '<|im_end|>' }}<end_of_turn>"
    )
    assert ids == {1, 5, 7}  # <end_of_turn> is not in the vocabulary


def test_override_replaces_and_extra_extends() -> None:
    tokenizer = SmallTokenizer()
    template = BUILTIN_TEMPLATES["chatml"]
    assert end_of_generation_ids(tokenizer, generation_config=None, template_text=template, override=[3]) == {3}
    assert end_of_generation_ids(tokenizer, generation_config=None, template_text=template, extra=[9]) == {1, 5, 9}
    assert end_of_generation_ids(
        tokenizer, generation_config=None, template_text=template, override=(), extra=[np.int64(4)]
    ) == {4}


def test_no_eos_anywhere_gives_an_empty_set() -> None:
    tokenizer = SmallTokenizer(eos_id=None)
    assert end_of_generation_ids(tokenizer, generation_config={"eos_token_id": None}, template_text="") == set()


@pytest.mark.parametrize(
    "kwargs, source",
    [
        ({"generation_config": {"eos_token_id": 10}}, "generation_config.eos_token_id"),
        ({"generation_config": {"eos_token_id": "</s>"}}, "generation_config.eos_token_id"),
        ({"generation_config": {"eos_token_id": [1, 2.0]}}, "generation_config.eos_token_id"),
        ({"generation_config": None, "override": [-1]}, "override"),
        ({"generation_config": None, "extra": [True]}, "extra"),
    ],
)
def test_bad_ids_are_rejected(kwargs: dict, source: str) -> None:
    with pytest.raises(ValueError, match=f"^{source}: .* is not a token id"):
        end_of_generation_ids(SmallTokenizer(), template_text=None, **kwargs)


def test_load_generation_config(tmp_path: pathlib.Path) -> None:
    assert load_generation_config(tmp_path) == {}
    (tmp_path / "generation_config.json").write_text(json.dumps(LLAMA31_GENERATION_CONFIG), encoding="utf-8")
    assert load_generation_config(tmp_path) == LLAMA31_GENERATION_CONFIG
    assert load_generation_config(tmp_path / "generation_config.json") == LLAMA31_GENERATION_CONFIG


@pytest.mark.parametrize("text, error", [("{", "invalid JSON"), ("[1]", "expected a JSON object")])
def test_load_generation_config_rejects_bad_files(tmp_path: pathlib.Path, text: str, error: str) -> None:
    (tmp_path / "generation_config.json").write_text(text, encoding="utf-8")
    with pytest.raises(ValueError, match=error):
        load_generation_config(tmp_path)
