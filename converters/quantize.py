"""Weights quantized into blocks (`jaxllama.core.blocks`) at conversion, and which form each source tensor keeps.

`quantize` is gguf's own quantizer (`gguf.quants.quantize`, bit-exact with llama.cpp's reference `quantize_row_*`),
run on a few rows at a time so that quantizing a large embedding holds little beside it.

GGUF tensors in a block type jaxllama has no products for are requantized once, at conversion, to `NEAREST`: q8_0
for every one of them. Measured on SmolLM2-135M's Q4_1 layers, requantizing the Q4_1 weights to Q8_0 moves them by
0.56% (relative L2 error, mean over the layers; at most 0.65%), to Q4_0 by 8.8%: as much again as 4-bit
quantization costs in the first place. Q8_0 keeps what the file holds; `--quantize q4_0` trades it for size.
"""

from __future__ import annotations

import gguf
import numpy as np

from jaxllama.core.blocks import BLOCK, Blocks, from_gguf

_TYPES = {"q8_0": gguf.GGMLQuantizationType.Q8_0, "q4_0": gguf.GGMLQuantizationType.Q4_0}
NATIVE = {qtype: name for name, qtype in _TYPES.items()}  # GGUF block types kept as they are
NEAREST = "q8_0"  # what every other block type becomes (see the module's docstring)
# Elements quantized per call: a few float32 temporaries of this many elements are held beside the tensor.
CHUNK = 1 << 22


def quantize(w: np.ndarray, format: str, in_dims: int = 1) -> Blocks:
    """w [*out, *in] (the last `in_dims` dims are inputs; any float dtype) as Blocks of `format`."""
    n_in = int(np.prod(w.shape[w.ndim - in_dims :]))
    if n_in % BLOCK:
        raise ValueError(f"a weight of shape {w.shape} has {n_in} inputs, not a multiple of {BLOCK}")
    rows = w.reshape(-1, n_in)
    step = max(1, CHUNK // n_in)
    raw = np.empty((rows.shape[0], n_in // BLOCK * (gguf.GGML_QUANT_SIZES[_TYPES[format]][1])), np.uint8)
    for start in range(0, rows.shape[0], step):
        chunk = np.asarray(rows[start : start + step], dtype=np.float32)
        raw[start : start + step] = gguf.quants.quantize(chunk, _TYPES[format])
    return from_gguf(raw, format, w.shape, in_dims)


def gguf_form(qtype: gguf.GGMLQuantizationType, can_be_blocks: bool) -> str:
    """The form a GGUF tensor of type `qtype` is stored in when no dtype is asked for: native blocks as they are,
    other block types as NEAREST, F16 and BF16 as bfloat16, anything else (F32, F64) as float32. A tensor that cannot
    be blocks (a norm) is float32 whatever its type."""
    if not can_be_blocks:
        return "float32"
    if qtype in (gguf.GGMLQuantizationType.F16, gguf.GGMLQuantizationType.BF16):
        return "bfloat16"
    if qtype in NATIVE:
        return NATIVE[qtype]
    return NEAREST if qtype in gguf.GGML_QUANT_SIZES and gguf.GGML_QUANT_SIZES[qtype][0] > 1 else "float32"
