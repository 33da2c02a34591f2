"""A damaged converted checkpoint (missing or truncated files, an absurd config.json, a config.json that does not
match the arrays stored) is refused with one CheckpointError naming the file and the problem, before anything of
the config's size is built; `jaxllama run` prints it as one `error:` line. Temporary folders that killed
conversions left beside OUT are removed by the next writer."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from jaxllama.core.checkpoint import CONFIG_FILE, PARAMS_DIR, CheckpointWriter, load_checkpoint, remove_stale_tmp
from jaxllama.core.config import ModelConfig
from jaxllama.errors import CheckpointError

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def copy(tiny_chat_checkpoint, tmp_path) -> Path:
    path = tmp_path / "ckpt"
    shutil.copytree(tiny_chat_checkpoint, path)
    return path


def edit_config(path: Path, **fields) -> None:
    config = json.loads((path / CONFIG_FILE).read_text())
    (path / CONFIG_FILE).write_text(json.dumps(config | fields))


def data_files(path: Path) -> list[Path]:
    return sorted(f for f in (path / PARAMS_DIR).rglob("*") if f.is_file() and f.parent.name == "d")


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"n_heads": 0}, "n_heads: must be positive, got 0"),
        ({"norm_eps": "small"}, "norm_eps: expected a positive number, got 'small'"),
        ({"ffn_dim": None}, "ffn_dim: expected a positive integer, got None"),
        ({"max_seq_len": 10**12}, "max_seq_len: 1000000000000 is more than 2147483647"),
        ({"dim": 60, "head_dim": None}, "dim: 60 is not divisible by n_heads=8"),
        ({"vocab_size": -1}, "vocab_size: must be positive, got -1"),
        ({"dtype": "int4"}, "dtype: 'int4' is not one of bfloat16, float32, float16"),
    ],
)
def test_an_absurd_config_is_refused_naming_the_field(copy, fields, message):
    edit_config(copy, **fields)
    with pytest.raises(CheckpointError, match=re.escape(f"{copy / CONFIG_FILE}: {message}")):
        load_checkpoint(copy)


def test_a_config_that_is_not_json_is_refused(copy):
    (copy / CONFIG_FILE).write_text('{"dim": 64,')
    with pytest.raises(CheckpointError, match=re.escape(f"{copy / CONFIG_FILE}: not readable as JSON")):
        ModelConfig.load(copy)


def test_a_config_of_a_million_layers_is_refused_from_the_stored_metadata(copy):
    """Restoring would first build a model of 10^6 layers (minutes and gigabytes); the metadata says there are 2."""
    edit_config(copy, n_layers=10**6)
    start = time.perf_counter()
    with pytest.raises(CheckpointError, match=r"config.json: n_layers is 1000000, but .*params holds 2 layers"):
        load_checkpoint(copy)
    assert time.perf_counter() - start < 60


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"n_layers": 10**6}, r"n_layers is 1000000, but .*params holds 2 layers"),
        (
            dict(dim=4096, n_layers=2, n_heads=32, n_kv_heads=8, head_dim=128, ffn_dim=14336, vocab_size=128256),
            r"vocab_size is 128256 and dim 4096, but .*params holds an embedding of shape \(264, 64\)",
        ),
    ],
)
def test_llm_load_trusts_no_size_the_stored_arrays_contradict(copy, fields, message):
    """Before the mesh, the backend or the memory check act on the config's sizes (which would call a tiny model
    with an 8B config "too large for the machine")."""
    from jaxllama import LLM

    edit_config(copy, **fields)
    with pytest.raises(CheckpointError, match=message):
        LLM.load(copy, max_slots=1, compilation_cache=False)


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"dim": 128, "head_dim": 16}, r"vocab_size is 264 and dim 128, but .*params holds an embedding of shape"),
        ({"ffn_dim": 128}, r"does not match .*params: layers_0/mlp/w1 is stored with shape \(96, 64\), .* \(128, 64\)"),
        ({"n_kv_heads": 4}, r"layers_0/attention/wk is stored with shape \(2, 8, 64\), the config gives \(4, 8, 64\)"),
        ({"tie_embeddings": True}, r"params: holds output, which the model of .* does not have \(tie_embeddings"),
        ({"dtype": "bfloat16"}, r"dtype is bfloat16, but .*params stores \S+ as float32"),
        ({"stored_as": {"layers_1/mlp/w2": "q8_0"}}, r"params: layers_1/mlp/w2/quants is missing"),
        ({"stored_as": {"layers_1/mlp/w2": "bfloat16"}}, r"stored_as gives layers_1/mlp/w2 as bfloat16, but"),
        ({"stored_as": {"norm/scale": "q4_0"}}, r"config.json: stored_as: norm/scale cannot be stored as blocks"),
        ({"stored_as": {"layers_9/mlp/w2": "q4_1"}}, r"config.json: stored_as: layers_9/mlp/w2: 'q4_1' is not one of"),
    ],
)
def test_a_config_that_does_not_match_the_stored_arrays_is_refused(copy, fields, message):
    edit_config(copy, **fields)
    with pytest.raises(CheckpointError, match=message):
        load_checkpoint(copy)


def test_missing_orbax_metadata_is_refused(copy):
    next((copy / PARAMS_DIR).rglob("_METADATA")).unlink()
    with pytest.raises(CheckpointError, match=r"params: cannot read Orbax's metadata"):
        load_checkpoint(copy)


@pytest.mark.parametrize("damage", ["truncate", "delete"])
def test_a_damaged_data_file_is_refused_naming_it(copy, damage):
    for f in data_files(copy):
        if damage == "truncate":
            f.write_bytes(f.read_bytes()[:10])
        else:
            f.unlink()
    # Each array's metadata is read from the data files: the damage is found there, before a restore.
    with pytest.raises(CheckpointError, match=r"params: cannot (read|restore) .*\(.*/d/") as e:
        load_checkpoint(copy)
    assert "tensorstore_spec" not in str(e.value)


def test_jaxllama_run_prints_one_error_line(copy, tmp_path):
    """Through the CLI: `error: ...`, a non-zero exit status, and no traceback."""
    for f in data_files(copy):
        f.write_bytes(f.read_bytes()[:10])
    job = tmp_path / "job.jsonl"
    job.write_text(json.dumps({"prompt": "the cat", "max_tokens": 2}) + "\n")
    env = {**os.environ, "JAXLLAMA_CACHE": os.environ.get("JAXLLAMA_TEST_CACHE", str(tmp_path / "cache"))}
    proc = subprocess.run(
        [sys.executable, "-m", "jaxllama.cli", "run", str(job), "--model", str(copy)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr
    assert len(errors) == 1 and f"{copy / 'params'}: cannot" in errors[0], proc.stderr


def test_temporary_folders_of_killed_writers_are_removed(tmp_path):
    """A conversion killed before it could clean up leaves `.OUT.tmp-PID-*`; the next writer of OUT removes it,
    but not the folder of a writer still at work."""
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    out = tmp_path / "out"
    stale = [tmp_path / f".out.tmp-{dead.pid}-0123abcd", tmp_path / ".out.tmp-89abcdef"]  # the second: no pid
    live = tmp_path / f".out.tmp-{os.getpid()}-0123abcd"
    other = tmp_path / f".other.tmp-{dead.pid}-0123abcd"  # another output's
    for folder in [*stale, live, other]:
        (folder / "params").mkdir(parents=True)
    config = ModelConfig(vocab_size=16, dim=16, n_layers=1, n_heads=2, n_kv_heads=1, ffn_dim=32)
    with CheckpointWriter(out, config) as writer:
        assert writer.tmp.name.startswith(f".out.tmp-{os.getpid()}-")
        assert not any(p.exists() for p in stale) and live.exists() and other.exists()
    assert not writer.tmp.exists()
    assert remove_stale_tmp(tmp_path / "other") == [other]
