"""The engine compiled ahead of time for devices it does not run on (`engine/aot.py`): a TPU slice described on this
host (with libtpu installed), or this host's CPU devices; the memory plan that sizes the mesh and context and refuses
what cannot fit (`engine/memory.py`)."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import logging
import re

import jax
import jax.numpy as jnp
import pytest

from jaxllama import targets
from jaxllama.cli import main
from jaxllama.core.config import ModelConfig
from jaxllama.core.shapes import known_shape
from jaxllama.engine import aot, memory
from jaxllama.engine.options import EngineOptions
from jaxllama.errors import ModelTooLarge
from jaxllama.llm import LLM

TINY = ModelConfig(
    vocab_size=512, dim=128, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=256, max_seq_len=512, dtype="bfloat16"
)
GiB = 2**30

needs_libtpu = pytest.mark.skipif(
    importlib.util.find_spec("libtpu") is None,
    reason="compiling for a TPU topology needs libtpu: pip install -e '.[tpu]' (the test extra installs it on Linux)",
)


needs_cuda_plugin = pytest.mark.skipif(
    importlib.util.find_spec("jax_cuda12_plugin") is None,
    reason="compiling for GPUs needs jax's CUDA plugin: pip install -e '.[gpu]' (the test extra installs it on Linux)",
)


@pytest.fixture(autouse=True)
def jaxllama_logger_kept():
    """The command, run in this process, sends jaxllama's log to stderr alone: the logger is put back after."""
    logger = logging.getLogger("jaxllama")
    kept = logger.level, logger.propagate, list(logger.handlers)
    yield
    logger.level, logger.propagate, logger.handlers[:] = kept


@pytest.fixture(scope="module")
def v5e_2x2():
    return aot.target_devices("v5e:2x2")[0]


@pytest.mark.slow
@needs_libtpu
def test_a_tiny_model_compiles_for_a_tpu_slice_and_is_measured(v5e_2x2):
    report = aot.compile_engine(TINY, v5e_2x2, target="v5e:2x2", max_slots=8, max_context=512, prefills=[(2, 100)])
    assert report.fits and report.chip.name == "TPU v5e" and report.device_memory == 16 * GiB
    assert report.mesh["data"] * report.mesh["model"] == 4 and report.slots == 8 and report.context == 512
    phases = {(p.kind, p.phase) for p in report.programs}
    assert {
        ("cache_resize", "cache growth"),
        ("decode_layers", "decode step"),
        ("decode_outputs", "decode step"),
    } <= phases
    assert ("prefill_layers", "prefill 2x100") in phases
    step = report.to_json()["decode_step"]
    # the step reads at least each device's weights and its part of the full cache, every program counted
    assert step["hbm_bytes"] >= report.footprint.cache * 0.9 and step["ideal_s"] > 0
    assert step["tok_s_per_sequence"]["ideal"] >= step["tok_s_per_sequence"]["hbm_traffic"] > 0
    assert step["memory_per_chip_bytes"] == report.footprint.total
    decode_layers = next(p for p in report.programs if p.kind == "decode_layers")
    assert decode_layers.calls == 1 and decode_layers.flops > 0 and decode_layers.heaviest
    if report.mesh["model"] > 1:
        assert "all-reduce" in step["collectives"]
    assert "decode step" in report.table() and json.dumps(report.to_json())


@pytest.mark.slow
@needs_libtpu
@pytest.mark.parametrize("family", ["qwen3", "mixtral"])
def test_every_family_compiles_for_a_tpu_slice_with_finite_estimates(v5e_2x2, family):
    """A family's own parameters (per-head norms; a router and experts split over the model axis) compile for a TPU
    slice, every phase with a finite estimate (the ragged products the compiler cannot cost: test_hlo.py)."""
    experts = {"n_experts": 4, "n_experts_per_token": 2} if family == "mixtral" else {}
    config = dataclasses.replace(TINY, family=family, **experts)
    report = aot.compile_engine(config, v5e_2x2, target="v5e:2x2", max_slots=8, max_context=512, prefills=[(2, 100)])
    assert report.fits
    for phase in [report.decode, *report.prefills]:
        estimate = phase.estimates()["estimate"]
        assert 0 < estimate < 1.0, (phase.name, estimate)  # a tiny model: well under a second a step


@needs_libtpu
def test_what_cannot_fit_is_refused_with_both_figures_before_compiling(v5e_2x2):
    with pytest.raises(ModelTooLarge, match=r"needs about \d+\.\d GiB per device .* holds 16\.0 GiB"):
        aot.compile_engine(known_shape("llama-3.1-70b"), v5e_2x2, target="v5e:2x2", max_context=2048)


@pytest.mark.slow
@needs_libtpu
def test_the_plan_counts_the_cache_and_its_growth_and_picks_a_mesh_that_fits():
    devices = aot.target_devices("v5e:4x4")[0]
    config = aot.quantized(known_shape("llama-3.1-70b"), "q8_0")
    bf16 = jnp.bfloat16
    # 8 slots x 2048 fits; the mesh keeps a whole copy of the weights on no device (75 GB > 16 GiB)...
    plan = memory.plan(config, devices, None, EngineOptions(max_slots=8, max_context=2048), bf16)
    assert plan.fits and plan.mesh.shape["model"] >= 8 and plan.context == 2048
    fp = plan.footprint
    kv_heads_per_device = 8 // min(8, plan.mesh.shape["model"])  # 8 KV heads split at most 8 ways, else replicated
    slots_per_device = 8 // plan.mesh.shape["data"]
    assert fp.cache == 80 * 2 * slots_per_device * kv_heads_per_device * 128 * 2048 * 2
    assert fp.growth == fp.cache // 80 and fp.total <= 16 * GiB
    # ... and moves the fewest bytes per decode step of the meshes that fit
    for spec in ("data=1,model=16", "data=2,model=8"):
        other = memory.plan(config, devices, spec, EngineOptions(max_slots=8, max_context=2048), bf16)
        assert memory.decode_bytes(plan) <= memory.decode_bytes(other)
    with pytest.raises(ModelTooLarge, match="mesh data=16,model=1"):
        memory.plan(config, devices, "data=16,model=1", EngineOptions(max_slots=8, max_context=2048), bf16)
    # a context asked for that cannot fit beside the weights is refused with both figures...
    with pytest.raises(ModelTooLarge, match=r"needs about .* GiB per device .* holds 16\.0 GiB"):
        memory.plan(config, devices, None, EngineOptions(max_slots=64, max_context=8192), bf16)
    # ... and without one the context is the longest that fits
    longest = memory.plan(config, devices, None, EngineOptions(max_slots=64), bf16)
    assert longest.fits and 256 <= longest.context < 8192


@pytest.mark.slow
def test_the_engine_compiles_for_this_hosts_devices_without_running_anything():
    devices = jax.devices()[:4]
    report = aot.compile_engine(TINY, devices, target="cpu", mesh="data=2,model=2", max_slots=4, max_context=256)
    assert report.mesh == {"data": 2, "model": 2} and report.fits and report.chip is None
    assert report.decode.hbm_bytes > 0 and any(p.kind == "prefill_layers" for p in report.programs)


@pytest.mark.slow
def test_the_compile_command_reports_a_checkpoint_as_json(tiny_chat_checkpoint, capsys, tmp_path):
    main(["compile", "--model", str(tiny_chat_checkpoint), "--mesh", "data=1,model=2", "--max-batch", "4"]
         + ["--max-context", "128", "--prefill", "2x16", "--json", "--hlo-dir", str(tmp_path)])  # fmt: skip
    report = json.loads(capsys.readouterr().out)
    written = sorted(p.name for p in tmp_path.iterdir())
    assert len(written) == len(report["programs"]) and any(n.startswith("decode_step-decode_layers") for n in written)
    assert "HloModule" in (tmp_path / written[0]).read_text()
    assert report["mesh"] == {"data": 1, "model": 2} and report["slots"] == 4 and report["fits"]
    assert [p["name"] for p in report["prefills"]] == ["prefill 2x16"]
    assert {"hbm_bytes", "ideal_s", "collectives", "memory_per_chip_bytes"} <= set(report["decode_step"])


def test_an_unknown_model_or_topology_is_one_error_line(capsys):
    with pytest.raises(SystemExit) as e:
        main(["compile", "--model", "llama-9-9000b"])
    assert e.value.code == 2 and "neither a checkpoint nor a known shape" in capsys.readouterr().err
    if importlib.util.find_spec("libtpu") is not None:
        with pytest.raises(SystemExit) as e:
            main(["compile", "--model", "smollm2-135m", "--topology", "v9z:1x1"])
        assert e.value.code == 2 and "Names look like v5e:2x4" in capsys.readouterr().err


def test_compile_takes_quantize_as_run_does_and_the_stored_blocks_apart():
    """`quantize` is the form made at load, as `LLM.load` takes it: the CPU kernels' forms need one CPU device, and
    are refused on a mesh of several as a load would refuse them; blocks a checkpoint stores are `stored_as`."""
    assert jax.device_count() > 1
    with pytest.raises(ValueError, match="quantize='w8a8' runs through the CPU kernels"):
        LLM.compile_for("smollm2-135m", quantize="w8a8")
    with pytest.raises(ValueError, match="stored_as='w8a8'"):
        LLM.compile_for("smollm2-135m", stored_as="w8a8")
    config = targets._target("llama-3.1-8b", None, None, "q4_0", None, None, {})[0]
    assert dict(config.stored_as)["layers_0/attention/wq"] == "q4_0" and "embedding" not in dict(config.stored_as)


@pytest.mark.slow
@needs_libtpu
def test_a_tpu_decode_step_reads_the_cache_in_place(v5e_2x2):
    """XLA's cache layout (positions-major keys) and attention (batched products on the matrix unit) let the compiled
    decode step read each device's cache in place: no copy of a layer's keys to another layout and back, and a cycle
    estimate within a few times the bandwidth-bound ideal (with keys cached transposed, 8x here). Heads of 128, as
    Llama 3.1 8B and 70B's."""
    config = ModelConfig(
        vocab_size=1024, dim=1024, n_layers=4, n_heads=8, n_kv_heads=4, ffn_dim=2048, max_seq_len=2048,
        dtype="bfloat16",
    )  # fmt: skip
    report = aot.compile_engine(
        config, v5e_2x2, target="v5e:2x2", mesh="data=1,model=4", max_slots=32, max_context=2048, prefills=[(1, 16)]
    )
    assert report.footprint.cache > 4 * report.footprint.weights  # the cache is what a step reads
    assert report.decode.cycles / report.chip.clock_hz <= 3 * report.decode.ideal_s
    layers = next(p for p in report.programs if p.kind == "decode_layers")
    cache_layer = report.footprint.cache // config.n_layers
    assert not [h for h in layers.heaviest if h["opcode"] == "copy" and h["hbm_bytes"] >= cache_layer // 2]


@pytest.mark.slow
@needs_cuda_plugin
def test_the_engine_compiles_for_gpus_on_a_host_without_one(capsys, tmp_path):
    """`--topology h100:2x8`: XLA's GPU compiler, told what an H100 is by a target config, compiles every program for
    16 GPUs on 2 hosts (the decode step's attention by jax's Triton paged-attention kernel), with the memory per GPU
    and the collectives; the GPU compiler gives no flops or cycles without a GPU ("?", null in JSON), so a job's clock
    charges each program its products' flops (read from the HLO) at the GPU's peak where they outlast its bytes."""
    main(
        [
            "compile",
            "--topology",
            "h100:2x8",
            "--model",
            "llama-3.2-1b",
            "--max-batch",
            "16",
            "--max-context",
            "4096",
            "--json",
        ]
    )
    report = json.loads(capsys.readouterr().out)
    assert report["target"] == "h100:2x8" and report["devices"] == 16 and report["chip"]["name"] == "H100 SXM"
    assert report["fits"] and report["device_memory_bytes"] == 80 * GiB
    assert report["decode_attention"] == "Pallas kernel"
    step = report["decode_step"]
    assert step["flops"] is None and step["hbm_bytes"] > 0 and "all-reduce" in step["collectives"]
    with pytest.raises(ValueError, match="h100:8 or h100:2x8"):
        aot.target_devices("h100:eight")
    job = tmp_path / "job.jsonl"
    lines = (json.dumps({"prompt": [100 + i] * 4096, "max_tokens": 1}) + "\n" for i in range(16))  # no prefix shared
    job.write_text("".join(lines))
    main(["compile", "--topology", "h100:8", "--model", "llama-3.2-1b", "--max-context", "8192", "--job", str(job)])
    predicted = capsys.readouterr().out
    wall = float(re.search(r"predicted wall time ([\d.]+) s", predicted).group(1))
    # 16 x 4,096 prompt tokens of a 1B model on 8 H100s (989 Tflop/s each, bfloat16): at least 20 ms of products
    assert wall >= 16 * 4096 * 2 * known_shape("llama-3.2-1b").n_params / (8 * 989e12)
