"""A prefill's host arrays (`PrefillBatch`): its rows padded to the static shapes the engine compiles for (rows to a
power of two, prompts to a length bucket: `buckets.py`), with each row's sampling parameters, stop ids and slot, or
its prompts packed one after another as one batch of tokens (`pack`). Plain numpy: the model runner puts them on
the devices and runs the programs over them."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from jaxllama.engine import buckets
from jaxllama.engine.interface import PrefillRow
from jaxllama.engine.request import SamplingParams
from jaxllama.engine.sampling import SamplerFlags, SamplingRows

if TYPE_CHECKING:
    from jaxllama.engine.model_runner import ModelRunner

MAX_STOP_IDS = 32  # end-of-generation ids a slot can hold: the model's and the request's own


@dataclasses.dataclass
class PrefillBatch:
    """A prefill's host arrays, padded to static shapes: rows to a power of two (a multiple of the data axis), prompt
    tokens to their length bucket; padding rows compute nothing that lands (their slot is out of range)."""

    arrays: dict
    flags: SamplerFlags
    span: int  # cache positions each row reads and writes (the rows' path)
    fresh: bool  # no row starts from a stored prefix
    prompt_logprobs: bool  # some row asks for its prompt's log-probabilities
    packed: bool = False  # the prompts' tokens as one batch over the slots' cache (`LayerCalls.packed`)
    copies: bool = False  # packed: some row copies a reused prefix from another slot first

    @staticmethod
    def of(
        rows: Sequence[PrefillRow], device: ModelRunner, masked: bool = False, columns: Sequence[int] = ()
    ) -> PrefillBatch:
        """`masked`: the first tokens are drawn under bitmasks (then [n, mask_words] of ones until given).
        `columns`: a packed prefill also runs a decode step of these slots (`ModelRunner.prefill_and_decode`)."""
        q = buckets.prompt_bucket(max(len(r.tokens) for r in rows), device.max_context)
        fresh = all(r.start == 0 for r in rows)
        span = q if fresh else buckets.bucket(max(r.start + q for r in rows), device.max_context)
        n = buckets.round_up(buckets.pow2(len(rows)), device.mesh.shape["data"])
        a = dict(
            starts=np.zeros(n, np.int32),
            lengths=np.ones(n, np.int32),
            sources=np.full(n, device.slots, np.int32),
            slots=np.full(n, device.slots, np.int32),  # padding rows land nowhere
            stop_ids=np.full((n, MAX_STOP_IDS), -1, np.int32),
        )
        params, seeds = [], []
        if not device.joins_decode and not all(r.final for r in rows):
            raise ValueError("a prompt is computed in chunks only where a prefill joins a decode step")
        for i, r in enumerate(rows):
            a["lengths"][i], a["starts"][i], a["sources"][i] = len(r.tokens), r.start, r.source
            a["slots"][i] = r.slot if r.final else device.slots  # a chunk's row lands in no decode slot
            eos = () if r.request.params.ignore_eos else device.eos_ids
            ids = sorted(set(eos) | set(r.request.params.stop_token_ids))
            a["stop_ids"][i, : len(ids)] = ids
            params.append(r.request.params)
            seeds.append(device.seed(r.request.params))
        params += [SamplingParams(temperature=0.0)] * (n - len(rows))
        seeds += [0] * (n - len(rows))
        a["sampling"] = SamplingRows(**SamplingRows.from_params(params, seeds))
        a["max_tokens"] = np.array([p.max_tokens for p in params], np.int32)
        a["limits"] = np.full(n, device.max_context, np.int32)
        flags = dataclasses.replace(SamplerFlags.of(params), mask=masked)
        a["mask"] = np.full((n, device.mask_words if masked else 1), -1, np.int32)
        a["seen"] = np.zeros((n, device.config.vocab_size if flags.penalize else 1), bool)
        if flags.penalize:
            for i, r in enumerate(rows):
                a["seen"][i, r.request.prompt] = True
        prompt_logprobs = any(r.request.params.prompt_logprobs is not None for r in rows)
        if device.packs_prompts:
            copies = pack(rows, a, device, columns)
            return PrefillBatch(a, flags, 0, fresh, prompt_logprobs, packed=True, copies=copies)
        a["tokens"] = np.zeros((n, q), np.int32)  # the prompts, each padded to the bucket
        for i, r in enumerate(rows):
            a["tokens"][i, : len(r.tokens)] = r.tokens
        return PrefillBatch(a, flags, span, fresh, prompt_logprobs)


def pack(rows: Sequence[PrefillRow], a: dict, device: ModelRunner, columns: Sequence[int] = ()) -> bool:
    """Adds to a prefill's arrays `a` its prompts' tokens as one batch, padded to a `buckets.token_bucket`:
    packed_tokens, packed_positions and packed_slots (padding tokens land nowhere), each row's last token's index
    (`last`), and the reused prefixes to copy: `copy_lengths` positions from the slot `copy_from` into `copy_to` (one
    entry per slot, those past the copies out of range: only rows reusing another slot's prefix copy). Returns
    whether there are any. With decode `columns` (slots, padded with the out-of-range `device.slots`), each one's
    place after the prompts' tokens (`decode_at`; a padding column's past the batch) and `decode_slots`: the device
    fills in their tokens and positions (`step.mixed_inputs`)."""
    n = buckets.token_bucket(sum(len(r.tokens) for r in rows) + len(columns))
    tokens, positions = np.zeros(n, np.int32), np.zeros(n, np.int32)
    slots = np.full(n, device.slots, np.int32)
    a["last"] = np.full(len(a["slots"]), n, np.int32)
    at = 0
    for i, r in enumerate(rows):
        k = len(r.tokens)
        tokens[at : at + k], positions[at : at + k] = r.tokens, np.arange(r.start, r.start + k)
        slots[at : at + k] = r.slot
        at += k
        a["last"][i] = at - 1
    if {r.slot for r in rows} & set(columns):  # a slot's stale position would be written beside its new prompt
        raise ValueError("a prefill's rows and the decode step joined to it share a slot")
    a["decode_slots"] = np.asarray(columns, np.int32)
    a["decode_at"] = np.full(len(columns), n, np.int32)
    for i, column in enumerate(columns):
        if column < device.slots:
            a["decode_at"][i], slots[at] = at, column
            at += 1
    a.update(packed_tokens=tokens, packed_positions=positions, packed_slots=slots)
    copies = [r for r in rows if r.start and r.source != r.slot]
    if {r.slot for r in copies} & {r.source for r in copies}:  # `kvcache.copy_rows` copies one pair after another
        raise ValueError("a packed prefill copies a prefix out of a slot it also copies one into")
    none = np.full(device.slots, device.slots, np.int32)  # out of range: no pair
    a["copy_from"], a["copy_to"], a["copy_lengths"] = none, none.copy(), np.zeros(device.slots, np.int32)
    for i, r in enumerate(copies):
        a["copy_from"][i], a["copy_to"][i], a["copy_lengths"][i] = r.source, r.slot, r.start
    return bool(copies)
