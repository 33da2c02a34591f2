"""Hand-written CPU kernels for what XLA:CPU runs poorly, built on first use with the system's C++ compiler and
called from jitted code through XLA's FFI. They depend on nothing else in jaxllama; `core` (products, decode
attention) and the engine's sampler (greedy row statistics) call them when the engine says they are loaded, and keep
XLA's own version otherwise."""
