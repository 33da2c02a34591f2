"""The real SmolLM2-135M-Instruct (Q4_1 GGUF): converted to float32, its logits equal transformers' on the same GGUF;
as converted by default (its Q4_1 weights requantized to Q8_0 blocks), they stay close."""

import jax.numpy as jnp
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


def _batch(prompts):
    """The prompts as one batch, zeros after the shorter ones (a position's logits see only the tokens before it), for
    `sequence_logits` called as it is: its one-layer program, compiled for this shape once, runs each of the 30
    layers (jitted whole, the model would compile as 30 layers, and again for each prompt's length)."""
    n = max(map(len, prompts))
    return jnp.asarray([p + [0] * (n - len(p)) for p in prompts])


def _log_softmax(x):
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


@pytest.mark.slow
def test_logits_match_transformers(smollm2_float32_checkpoint, transformers_smollm2):
    config, params = load_checkpoint(smollm2_float32_checkpoint)
    assert (config.n_layers, config.dim, config.n_heads, config.n_kv_heads, config.tie_embeddings) == (
        30,
        576,
        9,
        3,
        True,
    )
    logits = np.asarray(sequence_logits(params, config, _batch(PROMPTS)))
    for prompt, ours in zip(PROMPTS, logits, strict=True):
        ours = ours[: len(prompt)]
        with torch.no_grad():
            ref = transformers_smollm2(torch.tensor([prompt])).logits[0].numpy()
        np.testing.assert_allclose(ours, ref, atol=2e-3, rtol=1e-4)
        assert (ours.argmax(-1) == ref.argmax(-1)).all()


@pytest.mark.slow
def test_the_default_conversion_stays_close_to_transformers(smollm2_checkpoint, transformers_smollm2):
    """Q4_1 -> Q8_0 moves each weight by ~0.6% of its norm: the next-token distributions stay within a KL divergence
    of 0.05 nats of the file's own (requantizing to Q4_0 instead would add as much error again as Q4_1 has)."""
    config, params = load_checkpoint(smollm2_checkpoint)
    assert {form for _, form in config.stored_as} == {"q8_0"} and len(config.stored_as) == 1 + 7 * config.n_layers
    logits = np.asarray(sequence_logits(params, config, _batch(PROMPTS)))
    for prompt, ours in zip(PROMPTS, logits, strict=True):
        ours = _log_softmax(ours[: len(prompt)])
        with torch.no_grad():
            ref = _log_softmax(transformers_smollm2(torch.tensor([prompt])).logits[0].numpy())
        kl = (np.exp(ref) * (ref - ours)).sum(-1)
        assert kl.max() < 0.05
        assert (ours.argmax(-1) == ref.argmax(-1)).mean() > 0.85


@pytest.mark.slow
def test_greedy_tokens_through_the_paged_cache_are_the_cpu_kernels(smollm2_float32_checkpoint):
    """The real model through XLA's paged cache (`core/paged_kv.py`, pages of 16) gives the greedy tokens the CPU
    kernels' contiguous cache gives, each prompt alone and the three together, the third reusing the pages of a
    first run's prefix; and so do an accelerator's operations (a GPU's: pages of 64, wq and wk reordered for rotary
    halves, the feed-forward's gate behind a barrier; heads of 64 take XLA's attention, not its kernel)."""
    import jax

    from jaxllama.backends.pallas import GpuOps
    from jaxllama.core.sharding import make_mesh
    from jaxllama.engine.engine import Engine
    from jaxllama.engine.request import Request, SamplingParams

    config, params = load_checkpoint(smollm2_float32_checkpoint)
    mesh = make_mesh(config, "data=1,model=1", jax.devices()[:1])

    def greedy(engine, prompts):
        tokens = {}
        requests = [Request(i, p, SamplingParams(max_tokens=12, temperature=0.0)) for i, p in enumerate(prompts)]
        for u in engine.generate(requests):
            tokens.setdefault(u.id, []).extend(u.tokens)
        return [tokens[i] for i in range(len(prompts))]

    kernels = Engine(config, params, mesh, max_slots=4)
    paged = Engine(config, params, mesh, max_slots=4, cpu_kernels=False, page_size=16)
    assert paged.runner.pages is not None and kernels.runner.pages is None
    together = greedy(kernels, PROMPTS)
    assert [greedy(paged, [p])[0] for p in PROMPTS] == together
    assert greedy(paged, PROMPTS) == together
    assert paged.stats.cached_tokens >= 16  # the third prompt's 21 tokens held from its run alone: a page reused
    accelerator = Engine(config, params, mesh, max_slots=4, ops=GpuOps(interpret=True))
    assert accelerator.runner.pages is not None
    assert greedy(accelerator, PROMPTS) == together
