"""jaxllama: run Llama-family models in JAX.

Layers, each importing only from the ones above it in this list:

- ``jaxllama.errors`` the kinds of bad request, one class each (imports nothing);
- ``jaxllama.core``   config, model (written in an ``Ops`` value's operations: XLA's), parameter layout, sharding,
  checkpoints (jax, no text, no I/O but checkpoint files);
- ``jaxllama.backends`` other implementations of the model's operations, chosen once at load: ``cpu/``, the CPU
  kernels (builds on core; nothing else imports a kernel);
- ``jaxllama.text``   tokenizers, chat templates, end-of-generation ids, stop strings (plain Python, no jax);
- ``jaxllama.engine`` the model runner (KV cache, sampling, compiled prefill/decode programs) and the scheduler
  (continuous batching, plain Python), joined by ``Engine`` (builds on core and backends);
- ``jaxllama.llm``, ``jaxllama.batch``, ``jaxllama.server``  user-facing APIs (engine + text), with
  ``jaxllama.protocol``, the OpenAI request and response shapes the batch runner and the server share;
- ``jaxllama.cli``    the ``jaxllama`` command.

Heavy imports (jax) happen lazily so that ``jaxllama.text`` stays importable without them.
"""

__version__ = "0.1.0"

_LAZY = {
    "LLM": ("jaxllama.llm", "LLM"),
    "load_checkpoint": ("jaxllama.core.checkpoint", "load_checkpoint"),
    "ModelConfig": ("jaxllama.core.config", "ModelConfig"),
}

__all__ = sorted(_LAZY)


def __getattr__(name):
    if name in _LAZY:
        import importlib

        module, attr = _LAZY[name]
        return getattr(importlib.import_module(module), attr)
    raise AttributeError(f"module 'jaxllama' has no attribute {name!r}")
