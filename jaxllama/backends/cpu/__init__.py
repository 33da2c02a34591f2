"""The CPU backend: hand-written kernels for what XLA:CPU runs poorly (products on weights packed once, float32 or
int8; attention over the KV cache; greedy row statistics), built on first use with the system's C++ compiler
(`library.py`) and called from jitted code through XLA's FFI, and `CpuOps` (`ops.py`), the model's operations that
call them. `jaxllama.backends.choose` picks it; nothing outside `jaxllama.backends` imports it."""
