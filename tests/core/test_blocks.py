"""Blocks (Q8_0 / Q4_0 weights as stored) against the gguf library's own quantizer and dequantizer."""

import numpy as np
import pytest
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize

from jaxllama.core.blocks import Blocks, dequantize, from_gguf

TYPES = {"q8_0": GGMLQuantizationType.Q8_0, "q4_0": GGMLQuantizationType.Q4_0}


@pytest.mark.parametrize("format", sorted(TYPES))
@pytest.mark.parametrize("shape, in_dims", [((8, 96), 1), ((6, 3, 64), 2), ((2, 4, 32), 1)])
def test_dequantize_matches_gguf(format, shape, in_dims):
    w = np.random.default_rng(0).normal(size=shape).astype(np.float32)
    n_out = int(np.prod(shape[: len(shape) - in_dims]))
    raw = gguf_quantize(w.reshape(n_out, -1), TYPES[format])
    expected = gguf_dequantize(raw, TYPES[format]).reshape(shape)
    blocks = from_gguf(raw, format, shape, in_dims)
    assert isinstance(blocks, Blocks) and blocks.shape == shape
    assert blocks.nbytes == raw.nbytes
    np.testing.assert_array_equal(np.asarray(dequantize(blocks)), expected)


def test_inputs_not_whole_blocks_refused():
    with pytest.raises(ValueError, match="multiple of 32"):
        from_gguf(np.zeros((4, 34), np.uint8), "q8_0", (4, 40))
