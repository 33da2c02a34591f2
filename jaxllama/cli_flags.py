"""The `jaxllama` command's flags, in groups that commands share: each flag is written once, as a field of a frozen
dataclass whose metadata holds its help and how --help writes its value; a command takes the groups it uses as
values, each passed whole (`command`), as the engine takes `EngineOptions`.

A command that means something else by a shared flag says so in its docstring's `Args:` (which --help prefers); one
that takes a group with other defaults, or without some of its flags, names them in `Group`.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import os
from collections.abc import Callable, Mapping, Sequence

from jaxllama.engine.buckets import DEFAULT_SLOTS
from jaxllama.engine.request import SamplingParams


def flag(default, help: str, metavar: str | None = None, repeatable: bool = False):
    """A flag's field: its default, its help, how --help writes its value (default: its name in capitals, or its
    default where it has one) and whether it is given once per value (`--stop a --stop b`)."""
    return dataclasses.field(default=default, metadata={"help": help, "metavar": metavar, "repeatable": repeatable})


@dataclasses.dataclass(frozen=True)
class ModelFlags:
    """Which model a command loads, and in what form."""

    model: str | None = flag(
        None,
        "a checkpoint: converted, or a GGUF file, Hugging Face or Meta folder (converted once into the cache); "
        "default: SmolLM2-135M-Instruct.",
        "CKPT",
    )
    mesh: str | None = flag(
        None, "device mesh, e.g. data=2,model=4 (default: chosen from the devices and the model).", "data=2,model=4"
    )
    dtype: str | None = flag(
        None,
        "float32, bfloat16 or float16 to convert every weight to it while loading (blocks dequantized); default: the "
        "weights as the checkpoint stores them.",
        "float32|bfloat16",
    )
    quantize: str | None = flag(
        None,
        "q8_0, w8a8 or q4_0 to quantize float weights at load (one CPU device): int8 weights (llama.cpp's Q8_0) "
        "multiplied by inputs in int16 (q8_0) or int8 (w8a8, as llama.cpp; fastest where the CPU has AVX-512 VNNI), "
        "or 4-bit ones (Q4_0) by int8 inputs. Weights stored as Q8_0 or Q4_0 blocks are read as stored on a CPU, and "
        "as int8 weights made at load on a TPU or GPU. int8: on an accelerator (or a CPU mesh), int8 weights with a "
        "scale per output channel (blocks requantized).",
        "int8|w8a8|q8_0|q4_0",
    )
    chat_template: str | None = flag(
        None, "a built-in template (llama2, llama3, chatml, raw) or a .jinja file.", "NAME|FILE"
    )
    eos_id: list | None = flag(None, "an extra end-of-generation token id (repeatable).", "ID", repeatable=True)

    @property
    def eos_ids(self) -> list[int]:
        """--eos-id's ids (none where it is not given)."""
        return as_list(self.eos_id, int)


@dataclasses.dataclass(frozen=True)
class EngineFlags:
    """How the engine is sized and run (`EngineOptions`, less what `ModelFlags` says)."""

    max_batch: int = flag(DEFAULT_SLOTS, "decode slots: requests generated at once.")
    max_context: int | None = flag(None, "context limit (prompt + completion), at most the model's.", "N")
    decode_steps: int | None = flag(None, "decode steps per host round trip.", "N")
    kv_cache_dtype: str | None = flag(
        None,
        "float16 or bfloat16 keeps the KV cache in 16 bits, int8 (accelerators, a CPU mesh) in 8 with a scale per "
        "vector, float32 exactly; auto (default): float16 on a CPU's kernels for float32 weights, else the weights' "
        "dtype.",
        "float16",
    )

    def options(self, quantize: str | None = None):
        """These flags (and `--quantize`) as `EngineOptions`, checked where it is made: a ValueError naming the flag
        for a bad value."""
        from jaxllama.engine.options import EngineOptions
        from jaxllama.errors import InvalidOption

        values = dataclasses.asdict(self) | {"quantize": quantize}
        try:
            return EngineOptions(max_slots=values.pop("max_batch"), **values)
        except InvalidOption as e:
            name = "max_batch" if e.name == "max_slots" else e.name
            raise ValueError(f"--{name.replace('_', '-')}={e.value!r}: {e.expected}") from None


@dataclasses.dataclass(frozen=True)
class SamplingFlags:
    """How answers are sampled where a request does not say."""

    max_tokens: int = flag(SamplingParams.max_tokens, "tokens to generate per request at most.", "N")
    temperature: float = flag(SamplingParams.temperature, "sampling temperature; 0 is greedy.")
    top_p: float = flag(SamplingParams.top_p, "nucleus sampling mass.")
    top_k: int = flag(SamplingParams.top_k, "sample among the k most likely tokens (0: off).")
    min_p: float = flag(SamplingParams.min_p, "drop tokens less likely than min_p times the most likely one.")
    seed: int | None = flag(
        SamplingParams.seed, "random seed for sampling (per request, reproducible whatever shares the batch).", "S"
    )
    stop: list | None = flag(
        None,
        "a stop string, in which \\n, \\t, \\r, \\\\ and \\uXXXX stand for those characters (repeat --stop for more).",
        "STR",
        repeatable=True,
    )
    system_prompt: str | None = flag(None, "a system message for chat lines that have none.", "TEXT")

    def values(self) -> dict:
        """The sampling parameters these flags set (stop strings and the system prompt aside)."""
        names = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "seed")
        return {name: getattr(self, name) for name in names}

    @property
    def stops(self) -> list[str]:
        """--stop's strings, their escapes read."""
        from jaxllama.cli_args import unescape

        return [unescape(s) for s in as_list(self.stop)]


@dataclasses.dataclass(frozen=True)
class HostFlags:
    """A run over several hosts as one jax.distributed group (each flag or its JAX_* environment variable)."""

    coordinator: str | None = flag(
        None, "multi-host: HOST:PORT of process 0 (or JAX_COORDINATOR_ADDRESS).", "HOST:PORT"
    )
    num_processes: int | None = flag(None, "multi-host: number of processes (or JAX_NUM_PROCESSES).", "N")
    process_id: int | None = flag(None, "multi-host: this process's index (or JAX_PROCESS_ID).", "I")

    @property
    def this_process(self) -> int:
        """This process's index in the group (0 where it runs alone)."""
        return self.process_id if self.process_id is not None else int(os.environ.get("JAX_PROCESS_ID", 0))


@dataclasses.dataclass(frozen=True)
class ReplicaFlags:
    """A job answered by independent replicas on a Ray cluster (`jaxllama/ray.py`)."""

    ray: str | None = flag(
        None,
        'run the job as independent replicas on a Ray cluster: "local" (one started on this host), "auto" (the '
        "cluster this host is in) or its ADDRESS; this process reads and writes, the replicas answer (needs the "
        "extra: pip install -e '.[ray]').",
        "local|auto|ADDRESS",
    )
    replicas: int = flag(
        1,
        "with --ray, the engines answering the job, each over its share of the cluster's devices (--mesh: each "
        "replica's).",
        "N",
    )
    replica_processes: int = flag(
        1,
        "with --ray, each replica's processes (one a host, e.g. 4 for a v5e-16), one jax.distributed group over "
        "their devices; the cluster's devices are shared among replicas x processes.",
        "K",
    )

    @property
    def address(self) -> str | None:
        """The cluster's address (--ray alone: "local"), or None without --ray."""
        return None if self.ray is None else "local" if self.ray is True else str(self.ray)


@dataclasses.dataclass(frozen=True)
class Group:
    """A command's use of a group of flags: the group, the flags it leaves out, and other defaults."""

    flags: type
    leave_out: Sequence[str] = ()
    defaults: Mapping[str, object] = dataclasses.field(default_factory=dict)

    def fields(self) -> list[dataclasses.Field]:
        return [f for f in dataclasses.fields(self.flags) if f.name not in self.leave_out]

    def default(self, field: dataclasses.Field):
        return self.defaults.get(field.name, field.default)

    def value(self, given: dict):
        """The group's value from the command's keyword arguments (taking its own out of `given`)."""
        values = {f.name: given.pop(f.name, self.default(f)) for f in self.fields()}
        values |= {name: self.defaults[name] for name in self.leave_out if name in self.defaults}
        return self.flags(**values)


GROUPS = (ModelFlags, EngineFlags, SamplingFlags, HostFlags, ReplicaFlags)


def command(**groups: Group | type) -> Callable:
    """A command whose parameters named in `groups` are each a group of flags: its signature (what the command line,
    --help and fire read) has the groups' flags in their place, and the command gets each group as its value."""
    groups = {name: g if isinstance(g, Group) else Group(g) for name, g in groups.items()}

    def wrap(impl: Callable) -> Callable:
        params = []
        for p in inspect.signature(impl).parameters.values():
            if p.name not in groups:
                params.append(p)
                continue
            group = groups[p.name]
            kind = inspect.Parameter.KEYWORD_ONLY
            params += [
                inspect.Parameter(f.name, kind, default=group.default(f), annotation=f.type) for f in group.fields()
            ]

        @functools.wraps(impl)
        def run(*args, **kwargs):
            values = {name: group.value(kwargs) for name, group in groups.items()}
            return impl(*args, **values, **kwargs)

        positional = [p for p in params if p.kind is not inspect.Parameter.KEYWORD_ONLY]
        run.__signature__ = inspect.Signature(positional + [p for p in params if p not in positional])
        return run

    return wrap


def shared(key: str) -> dict[str, object]:
    """Every group flag's `key` ("help", "metavar"), by flag name: what --help says of a flag a command's docstring
    does not describe."""
    out = {}
    for group in GROUPS:
        for f in dataclasses.fields(group):
            if f.metadata.get(key) is not None:
                out[f.name] = f.metadata[key]
    return out


REPEATABLE = tuple(f.name for group in GROUPS for f in dataclasses.fields(group) if f.metadata["repeatable"])


def as_list(value, kind=str) -> list:
    """A flag's value as a list of `kind`: a repeatable flag's values, one value, or none (None)."""
    if value is None:
        return []
    return [kind(v) for v in (value if isinstance(value, (list, tuple)) else [value])]
