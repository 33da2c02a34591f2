"""Backends: the implementations of the model's operations (`jaxllama.core.ops.Ops`), chosen once at load.

XLA's operations (`core/ops.py`) are the reference and run everywhere: GPU, TPU, a mesh of CPU devices. On one CPU
device with float32 weights, the hand-written kernels of `cpu/` run the products, attention and greedy sampling
instead, where a C++ compiler builds them. Nothing outside this package imports a kernel.
"""

from __future__ import annotations

from pathlib import Path

import jax
import numpy as np
from jax.sharding import Mesh

from jaxllama.backends.cpu import library
from jaxllama.backends.cpu.matmul import QUANTIZATIONS, check_quantization
from jaxllama.backends.cpu.ops import CpuOps
from jaxllama.core.ops import XLA, Ops

__all__ = ["QUANTIZATIONS", "check_quantization", "choose"]


def choose(mesh: Mesh, dtype, kernel_dir: Path, *, cpu_kernels: bool = True, quantize: str | None = None) -> Ops:
    """The operations to run weights of `dtype` on mesh with: the CPU kernels (built into `kernel_dir` once per
    machine) on one CPU device with float32 weights unless `cpu_kernels` is False or `JAXLLAMA_CPU_KERNELS=0`, else
    XLA's. `quantize` (one of QUANTIZATIONS) needs the CPU kernels: ValueError where they are not used."""
    check_quantization(quantize)
    float32 = np.dtype(dtype) == np.float32
    usable = cpu_kernels and jax.default_backend() == "cpu" and mesh.size == 1 and float32
    if usable and library.load(kernel_dir):
        return CpuOps(quantize)
    if quantize is not None:
        raise ValueError(
            f"quantize={quantize!r} runs through the CPU kernels: one CPU device, float32 weights "
            f"(here: {jax.default_backend()}, {mesh.size} device(s), {np.dtype(dtype).name})"
        )
    return XLA
