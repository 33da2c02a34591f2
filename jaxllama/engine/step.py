"""The engine's jitted core, pure functions over a `DecodeState` pytree (donated and returned):

- `prefill`: run new prompts (or the part of them past a prefix another slot holds), sample their first
  tokens and insert them into free decode slots;
- `decode`: advance every slot (or the given ones) by `n_steps` tokens, checking end of generation on device.

Shapes are static per call: prompts padded to a length bucket and a row-count bucket, the cache to a
length bucket (`kvcache.py`), so the number of compilations stays small and bounded.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxllama.core.config import ModelConfig
from jaxllama.core.model import KVCache, forward
from jaxllama.engine.sampling import SamplerFlags, SamplingRows, sample


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class DecodeState:
    """Everything the decode loop carries, per slot; [s] = [slots]."""

    cache: KVCache
    tokens: jax.Array  # [s] int32: the next input token (last one sampled)
    positions: jax.Array  # [s] int32: its position
    active: jax.Array  # [s] bool: still generating
    remaining: jax.Array  # [s] int32: tokens it may still sample
    limit: jax.Array  # [s] int32: context limit (prompt + generated tokens)
    step: jax.Array  # [s] int32: tokens sampled so far (folds into the random key)
    stop_ids: jax.Array  # [s, e] int32: end-of-generation ids, padded with -1
    rows: SamplingRows  # [s] sampling parameters
    counts: jax.Array  # [s, vocab] int32: generated-token counts (penalties)
    seen: jax.Array  # [s, vocab] bool: prompt or generated tokens (repetition penalty)


def _advance(state: DecodeState, tokens, logprobs, was_active):
    """Record sampled tokens [s] for the rows that were active; decide which rows are done."""
    tokens = jnp.where(was_active, tokens, state.tokens)
    hit_stop = jnp.any(tokens[:, None] == state.stop_ids, axis=-1)
    remaining = state.remaining - was_active
    positions = jnp.where(was_active, state.positions + 1, state.positions)
    done = hit_stop | (remaining <= 0) | (positions + 1 >= state.limit)
    rows = jnp.arange(tokens.shape[0])
    return dataclasses.replace(
        state,
        tokens=tokens,
        positions=positions,
        remaining=remaining,
        active=was_active & ~done,
        step=state.step + was_active,
        counts=state.counts.at[rows, tokens].add(was_active.astype(jnp.int32)),
        seen=state.seen.at[rows, tokens].max(was_active),
    )


def decode(params, state: DecodeState, keep, slots=None, *, config: ModelConfig, n_steps: int, flags: SamplerFlags):
    """n_steps decode steps. keep [s] bool: false cancels a slot first. slots [b] int32 (optional): run only
    these slots (an index >= s pads the batch), so that a few active sequences do not pay for all s rows.

    Returns (state, tokens [n_steps, b], logprobs [n_steps, b], emitted [n_steps, b] bool), where b = s
    without `slots`.
    """
    state = dataclasses.replace(state, active=state.active & keep)
    rows = state if slots is None else _gather(state, slots)

    def one(carry, _):
        rows, cache = carry
        logits, cache = forward(
            params,
            config,
            rows.tokens[:, None],
            rows.positions[:, None],
            cache,
            logits_at=jnp.zeros_like(rows.tokens),
            rows=slots,
        )
        tokens, logprobs = sample(logits, rows.rows, rows.step, flags, rows.counts, rows.seen)
        was_active = rows.active
        return (_advance(rows, tokens, logprobs, was_active), cache), (tokens, logprobs, was_active)

    carry = (dataclasses.replace(rows, cache=[]), state.cache)
    if n_steps == 1:
        carry, out = one(carry, None)
        out = tuple(x[None] for x in out)
    else:
        carry, out = jax.lax.scan(one, carry, None, length=n_steps)
    rows, cache = carry
    state = rows if slots is None else _scatter(state, rows, slots)
    return dataclasses.replace(state, cache=cache), *out


def _gather(state: DecodeState, slots) -> DecodeState:
    """The per-slot fields of `slots` (padding indices >= s come back inactive); the cache stays whole."""
    rows = jax.tree.map(lambda x: jnp.take(x, slots, axis=0, mode="clip"), dataclasses.replace(state, cache=[]))
    return dataclasses.replace(rows, active=rows.active & (slots < state.active.shape[0]))


def _scatter(state: DecodeState, rows: DecodeState, slots) -> DecodeState:
    """`state` with the per-slot fields of `slots` replaced by `rows` (padding indices write nothing)."""
    fields = jax.tree.map(
        lambda big, small: big.at[slots].set(small.astype(big.dtype), mode="drop"),
        dataclasses.replace(state, cache=[]),
        dataclasses.replace(rows, cache=[]),
    )
    return dataclasses.replace(fields, cache=state.cache)


def prefill(
    params,
    state: DecodeState,
    tokens,
    starts,
    lengths,
    sources,
    slots,
    seen,
    new_rows: SamplingRows,
    max_tokens,
    limits,
    stop_ids,
    *,
    config: ModelConfig,
    flags: SamplerFlags,
    span: int,
):
    """Run prompts and put them in decode slots.

    Row i computes prompt tokens [starts[i], starts[i] + lengths[i]) given in tokens [n, q] (padded): its
    first starts[i] positions come from the cache of slot sources[i], which holds the same prefix (prefix
    reuse; starts[i] = 0 for a fresh prompt). The row's cache (`span` positions) then lands in slot
    slots[i] (index >= slots: a padding row, dropped). seen [n, vocab]: the whole prompt's tokens, for the
    repetition penalty (or [n, 1] when no row uses penalties).

    Returns (state, first tokens [n], logprobs [n], active [n]: false when the first token already ended it).
    """
    n, q = tokens.shape
    cache = [
        (jnp.take(k[:, :, :span], sources, axis=0, mode="clip"), jnp.take(v[:, :, :span], sources, axis=0, mode="clip"))
        for k, v in state.cache
    ]
    positions = starts[:, None] + jnp.arange(q)[None, :]
    logits, cache = forward(params, config, tokens, positions, cache, logits_at=lengths - 1)

    vocab = state.counts.shape[1]
    if seen.shape[1] != vocab:
        seen = jnp.zeros((n, vocab), bool)
    zeros = jnp.zeros((n,), jnp.int32)
    first, logprobs = sample(logits, new_rows, zeros, flags, jnp.zeros((n, vocab), jnp.int32), seen)

    fresh = DecodeState(
        cache=[],
        tokens=jnp.full((n,), -1, jnp.int32),
        positions=starts + lengths - 1,
        active=jnp.ones((n,), bool),
        remaining=max_tokens,
        limit=limits,
        step=zeros,
        stop_ids=stop_ids,
        rows=new_rows,
        counts=jnp.zeros((n, vocab), jnp.int32),
        seen=seen,
    )
    # The first token is sampled as if from a decode step at the prompt's last position.
    fresh = _advance(fresh, first, logprobs, jnp.ones((n,), bool))

    if stop_ids.shape[1] != state.stop_ids.shape[1]:
        raise ValueError("stop_ids width mismatch")
    new_cache = [
        (
            k.at[slots, :, :span].set(nk.astype(k.dtype), mode="drop"),
            v.at[slots, :, :span].set(nv.astype(v.dtype), mode="drop"),
        )
        for (k, v), (nk, nv) in zip(state.cache, cache, strict=True)
    ]
    state = dataclasses.replace(_scatter(state, fresh, slots), cache=new_cache)
    return state, first, logprobs, fresh.active
