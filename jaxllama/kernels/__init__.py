"""Hand-written CPU kernels for what XLA:CPU runs poorly, built on first use with the system's C++ compiler and
called from jitted code through XLA's FFI. They depend on nothing else in jaxllama; `core` calls them when the
engine says they are loaded, and keeps XLA's own version otherwise."""
