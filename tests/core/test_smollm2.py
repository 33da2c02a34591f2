"""The real SmolLM2-135M-Instruct (Q4_1 GGUF): converted logits equal transformers' on the same GGUF."""

import jax
import numpy as np
import pytest
import torch

from jaxllama.core.checkpoint import load_checkpoint
from jaxllama.core.model import sequence_logits

PROMPTS = [
    [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173],
    [504, 3458, 282, 4990, 314],
    [28, 253, 1345, 30, 1345, 30, 1345, 30, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29],
]


@pytest.fixture(scope="module")
def transformers_model(smollm2_path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        smollm2_path.parent, gguf_file=smollm2_path.name, dtype=torch.float32
    ).eval()


def test_logits_match_transformers(smollm2_checkpoint, transformers_model):
    config, params = load_checkpoint(smollm2_checkpoint)
    assert (config.n_layers, config.dim, config.n_heads, config.n_kv_heads, config.tie_embeddings) == (
        30,
        576,
        9,
        3,
        True,
    )
    f = jax.jit(sequence_logits, static_argnums=1)
    for prompt in PROMPTS:
        ours = np.asarray(f(params, config, np.array([prompt])))[0]
        with torch.no_grad():
            ref = transformers_model(torch.tensor([prompt])).logits[0].numpy()
        np.testing.assert_allclose(ours, ref, atol=2e-3, rtol=1e-4)
        assert (ours.argmax(-1) == ref.argmax(-1)).all()
