"""Programs kept exported on disk (`engine/programs.py`): found again without tracing, the same results as the
function jitted directly, outputs in their pytree (the engine's dataclasses too), donation kept, a damaged or
changed file exported again, and a file runs no code."""

import dataclasses
import functools
import logging
import os
import pickle

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxllama.engine import programs
from jaxllama.engine.sampling import SamplingRows

TRACES = []


def step(params, x, cache, *, scale):
    """A pytree in (dict, list of tuples), a pytree out; counts its traces."""
    TRACES.append(scale)
    y = jnp.tanh(x @ params["w"]) * scale
    return {"y": y, "sum": y.sum()}, [(k + 1, v * 2) for k, v in cache]


def args():
    rng = np.random.default_rng(0)
    params = {"w": jnp.asarray(rng.standard_normal((4, 4), np.float32))}
    x = jnp.asarray(rng.standard_normal((3, 4), np.float32))
    return params, x, [(jnp.zeros(2), jnp.ones(2))]


def test_a_kept_program_runs_again_without_tracing(tmp_path):
    fn = functools.partial(step, scale=2.0)
    want = jax.jit(fn)(*args())
    TRACES.clear()
    first = programs.compile_program(tmp_path, fn, args(), None, None, {})
    assert len(TRACES) == 1 and len(list(tmp_path.glob("*.jaxprog"))) == 1
    again = programs.compile_program(tmp_path, fn, args(), None, None, {})
    assert len(TRACES) == 1  # read from its file, not traced
    for compiled in (first, again):
        got = compiled(*args())
        assert jax.tree.structure(got) == jax.tree.structure(want)
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-6)


def test_keywords_shapes_and_static_switches_are_other_programs(tmp_path):
    params, x, cache = args()
    programs.compile_program(tmp_path, functools.partial(step, scale=2.0), (params, x, cache), None, None, {})
    programs.compile_program(tmp_path, functools.partial(step, scale=3.0), (params, x, cache), None, None, {})
    programs.compile_program(tmp_path, functools.partial(step, scale=2.0), (params, x[:2], cache), None, None, {})
    programs.compile_program(tmp_path, functools.partial(step, scale=2.0), (params, x, cache), None, "other", {})
    programs.compile_program(tmp_path, functools.partial(step, scale=2.0), (params, x, cache), 2, None, {})
    assert len(list(tmp_path.glob("*.jaxprog"))) == 5


def test_the_donated_argument_is_donated(tmp_path):
    fn = functools.partial(step, scale=1.0)
    for _ in range(2):  # exported, then read back
        params, x, cache = args()
        out, new_cache = programs.compile_program(tmp_path, fn, (params, x, cache), 2, None, {})(params, x, cache)
        assert all(a.is_deleted() for a in cache[0]) and not x.is_deleted()
        np.testing.assert_array_equal(new_cache[0][1], [2.0, 2.0])


def test_a_damaged_file_is_exported_again(tmp_path, caplog):
    fn = functools.partial(step, scale=2.0)
    want = jax.jit(fn)(*args())[0]["y"]
    programs.compile_program(tmp_path, fn, args(), None, None, {})
    (path,) = tmp_path.glob("*.jaxprog")
    path.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not a program at all")
    TRACES.clear()
    with caplog.at_level(logging.WARNING, logger="jaxllama.engine.programs"):
        got = programs.compile_program(tmp_path, fn, args(), None, None, {})(*args())
    assert "unreadable" in caplog.text and len(TRACES) == 1
    np.testing.assert_allclose(got[0]["y"], want, rtol=1e-6)
    assert programs.compile_program(tmp_path, fn, args(), None, None, {}) and len(TRACES) == 1  # whole again


def test_a_function_the_key_cannot_see_into_is_refused(tmp_path):
    """A closure or a positional argument could change the program without changing its file name."""
    scale = 2.0
    with pytest.raises(ValueError, match="module-level"):
        programs.compile_program(tmp_path, lambda *a: step(*a, scale=scale), args(), None, None, {})
    with pytest.raises(ValueError, match="module-level"):
        programs.compile_program(tmp_path, functools.partial(step, {"w": 1}), args()[1:], None, None, {})


def as_rows(x, *, scale):
    """A `SamplingRows` out: a dataclass that kept programs return (`programs.KEPT_NODES`)."""
    TRACES.append(scale)
    names = [f.name for f in dataclasses.fields(SamplingRows)]
    return SamplingRows(**{name: x * i * scale for i, name in enumerate(names)})


def test_a_kept_program_returns_the_engines_dataclasses(tmp_path):
    fn, x = functools.partial(as_rows, scale=2.0), jnp.arange(3.0)
    want = jax.jit(fn)(x)
    TRACES.clear()
    for _ in range(2):  # exported, then read back
        got = programs.compile_program(tmp_path, fn, (x,), None, None, {})(x)
        assert type(got) is SamplingRows and jax.tree.structure(got) == jax.tree.structure(want)
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
            np.testing.assert_array_equal(a, b)
    assert len(TRACES) == 1


class MakesDirectory:
    """A pickle that, loaded, creates a directory: what a crafted file could do."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return os.mkdir, (str(self.path),)


def test_a_program_file_runs_no_code(tmp_path, caplog):
    """A file as earlier versions wrote them (the size of an exported program, the program, a pickle of its outputs'
    pytree), its pickle crafted: it is exported again, and the pickle never loaded."""
    fn = functools.partial(step, scale=2.0)
    want = jax.jit(fn)(*args())[0]["y"]
    leaves, tree = jax.tree.flatten(args())
    flat = lambda *xs: jax.tree.leaves(fn(*tree.unflatten(xs)))
    blob = bytes(jax.export.export(jax.jit(flat))(*leaves).serialize())
    marker = tmp_path / "ran"
    path = tmp_path / f"{programs.program_key(fn, args(), None, None)}.jaxprog"
    path.write_bytes(len(blob).to_bytes(8, "little") + blob + pickle.dumps(MakesDirectory(marker)))
    with caplog.at_level(logging.WARNING, logger="jaxllama.engine.programs"):
        got = programs.compile_program(tmp_path, fn, args(), None, None, {})(*args())
    assert not marker.exists()
    assert "unreadable" in caplog.text
    np.testing.assert_allclose(got[0]["y"], want, rtol=1e-6)


def test_a_changed_file_is_exported_again(tmp_path, caplog):
    fn = functools.partial(step, scale=2.0)
    want = jax.jit(fn)(*args())[0]["y"]
    programs.compile_program(tmp_path, fn, args(), None, None, {})
    (path,) = tmp_path.glob("*.jaxprog")
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 1  # one bit, inside the program
    path.write_bytes(bytes(data))
    TRACES.clear()
    with caplog.at_level(logging.WARNING, logger="jaxllama.engine.programs"):
        got = programs.compile_program(tmp_path, fn, args(), None, None, {})(*args())
    assert "unreadable" in caplog.text and len(TRACES) == 1
    np.testing.assert_allclose(got[0]["y"], want, rtol=1e-6)


def resized(x, *, length):
    """A program whose output's shape is a keyword's, not its argument's: as `kvcache.resize_layer`."""
    TRACES.append(length)
    return jnp.zeros(length).at[: x.shape[0]].set(x[:length])


@pytest.mark.parametrize("keep", [False, True], ids=["in-memory", "exported"])
def test_calls_that_differ_only_in_a_keyword_run_their_own_programs(tmp_path, monkeypatch, keep):
    """A cache grown from 128 positions to 1,024, shrunk, then grown to 256 must get 256 (it got the 1,024-position
    program: its key held the argument's shape and not the target length)."""
    from jaxllama.core.ops import Ops
    from jaxllama.engine.stats import EngineStats

    monkeypatch.setattr(programs, "program_cache", lambda: tmp_path)
    engine_programs = programs.Programs(Ops(), EngineStats(), jax.devices()[0], keep_exported=keep)
    x = jnp.arange(128.0)
    for length in (1024, 256, 128, 256, 1024):
        y = engine_programs("cache_resize", functools.partial(resized, length=length), (x,), None, None, None)
        assert y.shape == (length,)
        np.testing.assert_array_equal(y[: min(128, length)], x[:length])
    assert engine_programs.stats.compiles == 3


def test_a_file_under_another_programs_name_is_exported_again(tmp_path, caplog):
    """Two kept programs' files swapped (each whole, under the other's name): each is exported again, not run."""
    fns = [functools.partial(step, scale=s) for s in (2.0, 3.0)]
    for fn in fns:
        programs.compile_program(tmp_path, fn, args(), None, None, {})
    a, b = (tmp_path / f"{programs.program_key(fn, args(), None, None)}.jaxprog" for fn in fns)
    data_a, data_b = a.read_bytes(), b.read_bytes()
    a.write_bytes(data_b)
    b.write_bytes(data_a)
    TRACES.clear()
    with caplog.at_level(logging.WARNING, logger="jaxllama.engine.programs"):
        for fn in fns:
            got = programs.compile_program(tmp_path, fn, args(), None, None, {})(*args())
            np.testing.assert_allclose(got[0]["y"], jax.jit(fn)(*args())[0]["y"], rtol=1e-6)
    assert "another program's" in caplog.text and TRACES == [2.0, 2.0, 3.0, 3.0]  # exported again, then checked


def test_a_file_that_is_not_a_regular_file_is_not_read(tmp_path, caplog):
    """A FIFO under a program's name would block its reader forever: it is passed over and the program compiled."""
    fn = functools.partial(step, scale=2.0)
    os.mkfifo(tmp_path / f"{programs.program_key(fn, args(), None, None)}.jaxprog")
    with caplog.at_level(logging.WARNING, logger="jaxllama.engine.programs"):
        got = programs.compile_program(tmp_path, fn, args(), None, None, {})(*args())
    assert "not a regular file" in caplog.text
    np.testing.assert_allclose(got[0]["y"], jax.jit(fn)(*args())[0]["y"], rtol=1e-6)
