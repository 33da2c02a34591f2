"""A job's time before it runs (`engine/job_clock.py`, `jaxllama compile --job`): the engine's scheduler runs the
job's requests on an abstract runner, on the clock of its programs' costs; every request generates its output length
(at most what its context holds), a line `run` refuses is counted, and the clock is the costs of the programs called."""

from __future__ import annotations

import json

import jax
import pytest

from jaxllama.cli import main
from jaxllama.core.config import ModelConfig
from jaxllama.engine import aot, job_clock
from jaxllama.engine.options import EngineOptions
from jaxllama.llm import LLM
from tests.engine.test_aot import TINY, jaxllama_logger_kept, needs_libtpu  # noqa: F401 (autouse: the log put back)

FLOAT32 = ModelConfig(vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, max_seq_len=512)


def local_engine(**options):
    engine, _ = aot.abstract_engine(FLOAT32, jax.devices()[:1], EngineOptions(**options), "data=1,model=1")
    return engine


@pytest.mark.slow
def test_each_request_generates_its_length_on_the_clock_of_the_programs_called():
    engine = local_engine(max_slots=4, max_context=256)
    jobs = [([1] * n, out) for n, out in [(10, 5), (100, 1), (40, 30), (200, 80), (3, 12), (300, 4)]]
    calls = []

    def cost(compiled, read):  # a millisecond a program call: the clock counts the calls
        calls.append(compiled.kind)
        return 1e-3

    p = job_clock.predict(engine.runner, jobs, cost, step_tokens=engine.options.step_tokens, chips=1, price=2.0)
    assert p.requests == 5 and list(p.refused) == [5] and "context" in p.refused[5]  # 300 tokens > 256
    assert p.prompt_tokens == 10 + 100 + 40 + 200 + 3
    assert p.output_tokens == 5 + 1 + 30 + (256 - 200) + 12  # the 200-token prompt stopped by its context
    assert p.wall_s == pytest.approx(len(calls) * 1e-3) and calls.count("decode_outputs") >= 56 - 1  # the longest
    assert 0 < p.ttft_p50_s <= p.ttft_p95_s <= p.wall_s and 0 < p.occupancy <= 1
    assert p.cost_usd == pytest.approx(p.wall_s / 3600 * 2.0) and p.output_tok_s == pytest.approx(104 / p.wall_s)


def test_a_prompt_reads_a_prefix_from_pages_its_slot_let_go_and_the_job_counts_it():
    """Four conversations' first turns, then their second, on two slots of a paged cache: each second turn starts
    with its first turn's 40 tokens, whose slot a later conversation took; the pool still caches their pages."""
    engine = local_engine(max_slots=2, max_context=256, page_size=8, cpu_kernels=False)
    firsts = [[10 + c] * 40 for c in range(4)]
    jobs = [(p, 3) for p in firsts] + [(p + [7] * 20, 3) for p in firsts]
    p = job_clock.predict(engine.runner, jobs, lambda c, read: 1e-3, step_tokens=2048, chips=1)
    assert p.cached_tokens == 4 * 40 and "160 prompt tokens read from the cache" in p.table()


def test_a_program_is_measured_once_per_shape_on_the_local_devices():
    engine = local_engine(max_slots=4, max_context=256)
    measured, seen = job_clock.measured_cost(repeats=1), []

    def cost(compiled, read):
        seen.append(compiled)
        return measured(compiled, read)

    p = job_clock.predict(engine.runner, [([1] * 20, 6)] * 6, cost, step_tokens=2048, chips=1)
    assert p.output_tokens == 36 and p.wall_s > 0 and p.programs == len(set(map(id, seen))) < len(seen)


@pytest.mark.slow
def test_the_compile_command_predicts_a_job_and_counts_the_lines_run_refuses(tiny_chat_checkpoint, tmp_path, capsys):
    job = tmp_path / "job.jsonl"
    lines = [
        {"messages": [{"role": "user", "content": "hello there"}], "max_tokens": 8},
        {"prompt": [5, 6, 7, 8], "max_tokens": 5, "n": 2},
        {"prompt": "the cat", "top_p": 7},  # refused by `run`: an invalid parameter
        "{not json",
    ]
    job.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    args = ["compile", "--model", str(tiny_chat_checkpoint), "--mesh", "data=1,model=1", "--max-batch", "4"]
    args += ["--max-context", "128"]
    main([*args, "--prefill", "1x16", "--job", str(job), "--price", "1.5", "--json"])
    out = json.loads(capsys.readouterr().out)["job"]
    assert out["lines"] == 4 and out["refused_lines"] == 2 and out["requests"] == 3
    assert out["output_tokens"] == 8 + 5 + 5 and out["wall_s"] > 0 and out["chips"] == 1
    assert out["cost_usd"] == pytest.approx(out["wall_s"] / 3600 * 1.5)
    for key in ("output_tok_s", "total_tok_s", "ttft_p50_s", "ttft_p95_s", "chip_hours"):
        assert out[key] > 0


@pytest.mark.slow
@needs_libtpu
def test_a_job_is_predicted_for_a_tpu_slice_from_the_compilers_estimates():
    jobs = [([1] * n, 16) for n in (30, 100, 200, 60)] * 4
    p = LLM.predict_job(TINY, jobs, topology="v5e:2x2", max_slots=8, max_context=512, price=1.2)
    assert p.requests == 16 and p.output_tokens == 16 * 16 and p.chips == 4
    # 16 x 16 tokens over 8 slots: at least 32 decode steps of a memory-bound model, each at least its weights' read
    assert p.wall_s > 32 * TINY.n_layers * 4 * TINY.dim * TINY.ffn_dim * 2 / 819e9
