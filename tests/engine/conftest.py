"""The engine tests' tiny model (tests/helpers/engine.py builds it), made once per module."""

import pytest

from tests.helpers.engine import spread_params, tiny_config


@pytest.fixture(scope="module")
def tiny():
    config = tiny_config()
    return config, spread_params(config)
