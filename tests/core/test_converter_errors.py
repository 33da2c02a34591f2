"""Bad input to `python -m converters.llama`: one clear line naming the file and the problem, exit 1, and no
OUT (complete-looking or otherwise) left behind."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.factories import Tiny, copy_gguf, hf_state, meta_state, write_gguf, write_hf, write_meta

REPO = Path(__file__).resolve().parents[2]


def run_converter(src, out, *args, prelude: str = ""):
    code = (
        f"{prelude}import runpy, sys; sys.argv = ['converters.llama'] + sys.argv[1:]; "
        "runpy.run_module('converters.llama', run_name='__main__')"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, str(src), str(out), *args], cwd=REPO, capture_output=True, text=True, timeout=300
    )
    return proc.returncode, proc.stderr.strip().splitlines()


def assert_fails(tmp_path, src, message, *args, prelude=""):
    out = tmp_path / "out"
    code, lines = run_converter(src, out, *args, prelude=prelude)
    assert code == 1, lines
    assert lines[-1].startswith("error: ") and message in lines[-1], lines[-1]
    assert not out.exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out.tmp")]
    return lines[-1]


def test_not_a_checkpoint(tmp_path):
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "readme.txt").write_text("hello")
    assert_fails(tmp_path, tmp_path / "junk", "not a Llama checkpoint")
    assert_fails(tmp_path, tmp_path / "nowhere", "no such file or directory")


@pytest.fixture(scope="module")
def tiny_state(tmp_path_factory):
    tiny = Tiny(vocab=132)  # even, so that Meta shards can split the output projection
    return tiny, hf_state(write_hf(tiny, tmp_path_factory.mktemp("hf") / "hf"))


def test_meta_missing_shard(tmp_path, tiny_state):
    tiny, state = tiny_state
    write_meta(tiny, meta_state(tiny, state), tmp_path / "meta", shards=2, embedding_axis=1)
    (tmp_path / "meta" / "consolidated.00.pth").unlink()
    assert_fails(tmp_path, tmp_path / "meta", "missing shard consolidated.00.pth")


def test_meta_without_torch_names_the_extra(tmp_path, tiny_state):
    tiny, state = tiny_state
    write_meta(tiny, meta_state(tiny, state), tmp_path / "meta")
    assert_fails(
        tmp_path, tmp_path / "meta", "pip install 'jaxllama[meta]'", prelude="import sys; sys.modules['torch'] = None; "
    )


def test_hf_missing_shard_file(tmp_path):
    write_hf(Tiny(), tmp_path / "hf", max_shard_size="50KB")
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    victim = sorted(set(index["weight_map"].values()))[1]
    (tmp_path / "hf" / victim).unlink()
    assert_fails(tmp_path, tmp_path / "hf", f"lists {victim}, which is missing")


def test_hf_shape_mismatch_names_tensor(tmp_path):
    write_hf(Tiny(), tmp_path / "hf")
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    cfg["intermediate_size"] = 128
    (tmp_path / "hf" / "config.json").write_text(json.dumps(cfg))
    line = assert_fails(
        tmp_path, tmp_path / "hf", "model.layers.0.mlp.gate_proj.weight: shape (96, 64), expected (128, 64)"
    )
    assert "model.safetensors" in line


def test_hf_unsupported_architecture(tmp_path):
    write_hf(Tiny(), tmp_path / "hf")
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    cfg["architectures"], cfg["model_type"] = ["GPT2LMHeadModel"], "gpt2"
    (tmp_path / "hf" / "config.json").write_text(json.dumps(cfg))
    assert_fails(tmp_path, tmp_path / "hf", "unsupported architecture 'GPT2LMHeadModel'")


def test_gguf_unsupported_tensor_type(tmp_path, tiny_state):
    tiny, state = tiny_state
    write_gguf(tiny, state, tmp_path / "m.gguf")
    f64 = lambda t: (np.asarray(t.data).astype(np.float64), None) if t.name == "blk.1.ffn_up.weight" else None
    copy_gguf(tmp_path / "m.gguf", tmp_path / "bad.gguf", replace=f64)
    assert_fails(tmp_path, tmp_path / "bad.gguf", "blk.1.ffn_up.weight has type F64")


def test_gguf_unsupported_architecture(tmp_path):
    import gguf

    writer = gguf.GGUFWriter(str(tmp_path / "g.gguf"), "gpt2")
    writer.add_block_count(1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert_fails(tmp_path, tmp_path / "g.gguf", "unsupported architecture 'gpt2'")


def test_existing_output_is_kept(tmp_path, tiny_state):
    write_hf(Tiny(), tmp_path / "hf")
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "mine.txt").write_text("keep me")
    code, lines = run_converter(tmp_path / "hf", tmp_path / "out")
    assert code == 1 and "already exists" in lines[-1] and "--overwrite" in lines[-1]
    assert (tmp_path / "out" / "mine.txt").read_text() == "keep me"
