"""`LLM.logits` refuses what the model would silently compute garbage for (ids outside the vocabulary read another
row or NaN; a row past the context grows attention without bound) with a ValueError naming the problem."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from jaxllama import LLM
from jaxllama.backends.cpu.matmul import Packed
from jaxllama.backends.cpu.ops import CpuOps
from jaxllama.errors import ContextLengthExceeded, InvalidParameter, InvalidRequest


@pytest.fixture(scope="module")
def llm(tiny_chat_checkpoint):
    return LLM.load(tiny_chat_checkpoint, max_slots=1, compilation_cache=False)  # the session's cache is already on


# Each case: the batch (from the vocabulary size and the context), the error, and what its message says (a regex,
# formatted with `vocab` and `context`).
BAD_BATCHES = {
    "id = vocab size": (lambda vocab, context: [[1, vocab]], InvalidParameter, r"token_ids\[0\]\[1\] = {vocab}: not"),
    "negative id": (lambda vocab, context: [[1], [2, -1]], InvalidParameter, r"token_ids\[1\]\[1\] = -1: not"),
    "huge id": (lambda vocab, context: [[2**70]], InvalidParameter, r"token_ids\[0\]\[0\] = 1180591620717411303424"),
    "numpy id past the vocabulary": (lambda vocab, context: np.array([[vocab + 5]]), InvalidParameter, "not a token"),
    "float ids": (lambda vocab, context: [[1.0, 2.0]], InvalidParameter, r"token_ids\[0\]: token ids must be integers"),
    "bool ids": (lambda vocab, context: [[True]], InvalidParameter, "must be integers"),
    "longer than the context": (
        lambda vocab, context: [[1] * (context + 1)],
        ContextLengthExceeded,
        "context of {context}",
    ),
    "empty row": (lambda vocab, context: [[1], []], InvalidRequest, r"token_ids\[1\]: the sequence is empty"),
    "empty batch": (lambda vocab, context: [], InvalidRequest, "token_ids: the batch is empty"),
    "flat list": (lambda vocab, context: [1, 2], InvalidRequest, r"token_ids\[0\]: expected a list of token ids"),
    "string": (lambda vocab, context: "hello", InvalidRequest, "expected a list of token id lists"),
}


@pytest.mark.parametrize("case", BAD_BATCHES)
def test_logits_refuse_what_the_model_cannot_compute(llm, case):
    batch, error, message = BAD_BATCHES[case]
    sizes = {"vocab": llm.config.vocab_size, "context": llm.config.max_seq_len}
    with pytest.raises(error, match=message.format(**sizes)) as e:
        llm.logits(batch(**sizes))
    assert isinstance(e.value, ValueError)


def test_logits_of_rows_of_any_length(llm):
    out = llm.logits([np.array([1, 2, 3], np.int64), [4]])
    assert out.shape == (2, 3, llm.config.vocab_size) and out.dtype == np.float32
    assert np.isfinite(out[0]).all() and np.isfinite(out[1, 0]).all() and np.isnan(out[1, 1:]).all()
    np.testing.assert_allclose(out[1, 0], llm.logits([[4]])[0, 0], rtol=1e-5, atol=1e-5)


def test_cpu_kernels_false_runs_xlas_own_operations_with_the_same_logits(tiny_chat_checkpoint, cpu_kernels):
    """`LLM.load(..., cpu_kernels=False)` (an EngineOptions field) loads the weights for XLA's operations, not the
    kernels' packed panels, and reads a text as the kernels do."""
    assert cpu_kernels
    one = {"mesh": "data=1,model=1", "max_slots": 1, "compilation_cache": False}
    kernels, xla = LLM.load(tiny_chat_checkpoint, **one), LLM.load(tiny_chat_checkpoint, **one, cpu_kernels=False)
    assert isinstance(kernels.engine.ops, CpuOps) and not isinstance(xla.engine.ops, CpuOps)
    packed = [x for x in jax.tree.leaves(xla.params, is_leaf=lambda x: isinstance(x, Packed)) if isinstance(x, Packed)]
    assert not packed
    tokens = [[1, 5, 9, 2, 7]]
    np.testing.assert_allclose(xla.logits(tokens), kernels.logits(tokens), rtol=2e-3, atol=2e-3)
