"""The accelerators' attention kernels (`backends/pallas.py`): the TPU's paged-attention kernel
(`backends/paged_attention.py`) and jax's GPU kernel, run here in Pallas's interpreters (the TPU's, and the GPU
kernel's `interpret=True`), give XLA's attention over the same pages (to the kernels' own rounding), bfloat16 and int8,
alone and split over a mesh's `model` axis; the TPU's reads no page past a row's length; compiled for a TPU slice, a
decode step runs the TPU's where a head is 128 wide, and XLA's attention where not."""

from __future__ import annotations

import contextlib
import importlib.util
import math
from dataclasses import replace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxllama.backends import paged_attention
from jaxllama.backends.pallas import FLASH_MIN_TOKENS, INT8_PAGE_SIZE, PAGE_SIZE, GpuOps, TpuOps
from jaxllama.core import int8_kv
from jaxllama.core.config import ModelConfig
from jaxllama.core.ops import Ops
from jaxllama.engine.options import EngineOptions

needs_libtpu = pytest.mark.skipif(
    importlib.util.find_spec("libtpu") is None,
    reason="compiling for a TPU topology needs libtpu: pip install -e '.[tpu]' (the test extra installs it on Linux)",
)


def _case(kv=2, g=4, hd=128, page_size=16, pages=12):
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.normal(size=(3, 1, kv, g, hd)), jnp.float32)
    pool_k, pool_v = (jnp.asarray(rng.normal(size=(kv, pages, page_size, hd)), jnp.float32) for _ in range(2))
    # ragged rows: 41, 21 and 64 positions, through scattered pages; `pages` marks a page not given out
    table = jnp.asarray([[3, 7, 1, pages], [0, 2, pages, pages], [5, 4, 6, 8]], jnp.int32)
    positions = jnp.asarray([[40], [20], [63]], jnp.int32)
    return q, pool_k, pool_v, positions, table


@pytest.mark.slow
def test_the_pallas_kernel_gives_xlas_attention_over_the_same_pages():
    args = _case()
    want = Ops(float32_products=True).paged_attention(*args)
    with pltpu.force_tpu_interpret_mode():
        got = TpuOps().paged_attention(*args)
    # the kernel's products round their operands as a TPU's default precision does (bfloat16 passes)
    np.testing.assert_allclose(got, want, atol=1e-2)
    assert "pallas_call" in str(jax.make_jaxpr(TpuOps().paged_attention)(*args))


@pytest.mark.parametrize("dtype", ["bfloat16", "int8"])
@pytest.mark.parametrize("pages_per_block", [1, 2, 4])
def test_the_tpu_kernel_gives_xlas_attention_over_the_same_pages(pages_per_block, dtype):
    """`paged_attention.py` in the TPU interpreter: each row's keys and values read a block of pages at a time (an
    int8 page with its own scales), rows of 2 to 4 pages and different lengths (the next row's first block fetched
    during the last of this one): XLA's attention over the same cache, to float32's rounding."""
    q, pool_k, pool_v, positions, table = _case(kv=2, g=4)
    if dtype == "int8":
        pool_k, pool_v = (int8_kv.Int8KV(*int8_kv.quantize(p)) for p in (pool_k, pool_v))
    else:
        pool_k, pool_v = (p.astype(jnp.bfloat16) for p in (pool_k, pool_v))
    want = Ops(float32_products=True).paged_attention(q, pool_k, pool_v, positions, table)
    b, _, kv, g, hd = q.shape
    queries = q[:, 0].reshape(b, kv * g, hd)
    pages = jnp.minimum(table, pool_k.shape[1] - 1)
    with pltpu.force_tpu_interpret_mode():
        got = paged_attention.paged_attention(
            queries,
            pool_k,
            pool_v,
            positions[:, 0] + 1,
            pages,
            pages_per_block=pages_per_block,
            scale=1 / math.sqrt(hd),
        )
    np.testing.assert_allclose(got.reshape(want.shape), want, atol=1e-5)


@pytest.mark.parametrize("dtype", ["bfloat16", "int8"])
def test_the_tpu_kernel_reads_no_page_past_a_rows_length(dtype):
    """Pages a row's table names past its length (the unused page a table's padding points at) are never copied: NaN
    there leaves every row's attention XLA's over the clean pool, where a kernel copying a row's whole last block
    (jax's) gives NaN. With blocks of 4 pages of 16 positions, rows of 41 and 21 positions end inside their first
    block."""
    q, pool_k, pool_v, positions, table = _case(kv=2, g=4)
    unused = pool_k.shape[1] - 1  # not in any row's pages; a padding entry of the table points there
    if dtype == "int8":
        pool_k, pool_v = (int8_kv.Int8KV(*int8_kv.quantize(p)) for p in (pool_k, pool_v))
        poison = lambda p: int8_kv.Int8KV(p.values, p.scales.at[:, unused].set(jnp.nan))
    else:
        pool_k, pool_v = (p.astype(jnp.bfloat16) for p in (pool_k, pool_v))
        poison = lambda p: p.at[:, unused].set(jnp.nan)
    want = Ops(float32_products=True).paged_attention(q, pool_k, pool_v, positions, table)
    with pltpu.force_tpu_interpret_mode():
        got = TpuOps().paged_attention(q, poison(pool_k), poison(pool_v), positions, table)
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), atol=2e-2)
    assert TpuOps().kernel_read(41, 16) == 48 and GpuOps().kernel_read(41, 16) == 64


def test_an_int8_cache_on_a_tpu_is_paged_and_read_by_the_tpu_kernel():
    q, pool_k, pool_v, positions, table = _case()
    pool_k, pool_v = (int8_kv.Int8KV(*int8_kv.quantize(p)) for p in (pool_k, pool_v))
    assert "pallas_call" in str(jax.make_jaxpr(TpuOps().paged_attention)(q, pool_k, pool_v, positions, table))
    assert TpuOps().page_size(jnp.int8) == INT8_PAGE_SIZE and TpuOps().page_size(jnp.bfloat16) == PAGE_SIZE


def _prompt(b=2, t=FLASH_MIN_TOKENS, kv=2, g=3, hd=128):
    rng = np.random.default_rng(1)
    q = jnp.asarray(rng.normal(size=(b, t, kv, g, hd)), jnp.float32)
    k, v = (jnp.asarray(rng.normal(size=(b, t, kv, hd)), jnp.float32) for _ in range(2))
    return q, k, v


def _causal(q, k, v):
    """XLA's attention over the prompt's own keys and values, each row from position 0."""
    positions = jnp.broadcast_to(jnp.arange(q.shape[1]), q.shape[:2])
    return Ops(float32_products=True)._blocked(q, k.swapaxes(1, 2), v.swapaxes(1, 2), positions)


def test_the_flash_kernel_gives_xlas_attention_over_a_fresh_prompt():
    q, k, v = _prompt()
    with pltpu.force_tpu_interpret_mode():
        got = TpuOps().prompt_attention(q, k, v)
    np.testing.assert_allclose(got, _causal(q, k, v), atol=1e-5)
    assert "pallas_call" in str(jax.make_jaxpr(TpuOps().prompt_attention)(q, k, v))
    # shorter prompts, prompts of no whole 128-token blocks and heads not 128 wide take XLA's attention
    assert TpuOps().prompt_attention(*_prompt(t=FLASH_MIN_TOKENS // 2)) is None
    assert TpuOps().prompt_attention(*_prompt(t=FLASH_MIN_TOKENS + 64)) is None
    assert TpuOps().prompt_attention(*_prompt(hd=64)) is None
    assert Ops().prompt_attention(q, k, v) is None  # the reference backend has no kernel


def test_the_flash_kernel_split_over_the_model_axis_runs_each_devices_heads():
    if len(jax.devices()) < 2:
        pytest.skip("needs two CPU devices (XLA_FLAGS=--xla_force_host_platform_device_count)")
    q, k, v = _prompt(b=1)
    mesh = Mesh(np.array(jax.devices()[:2]).reshape(1, 2), ("data", "model"))
    heads = NamedSharding(mesh, PartitionSpec(None, None, "model"))
    with jax.set_mesh(mesh), pltpu.force_tpu_interpret_mode():
        got = jax.jit(TpuOps().prompt_attention)(*(jax.device_put(x, heads) for x in (q, k, v)))
    np.testing.assert_allclose(got, _causal(q, k, v), atol=1e-5)


@pytest.mark.parametrize("cache_dtype", ["float32", "int8"])
def test_a_fresh_prompt_through_the_kernel_gives_the_models_logits(cache_dtype):
    """The model's layer with `fresh` set attends through the kernel over the keys and values it writes into the
    cache, as the cache gives them back (an int8 cache's rounded to their int8 steps), and gives what the same layer
    gives attending over that cache (its wq and wk reordered for the TPU's rotary halves)."""
    from jaxllama.core import model
    from jaxllama.core.params import init_params

    config = ModelConfig(vocab_size=64, dim=512, n_layers=1, n_heads=4, n_kv_heads=2, ffn_dim=128, max_seq_len=2048)
    params = init_params(config, jax.random.key(0), jnp.float32)
    tokens = jax.random.randint(jax.random.key(1), (1, FLASH_MIN_TOKENS), 0, 64)
    positions = jnp.arange(FLASH_MIN_TOKENS)[None]
    cache = [tuple(int8_kv.zeros((1, 2, FLASH_MIN_TOKENS, 128), cache_dtype) for _ in range(2))]
    x = model.embed(params, tokens)
    layers = model.layer_params(params, config)
    at = model.Placement.of(positions, config)
    want, _ = model.layers(layers, config, x, at, cache, ops=Ops(float32_products=True))
    with pltpu.force_tpu_interpret_mode():
        fresh = replace(at, fresh=True)
        prepared = TpuOps().prepare(layers, config)
        got, written = model.layers(prepared, config, x, fresh, cache, ops=TpuOps())
    np.testing.assert_allclose(got, want, atol=1e-4)
    assert float(jnp.abs(int8_kv.split(written[0][0])[0]).sum()) > 0  # the keys are written all the same
    run = lambda x: model.layers(prepared, config, x, fresh, cache, ops=TpuOps())
    assert "pallas_call" in str(jax.make_jaxpr(run)(x))


@pytest.mark.slow
@pytest.mark.parametrize("int8", [False, True])
def test_the_gpu_kernel_gives_xlas_attention_over_the_same_pages(int8):
    q, pool_k, pool_v, positions, table = _case(g=4)
    table = jnp.concatenate([table] * 4, axis=1)  # 16 pages a row: the kernel's 16 parts of a row's pages
    if int8:
        pool_k, pool_v = (int8_kv.Int8KV(*int8_kv.quantize(p)) for p in (pool_k, pool_v))
    args = (q, pool_k, pool_v, positions, table)
    want = Ops(float32_products=True).paged_attention(*args)
    got = GpuOps(interpret=True).paged_attention(*args)
    np.testing.assert_allclose(got, want, atol=2e-5)
    assert "pallas_call" in str(jax.make_jaxpr(GpuOps(interpret=True).paged_attention)(*args))


@pytest.mark.slow
@pytest.mark.parametrize("kernel", ["tpu", "gpu"])
def test_split_over_the_model_axis_each_device_attends_with_its_own_heads(kernel):
    if len(jax.devices()) < 2:
        pytest.skip("needs two CPU devices (XLA_FLAGS=--xla_force_host_platform_device_count)")
    q, pool_k, pool_v, positions, table = _case(kv=2)
    table = jnp.concatenate([table] * 4, axis=1)
    want = Ops(float32_products=True).paged_attention(q, pool_k, pool_v, positions, table)
    mesh = Mesh(np.array(jax.devices()[:2]).reshape(1, 2), ("data", "model"))
    heads = NamedSharding(mesh, PartitionSpec(None, None, "model"))
    pools = NamedSharding(mesh, PartitionSpec("model"))
    q, pool_k, pool_v = jax.device_put(q, heads), jax.device_put(pool_k, pools), jax.device_put(pool_v, pools)
    ops = TpuOps() if kernel == "tpu" else GpuOps(interpret=True)
    interpreted = pltpu.force_tpu_interpret_mode() if kernel == "tpu" else contextlib.nullcontext()
    with jax.set_mesh(mesh), interpreted:
        got = jax.jit(ops.paged_attention)(q, pool_k, pool_v, positions, table)
    np.testing.assert_allclose(got, want, atol=1e-2 if kernel == "tpu" else 2e-5)


@pytest.mark.slow
@needs_libtpu
@pytest.mark.parametrize("dim, kernel", [(512, True), (128, False)])  # heads of 128 and of 32
def test_the_engine_compiled_for_a_tpu_slice_runs_the_kernels_where_they_can(dim, kernel):
    from jaxllama.engine import aot

    config = ModelConfig(
        vocab_size=512, dim=dim, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=256, max_seq_len=2048, dtype="bfloat16"
    )
    devices = aot.target_devices("v5e:2x2")[0]
    prefills = [(2, 100), (1, FLASH_MIN_TOKENS)]  # a prompt's attention: XLA's, then the flash kernel's
    report = aot.compile_engine(
        config, devices, target="v5e:2x2", mesh="data=1,model=4", max_slots=8, max_context=2048, prefills=prefills
    )
    assert report.fits and report.footprint.growth == 0  # a paged cache: allocated once, never grown
    assert "cache growth" not in {p.phase for p in report.programs}
    decode = next(p for p in report.programs if p.kind == "decode_layers")
    assert ("tpu_custom_call" in decode.hlo_text) == kernel
    assert report.decode_attention == ("Pallas kernel" if kernel else "XLA")
    assert report.prompt_kernel == ([f"prefill 1x{FLASH_MIN_TOKENS}"] if kernel else [])
    assert report.kv_cache == "paged, 64-position pages" and "KV cache: paged" in report.table()


@needs_libtpu
def test_blocks_are_read_as_int8_weights_on_a_tpu_and_as_blocks_on_a_cpu_mesh(tmp_path):
    from jaxllama import backends
    from jaxllama.engine import aot

    config = ModelConfig(vocab_size=512, dim=512, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=256, max_seq_len=512)
    tpu = Mesh(np.array(aot.target_devices("v5e:2x2")[0]).reshape(1, 4), ("data", "model"))
    cpu = Mesh(np.array(jax.devices()[:2]).reshape(1, 2), ("data", "model"))
    assert backends.choose(tpu, "q8_0", tmp_path) == TpuOps(int8_weights=True)
    assert backends.choose(tpu, "bfloat16", tmp_path) == TpuOps()
    assert not backends.choose(cpu, "q8_0", tmp_path).int8_weights
    # the memory plan counts what the products read: int8 weights, not blocks
    stored = aot.quantized(config, "q8_0")
    devices, sizes = aot.target_devices("v5e:2x2")[0], EngineOptions(max_slots=8, max_context=512)
    plan = aot.memory.plan(stored, devices, "data=1,model=4", sizes, jnp.bfloat16)
    int8 = aot.memory.plan(config, devices, "data=1,model=4", replace(sizes, quantize="int8"), jnp.bfloat16)
    assert plan.footprint.weights == int8.footprint.weights


def test_tpu_programs_compile_without_collective_matmuls_and_a_v6e_with_more_vmem():
    from types import SimpleNamespace

    v5e, v6e = (SimpleNamespace(platform="tpu", device_kind=kind) for kind in ("TPU v5 lite", "TPU v6 lite"))
    off = {"xla_tpu_enable_windowed_einsum_for_all_gather": False}
    assert TpuOps().compiler_options("prefill_layers", v5e).items() >= off.items()
    assert "xla_tpu_scoped_vmem_limit_kib" not in TpuOps().compiler_options("prefill_layers", v5e)
    assert TpuOps().compiler_options("decode_layers", v6e)["xla_tpu_scoped_vmem_limit_kib"] == 98304
    assert GpuOps().compiler_options("prefill_layers", SimpleNamespace(platform="gpu", device_kind="NVIDIA H200")) == {}


@pytest.mark.slow
def test_an_engine_over_an_int8_cache_on_a_tpus_operations_gives_xlas_int8_tokens():
    """The engine with a TPU's operations (in the interpreter) over an int8 cache: paged in 128-position pages, its
    decode steps through the TPU kernel; greedy tokens those of XLA's attention over a contiguous int8 cache."""
    from jaxllama.core.params import init_params
    from jaxllama.core.sharding import make_mesh
    from jaxllama.engine.engine import Engine
    from jaxllama.engine.request import Request, SamplingParams
    from tests.helpers.engine import run

    config = ModelConfig(vocab_size=96, dim=256, n_layers=2, n_heads=2, n_kv_heads=1, ffn_dim=128, max_seq_len=512)
    params = init_params(config, jax.random.key(0), jnp.float32)
    mesh = make_mesh(config, "data=1,model=1", jax.devices()[:1])
    rng = np.random.default_rng(0)
    requests = [
        Request(i, [int(t) for t in rng.integers(1, 96, n)], SamplingParams(max_tokens=m, temperature=0.0))
        for i, (n, m) in enumerate([(5, 20), (150, 12), (40, 30)])  # the second past a page when it ends
    ]
    options = dict(max_slots=2, max_context=512, kv_cache_dtype="int8")
    want = run(Engine(config, params, mesh, ops=Ops(float32_products=True), **options), requests)[0]
    with pltpu.force_tpu_interpret_mode():
        engine = Engine(config, params, mesh, ops=TpuOps(), **options)
        assert engine.runner.pages is not None and engine.runner.pages.page_size == INT8_PAGE_SIZE
        assert run(engine, requests)[0] == want


@pytest.mark.parametrize("row_parallel", [False, True], ids=["outputs-split", "inputs-split"])
def test_a_grouped_product_by_the_megablox_kernel_gives_xlas(row_parallel):
    """A mixture of experts' product on a TPU (`TpuOps.grouped`: jax's megablox kernel, in Pallas's interpreter here)
    gives XLA's `ragged_dot` over the same rows and groups (one empty; rows not a whole tile), each device of a
    `model` axis of 2 running its part of the weights' outputs or inputs (then summed)."""
    if len(jax.devices()) < 2:
        pytest.skip("needs two CPU devices (XLA_FLAGS=--xla_force_host_platform_device_count)")
    rng = np.random.default_rng(0)
    rows = jnp.asarray(rng.normal(size=(40, 512)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(4, 256, 512)) / 16, jnp.float32)  # [groups, out, in]
    sizes = jnp.asarray([10, 0, 25, 5], jnp.int32)
    want = Ops().grouped(rows, w, sizes)
    mesh = Mesh(np.array(jax.devices()[:2]).reshape(1, 2), ("data", "model"))
    by_inputs = (PartitionSpec(None, "model"), PartitionSpec(None, None, "model"))
    specs = by_inputs if row_parallel else (PartitionSpec(), PartitionSpec(None, "model"))
    rows, w = (jax.device_put(x, NamedSharding(mesh, s)) for x, s in zip((rows, w), specs, strict=True))
    product = jax.jit(lambda r, w, s: TpuOps().grouped(r, w, s, row_parallel=row_parallel))
    with jax.set_mesh(mesh), pltpu.force_tpu_interpret_mode():
        got = product(rows, w, sizes)
        assert "pallas_call" in str(jax.make_jaxpr(product)(rows, w, sizes))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
