"""Bad input to `python -m converters.llama`: one clear line naming the file and the problem, exit 1, and no
OUT (complete-looking or otherwise) left behind."""

from __future__ import annotations

import contextlib
import io
import json
import re
import shutil
import struct
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from converters.layout import ConversionError
from converters.llama import convert
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


def run_main(src, out):
    """`main`, which the command runs on its arguments, in this process (a subprocess costs seconds of imports; the
    tests that pass `command=True` run the command itself): its exit status and stderr lines."""
    from converters.llama import main

    err = io.StringIO()
    with contextlib.redirect_stderr(err), pytest.raises(SystemExit) as e:
        main(str(src), str(out))
    return e.value.code, err.getvalue().strip().splitlines()


def assert_fails(tmp_path, src, message, prelude="", command=False):
    out = tmp_path / "out"
    code, lines = run_converter(src, out, prelude=prelude) if command or prelude else run_main(src, out)
    assert code == 1, lines
    assert lines[-1].startswith("error: ") and message in lines[-1], lines[-1]
    assert not out.exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out.tmp")]
    return lines[-1]


def test_not_a_checkpoint(tmp_path):
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "readme.txt").write_text("hello")
    assert_fails(tmp_path, tmp_path / "junk", "not a Llama checkpoint", command=True)
    assert_fails(tmp_path, tmp_path / "nowhere", "no such file or directory", command=True)


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
    code, lines = run_main(tmp_path / "hf", tmp_path / "out")
    assert code == 1 and "already exists" in lines[-1] and "--overwrite" in lines[-1]
    assert (tmp_path / "out" / "mine.txt").read_text() == "keep me"


# Damaged weights, absurd configs and configs the weights contradict: refused before anything is converted.


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("hf-good") / "hf"
    write_hf(Tiny(), path)
    return path


def hf_copy(hf_folder, tmp_path, **config) -> Path:
    """A copy of the tiny HF folder with config.json fields replaced."""
    copy = tmp_path / "hf"
    shutil.copytree(hf_folder, copy)
    cfg = json.loads((copy / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps(cfg | config))
    return copy


def rewrite_safetensors(path: Path, header=None, data=None) -> None:
    """Rewrite a safetensors file with its header changed by `header(dict)` and its data by `data(bytes)`."""
    raw = path.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    head, body = json.loads(raw[8 : 8 + n]), raw[8 + n :]
    head = header(head) if header else head
    text = json.dumps(head).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + (data(body) if data else body))


def lie_about_embedding_shape(head):
    head["model.embed_tokens.weight"]["shape"][0] *= 4
    return head


@pytest.mark.parametrize(
    "damage",
    [
        lambda f: rewrite_safetensors(f, data=lambda body: body[: len(body) // 2]),  # truncated
        lambda f: f.write_bytes(b"not a safetensors file at all" * 100),  # garbage
        lambda f: rewrite_safetensors(f, header=lie_about_embedding_shape),  # header says more than the data holds
    ],
    ids=["truncated", "garbage", "lying-header"],
)
def test_damaged_safetensors_is_refused_naming_the_file(hf_folder, tmp_path, damage):
    src = hf_copy(hf_folder, tmp_path)
    damage(src / "model.safetensors")
    with pytest.raises(ConversionError, match=r"model\.safetensors: not a valid safetensors file \("):
        convert(src, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"num_attention_heads": 0}, "num_attention_heads: must be positive, got 0"),
        ({"rms_norm_eps": "tiny"}, "rms_norm_eps: expected a positive number, got 'tiny'"),
        ({"intermediate_size": None}, "intermediate_size: expected a positive integer, got None"),
        ({"max_position_embeddings": 10**12}, "max_position_embeddings: 1000000000000 is more than 2147483647"),
        ({"hidden_size": 60, "head_dim": None}, "hidden_size: 60 is not divisible by n_heads=8"),
        ({"num_key_value_heads": -2}, "num_key_value_heads: must be positive, got -2"),
        ({"rms_norm_eps": float("nan")}, "rms_norm_eps: must be a positive number, got nan"),
        ({"rope_parameters": {"rope_type": "default", "rope_theta": -1}}, "rope_theta: must be a positive number"),
    ],
)
def test_absurd_config_values_are_refused_naming_the_field(hf_folder, tmp_path, fields, message):
    src = hf_copy(hf_folder, tmp_path, **fields)
    with pytest.raises(ConversionError, match=re.escape(f"{src / 'config.json'}: {message}")):
        convert(src, tmp_path / "out", progress=False)


def test_absurd_config_is_one_error_line(hf_folder, tmp_path):
    """0 heads used to end in a ZeroDivisionError traceback."""
    src = hf_copy(hf_folder, tmp_path, num_attention_heads=0)
    line = assert_fails(tmp_path, src, "config.json: num_attention_heads: must be positive, got 0")
    assert line.count("error:") == 1


def test_a_config_of_a_million_layers_is_refused_before_converting(hf_folder, tmp_path):
    """Checked against the layers the weights hold, before the model's layout (whose cost grows with the layers)
    is built: this used to run for minutes and gigabytes."""
    src = hf_copy(hf_folder, tmp_path, num_hidden_layers=10**6)
    start = time.perf_counter()
    assert_fails(tmp_path, src, "config.json: num_hidden_layers is 1000000, but the weights hold 2 layers")
    assert time.perf_counter() - start < 120


def test_a_config_wider_than_the_weights_is_refused_before_converting(hf_folder, tmp_path):
    src = hf_copy(hf_folder, tmp_path, hidden_size=64 * 10**4, head_dim=8)
    message = r"model.embed_tokens.weight: shape \(131, 64\), expected \(131, 640000\)"
    with pytest.raises(ConversionError, match=message):
        convert(src, tmp_path / "out", progress=False)
