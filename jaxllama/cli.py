"""The `jaxllama` command: `run` a batch job, `serve` the OpenAI API, `info` about a checkpoint, `chat` in the terminal,
`compile` the engine for a target (a TPU slice) to see whether a model fits and how fast it would run.

jaxllama run jobs/eval.jsonl [--model PATH] [--output OUT.jsonl] ...
jaxllama serve [--model PATH] [--host 127.0.0.1] [--port 8000] ...
jaxllama info [PATH]
jaxllama chat [--model PATH]

Each command's flags are its keyword parameters, those that several commands share written once in groups
(`cli_flags.py`) and passed to the command as values; --help describes a flag from the command's docstring (`Args:`),
or from its group where the docstring does not.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import sys

import fire

from jaxllama import cli_flags
from jaxllama.cli_flags import (
    EngineFlags,
    Group,
    HostFlags,
    ModelFlags,
    ReplicaFlags,
    SamplingFlags,
    as_list,
    command,
)
from jaxllama.errors import ModelTooLarge

log = logging.getLogger("jaxllama.cli")  # not __name__: run as a program, that is __main__

REPEATABLE = cli_flags.REPEATABLE  # flags given once per value
# Exit statuses besides 0 (done): 1, a job ended with error records for some lines; 2, a command line, flag value or
# input refused before work began; CRASHED, a failure nothing expected (a bug, with its traceback); INTERRUPTED, Ctrl-C.
CRASHED, INTERRUPTED = 3, 130
# What loading a model may fail with that is the user's to fix (a path, a checkpoint, the memory): one error line.
LOAD_ERRORS = (ValueError, OSError, ModelTooLarge)


def _load(flags: ModelFlags, options, *, quiet=False):
    """The model a command runs (`flags.model`: a path or None for the default model), its engine sized and run by
    `options` (`EngineOptions`, checked already: a flag's bad value is refused before anything loads)."""
    from jaxllama.core.config import ModelConfig, check_dtype
    from jaxllama.default_model import resolve_model
    from jaxllama.engine.runtime import initialize_distributed
    from jaxllama.llm import LLM

    check_dtype(flags.dtype)
    _log_to_stderr(logging.WARNING if quiet else logging.INFO)
    initialize_distributed()  # a multi-host run by JAX's environment variables, where `run` has not joined one
    path = resolve_model(flags.model, progress=not quiet)
    log.info("loading %s (%.0f M parameters)", path, ModelConfig.load(path).n_params / 1e6)
    extra = flags.eos_ids
    llm = LLM.load(
        path, options, mesh=flags.mesh, chat_template=flags.chat_template, extra_eos_ids=extra, dtype=flags.dtype
    )
    _warn_if_cpu_mesh(llm)
    return llm


def _replica_spec(replicas: ReplicaFlags, hosts: HostFlags, flags: ModelFlags, options):
    """What each replica of a `--ray` job loads; the flags checked, and Ray's presence, before anything starts."""
    from jaxllama.core.config import check_dtype
    from jaxllama.ray import ReplicaSpec, import_ray

    for name, value in (("--replicas", replicas.replicas), ("--replica-processes", replicas.replica_processes)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            _fail(f"{name} {value!r}: must be a whole number of at least 1")
    if hosts.coordinator is not None:
        _fail(
            "--ray and --coordinator: Ray forms each replica's group itself; for a replica over several hosts, "
            "--replica-processes N"
        )
    try:
        import_ray()
    except ImportError as e:
        _fail(f"--ray: {e}")
    check_dtype(flags.dtype)
    return ReplicaSpec(
        flags.model,
        options,
        mesh=flags.mesh,
        dtype=flags.dtype,
        chat_template=flags.chat_template,
        eos_ids=tuple(flags.eos_ids),
        processes=replicas.replica_processes,
    )


def _log_to_stderr(level: int) -> None:
    """Show jaxllama's log records of `level` and above on stderr, as plain lines that leave progress bars whole, and
    only there (not also through a handler that a library put on the root logger)."""
    logger = logging.getLogger("jaxllama")
    logger.setLevel(level)
    logger.propagate = False
    if not any(isinstance(h, _TqdmHandler) for h in logger.handlers):
        logger.addHandler(_TqdmHandler())


class _TqdmHandler(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        from tqdm import tqdm

        tqdm.write(self.format(record), file=sys.stderr)


def _warn_if_cpu_mesh(llm) -> None:
    import jax

    from jaxllama.core.ops import XLA

    if jax.default_backend() == "cpu" and llm.mesh.size > 1 and llm.engine.ops is XLA:
        log.warning(
            "a mesh of %d CPU devices runs XLA's operations: the CPU kernels run on one device, several times "
            "faster (--mesh data=1,model=1)",
            llm.mesh.size,
        )


@command(model=ModelFlags, engine=EngineFlags, sampling=SamplingFlags, hosts=HostFlags, replicas=ReplicaFlags)
def run(
    job: str,
    *,
    output: str | None = None,
    model: ModelFlags,
    sampling: SamplingFlags,
    engine: EngineFlags,
    overwrite: bool = False,
    no_retry_errors: bool = False,
    stats_file: str | None = None,
    quiet: bool = False,
    hosts: HostFlags,
    replicas: ReplicaFlags,
):
    """Run a JSONL job: one request per line (chat "messages", plain "prompt", or OpenAI Batch API lines).

    Writes one line per input line, in order, to OUTPUT (default: JOB.out.jsonl beside the job), keeping each
    finished line at once in OUTPUT.journal. Running the same command again (after a kill or Ctrl-C, or to
    retry failed lines) resumes: lines already answered are kept, lines whose record is an error run again; it is
    refused if the settings differ from those OUTPUT was written with; --overwrite starts over. Per-line
    parameters override the options below. Exit status 1 when any line of the job has an error record, 2 when the
    command line or settings are refused before it runs, 3 when it fails unexpectedly (a bug), 130 when
    interrupted.

    Args:
      job: the JSONL job file.
      output: the output JSONL file.
      overwrite: start over instead of resuming.
      no_retry_errors: on resume, keep the error records of failed lines instead of running them again.
      stats_file: also write the summary statistics as JSON here.
      quiet: no progress or summary on stderr.
    """
    from pathlib import Path

    from jaxllama.batch.lock import OutputLock
    from jaxllama.batch.runner import JobInterrupted, JobOptions, default_output, run_job
    from jaxllama.batch.settings import SettingsChanged, check_settings
    from jaxllama.engine.runtime import initialize_distributed, is_main_process

    job_path = Path(job)
    if not job_path.is_file():
        _fail(f"{job}: no such job file")
    on_ray = replicas.address is not None
    try:
        defaults, settings, engine_options = _job_settings(job_path, model, sampling, engine)
        out_path = Path(output) if output else default_output(job_path)
        if on_ray:
            spec = _replica_spec(replicas, hosts, model, engine_options)
        else:
            initialize_distributed(hosts.coordinator, hosts.num_processes, hosts.process_id)
        main = on_ray or is_main_process()  # process 0 of a multi-host run writes the output
        # Before the model loads, held until the process ends: one writer per output.
        lock = OutputLock(out_path).acquire() if main else None
        if not overwrite:  # before the model loads: a resume with other settings is refused at once
            check_settings(out_path, settings)
        if not on_ray:
            llm = _load(model, engine_options, quiet=quiet or hosts.this_process != 0)
    except LOAD_ERRORS as e:
        _fail(str(e))
    options = JobOptions(
        defaults=defaults,
        stop=tuple(sampling.stops),
        system_prompt=sampling.system_prompt,
        overwrite=overwrite,
        write=main,
        retry_errors=not no_retry_errors,
        settings=settings,
        quiet=quiet or not main,
    )
    try:
        if on_ray:
            from jaxllama.ray import run_job_on_ray

            stats, summary = run_job_on_ray(job_path, out_path, options, spec, replicas.replicas, replicas.address)
        else:
            stats, summary = run_job(llm, job_path, Path(output) if output else None, options)
    except (OSError, SettingsChanged) as e:
        _fail(str(e))
    except JobInterrupted as e:
        print(f"interrupted: {e}", file=sys.stderr)
        sys.exit(INTERRUPTED)
    if main:
        _report_job(summary, output or default_output(job_path), stats_file, quiet)
    if lock is not None:
        lock.release()
    if stats.has_errors:
        sys.exit(1)


def _job_settings(job_path, model: ModelFlags, sampling: SamplingFlags, engine: EngineFlags):
    """`run`'s (sampling defaults, settings its output is written with, engine options): the defaults checked as a
    job line's fields are; no more slots than the job has lines (a slot's KV cache is allocated whether or not a line
    uses it)."""
    from jaxllama.batch.jobs import count_lines
    from jaxllama.batch.settings import job_settings
    from jaxllama.engine.request import SamplingParams
    from jaxllama.protocol.requests import sampling_params

    defaults = sampling_params(sampling.values(), SamplingParams())
    options = dict(chat_template=model.chat_template, eos_id=model.eos_ids, quantize=model.quantize)
    options.update(dtype=model.dtype, kv_cache_dtype=engine.kv_cache_dtype, max_context=engine.max_context)
    settings = job_settings(model.model, defaults, sampling.stops, sampling.system_prompt, **options)
    engine_options = engine.options(model.quantize)
    slots = min(engine_options.max_slots, max(1, count_lines(job_path)))
    return defaults, settings, dataclasses.replace(engine_options, max_slots=slots)


def _report_job(summary: dict, output, stats_file: str | None, quiet: bool) -> None:
    """A finished job's summary on stderr (unless `quiet`) and in `stats_file`."""
    from pathlib import Path

    from jaxllama.batch.runner import print_summary

    if not quiet:
        print_summary(summary)
        print(f"wrote {output}", file=sys.stderr)
    if stats_file:
        Path(stats_file).write_text(json.dumps(summary, indent=2) + "\n")


@command(model=ModelFlags, engine=EngineFlags)
def serve(
    *,
    model: ModelFlags,
    host: str = "127.0.0.1",
    port: int = 8000,
    served_model_name: str | None = None,
    max_tokens: int | None = None,
    engine: EngineFlags,
    max_queue: int = 256,
    log_level: str = "info",
):
    """Serve the OpenAI API: POST /v1/chat/completions and /v1/completions (streamed with "stream": true),
    GET /v1/models, /health and /metrics (Prometheus). Concurrent requests share the engine's slots.

    Args:
      host: the address to listen on.
      port: the port to listen on.
      served_model_name: the model's name in /v1/models and in answers (default: the checkpoint folder's).
      max_tokens: tokens per answer when a request does not say (default: up to the context limit).
      max_queue: samples (prompts x n) waiting for a slot at most; a request beyond is answered 429.
      log_level: uvicorn's log level (debug, info, warning, error).
    """
    import uvicorn

    from jaxllama.server.app import create_app

    try:
        options = engine.options(model.quantize)
        quiet = log_level.lower() not in ("debug", "info", "trace")
        llm = _load(model, options, quiet=quiet)
        app = create_app(llm, model_name=served_model_name, max_queue=max_queue, max_tokens=max_tokens)
    except LOAD_ERRORS as e:
        _fail(str(e))
    uvicorn.run(app, host=host, port=int(port), log_level=log_level)


@command(model=Group(ModelFlags, leave_out=("chat_template", "eos_id")), engine=Group(EngineFlags, ("decode_steps",)))
def compile(
    *,
    model: ModelFlags,
    topology: str | None = None,
    stored_as: str | None = None,
    engine: EngineFlags,
    prefill=None,
    json: bool = False,
    hlo_dir: str | None = None,
    job: str | None = None,
    price: float | None = None,
    assume_output: int | None = None,
    max_tokens: int | None = None,
):
    """Compile the engine for a target, without weights or the target's hardware, and say whether the model fits and
    how fast a decode step would run: memory per device, flops, HBM traffic, the compiler's cycle estimate and the
    collectives of every program, against the ideal step (weights and live KV cache per device / HBM bandwidth).
    Exit status 2 when the model is refused before compiling (or the compiler cannot fit a program), 1 when the
    compiled programs' temporaries leave it past a device's memory (the figures printed).

    Args:
      model: a known shape (smollm2-135m, llama-3.2-1b, llama-3.2-3b, llama-3.1-8b, llama-3.1-70b, llama-3.1-405b,
        qwen2.5-7b, qwen3-8b, mixtral-8x7b)
        or a checkpoint (only its config is read); default: the default model.
      topology: a TPU slice to compile for on this host, e.g. v5e:2x4, v5e:4x4, v6e:2x4, v5p:2x2x2 (needs libtpu:
        pip install -e '.[tpu]'); default: this machine's devices.
      mesh: device mesh, e.g. data=1,model=8 (default: of those that fit, the one whose decode step reads the
        fewest bytes per device).
      max_context: context in positions (default: on an accelerator the longest that fits, at most the model's).
      dtype: float32, bfloat16 or float16: every weight in it (default: the checkpoint's; bfloat16 for a shape).
      stored_as: q8_0 or q4_0: the model's products' weights taken as stored as llama.cpp's blocks of 32, as a
        converted GGUF of that type holds them; a TPU or GPU reads them as int8 weights.
      prefill: the prefills to compile, ROWSxTOKENS separated by commas (default: 1xCONTEXT-1,8x512).
      json: print the report as one JSON object.
      hlo_dir: also write each compiled program's optimized HLO into this folder.
      job: a job file (as `jaxllama run` reads it): predict its wall time, tok/s, time to first token, slot
        occupancy and chip-hours, the engine's scheduler running its lines on the clock of the compiled programs'
        costs (estimated for a topology, measured on the local devices); each answer as long as its max_tokens.
      price: dollars per chip-hour, for the job's cost.
      assume_output: with --job, each answer at most this many tokens (a mean guess where max_tokens is a cap).
      max_tokens: with --job, the max_tokens of lines that give none (default: as `jaxllama run`'s).
    """
    import json as json_module

    from jaxllama.llm import LLM

    _log_to_stderr(logging.INFO)
    try:
        prefills = [_rows_by_tokens(p) for p in as_list(prefill) for p in p.split(",") if p] or None
        options = engine.options(model.quantize)
        # `--quantize` travels in `options`, checked there with the flag's name in the error
        target = dict(topology=topology, stored_as=stored_as, options=options, mesh=model.mesh, dtype=model.dtype)
        report = LLM.compile_for(model.model, prefills=prefills, **target)
    except LOAD_ERRORS as e:
        _fail(str(e))
    prediction = None
    if job is not None:
        try:
            prediction = _predict_job(job, model, target, price, assume_output, max_tokens)
        except LOAD_ERRORS as e:
            _fail(str(e))
    if json:
        print(json_module.dumps(report.to_json() | ({"job": prediction} if prediction else {}), indent=1))
    else:
        print(report.table())
        if prediction:
            print("\n" + prediction.pop("table"))
    if hlo_dir is not None:
        log.info("wrote %d programs' HLO into %s", len(report.write_hlo(hlo_dir)), hlo_dir)
    if not report.fits:
        print("error: the model does not fit the target's devices (see the memory per device above)", file=sys.stderr)
        sys.exit(1)


def _predict_job(job, flags: ModelFlags, target: dict, price, assume_output, max_tokens) -> dict:
    """`compile --job`: the job's sizes read as `run` reads its lines (text through the checkpoint's tokenizer and chat
    template; a shape's lines must give token ids), then its predicted run (`LLM.predict_job`), as JSON with its
    table under "table". `target`: `compile_for`'s arguments but the model."""
    from pathlib import Path

    from jaxllama.batch.job_sizes import SizesOnly, TokenIdsOnly, job_sizes
    from jaxllama.core.checkpoint import load_config
    from jaxllama.core.shapes import known_shape
    from jaxllama.default_model import resolve_model
    from jaxllama.engine.request import SamplingParams
    from jaxllama.llm import LLM, _load_text
    from jaxllama.text.prompts import PromptEncoder

    model = flags.model
    if isinstance(model, str) and known_shape(model) is not None:
        encoder = TokenIdsOnly()
    else:
        path = resolve_model(model)
        tokenizer, template, _ = _load_text(Path(path), None, None, ())
        encoder = SizesOnly(PromptEncoder(tokenizer, template, None, load_config(path).vocab_size))
    defaults = SamplingParams() if max_tokens is None else SamplingParams(max_tokens=int(max_tokens))
    sizes = job_sizes(Path(job), encoder, defaults, assume_output=assume_output)
    for number, why in list(sizes.refused.items())[:5]:
        log.warning("%s line %d refused: %s", job, number, why)
    p = LLM.predict_job(model, sizes.requests, price=price, **target)
    out = p.to_json() | {"lines": sizes.lines, "refused_lines": len(sizes.refused)}
    return out | {"table": f"{sizes.lines} lines, {len(sizes.refused)} refused by `run`\n" + p.table()}


def _rows_by_tokens(text: str) -> tuple[int, int]:
    rows, x, tokens = text.strip().partition("x")
    if not (x and rows.isdigit() and tokens.isdigit()):
        raise ValueError(f"--prefill {text!r}: expected ROWSxTOKENS, e.g. 8x512")
    return int(rows), int(tokens)


def info(path: str | None = None):
    """Describe a checkpoint: config, parameter count, dtype, tokenizer, chat template, end-of-generation ids.

    Args:
      path: a checkpoint: converted, or a GGUF file, Hugging Face or Meta folder (converted once into the
        cache); default: the default model.
    """
    from jaxllama.core.config import ModelConfig
    from jaxllama.default_model import resolve_model
    from jaxllama.text.chat_template import ChatTemplate
    from jaxllama.text.end_of_generation import end_of_generation_ids, load_generation_config
    from jaxllama.text.loading import load_tokenizer

    _log_to_stderr(logging.INFO)
    try:
        folder = resolve_model(path)
        config = ModelConfig.load(folder)
        tok = load_tokenizer(folder)
        template = ChatTemplate.from_checkpoint(folder, special_tokens=tok.special_tokens)
        eos = end_of_generation_ids(
            tok, generation_config=load_generation_config(folder), template_text=template.source
        )
    except LOAD_ERRORS as e:
        _fail(str(e))
    print(f"checkpoint: {folder}")
    forms = sorted({form for _, form in config.stored_as})
    stored = ", ".join([config.dtype, *(f"{f} ({sum(g == f for _, g in config.stored_as)} weights)" for f in forms)])
    print(f"parameters: {config.n_params / 1e6:.1f} M, stored as {stored}")
    print(f"config: {json.dumps({k: v for k, v in config.to_dict().items() if k != 'stored_as'})}")
    print(
        f"tokenizer: {type(tok).__name__}, vocab {tok.vocab_size}, bos {tok.bos_token!r} ({tok.bos_id}), "
        f"eos {tok.eos_token!r} ({tok.eos_id}), adds bos: {tok.add_bos}"
    )
    print(f"chat template: {template.name}")
    print("end of generation: " + ", ".join(f"{i} {tok.id_to_token(i)!r}" for i in sorted(eos)))


@command(
    model=Group(ModelFlags, leave_out=("eos_id",)),
    engine=Group(EngineFlags, leave_out=("max_batch", "max_context", "decode_steps"), defaults={"max_batch": 1}),
    sampling=Group(
        SamplingFlags,
        leave_out=("top_k", "min_p", "stop"),
        defaults={"max_tokens": 512, "temperature": 0.7, "top_p": 0.95, "seed": None},
    ),
)
def chat(*, model: ModelFlags, sampling: SamplingFlags, engine: EngineFlags):
    """Chat with a model in the terminal, the reply streamed as it is generated. Ctrl-D or /exit to quit.

    Args:
      system_prompt: a system message for the conversation.
      max_tokens: tokens per reply at most.
      seed: random seed.
    """
    try:
        llm = _load(model, engine.options(model.quantize))
    except LOAD_ERRORS as e:
        _fail(str(e))
    messages = [{"role": "system", "content": sampling.system_prompt}] if sampling.system_prompt else []
    while True:
        try:
            user = input("you> ")
        except EOFError:
            print()
            return
        if user.strip() in ("/exit", "/quit"):
            return
        messages.append({"role": "user", "content": user})
        print("model> ", end="", flush=True)
        reply = []
        params = dict(max_tokens=sampling.max_tokens, temperature=sampling.temperature, top_p=sampling.top_p)
        for piece in llm.chat(messages, stream=True, seed=sampling.seed, **params):
            reply.append(piece)
            print(piece, end="", flush=True)
        print()
        messages.append({"role": "assistant", "content": "".join(reply)})


def _fail(message: str):
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


COMMANDS = {"run": run, "serve": serve, "info": info, "chat": chat, "compile": compile}

# What --help says of a flag of a group (`cli_flags.py`) where a command's docstring (`Args:`) does not: that says
# it only where the flag means something else there (compile's --model also takes a known shape).
FLAG_HELP = cli_flags.shared("help")

# How --help and the README write the value of an argument without a default (one with a default shows it).
METAVARS = cli_flags.shared("metavar") | {
    "job": "JOB.jsonl",
    "path": "CKPT",
    "output": "OUT.jsonl",
    "stats_file": "stats.json",
    "served_model_name": "NAME",
    "topology": "v5e:2x4",
    "stored_as": "q8_0|q4_0",
    "prefill": "8x512",
    "hlo_dir": "DIR",
    "price": "USD",
    "assume_output": "N",
}


def main(argv: list[str] | None = None):
    from jaxllama import __version__
    from jaxllama.cli_args import check_argv

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    argv = list(sys.argv[1:] if argv is None else argv)
    command = check_argv(
        "jaxllama", COMMANDS, argv, version=__version__, metavars=METAVARS, repeatable=REPEATABLE, helps=FLAG_HELP
    )  # exits with the usage on a command line the command cannot take, before anything loads
    from jaxllama.core.chips import skip_absent_tpu

    skip_absent_tpu()
    fire.Fire(COMMANDS, command=command, name="jaxllama")


def program() -> None:
    """The `jaxllama` program: `main`, then an exit that skips the interpreter's teardown. Tearing down a process that
    has loaded jax and a model (collecting every module's objects, destroying the compiled programs) takes ~1 s on
    2 cores and does no work that outlives the process; the exit functions still run (jax.distributed's shutdown,
    logging's flush), and threads still at work are waited for, as a normal exit does."""
    try:
        main()
        status = 0
    except SystemExit as e:
        if isinstance(e.code, str):
            print(e.code, file=sys.stderr)
        status = e.code if isinstance(e.code, int) else int(e.code is not None)
    except KeyboardInterrupt:
        status = INTERRUPTED
    except Exception:  # a failure nothing expected: its own status, so that a script tells it from bad lines
        import traceback

        traceback.print_exc()
        print("error: jaxllama failed unexpectedly (the traceback above); please report it", file=sys.stderr)
        status = CRASHED
    _exit_now(status)


def _exit_now(status: int) -> None:
    import atexit
    import threading

    shutdown = getattr(threading, "_shutdown", None)  # what a normal exit runs first: waits for non-daemon threads
    if shutdown is not None:
        shutdown()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe: nothing more can be said on it
            pass
    os._exit(status)


if __name__ == "__main__":
    program()
