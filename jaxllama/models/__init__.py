"""The model families jaxllama runs, as a registry: one file per family (`llama.py`, `qwen2.py`, `qwen3.py`,
`mixtral.py`), each declaring its parameters once (`family.py`), found by `ModelConfig.family`, by a Hugging Face
config's `architectures`, or by a GGUF file's `general.architecture` (and whether it has experts)."""

from __future__ import annotations

import functools

from jaxllama.core.config import ModelConfig
from jaxllama.models.family import Declared, Family
from jaxllama.models.llama import LLAMA
from jaxllama.models.mixtral import MIXTRAL
from jaxllama.models.qwen2 import QWEN2
from jaxllama.models.qwen3 import QWEN3

FAMILIES: dict[str, Family] = {f.name: f for f in (LLAMA, QWEN2, QWEN3, MIXTRAL)}

__all__ = ["FAMILIES", "Declared", "Family", "declarations", "declared", "family_of", "for_gguf", "for_hf"]


def family_of(config: ModelConfig) -> Family:
    return FAMILIES[config.family]  # ModelConfig refuses a family not in FAMILIES


@functools.lru_cache(maxsize=16)
def declarations(config: ModelConfig) -> dict[str, Declared]:
    """Every parameter of a model of config `config` (`Family.declarations`; one dict per config: not to be
    changed)."""
    return family_of(config).declarations(config)


def declared(config: ModelConfig, name: str) -> Declared | None:
    """One parameter's declaration (`Family.declared`)."""
    return family_of(config).declared(config, name)


def for_hf(architecture: str | None, model_type: str | None) -> Family | None:
    """The family of a Hugging Face config.json's first `architectures` entry (or, without one, its `model_type`)."""
    for family in FAMILIES.values():
        if architecture in family.hf_architectures or (architecture is None and model_type in family.hf_model_types):
            return family
    return None


def for_gguf(architecture: str | None, n_experts: int = 0) -> Family | None:
    """The family of a GGUF file's `general.architecture`, with or without experts (`{arch}.expert_count`)."""
    found = (f for f in FAMILIES.values() if f.gguf_architecture == architecture and f.experts == bool(n_experts))
    return next(found, None)


def hf_architectures() -> tuple[str, ...]:
    return tuple(a for f in FAMILIES.values() for a in f.hf_architectures)
