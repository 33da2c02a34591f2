"""A checkpoint restores onto meshes of 1, 2, 4 and 8 devices with the same logits."""

import dataclasses

import jax
import numpy as np
import pytest

from converters.llama import convert
from jaxllama.core.checkpoint import load_checkpoint
from jaxllama.core.config import ModelConfig
from jaxllama.core.model import sequence_logits
from jaxllama.core.sharding import make_mesh, parse_mesh
from tests.factories import Tiny, write_hf

TOKENS = np.array([[1, 5, 9, 100, 77, 3, 42, 8], [2, 130, 7, 7, 7, 1, 99, 15]])


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("mesh")
    # 8 heads but 2 KV heads: on model=4 or 8 the KV heads are replicated; vocab 131 is never divisible.
    write_hf(Tiny(heads=8, kv_heads=2, vocab=131, ffn=96), tmp / "hf")
    return convert(tmp / "hf", tmp / "ckpt", progress=False)


@pytest.fixture(scope="module")
def reference(checkpoint):
    config, params = load_checkpoint(checkpoint)
    return np.asarray(jax.jit(sequence_logits, static_argnums=1)(params, config, TOKENS))


def _mesh(config, spec):
    sizes = parse_mesh(spec)
    return make_mesh(config, spec, devices=jax.devices()[: sizes["data"] * sizes["model"]])


@pytest.mark.slow
@pytest.mark.parametrize(
    "spec",
    [
        "data=1,model=1",
        "data=1,model=2",
        "data=2,model=2",
        "data=1,model=4",
        "data=2,model=4",
        "data=1,model=8",
        "data=8,model=1",
    ],
)
def test_same_logits_on_every_mesh(checkpoint, reference, spec):
    mesh = _mesh(ModelConfig.load(checkpoint), spec)
    config, params = load_checkpoint(checkpoint, mesh=mesh)
    wq = params["layers_0"]["attention"]["wq"]
    assert wq.sharding.mesh.shape == dict(mesh.shape)
    # heads really are split over the model axis; each device holds its share only
    assert wq.addressable_shards[0].data.shape[0] == config.n_heads // mesh.shape["model"]
    logits = jax.jit(sequence_logits, static_argnums=1)(params, config, TOKENS)
    np.testing.assert_allclose(np.asarray(logits), reference, atol=1e-5)


def test_impossible_mesh_is_refused_with_the_constraint(checkpoint):
    config = ModelConfig.load(checkpoint)
    six_heads = dataclasses.replace(config, n_heads=6, n_kv_heads=2, head_dim=8)
    with pytest.raises(ValueError, match="model=4 does not divide the model's heads"):
        _mesh(six_heads, "data=1,model=4")
    with pytest.raises(ValueError, match="needs 16 devices"):
        make_mesh(config, "data=2,model=8")
    with pytest.raises(ValueError, match="expected 'data=N,model=M'"):
        make_mesh(config, "batch=2")
