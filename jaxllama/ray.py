"""A job over many hosts as independent replicas of the engine, on Ray: the one module that knows Ray.

`run_job_on_ray` is `jaxllama run JOB --ray ADDRESS --replicas N`: this process (the driver) reads the job, keeps
what an earlier run finished and writes every record in order through the same writer and journal as a one-process
job (`batch/runner.answer_job`); N Ray actors (`Replica`), each one engine over the devices Ray gives it (a host's
TPU chips, some GPUs, or CPU cores), answer blocks of lines (`batch/dispatch.py`: which block goes where, what
becomes of a dead replica's lines). The driver touches no device. A replica that dies is restarted by Ray and its
lines go to whichever replica asks next; a driver that dies is a resume, as for any job.

A replica may span several processes (`--replica-processes K`: a model too large for one host, a 70B on a v5e-16's
four hosts): K actors in a placement group form one jax.distributed group, process 0 (the leader) getting the blocks
and handing each to the others before answering it with them in lockstep (`batch/replica.LockstepLoop`). One of
them lost, the group is restarted whole.

`Answerer` is the same replica for a Ray Data pipeline: `dataset.map_batches(Answerer, fn_constructor_kwargs=...,
concurrency=N)` maps rows holding a prompt or messages (and any sampling fields) to rows with their answers.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import socket
import threading
import time
from collections.abc import Hashable, Iterator
from pathlib import Path

import numpy as np

from jaxllama.batch.dispatch import Dispatcher
from jaxllama.batch.jobs import JobLine
from jaxllama.batch.replica import LockstepLoop, ReplicaLoop
from jaxllama.batch.runner import WINDOW_LINES, Answered, JobOptions, JobStats, Tally, answer_job, job_summary
from jaxllama.engine.options import EngineOptions
from jaxllama.engine.stats import EngineStats

MISSING = "Ray is not installed: pip install -e '.[ray]' (or pip install 'jaxllama[ray]')"
# Per replica, lines in flight: its slots' worth and a block more, so that its engine starts a line as soon as one
# ends, and few lines wait on a replica while another has nothing to do.
BLOCK_OF_SLOTS = 8  # a block: this share of a replica's slots
RESTARTS = 4  # a replica's restarts by Ray before it is given up


def import_ray():
    """Ray, or an ImportError naming the extra that installs it."""
    try:
        import ray
    except ImportError:
        raise ImportError(MISSING) from None
    return ray


@dataclasses.dataclass(frozen=True)
class ReplicaSpec:
    """What each replica loads: the model (a path, a name of the model cache, None for the default) and how."""

    model: str | None = None
    options: EngineOptions = dataclasses.field(default_factory=EngineOptions)
    mesh: str | None = None
    dtype: str | None = None
    chat_template: str | None = None
    eos_ids: tuple[int, ...] = ()
    processes: int = 1  # a replica's processes (one a host), one jax.distributed group where more than one

    def resolve(self) -> Path:
        """The model's converted checkpoint on this host (converted here first where it is a name not yet in the
        model cache)."""
        from jaxllama.default_model import resolve_model

        return Path(resolve_model(self.model, progress=False))

    def load(self, path: Path | None = None):
        """The model loaded (from `path`: `resolve`'s, where the caller has it)."""
        from jaxllama.llm import LLM

        path = path or self.resolve()
        return LLM.load(
            path,
            self.options,
            mesh=self.mesh,
            chat_template=self.chat_template,
            extra_eos_ids=list(self.eos_ids),
            dtype=self.dtype,
        )


class Replica:
    """One engine answering blocks of a job's lines (a Ray actor's class: `ray.remote(Replica)`): alone (`rank` None),
    or as process `rank` of a replica over `spec.processes` processes, which joins its group in `join`."""

    def __init__(self, spec: ReplicaSpec, options: JobOptions, rank: int | None = None):
        self.spec, self.options, self.rank = spec, options, rank
        self.loop = ReplicaLoop(spec.load(), options) if rank is None else None
        self.followers: list = []
        self._lockstep = threading.Lock()

    def describe(self) -> dict:
        import jax

        devices = jax.devices()
        where = f" over {jax.process_count()} processes" if jax.process_count() > 1 else ""
        return {
            "node": socket.gethostname(),
            "pid": os.getpid(),
            "devices": f"{len(devices)} {devices[0].platform}{where}",
        }

    def coordinator(self) -> str:
        """An address for the group's jax.distributed coordinator, on this actor's node."""
        ray = import_ray()
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return f"{ray.util.get_node_ip_address()}:{port}"

    def join(self, coordinator: str) -> dict:
        """Join the group as process `rank` and load this process's share of the model (every process at once)."""
        from jaxllama.engine.runtime import initialize_distributed

        path = _resolve_on_this_node(self.spec)
        initialize_distributed(coordinator, self.spec.processes, self.rank)
        self.loop = LockstepLoop(self.spec.load(path), self.options)
        return self.describe()

    def lead(self, followers: list) -> dict:
        """As process 0: form the group with `followers` (the other processes' actors) and load the model."""
        ray = import_ray()
        address = self.coordinator()
        joined = [f.join.remote(address) for f in followers]
        about = self.join(address)
        ray.get(joined)
        self.followers = followers
        return about

    def answer(self, lines: list[JobLine]) -> tuple[list[Answered], int, float]:
        """The block's records, this process's id and the seconds its engine has been busy."""
        if not self.followers:
            return self.loop.answer(lines), os.getpid(), self.loop.stats.busy_s
        with self._lockstep:  # the followers get the blocks in the order this process answers them
            ray = import_ray()
            theirs = [f.answer.remote(lines) for f in self.followers]
            threading.Thread(target=_die_with, args=(ray, theirs), daemon=True).start()
            answers = self.loop.answer(lines)
            ray.get(theirs)
        return answers, os.getpid(), self.loop.stats.busy_s

    def engine_stats(self) -> tuple[EngineStats, int]:
        return self.loop.llm.stats, self.loop.llm.slots


def _resolve_on_this_node(spec: ReplicaSpec) -> Path:
    """`spec.resolve()` in a task on this actor's node: a conversion starts JAX, which this process must not do before
    it joins its group."""
    ray = import_ray()
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
    return ray.get(ray.remote(num_cpus=0)(ReplicaSpec.resolve).options(scheduling_strategy=here).remote(spec))


def _die_with(ray, refs: list) -> None:
    """End this process if a follower's part of a block fails (its process lost): this process would otherwise wait
    in a collective for it for good, and its end tells the driver that the group is lost."""
    try:
        ray.get(refs)
    except Exception:  # noqa: BLE001 - any failure of a follower is the group's
        os._exit(1)


@dataclasses.dataclass
class _Seat:
    """A replica as the driver sees it: its actor, what it has in flight, and its figures over its restarts."""

    index: int
    actor: object  # the replica's actor (its process 0's, where it has several)
    about: dict
    group: tuple = ()  # a replica over several processes: the others' actors, and their placement group
    in_flight: dict = dataclasses.field(default_factory=dict)  # object ref -> block
    busy_s: dict = dataclasses.field(default_factory=dict)  # by process id: that incarnation's busy seconds
    lines: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    restarts: int = 0
    loading: object = None  # a restarted replica's first call, until its model is loaded
    dead: bool = False

    @property
    def ready(self) -> bool:
        return not self.dead and self.loading is None

    def figures(self, wall_s: float) -> dict:
        busy = sum(self.busy_s.values())
        return {
            "replica": self.index,
            **self.about,
            "lines": self.lines,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "output_tok_s": round(self.completion_tokens / busy, 2) if busy else 0.0,
            "busy_share": round(min(1.0, busy / max(wall_s, 1e-9)), 3),
            "restarts": self.restarts,
        }


def connect(address: str | None = "local", num_cpus: int | None = None):
    """Join the Ray cluster at `address` ("auto": the one this host belongs to), or start one on this host
    ("local", None) with `num_cpus` logical cores (default: the host's)."""
    ray = import_ray()
    if not ray.is_initialized():
        local = address in (None, "local")
        ray.init(address=None if local else address, num_cpus=num_cpus if local else None, include_dashboard=False)
    return ray


def process_resources(ray, processes: int) -> dict:
    """Each replica process's share of the cluster (`processes`: all the job's): its TPU chips or GPUs where there
    are, else its CPU cores (and as many threads for the CPU kernels)."""
    total = ray.cluster_resources()
    if total.get("TPU"):
        return {"num_cpus": 1, "resources": {"TPU": total["TPU"] // processes}}
    if total.get("GPU"):
        return {"num_cpus": 1, "num_gpus": total["GPU"] // processes}
    cores = max(1, int(total.get("CPU", 1)) // processes)
    env = {"JAXLLAMA_KERNEL_THREADS": str(cores), "JAX_PLATFORMS": "cpu"}  # no accelerator plugin is probed
    return {"num_cpus": cores, "runtime_env": {"env_vars": env}}


def _bundle(resources: dict) -> dict:
    """A placement group's bundle holding what an actor started with `resources` takes."""
    return {
        "CPU": resources.get("num_cpus", 1),
        **({"GPU": resources["num_gpus"]} if "num_gpus" in resources else {}),
        **resources.get("resources", {}),
    }


def _start(ray, actor_class, resources: dict, spec: ReplicaSpec, options: JobOptions) -> tuple[object, tuple, object]:
    """Start a replica: (its actor, the group's other actors and placement group, the reference that is ready once
    its model is loaded, to `describe` it). A replica over several processes is placed one process to a node where
    the cluster has nodes enough (a soft spread: a one-host cluster holds them all)."""
    if spec.processes == 1:
        actor = actor_class.options(**resources).remote(spec, options)
        return actor, (), actor.describe.remote()
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    group = placement_group([_bundle(resources)] * spec.processes, strategy="SPREAD")
    members = []
    for rank in range(spec.processes):
        placed = PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=rank)
        ordered = {"max_concurrency": 1} if rank else {}  # a follower answers its blocks in the order they are sent
        actor = actor_class.options(**resources, **ordered, scheduling_strategy=placed)
        members.append(actor.remote(spec, options, rank))
    leader, followers = members[0], members[1:]
    return leader, (*followers, group), leader.lead.remote(followers)


def _stop(ray, seat: _Seat) -> None:
    """Kill a replica's actors, and free its placement group."""
    ray.kill(seat.actor)
    *followers, group = seat.group or (None,)
    for actor in followers:
        ray.kill(actor)
    if group is not None:
        ray.util.remove_placement_group(group)


def run_job_on_ray(
    job: Path,
    output: Path | None,
    options: JobOptions,
    spec: ReplicaSpec,
    replicas: int,
    address: str | None = "local",
    block_lines: int | None = None,
    replica_class: type = Replica,
) -> tuple[JobStats, dict]:
    """Run a job file on `replicas` replicas of `spec` on a Ray cluster (`connect`'s `address`). Blocks of
    `block_lines` lines (default: an eighth of a replica's slots); `replica_class`: `Replica` or one like it.
    Returns (job statistics, summary dict: `run_job`'s, with "replicas": their figures). Raises what `run_job`
    raises, and RuntimeError when every replica is lost."""
    processes = replicas * spec.processes
    ray = connect(address, num_cpus=max(os.cpu_count() or 1, processes))  # a local cluster: a core a process at least
    block, in_flight = _blocks(spec, block_lines)
    actor_class = ray.remote(max_restarts=0, max_concurrency=in_flight + 1)(replica_class)
    seats: list[_Seat] = []
    start, loaded = time.perf_counter(), []

    def answer(lines: Iterator[JobLine], tally: Tally) -> None:
        lines = iter(lines)
        first = next(lines, None)
        if first is None:
            return
        lines = itertools.chain([first], lines)
        resources = process_resources(ray, processes)

        def restart(seat: _Seat) -> None:
            _stop(ray, seat)
            if seat.restarts == RESTARTS:
                seat.dead = True
                return
            seat.restarts += 1
            seat.actor, seat.group, seat.loading = _start(ray, actor_class, resources, spec, options)

        started = [_start(ray, actor_class, resources, spec, options) for _ in range(replicas)]
        abouts = ray.get([ready for *_, ready in started])  # each model loaded, or its failure raised here
        loaded.append(time.perf_counter() - start)
        for i, ((actor, group, _), about) in enumerate(zip(started, abouts, strict=True)):
            seats.append(_Seat(i, actor, about, group))
        _drive(ray, _Feed(lines, Dispatcher(block), replicas * in_flight), seats, tally, restart, in_flight)

    stats = answer_job(job, output, options, answer, agree=False)
    wall = time.perf_counter() - start
    out = _summary(ray, stats, seats)
    out["replicas_loaded_s"] = round(loaded[0], 3) if loaded else 0.0  # of wall_s: starting the replicas
    out["replicas"] = [seat.figures(wall) for seat in seats]
    for seat in seats:
        _stop(ray, seat)
    return stats, out


def _blocks(spec: ReplicaSpec, block_lines: int | None) -> tuple[int, int]:
    """(lines a block, blocks in flight at a replica): blocks of an eighth of its slots (or `block_lines`), enough
    in flight to keep them full; a replica over several processes answers a block whole, one after another: a block
    fills the slots, the next one waits its turn."""
    if spec.processes == 1:
        block = block_lines or max(1, spec.options.max_slots // BLOCK_OF_SLOTS)
        return block, -(-spec.options.max_slots // block) + 1
    return block_lines or spec.options.max_slots, 2


def _summary(ray, stats: JobStats, seats: list[_Seat]) -> dict:
    """`run_job`'s summary of the job, its engine figures summed over the replicas still answering."""
    engines, slots = EngineStats(), 0
    for seat in seats:
        if seat.dead:
            continue
        try:
            e, n = ray.get(seat.actor.engine_stats.remote())
        except ray.exceptions.RayError:
            continue
        engines = EngineStats(**{f.name: getattr(engines, f.name) + getattr(e, f.name) for f in dataclasses.fields(e)})
        slots += n
    return job_summary(stats, engines, slots) | {"hosts": []}


class _Feed:
    """The job's lines into the dispatcher, a window at a time, whenever it has fewer blocks waiting than `blocks`
    (every replica's in flight): the driver holds a window or two of the job, whatever its length."""

    def __init__(self, lines: Iterator[JobLine], dispatcher: Dispatcher, blocks: int):
        self.lines, self.dispatcher, self.blocks = lines, dispatcher, blocks

    def top_up(self) -> Dispatcher:
        d = self.dispatcher
        while not d.closed and d.pending < self.blocks:
            window = list(itertools.islice(self.lines, WINDOW_LINES))
            d.add(window)
            if len(window) < WINDOW_LINES:
                d.close()
        return d


def _drive(ray, feed: _Feed, seats: list[_Seat], tally: Tally, restart, in_flight: int) -> None:
    """Keep every live replica fed with up to `in_flight` blocks until every line is answered."""
    while not (dispatcher := feed.top_up()).finished:
        for seat in seats:
            while seat.ready and len(seat.in_flight) < in_flight:
                lines = dispatcher.next_block(seat.index, busy=bool(seat.in_flight))
                if lines is None:
                    break
                seat.in_flight[seat.actor.answer.remote(lines)] = lines
        refs = {ref: seat for seat in seats for ref in [*seat.in_flight, *filter(None, [seat.loading])]}
        if not refs:
            raise RuntimeError(
                f"every replica was lost; {dispatcher.unfinished} lines unanswered (run again to resume)"
            )
        ready, _ = ray.wait(list(refs), num_returns=1)
        for ref in ready:
            seat = refs[ref]
            if ref is seat.loading:  # a restarted replica
                seat.loading = None
                try:
                    seat.about = ray.get(ref)
                except ray.exceptions.RayError:
                    _lost(seat, dispatcher, tally, restart)
                continue
            if ref not in seat.in_flight:  # its replica was lost, its lines handed back already
                continue
            try:
                answers, pid, busy_s = ray.get(ref)
            except ray.exceptions.RayError:  # the process died, or its engine stopped
                _lost(seat, dispatcher, tally, restart)
                continue
            seat.in_flight.pop(ref)
            seat.busy_s[pid] = busy_s
            for a in answers:
                tally.add(a)
                seat.lines += 1
                seat.prompt_tokens += a.prompt_tokens
                seat.completion_tokens += a.completion_tokens
            dispatcher.done(seat.index, answers)


def _lost(seat: _Seat, dispatcher: Dispatcher, tally: Tally, restart) -> None:
    """A replica died (or its engine stopped): the lines it had go back to the dispatcher (or, out of tries, become
    error records), and a new replica takes its seat, up to RESTARTS times."""
    for block in seat.in_flight.values():
        for a in dispatcher.lost(seat.index, block):
            tally.add(a)
    seat.in_flight.clear()
    restart(seat)


class Answerer:
    """A replica for Ray Data: `dataset.map_batches(Answerer, fn_constructor_kwargs={"model": ...}, concurrency=N,
    batch_size=64, batch_format="pyarrow")` (pyarrow keeps a column of integers with gaps integers; numpy's batches
    make them floats, which a line's integer fields refuse). Each row holds "messages" (a chat) or "prompt" (a
    completion), and optionally any field a job line takes (max_tokens, temperature, seed, stop, ...); the rows come
    back with "answer" (the generated text, or None), "finish_reason", "prompt_tokens", "completion_tokens" and
    "error" (None, or what was wrong with the row). `model` and `options` are `ReplicaSpec`'s, the other keywords
    `JobOptions`' (`defaults`, `stop`, `system_prompt`)."""

    def __init__(self, model: str | None = None, options: EngineOptions | None = None, **job_options):
        spec = ReplicaSpec(model, options or EngineOptions())
        self.loop = ReplicaLoop(spec.load(), JobOptions(quiet=True, **job_options))
        self._numbered = 0

    def __call__(self, batch) -> dict[str, np.ndarray]:
        if hasattr(batch, "to_pylist"):  # batch_format="pyarrow": a field a row lacks is None, an integer an int
            rows = batch.to_pylist()
            batch = {name: batch.column(name).to_pylist() for name in batch.column_names}
        else:  # numpy: a field a row lacks is None, or NaN in a column of numbers
            rows = [dict(zip(batch, values, strict=True)) for values in zip(*batch.values(), strict=True)]
        lines = [
            JobLine(self._numbered + i + 1, self._numbered + i + 1, False, _plain(row)) for i, row in enumerate(rows)
        ]
        self._numbered += len(rows)
        by_number = {a.number: a for a in self.loop.answer(lines)}
        out = {k: list(v) for k, v in batch.items()}
        columns = {"answer": [], "finish_reason": [], "prompt_tokens": [], "completion_tokens": [], "error": []}
        for line in lines:
            record = by_number[line.number].record
            error = record.get("error")
            message = record.get("message")
            columns["answer"].append(message["content"] if message else record.get("text"))
            columns["finish_reason"].append(record.get("finish_reason"))
            columns["prompt_tokens"].append(record.get("usage", {}).get("prompt_tokens", 0))
            columns["completion_tokens"].append(record.get("usage", {}).get("completion_tokens", 0))
            columns["error"].append(None if error is None else error["message"])
        return {k: np.asarray(v, dtype=object) for k, v in {**out, **columns}.items()}


def _plain(row: dict) -> dict:
    """A Ray Data row as a job line's object: numpy values as the JSON values they stand for; a field the row has
    only because other rows have it (None) left out."""
    out: dict[Hashable, object] = {}
    for k, v in row.items():
        if v is None or (isinstance(v, float | np.floating) and np.isnan(v)):
            continue
        if isinstance(v, np.ndarray):
            v = [_plain(x) if isinstance(x, dict) else x for x in v.tolist()]
        elif isinstance(v, np.generic):
            v = v.item()
        out[k] = v
    return out
