"""make_mesh on a machine of 8 devices (tests/conftest.py): a smaller --mesh takes the first devices; a larger one is
refused with the counts."""

import jax
import pytest

from jaxllama.core.config import ModelConfig
from jaxllama.core.sharding import make_mesh

CONFIG = ModelConfig(vocab_size=131, dim=64, n_layers=2, n_heads=8, n_kv_heads=2, ffn_dim=96)


def test_a_smaller_mesh_takes_the_first_devices():
    assert len(jax.devices()) == 8
    mesh = make_mesh(CONFIG, "data=1,model=2")
    assert dict(mesh.shape) == {"data": 1, "model": 2} and list(mesh.devices.flat) == jax.devices()[:2]
    assert list(make_mesh(CONFIG, "data=1,model=1").devices.flat) == jax.devices()[:1]
    assert make_mesh(CONFIG).size == 8  # without a spec: every device


def test_a_larger_mesh_is_refused_with_the_counts():
    with pytest.raises(ValueError, match="mesh data=2,model=8 needs 16 devices, 8 are available"):
        make_mesh(CONFIG, "data=2,model=8")
    with pytest.raises(ValueError, match="needs 2 devices, 1 is available"):
        make_mesh(CONFIG, "data=1,model=2", devices=jax.devices()[:1])
