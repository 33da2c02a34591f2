"""The engine's jitted core: pure functions over the slots' `DecodeState` and KV cache (both donated and
returned).

A prefill or a decode step runs as a few programs in turn: `*_inputs` (embed), `*_layers` over each run of
`layers_per_program` consecutive layers (the same compiled program for every run of equal length), then
`*_outputs` (final norm, logits, sampling, slot bookkeeping). A program of a few layers compiles in a fraction of
the time a whole model takes and is compiled once for all runs of layers, for a few more dispatches a step.

- prefill: run new prompts (or the part of them past a prefix another slot holds), sample their first
  tokens and insert them into free decode slots;
- decode: advance every slot (or the given ones) by one token, checking end of generation on device.

Shapes are static per call: prompts padded to a length bucket and a row-count bucket, the cache to a
length bucket (`buckets.py`), so the number of compilations stays small and bounded. Every function takes the
backend's operations as `ops` (`jaxllama.core.ops`), a static argument.

Each row that ends reports why, as a FINISH code (`interface.py`): an end-of-generation token ("stop") or its
budget or the context ("length"); the host reads the reason, it does not work it out again.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxllama.core.config import ModelConfig
from jaxllama.core.model import KVCache, Mixed, Placement, embed, head, layers
from jaxllama.core.ops import XLA, Ops
from jaxllama.engine import buckets
from jaxllama.engine.interface import LENGTH, RUNNING, STOPPED
from jaxllama.engine.request import MAX_LOGPROBS
from jaxllama.engine.sampling import RowHistory, SamplerFlags, SamplingRows, sample


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class DecodeState:
    """Everything the decode loop carries per slot besides the KV cache; [s] = [slots]."""

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


def _advance(state: DecodeState, tokens, was_active, penalties: bool):
    """Record sampled tokens [s] for the rows that were active; decide which rows are done -> (state, finish [s]
    int32: a FINISH code, RUNNING for rows still going or not active). The token counts are kept only when some
    row uses `penalties`: a request's slot then gets them zeroed at its prefill and updated at every step while it
    runs, and no other slot's counts are ever read."""
    tokens = jnp.where(was_active, tokens, state.tokens)
    hit_stop = jnp.any(tokens[:, None] == state.stop_ids, axis=-1)
    remaining = state.remaining - was_active
    positions = jnp.where(was_active, state.positions + 1, state.positions)
    done = hit_stop | (remaining <= 0) | (positions + 1 >= state.limit)
    finish = jnp.where(was_active & done, jnp.where(hit_stop, STOPPED, LENGTH), RUNNING).astype(jnp.int32)
    rows = jnp.arange(tokens.shape[0])
    if penalties:
        state = dataclasses.replace(
            state,
            counts=state.counts.at[rows, tokens].add(was_active.astype(jnp.int32)),
            seen=state.seen.at[rows, tokens].max(was_active),
        )
    state = dataclasses.replace(
        state,
        tokens=tokens,
        positions=positions,
        remaining=remaining,
        active=was_active & ~done,
        step=state.step + was_active,
    )
    return state, finish


def decode_inputs(params, state: DecodeState, slots=None, *, config: ModelConfig):
    """A decode step's inputs: the next token of each row, embedded [b, 1, dim], and its `Placement` (its position
    [b, 1] with the position's rotary angles, computed here once for all the step's layer programs). slots [b] int32
    (optional): run only these slots (an index >= s pads the batch), so that a few active sequences do not pay for
    all s rows; each row then reads and writes its slot's row of the cache."""
    tokens, positions = state.tokens, state.positions
    if slots is not None:
        tokens, positions = (jnp.take(x, slots, axis=0, mode="clip") for x in (tokens, positions))
    return embed(params, tokens[:, None]), Placement.of(positions[:, None], config, rows=slots)


def step_layers(layer_params, x, at: Placement, cache: KVCache, *, config: ModelConfig, ops: Ops = XLA):
    """Some consecutive layers of a decode step, a packed prefill (each prompt token a row that reads and writes
    its slot's row of the cache) or any step over a paged cache (row i of x reads and writes the pages `at.pages[i]`
    names: the pool never changes shape, so a prefill's programs are compiled per rows x tokens x pages read, as a
    decode step's per rows x pages read)."""
    return layers(layer_params, config, x, at, cache, ops)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class StepRows:
    """The rows a decode step's outputs are for. keep [s] bool: false cancels a slot first. slots [b] int32: the
    slots the step ran (an index >= s pads), or None: every slot. mask [b, ceil(vocab / 32)] int32 (with
    `SamplerFlags.mask`): the tokens each row may draw (`sampling.apply_mask`), or None."""

    keep: jax.Array
    slots: jax.Array | None = None
    mask: jax.Array | None = None


def decode_outputs(
    params, state: DecodeState, x, rows: StepRows, *, config: ModelConfig, flags: SamplerFlags, ops: Ops = XLA
):
    """Finish a decode step from the last layer's output x [b, 1, dim]: sample a token per row and advance the
    rows' state, checking end of generation.

    Returns (state, tokens [b], logprobs [b], emitted [b] bool, finish [b]: FINISH codes, top: the rows'
    `sampling.top_logprobs` with `flags.top`, else None), where b = s without `rows.slots`.
    """
    state = dataclasses.replace(state, active=state.active & rows.keep)
    ran = state if rows.slots is None else _gather(state, rows.slots)
    logits = head(params, config, x[:, 0], ops=ops)
    history = RowHistory(ran.step, ran.stop_ids, ran.counts, ran.seen)
    tokens, logprobs, top = sample(logits, ran.rows, history, flags, ops, rows.mask)
    was_active = ran.active
    ran, finish = _advance(ran, tokens, was_active, flags.penalize)
    state = ran if rows.slots is None else _scatter(state, ran, rows.slots, flags.penalize)
    return state, tokens, logprobs, was_active, finish, top


def _gather(state: DecodeState, slots) -> DecodeState:
    """The fields of `slots` (padding indices >= s come back inactive)."""
    rows = jax.tree.map(lambda x: jnp.take(x, slots, axis=0, mode="clip"), state)
    return dataclasses.replace(rows, active=rows.active & (slots < state.active.shape[0]))


def _scatter(state: DecodeState, rows: DecodeState, slots, penalties: bool) -> DecodeState:
    """`state` with the fields of `slots` replaced by `rows` (padding indices write nothing); the token counts
    only with `penalties` (see `_advance`)."""
    kept = {} if penalties else {"counts": state.counts, "seen": state.seen}
    scattered_fields = (lambda s: s) if penalties else (lambda s: dataclasses.replace(s, counts=None, seen=None))
    new = jax.tree.map(
        lambda big, small: big.at[slots].set(small.astype(big.dtype), mode="drop"),
        scattered_fields(state),
        scattered_fields(rows),
    )
    return dataclasses.replace(new, **kept)


def prefill_inputs(params, tokens, starts, *, config: ModelConfig):
    """A prefill's inputs: prompt tokens [n, q] (padded) embedded [n, q, dim], and their `Placement`: positions
    [n, q] (row i starts at starts[i]) with their rotary angles."""
    positions = starts[:, None] + jnp.arange(tokens.shape[1])[None, :]
    return embed(params, tokens), Placement.of(positions, config)


def mixed_inputs(params, state: DecodeState, tokens, positions, slots, at, *, config: ModelConfig):
    """A packed prefill's inputs with a decode step's rows among them: prompt tokens [t] at positions [t] as the
    host packed them, where at [c] (an index >= t: none) the next token of slot slots[c] goes, at its position."""
    tokens = tokens.at[at].set(jnp.take(state.tokens, slots, mode="clip"), mode="drop")
    positions = positions.at[at].set(jnp.take(state.positions, slots, mode="clip"), mode="drop")
    return prefill_inputs(params, tokens[:, None], positions, config=config)


def mixed_step_inputs(params, state: DecodeState, tokens, starts, slots, *, config: ModelConfig):
    """A mixed step's inputs (`model.Mixed`): prompt rows tokens [r, t] (row i from position starts[i]) and the next
    token of each decode slot of `slots` [s] (an index >= s pads), embedded as one batch [1, r * t + s, dim], with
    the two parts' placements."""
    x_prompt, prompt = prefill_inputs(params, tokens, starts, config=config)
    x_decode, decode = decode_inputs(params, state, slots, config=config)
    flat = lambda x: x.reshape(1, -1, x.shape[-1])
    return jnp.concatenate([flat(x_prompt), flat(x_decode)], axis=1), Mixed(prompt, decode)


def mixed_step_parts(x, *, rows: int, tokens: int):
    """A mixed step's last layer output x [1, rows * tokens + s, dim] as its two parts: the prompt rows' [rows,
    tokens, dim] and the decode rows' [s, 1, dim]."""
    n = rows * tokens
    return x[0, :n].reshape(rows, tokens, x.shape[-1]), x[0, n:, None]


def prefill_layers(
    layer_params, x, at: Placement, rows: KVCache | None, *, config: ModelConfig, ops: Ops = XLA, cache_dtype=None
):
    """Some consecutive layers of a prefill (`at` from `prefill_inputs`), over the rows' own caches: `rows` per
    layer holds, for each of the n rows, the first `span` positions of a slot that already computed a prefix of its
    prompt (`kvcache.take_rows`), or is None for prompts computed from their start (span = x's length). Returns (x,
    rows with the new tokens' keys/values), which `kvcache.put_rows` then stores in the rows' slots. The slots'
    cache is no input here, so that these programs, the costliest to compile, are compiled per rows x tokens x span
    and not also per cache length. `cache_dtype`: the slots' cache's (default x's), which fresh rows' caches take,
    so that a prompt attends over the same rounded keys and values whether or not it starts from a stored prefix."""
    fresh = rows is None
    if fresh:
        shapes = ops.cache_layout.shapes(config, x.shape[0], x.shape[1])
        rows = [tuple(ops.cache_layout.zeros(shape, cache_dtype or x.dtype) for shape in shapes)] * len(layer_params)
    return layers(layer_params, config, x, dataclasses.replace(at, fresh=fresh), rows, ops)


def prefill_last(x, lengths):
    """Each row's last prompt token from the last layer's output x [n, q, dim] -> [n, 1, dim]: a program of
    its own, so that `prefill_outputs` (slow to compile: it holds the sampler) is compiled per row count, not per
    prompt bucket."""
    return x[jnp.arange(x.shape[0]), lengths - 1][:, None]


def packed_last(x, last):
    """Each row's last prompt token from a packed prefill's output x [tokens, 1, dim], `last` [n] its index ->
    [n, 1, dim] (an index past the end clips: a padding row's)."""
    return jnp.take(x, last, axis=0, mode="clip")


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Admitted:
    """The rows a prefill puts in decode slots, [n] each (padding rows' slots out of range): row i computed prompt
    tokens [starts[i], starts[i] + lengths[i]) and goes to slot slots[i], with its sampling parameters, its token
    budget (`max_tokens`), its context limit (`limits`) and end-of-generation ids (`stop_ids` [n, e], padded with
    -1). seen [n, vocab]: the whole prompt's tokens, for the repetition penalty (or [n, 1] when no row uses
    penalties). mask [n, ceil(vocab / 32)] int32: the tokens each row's first token may be (with `flags.mask`; else
    [n, 1], unread)."""

    starts: jax.Array
    lengths: jax.Array
    slots: jax.Array
    seen: jax.Array
    sampling: SamplingRows
    max_tokens: jax.Array
    limits: jax.Array
    stop_ids: jax.Array
    mask: jax.Array


def prefill_outputs(
    params, state: DecodeState, x, new: Admitted, *, config: ModelConfig, flags: SamplerFlags, ops: Ops = XLA
):
    """Finish a prefill from the last layer's output at each row's last prompt token, x [n, 1, dim]: sample each
    row's first token and put the rows in their decode slots.

    Returns (state, first tokens [n], logprobs [n], finish [n]: FINISH codes, RUNNING unless the first token
    already ended the row, top: as `decode_outputs`').
    """
    n = x.shape[0]
    logits = head(params, config, x[:, 0], ops=ops)
    vocab = state.counts.shape[1]
    seen = new.seen if new.seen.shape[1] == vocab else jnp.zeros((n, vocab), bool)
    zeros = jnp.zeros((n,), jnp.int32)
    counts = jnp.zeros((n, vocab), jnp.int32)
    history = RowHistory(zeros, new.stop_ids, counts, seen)
    first, logprobs, top = sample(logits, new.sampling, history, flags, ops, new.mask)

    fresh = DecodeState(
        tokens=jnp.full((n,), -1, jnp.int32),
        positions=new.starts + new.lengths - 1,
        active=jnp.ones((n,), bool),
        remaining=new.max_tokens,
        limit=new.limits,
        step=zeros,
        stop_ids=new.stop_ids,
        rows=new.sampling,
        counts=counts,
        seen=seen,
    )
    # The first token is sampled as if from a decode step at the prompt's last position.
    fresh, finish = _advance(fresh, first, jnp.ones((n,), bool), flags.penalize)
    if new.stop_ids.shape[1] != state.stop_ids.shape[1]:
        raise ValueError("stop_ids width mismatch")
    return _scatter(state, fresh, new.slots, flags.penalize), first, logprobs, finish, top


def prompt_logprobs(params, x, tokens, *, config: ModelConfig, ops: Ops = XLA):
    """The log-probability of each prompt token given the tokens before it, from a prefill's last layer output
    x [n, q, dim] over its tokens [n, q]: position j's raw logits (no penalty, no temperature) predict token j + 1.
    One row at a time, so that the [q, vocab] log-softmax is never held for every row at once.

    Returns (logprobs [n, q]: of token j + 1 at position j, meaningless at a row's last token and past it; top ids
    [n, q, k] int32 and their logprobs [n, q, k]: the k = MAX_LOGPROBS most likely tokens there)."""
    following = jnp.concatenate([tokens[:, 1:], jnp.zeros_like(tokens[:, :1])], axis=1)
    return _logprobs_of(params, x, following, config, ops)


def packed_prompt_logprobs(params, x, tokens, *, config: ModelConfig, ops: Ops = XLA):
    """`prompt_logprobs` of a packed prefill: its last layer output x [t, 1, dim] over its tokens [t] (t a multiple
    of PACKED_STEP, prompts one after another) -> logprobs [t], top ids and logprobs [t, k], each position's as in a
    row (of token j + 1 at position j: meaningless at a prompt's last token), PACKED_STEP positions at a time."""
    following = jnp.concatenate([tokens[1:], jnp.zeros_like(tokens[:1])])
    step = buckets.PACKED_STEP
    out = _logprobs_of(params, x.reshape(-1, step, x.shape[-1]), following.reshape(-1, step), config, ops)
    return jax.tree.map(lambda y: y.reshape(-1, *y.shape[2:]), out)


def _logprobs_of(params, x, following, config: ModelConfig, ops: Ops):
    """Per row of x [n, q, dim]: each position's log-probability of `following` [n, q] there, and the MAX_LOGPROBS
    most likely tokens' ids and log-probabilities; one row at a time."""
    k = min(MAX_LOGPROBS, config.vocab_size)

    def row(args):
        x, following = args
        logits = head(params, config, x, ops=ops)  # [q, vocab] float32
        logz = ops.logsumexp(logits)[:, None]
        picked = jnp.take_along_axis(logits, following[:, None], axis=-1)
        values, ids = jax.lax.top_k(logits, k)
        return (picked - logz)[:, 0], ids.astype(jnp.int32), values - logz

    return jax.lax.map(row, (x, following))
