"""`LLM`: the Python API. A whole conversation in, the reply out; no conversation state is kept.

from jaxllama import LLM
llm = LLM.load()                                   # the default model (SmolLM2-135M-Instruct)
llm.generate("Once upon a time", max_tokens=20, temperature=0).text
llm.chat([{"role": "user", "content": "What do llamas eat?"}], max_tokens=30).text
for piece in llm.generate("Tell me a story", max_tokens=20, stream=True): print(piece, end="")
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import os
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from jaxllama import targets
from jaxllama.core import kv_groups
from jaxllama.core.checkpoint import is_checkpoint, load_config
from jaxllama.core.chips import skip_absent_tpu
from jaxllama.core.config import ModelConfig, check_dtype
from jaxllama.core.model import forward, sequence_logits
from jaxllama.core.params import abstract_stored, as_blocks
from jaxllama.engine import prepared
from jaxllama.engine.engine import Engine
from jaxllama.engine.load_plan import LoadPlan, plan_load
from jaxllama.engine.options import EngineOptions
from jaxllama.engine.programs import preload_imports
from jaxllama.engine.request import SamplingParams
from jaxllama.engine.runtime import enable_compilation_cache, prepared_cache
from jaxllama.engine.stats import EngineStats
from jaxllama.engine_loop import EngineLoop
from jaxllama.errors import ContextLengthExceeded, InvalidParameter, InvalidRequest
from jaxllama.protocol.requests import (
    OUTPUT_FORMAT_FIELDS,
    SAMPLING_FIELDS,
    lone_surrogate_text,
    output_format,
    samples,
    sampling_params,
)
from jaxllama.results import Result
from jaxllama.text.chat_template import ChatTemplate
from jaxllama.text.conversation import validate_messages
from jaxllama.text.end_of_generation import end_of_generation_ids, load_generation_config
from jaxllama.text.loading import load_tokenizer
from jaxllama.text.prompts import PromptEncoder
from jaxllama.text.structured import Grammar, GrammarCompiler, OutputFormat
from jaxllama.text.tokenizer import Tokenizer
from jaxllama.text_engine import TextEngine, TextRequest

log = logging.getLogger(__name__)


@dataclasses.dataclass
class Score:
    """The scored tokens of one `LLM.score` item, their log-probabilities (each given every token before it), and
    whether each was the most likely token there (greedy decoding would have produced them)."""

    token_ids: list[int]
    logprobs: list[float]
    greedy: bool

    @property
    def logprob(self) -> float:
        """The log-likelihood: the sum of the tokens' log-probabilities."""
        return float(sum(self.logprobs))


class LLM:
    """A loaded model with its tokenizer, chat template and end-of-generation ids, and an engine to run it.

    Its methods (`generate`, `chat`, `score`, `logits`, a stream being read) may be called from several threads at
    once: one thread at a time uses the engine (a submission, a step, `logits`), in the order they asked, and the
    requests of calls running at once share the engine's steps (whichever call steps hands the others their events),
    up to `slots` at once, the rest waiting for a slot. So each thread gets the answer it would get alone, no sooner
    than the steps it shares allow; for many clients, the server (`jaxllama.server`) batches their requests the same
    way, with a queue limit and cancellation. `forward` is a pure function: calling it uses no engine.
    """

    def __init__(
        self,
        config: ModelConfig,
        params,
        mesh,
        tokenizer: Tokenizer,
        template: ChatTemplate,
        eos_ids: Iterable[int],
        options: EngineOptions | None = None,
        *,
        path: Path | None = None,
        donate_params: bool = False,
        ops=None,
        plan: LoadPlan | None = None,
    ):
        self.config, self.mesh = config, mesh
        self.tokenizer, self.template, self.eos_ids = tokenizer, template, frozenset(eos_ids)
        self.path = path
        engine_args = dict(eos_ids=self.eos_ids, donate_params=donate_params, ops=ops, plan=plan)
        self.engine = Engine(config, params, mesh, options, **engine_args)
        self.params = self.engine.params  # the weights the engine runs: prepared for its backend, no other copy
        self.text_engine = TextEngine(self.engine, tokenizer)
        grammars = GrammarCompiler(tokenizer, config.vocab_size, self.eos_ids)
        self.prompts = PromptEncoder(tokenizer, template, grammars, config.vocab_size)  # what request pipelines use
        self.loop = EngineLoop(self.text_engine)  # how every call runs its requests

    @classmethod
    def load(
        cls,
        path: str | Path | None = None,
        options: EngineOptions | None = None,
        *,
        mesh: str | dict | None = None,
        dtype=None,
        chat_template: str | None = None,
        eos_ids: Iterable[int] | None = None,
        extra_eos_ids: Iterable[int] = (),
        compilation_cache: bool = True,
        keep_prepared: bool | None = None,
        **engine_options,
    ) -> LLM:
        """Load a converted checkpoint (None: the default model) onto a mesh ('data=2,model=4'; default:
        chosen from the devices). `dtype`: None (default) runs the weights as the checkpoint stores them (bfloat16 as
        bfloat16, Q8_0/Q4_0 blocks as blocks); 'float32', 'bfloat16' or 'float16' converts every weight to it once,
        while loading (blocks dequantized). `chat_template`: a built-in name or a .jinja file instead of the
        checkpoint's. `eos_ids` replaces the end-of-generation set; `extra_eos_ids` extends it. `options`
        (`EngineOptions`), with any of its fields given here as keywords replacing its own, size and run the engine:
        `max_slots` requests at once, `max_context` positions each, `decode_steps` tokens per decode call. `quantize`:
        generate with int8 weights in blocks of 32 (llama.cpp's Q8_0), on one CPU device: 'q8_0' multiplies them by
        the inputs in int16, 'w8a8' by the inputs in int8 (as llama.cpp does; fastest on CPUs with AVX-512 VNNI);
        'int8', on XLA's path (accelerators, a CPU mesh), int8 weights with a scale per output channel;
        `logits` and `forward` run on the same weights. `kv_cache_dtype`: 'float16' or 'bfloat16' keeps the
        KV cache in 16 bits (half the bytes attention reads), 'int8' in 8 with a scale per cached vector (XLA's path:
        accelerators, a CPU mesh), 'float32', or None for the backend's choice (float16 on the CPU kernels where the
        weights compute in float32, else the weights' dtype).
        `compilation_cache`: keep compiled programs on disk (`runtime.enable_compilation_cache`); `keep_prepared`:
        keep the weights prepared for the CPU kernels there too, so that loading this model again maps them from a
        file in a fraction of a second (`engine/prepared.py`; one more copy of the weights on disk; default: yes,
        unless the environment sets JAXLLAMA_KEEP_PREPARED=0)."""
        from jaxllama.default_model import resolve_model

        options = dataclasses.replace(options or EngineOptions(), **engine_options)  # checked before a long load
        check_dtype(dtype)
        skip_absent_tpu()
        if compilation_cache:
            enable_compilation_cache()
        path = resolve_model(path)
        kept, digest, stored = _kept_and_stored(path, keep_prepared)
        config = stored.with_dtype(jnp.dtype(dtype).name) if dtype is not None else stored  # as restored
        plan = plan_load(config, jax.devices(), mesh, options, stored=stored)
        ops = plan.ops
        # Named before the threads below start: the name reads jaxllama's sources, and each read made here while they
        # hold the GIL waits for it (0.4 s instead of 0.01 s).
        entry = prepared.entry_name(digest, ops, dtype) if digest is not None else None
        # The text side is read, and what the first program's call imports imported, on threads while the weights
        # restore or map (TensorStore's threads or the kernel do that work, not Python's). Each part of the model is
        # prepared for the backend as it is restored: one copy at a time.
        with ThreadPoolExecutor(2) as pool:
            text = pool.submit(_load_text, path, chat_template, eos_ids, extra_eos_ids)
            pool.submit(preload_imports)
            params = prepared.restore(kept, entry, Path(path), stored, plan.mesh, dtype, ops)
            params = _repeat_kv_heads(params, config, plan.config, plan.mesh)
            tokenizer, template, eos = text.result()
        return cls(plan.config, params, plan.mesh, tokenizer, template, eos, path=Path(path), plan=plan)

    compile_for = staticmethod(targets.compile_for)
    predict_job = staticmethod(targets.predict_job)

    @property
    def name(self) -> str:
        """The model's name in answers and records: its checkpoint folder's name, or "jaxllama"."""
        return self.path.name if self.path else "jaxllama"

    @property
    def slots(self) -> int:
        """Requests the engine generates for at once."""
        return self.engine.slots

    @property
    def max_context(self) -> int:
        """Positions a request may hold: its prompt and what it generates."""
        return self.engine.max_context

    @property
    def stats(self) -> EngineStats:
        """The engine's counters and times since the model loaded."""
        return self.engine.stats

    # ---- research --------------------------------------------------------------------------------

    @property
    def forward(self):
        """The pure forward function `(params, tokens [b, t], positions [b, t], cache) -> (logits, cache)`,
        for use inside your own `jax.jit` (see `jaxllama.core.model.forward`), with the operations `llm.params`
        are prepared for."""
        return functools.partial(forward, config=self.config, ops=self.engine.ops)

    def logits(self, token_ids: Sequence[Sequence[int]]) -> np.ndarray:
        """Logits [batch, time, vocab] (float32) of token id lists of any lengths; rows are right-padded,
        and positions past a sequence's end hold NaN.

        Raises:
            InvalidRequest: an empty batch or row, or a row that is not a list of token ids.
            InvalidParameter: an id that is not an integer or not in [0, vocab_size).
            ContextLengthExceeded: a row longer than the model's context (`config.max_seq_len`).
        """
        rows = _token_rows(token_ids, self.config.vocab_size, self.config.max_seq_len)
        lengths = [len(row) for row in rows]
        tokens = np.zeros((len(rows), max(lengths)), np.int32)
        for i, row in enumerate(rows):
            tokens[i, : len(row)] = row
        replicated = NamedSharding(self.mesh, PartitionSpec())  # every process can read all of it
        with self.loop.turn():  # the engine's weights and operations, which a step uses meanwhile
            logits = _sequence_logits(self.params, self.config, jnp.asarray(tokens), replicated, self.engine.ops)
            out = np.array(logits)
        for i, n in enumerate(lengths):
            out[i, n:] = np.nan
        return out

    def apply_chat_template(self, messages, *, add_generation_prompt: bool = True, **kwargs) -> str:
        return self.template.render(
            validate_messages(messages),
            add_generation_prompt=add_generation_prompt,
            bos_token=self.tokenizer.bos_token,
            eos_token=self.tokenizer.eos_token,
            **kwargs,
        )

    def encode_chat(self, messages, **kwargs) -> list[int]:
        """The prompt token ids of a conversation: the chat template applied (with the generation prompt),
        then tokenized."""
        return self.prompts.encode_chat(messages, **kwargs)

    def encode(self, text: str, *, add_bos: bool | None = None) -> list[int]:
        """The prompt token ids of a plain text prompt: BOS in front if the model's tokenizer adds one (or as
        `add_bos` says); special-token text in `text` stays plain text."""
        return self.prompts.encode(text, add_bos=add_bos)

    def grammar(self, output: OutputFormat, params: SamplingParams) -> Grammar:
        """The grammar a request's text must match (structured output), with the request's own stop ids; raises
        InvalidParameter for a schema, regular expression or grammar that cannot be compiled."""
        return self.prompts.grammar(output, params.stop_token_ids)

    def decode(self, ids: Sequence[int]) -> str:
        """The text of token ids (special tokens included); raises InvalidParameter for an id outside the
        vocabulary."""
        return self.prompts.decode(ids)

    # ---- generation ------------------------------------------------------------------------------

    def generate(
        self,
        prompt: str | list[int] | Sequence[str | list[int]],
        *,
        stream: bool = False,
        stop: str | Sequence[str] = (),
        include_stop: bool = False,
        logprobs: bool = False,
        add_bos: bool | None = None,
        **sampling,
    ):
        """Complete a prompt (text or token ids), or a list of prompts as one batch.

        Sampling keywords: max_tokens, temperature (0: greedy), top_k, top_p, min_p, seed,
        repetition_penalty, presence_penalty, frequency_penalty, stop_token_ids, logit_bias ({token_id: bias}), n
        (samples of each prompt), and one structured output field: response_format ({"type": "json_object"} or
        {"type": "json_schema", "json_schema": {"schema": ...}}), guided_json (a schema), guided_regex or
        guided_grammar (Lark). Returns a `Result` (text, token_ids, finish_reason, stop_reason, usage, timings,
        logprobs), a list of them (one per prompt; with n > 1 each a list of n), or with `stream=True` an iterator
        of text pieces (one prompt only).

        >>> llm.generate("The capital of France is", max_tokens=5, temperature=0).text  # doctest: +SKIP
        ' Paris.'
        """
        single = isinstance(prompt, str) or (bool(prompt) and isinstance(prompt[0], int))
        prompts = [prompt] if single else list(prompt)
        _refuse_lone_surrogates({"prompt": prompt})
        ids = [p if not isinstance(p, str) else self.encode(p, add_bos=add_bos) for p in prompts]
        return self._run(ids, single, stream, stop, include_stop, logprobs, sampling)

    def chat(
        self,
        messages,
        *,
        stream: bool = False,
        stop: str | Sequence[str] = (),
        include_stop: bool = False,
        logprobs: bool = False,
        **sampling,
    ):
        """Reply to a conversation (a list of {"role", "content"} messages), or to a list of conversations
        at once. Same keywords and results as `generate`."""
        single = bool(messages) and isinstance(messages[0], dict)
        conversations = [messages] if single else list(messages)
        ids = [self.encode_chat(c) for c in conversations]
        return self._run(ids, single, stream, stop, include_stop, logprobs, sampling)

    def score(self, items: Sequence) -> list[Score]:
        """Log-likelihoods, as evaluation harnesses ask for them, computed in one batch (a context shared by several
        items is computed once): each item is a text or token ids (every token after the first scored), or a
        (context, continuation) pair of either (the continuation's tokens scored, given the context; texts are
        encoded apart, the continuation without BOS). Returns a `Score` per item.

        >>> llm.score([("The capital of France is", " Paris")])[0].logprob  # doctest: +SKIP
        -1.23
        """
        prompts, scored = _scored_prompts(items, self.encode)
        params = SamplingParams(max_tokens=0, temperature=0.0, prompt_logprobs=1)
        request_ids, inbox = self.loop.submit_all([TextRequest(prompt, params) for prompt in prompts])
        with contextlib.closing(self.loop.events(request_ids, inbox)) as events:
            results = {e.id: e.result for e in events if e.result is not None}
        out = []
        for rid, prompt, n in zip(request_ids, prompts, scored, strict=True):
            positions = results[rid].prompt_logprobs[-n:]
            tokens = prompt[-n:]
            greedy = all(top[0][0] == t for t, (_, top) in zip(tokens, positions, strict=True))
            out.append(Score(tokens, [lp for lp, _ in positions], greedy))
        return out

    def _run(self, ids, single, stream, stop, include_stop, logprobs, sampling):
        unknown = set(sampling) - set(SAMPLING_FIELDS) - set(OUTPUT_FORMAT_FIELDS) - {"n"}
        if unknown:
            raise TypeError(f"unknown sampling argument(s): {', '.join(sorted(unknown))}")
        _refuse_lone_surrogates({"stop": stop, **sampling})
        try:
            params = sampling_params(sampling, SamplingParams())
            output, n = output_format(sampling), samples(sampling)
            grammar = self.grammar(output, params) if output else None
        except RecursionError:  # a schema (or another value) nested past what can be read
            field = next((k for k in OUTPUT_FORMAT_FIELDS if k in sampling), "sampling")
            raise InvalidParameter(f"{field}: nested too deep", field) from None
        stop = [stop] if isinstance(stop, str) else list(stop)
        if stream:
            if not single or n > 1:
                raise ValueError("stream=True takes a single prompt or conversation, and n=1")
            return self._stream(ids[0], params, stop, include_stop, grammar)
        requests = [TextRequest(p, params, stop, include_stop, logprobs, grammar=grammar, n=n) for p in ids]
        request_ids, inbox = self.loop.submit_all(requests)
        results = {r: [None] * n for r in request_ids}
        with contextlib.closing(self.loop.events(request_ids, inbox)) as events:  # closed early: the rest are cancelled
            for event in events:
                if event.result is not None:
                    if event.result.error is not None:
                        raise event.result.error
                    results[event.id][event.index] = event.result
        out = [results[r] if n > 1 else results[r][0] for r in request_ids]
        return out[0] if single else out

    def _stream(self, prompt_ids, params, stop, include_stop, grammar=None) -> Iterator[str]:
        request_ids, inbox = self.loop.submit_all(
            [TextRequest(prompt_ids, params, stop, include_stop, grammar=grammar)]
        )
        with contextlib.closing(self.loop.events(request_ids, inbox)) as events:
            for event in events:
                if event.result is not None and event.result.error is not None:
                    raise event.result.error
                if event.delta:
                    yield event.delta


def _scored_prompts(items: Sequence, encode) -> tuple[list[list[int]], list[int]]:
    """`LLM.score`'s items as prompts (token ids, texts encoded with `encode`) and how many of each one's last tokens
    are scored."""
    prompts, scored = [], []
    for i, item in enumerate(items):
        if isinstance(item, tuple):
            if len(item) != 2:
                raise InvalidRequest(f"items[{i}]: a pair is (context, continuation)")
            context, continuation = item
            context = encode(context) if isinstance(context, str) else list(context)
            continuation = encode(continuation, add_bos=False) if isinstance(continuation, str) else list(continuation)
            if not context or not continuation:
                raise InvalidRequest(f"items[{i}]: the context and the continuation must each hold a token")
            prompts.append(context + continuation)
            scored.append(len(continuation))
        else:
            ids = encode(item) if isinstance(item, str) else list(item)
            if len(ids) < 2:
                raise InvalidRequest(f"items[{i}]: a text to score needs at least two tokens")
            prompts.append(ids)
            scored.append(len(ids) - 1)
    return prompts, scored


def _kept_and_stored(path, keep_prepared: bool | None):
    """(where prepared weights are kept or None, the checkpoint's digest there or None, its config as stored) for
    `LLM.load`: the config checked against the arrays stored before its sizes are trusted, unless weights prepared
    from this very checkpoint are kept (it was checked then)."""
    if keep_prepared is None:
        keep_prepared = os.environ.get("JAXLLAMA_KEEP_PREPARED", "1") != "0"
    kept = prepared_cache() if keep_prepared else None
    digest = prepared.checkpoint_digest(Path(path)) if kept is not None and is_checkpoint(path) else None
    return kept, digest, load_config(path, check=digest is None or not prepared.checked(kept, digest))


def _load_text(
    path: Path, chat_template: str | None, eos_ids, extra_eos_ids
) -> tuple[Tokenizer, ChatTemplate, frozenset[int]]:
    """A checkpoint's tokenizer, chat template (or the one asked for) and end-of-generation ids."""
    tokenizer = load_tokenizer(path)
    tokenizer.prepare()
    template = ChatTemplate.from_checkpoint(path, chat_template, special_tokens=tokenizer.special_tokens)
    eos = end_of_generation_ids(
        tokenizer,
        generation_config=load_generation_config(path),
        template_text=template.source,
        override=eos_ids,
        extra=extra_eos_ids,
    )
    return tokenizer, template, eos


def _refuse_lone_surrogates(arguments: dict) -> None:
    """InvalidRequest naming the argument (`prompt[1]`, `stop[0]`) whose text holds a lone surrogate, which is not
    Unicode text and which no tokenizer takes (`protocol.requests.lone_surrogate_text`, as the server and job
    lines)."""
    surrogate = lone_surrogate_text(arguments, escape=False)
    if surrogate is not None:
        path, _, message = surrogate
        raise InvalidRequest(message, path)


def _repeat_kv_heads(params, config: ModelConfig, run_config: ModelConfig, mesh):
    """The restored params of `config` as `run_config` runs them: each KV head repeated to fill the mesh's model axis
    (`core/kv_groups.py`), a layer at a time."""
    r = run_config.n_kv_heads // config.n_kv_heads
    if r == 1:
        return params
    layer = as_blocks(abstract_stored(run_config, mesh), run_config)["layers_0"]
    return kv_groups.repeat_on_mesh(params, config, r, jax.tree.map(lambda x: x.sharding, layer))


def _token_rows(token_ids, vocab_size: int, max_len: int) -> list[np.ndarray]:
    """`LLM.logits`' batch checked, as int64 rows. The model would not refuse bad ids itself: an id past the
    vocabulary reads an embedding out of bounds (NaN or another token's), and a row past the context grows the
    attention without bound."""
    if isinstance(token_ids, (str, bytes)) or not isinstance(token_ids, (Sequence, np.ndarray)):
        raise InvalidRequest(f"token_ids: expected a list of token id lists, got {type(token_ids).__name__}")
    if len(token_ids) == 0:
        raise InvalidRequest("token_ids: the batch is empty")
    return [_token_row(i, row, vocab_size, max_len) for i, row in enumerate(token_ids)]


def _token_row(i: int, row, vocab_size: int, max_len: int) -> np.ndarray:
    where = f"token_ids[{i}]"
    if isinstance(row, (str, bytes)) or not isinstance(row, (Sequence, np.ndarray)):
        raise InvalidRequest(f"{where}: expected a list of token ids, got {type(row).__name__}")
    array = np.asarray(row)
    if array.ndim != 1:
        raise InvalidRequest(f"{where}: expected a flat list of token ids, got shape {array.shape}")
    if array.size == 0:
        raise InvalidRequest(f"{where}: the sequence is empty")
    if array.size > max_len:
        raise ContextLengthExceeded(f"{where}: {array.size} tokens, more than the model's context of {max_len}")
    if array.dtype.kind not in "iu" and not all(isinstance(v, int) and not isinstance(v, bool) for v in row):
        raise InvalidParameter(f"{where}: token ids must be integers, got {array.dtype.name} values", "token_ids")
    if array.dtype.kind in "iu":
        bad = np.flatnonzero((array < 0) | (array >= vocab_size)).tolist()
    else:  # Python ints too large for int64
        bad = [j for j, v in enumerate(row) if not 0 <= v < vocab_size]
    if bad:
        j = bad[0]
        message = f"{where}[{j}] = {int(row[j])}: not a token id (expected 0 <= id < vocab_size = {vocab_size})"
        raise InvalidParameter(message, "token_ids")
    return array.astype(np.int64)


@functools.partial(jax.jit, static_argnums=(1, 3, 4))
def _sequence_logits(params, config, tokens, out_sharding, ops):
    return jax.lax.with_sharding_constraint(sequence_logits(params, config, tokens, ops), out_sharding)


__all__ = ["LLM", "Result", "Score"]
