"""Converted checkpoints give the logits of the reference implementations: HF transformers for HF and GGUF
sources, Meta's reference model for Meta folders."""

from __future__ import annotations

import os

import jax
import numpy as np
import pytest
import torch

from converters.llama import convert
from jaxllama.core.checkpoint import load_checkpoint
from jaxllama.core.model import sequence_logits
from tests.factories import GGUF_TYPE_MIX, Tiny, copy_gguf, hf_state, meta_state, write_gguf, write_hf, write_meta

TINIES = {
    "mqa-tied": Tiny(heads=8, kv_heads=1, tied=True, vocab=131),
    "gqa-untied-rope-scaled": Tiny(heads=8, kv_heads=2, tied=False, vocab=250, rope_theta=500000.0, rope_scaling=True),
}
TOKENS = np.array([[1, 5, 9, 100, 77, 3, 42, 8, 8, 120, 0, 64], [2, 130, 7, 7, 7, 1, 99, 15, 16, 17, 18, 19]])


def ours(ckpt, tokens=TOKENS) -> np.ndarray:
    config, params = load_checkpoint(ckpt)
    return np.asarray(jax.jit(sequence_logits, static_argnums=1)(params, config, tokens))


def hf_logits(model, tokens=TOKENS) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor(tokens)).logits.float().numpy()


@pytest.mark.parametrize("name", TINIES)
def test_hf_matches_transformers(name, tmp_path):
    tiny = TINIES[name]
    model = write_hf(tiny, tmp_path / "hf")
    convert(tmp_path / "hf", tmp_path / "ckpt", progress=False)
    np.testing.assert_allclose(ours(tmp_path / "ckpt"), hf_logits(model), atol=1e-4)


def test_hf_sharded_safetensors(tmp_path):
    tiny = TINIES["gqa-untied-rope-scaled"]
    model = write_hf(tiny, tmp_path / "hf", max_shard_size="50KB")
    assert (tmp_path / "hf" / "model.safetensors.index.json").is_file()
    convert(tmp_path / "hf", tmp_path / "ckpt", progress=False)
    np.testing.assert_allclose(ours(tmp_path / "ckpt"), hf_logits(model), atol=1e-4)


@pytest.mark.parametrize("name", TINIES)
def test_gguf_matches_transformers(name, tmp_path):
    from transformers import AutoModelForCausalLM

    tiny = TINIES[name]
    if tiny.rope_scaling:
        pytest.skip("GGUF carries Llama 3.1 scaling as a rope_freqs tensor: see test_gguf_rope_freqs")
    state = hf_state(write_hf(tiny, tmp_path / "hf"))
    write_gguf(tiny, state, tmp_path / "m.gguf", GGUF_TYPE_MIX)
    convert(tmp_path / "m.gguf", tmp_path / "ckpt", dtype="float32", progress=False)  # every type dequantized
    oracle = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="m.gguf", dtype=torch.float32).eval()
    np.testing.assert_allclose(ours(tmp_path / "ckpt"), hf_logits(oracle), atol=1e-4)


def test_gguf_rope_freqs(tmp_path):
    """llama.cpp stores Llama 3.1 rope scaling as per-frequency factors; compare with HF's llama3 scaling."""
    tiny = TINIES["gqa-untied-rope-scaled"]
    model = write_hf(tiny, tmp_path / "hf")
    state = hf_state(model)
    hd = tiny.dim // tiny.heads
    plain = 1.0 / tiny.rope_theta ** (np.arange(0, hd, 2) / hd)
    # llama.cpp's factors, computed as its converter does from the HF config (independently of ours).
    factors = []
    for f in plain:
        wavelen = 2 * np.pi / f
        if wavelen < 8192 / 4.0:
            factors.append(1.0)
        elif wavelen > 8192 / 1.0:
            factors.append(8.0)
        else:
            smooth = (8192 / wavelen - 1.0) / (4.0 - 1.0)
            factors.append(1 / ((1 - smooth) / 8.0 + smooth))
    write_gguf(tiny, state, tmp_path / "m.gguf")
    copy_gguf(tmp_path / "m.gguf", tmp_path / "s.gguf", extra={"rope_freqs.weight": np.asarray(factors, np.float32)})
    convert(tmp_path / "s.gguf", tmp_path / "ckpt", progress=False)
    np.testing.assert_allclose(ours(tmp_path / "ckpt"), hf_logits(model), atol=1e-4)


def test_gguf_k_quants(tmp_path):
    """K-quant blocks (Q4_K, Q6_K) dequantized as transformers dequantizes them."""
    import gguf
    from transformers import AutoModelForCausalLM

    tiny = Tiny(dim=256, heads=4, kv_heads=2, ffn=256, vocab=131)
    state = hf_state(write_hf(tiny, tmp_path / "hf"))
    write_gguf(tiny, state, tmp_path / "f.gguf")
    # Replace two weights with random but valid K-quant blocks.
    rng = np.random.default_rng(0)

    def k_quant(t):
        if not (t.name.endswith("attn_q.weight") or t.name.endswith("ffn_up.weight")):
            return None
        rows = int(t.shape[1]) if len(t.shape) > 1 else 1
        kind = gguf.GGMLQuantizationType.Q4_K if "attn_q" in t.name else gguf.GGMLQuantizationType.Q6_K
        block, size = gguf.GGML_QUANT_SIZES[kind]
        raw = rng.integers(0, 256, size=(rows, int(t.shape[0]) // block, size), dtype=np.uint8)
        scale = np.frombuffer(np.float16(0.01).tobytes(), np.uint8)
        if kind == gguf.GGMLQuantizationType.Q4_K:
            raw[..., 0:2], raw[..., 2:4] = scale, scale  # d, dmin
        else:
            raw[..., -2:] = scale  # d
        return raw.reshape(rows, -1), kind

    copy_gguf(tmp_path / "f.gguf", tmp_path / "k.gguf", replace=k_quant)
    convert(tmp_path / "k.gguf", tmp_path / "ckpt", dtype="float32", progress=False)  # dequantized, exactly
    oracle = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="k.gguf", dtype=torch.float32).eval()
    np.testing.assert_allclose(ours(tmp_path / "ckpt"), hf_logits(oracle), atol=1e-4)


@pytest.fixture(scope="module")
def meta_reference_runtime():
    """Meta's reference model runs with torch.distributed + fairscale model parallelism of size 1."""
    import torch.distributed as dist
    from fairscale.nn.model_parallel import initialize as fs_init

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    if not dist.is_initialized():
        dist.init_process_group("gloo", rank=0, world_size=1)
    if not fs_init.model_parallel_is_initialized():
        fs_init.initialize_model_parallel(1)


def meta_reference_logits(tiny: Tiny, state: dict[str, np.ndarray], tokens=TOKENS) -> np.ndarray:
    from llama_models.llama3.args import ModelArgs
    from llama_models.llama3.model import Transformer

    args = ModelArgs(
        dim=tiny.dim,
        n_layers=tiny.layers,
        n_heads=tiny.heads,
        n_kv_heads=tiny.kv_heads,
        vocab_size=tiny.vocab,
        norm_eps=1e-5,
        rope_theta=tiny.rope_theta,
        use_scaled_rope=tiny.rope_scaling,
        max_batch_size=tokens.shape[0],
        max_seq_len=64,
        multiple_of=16,
        ffn_dim_multiplier=None,
    )
    torch.set_default_dtype(torch.float32)
    model = Transformer(args)
    full = dict(state)
    full.setdefault("output.weight", state["tok_embeddings.weight"])
    assert model.layers[0].feed_forward.w1.weight.shape[0] == tiny.ffn
    model.load_state_dict({k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in full.items()}, strict=False)
    with torch.no_grad():
        return model(torch.tensor(tokens), 0).float().numpy()


# Meta's ffn size rule: int(2 * 4 * dim / 3) rounded up to multiple_of=16 -> 176 for dim 64.
META_TINIES = {n: Tiny(**{**t.__dict__, "ffn": 176}) for n, t in TINIES.items()}


@pytest.mark.parametrize("name", META_TINIES)
def test_meta_matches_reference(name, tmp_path, meta_reference_runtime):
    tiny = META_TINIES[name]
    state = meta_state(tiny, hf_state(write_hf(tiny, tmp_path / "hf")))
    write_meta(tiny, state, tmp_path / "meta")
    convert(tmp_path / "meta", tmp_path / "ckpt", progress=False)
    np.testing.assert_allclose(ours(tmp_path / "ckpt"), meta_reference_logits(tiny, state), atol=1e-4)


@pytest.mark.parametrize("embedding_axis", [0, 1], ids=["llama3-vocab-split", "llama2-width-split"])
def test_meta_model_parallel_shards_merge(embedding_axis, tmp_path):
    tiny = META_TINIES["gqa-untied-rope-scaled"]
    state = meta_state(tiny, hf_state(write_hf(tiny, tmp_path / "hf")))
    write_meta(tiny, state, tmp_path / "one")
    write_meta(tiny, state, tmp_path / "two", shards=2, embedding_axis=embedding_axis)
    convert(tmp_path / "one", tmp_path / "c1", progress=False)
    convert(tmp_path / "two", tmp_path / "c2", progress=False)
    _, p1 = load_checkpoint(tmp_path / "c1")
    _, p2 = load_checkpoint(tmp_path / "c2")
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), p1, p2)


def test_meta_bfloat16_stays_bfloat16(tmp_path):
    tiny = META_TINIES["mqa-tied"]
    state = meta_state(tiny, hf_state(write_hf(tiny, tmp_path / "hf")))
    write_meta(tiny, state, tmp_path / "meta", dtype=torch.bfloat16)
    convert(tmp_path / "meta", tmp_path / "ckpt", progress=False)
    config, params = load_checkpoint(tmp_path / "ckpt", dtype="bfloat16")
    assert config.dtype == "bfloat16" and params["embedding"].dtype == jax.numpy.bfloat16
    expected = torch.from_numpy(state["tok_embeddings.weight"]).to(torch.bfloat16).float().numpy()
    np.testing.assert_array_equal(np.asarray(params["embedding"], np.float32), expected)
