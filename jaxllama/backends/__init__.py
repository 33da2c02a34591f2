"""Backends: the implementations of the model's operations (`jaxllama.core.ops.Ops`), chosen once at load.

XLA's operations (`core/ops.py`) are the reference and run everywhere: GPU, TPU, a mesh of CPU devices. On one CPU
device with float32, bfloat16 or block weights, the hand-written kernels of `cpu/` run the products, attention and
greedy sampling instead, where a C++ compiler builds them. On a TPU or GPU, Pallas kernels run a decode step's attention
over a paged cache (`pallas.py`: on a TPU this project's `paged_attention.py`, on a GPU jax's). Nothing outside this
package imports a kernel.
"""

from __future__ import annotations

from pathlib import Path

import jax.numpy as jnp
from jax.sharding import Mesh

from jaxllama.backends.cpu import library, matmul
from jaxllama.backends.cpu.ops import CpuOps
from jaxllama.backends.pallas import GpuOps, TpuOps
from jaxllama.core.blocks import FORMATS
from jaxllama.core.ops import ACCELERATOR, XLA, Ops
from jaxllama.errors import InvalidOption

__all__ = ["QUANTIZATIONS", "check_quantization", "choose", "int8_at_load"]

# "int8": XLA's products on int8 weights with a scale per output channel (`core/int8_weights.py`: for accelerators);
# the others are the CPU kernels' (`cpu/matmul.py`).
QUANTIZATIONS = ("int8", *matmul.QUANTIZATIONS)


def check_quantization(name: str | None) -> None:
    """Raise InvalidOption unless name is None (weights as stored) or one of QUANTIZATIONS."""
    if name is not None and name not in QUANTIZATIONS:
        raise InvalidOption("quantize", name, f"expected one of {', '.join(QUANTIZATIONS)} or None")


ACCELERATORS = {"tpu": TpuOps, "gpu": GpuOps}


def int8_at_load(form: str, platform: str, quantize: str | None) -> bool:
    """Whether XLA's products read int8 weights made at load from weights stored in `form` (a dtype name or a block
    format) on `platform`: asked for (`quantize="int8"`), or blocks on an accelerator, where multiplied by their scales
    inside every product they cost a TPU ~13x the product's own cycles (`jaxllama compile`)."""
    return quantize == "int8" or (form in FORMATS and platform in ACCELERATORS)


def choose(mesh: Mesh, dtype, kernel_dir: Path, *, cpu_kernels: bool = True, quantize: str | None = None) -> Ops:
    """The operations to run weights stored as `dtype` on mesh with: the CPU kernels (built into `kernel_dir` once
    per machine) on one CPU device with float32 or bfloat16 weights or weights stored as blocks (`dtype` a Blocks
    format, "q8_0" or "q4_0"), unless `cpu_kernels` is False or `JAXLLAMA_CPU_KERNELS=0`, else XLA's (on a TPU or GPU
    with blocks requantized as int8 weights). `quantize` (one of QUANTIZATIONS) needs the CPU kernels, but for
    "int8": ValueError where they are not used."""
    check_quantization(quantize)
    name = dtype if dtype in FORMATS else jnp.dtype(dtype).name
    readable = name in ("float32", "bfloat16", *FORMATS)
    platform = mesh.devices.flat[0].platform  # the mesh's, not the host's: a mesh may be of devices elsewhere
    if int8_at_load(name, platform, quantize):
        if platform in ACCELERATORS:
            return ACCELERATORS[platform](int8_weights=True)
        return Ops(float32_products=platform != "cpu", int8_weights=True)
    usable = cpu_kernels and platform == "cpu" and mesh.size == 1 and readable
    if usable and library.load(kernel_dir):
        return CpuOps(quantize)
    if quantize is not None:
        raise ValueError(
            f"quantize={quantize!r} runs through the CPU kernels: one CPU device, float32, bfloat16 or block "
            f"weights (here: {platform}, {mesh.size} device(s), {name})"
        )
    return {"cpu": XLA, "tpu": TpuOps(), "gpu": GpuOps()}.get(platform, ACCELERATOR)
