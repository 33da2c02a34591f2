"""Tiny random models, prompts, requests and the full-forward oracle shared by the engine and kernel tests."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jaxllama.core.config import ModelConfig
from jaxllama.core.model import sequence_logits
from jaxllama.core.params import init_params
from jaxllama.engine.request import Request, SamplingParams

EOS = 2


def tiny_config(**kw) -> ModelConfig:
    base = dict(vocab_size=131, dim=64, n_layers=3, n_heads=8, n_kv_heads=2, ffn_dim=96, max_seq_len=128)
    return ModelConfig(**{**base, **kw})


def pairs_config() -> ModelConfig:
    """`tiny_config` with heads of 16 dims: where the CPU kernels compute attention over a bfloat16 cache in bfloat16
    pairs (`library.attends_in_bfloat16`); `tiny_config`'s 8 fall back to float32."""
    return tiny_config(n_heads=4)


def spread_params(config: ModelConfig, seed: int = 0):
    """Random weights scaled up so that logits are far apart: greedy choices are not near-ties. A tied model gets the
    untied model's weights but the output layer: XLA compiles each configuration's initializer once per session, for
    several seconds."""
    params = init_params(dataclasses.replace(config, tie_embeddings=False), jax.random.key(seed))
    if config.tie_embeddings:
        params = {name: value for name, value in params.items() if name != "output"}
    return jax.tree.map(lambda x: x * 5 if x.ndim > 1 else x, params)


def random_prompts(n: int, seed: int = 0, vocab: int = 131, max_len: int = 40) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, vocab, size=int(rng.integers(1, max_len))).tolist() for _ in range(n)]


forward = jax.jit(sequence_logits, static_argnums=1)  # logits [batch, positions, vocab]


def reference_greedy(config, params, prompt, max_tokens, eos=(EOS,), limit=None):
    """Token by token with the full-sequence forward: the oracle for greedy decoding. Sequences are padded
    to the context length (causal attention ignores what follows), so that this compiles once."""
    seq, out = list(prompt), []
    limit = limit or config.max_seq_len
    while len(out) < max_tokens and len(seq) < limit:
        padded = np.zeros((1, config.max_seq_len), np.int32)
        padded[0, : len(seq)] = seq
        token = int(np.argmax(np.asarray(forward(params, config, jnp.asarray(padded)))[0, len(seq) - 1]))
        out.append(token)
        seq.append(token)
        if token in eos:
            break
    return out


def run(engine, requests):
    tokens, finals = {}, {}
    for u in engine.generate(requests):
        tokens.setdefault(u.id, []).extend(u.tokens)
        if u.finish_reason:
            finals[u.id] = u
    return tokens, finals


def greedy_requests(n=10, seed=0):
    rng = np.random.default_rng(seed + 1)
    return [
        Request(i, p, SamplingParams(max_tokens=int(rng.integers(1, 30)), temperature=0.0))
        for i, p in enumerate(random_prompts(n, seed))
    ]


def greedy_request(i, prompt, max_tokens=12):
    return Request(i, prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0))


def token_logprobs(engine, request):
    """The log-probabilities of the tokens `request` gets, the engine run on it alone."""
    return [lp for u in engine.generate([request]) for lp in u.logprobs]
