"""Prepared weights kept on disk (`engine/prepared.py`): a second load maps the arrays the first one prepared, from
the file itself, and runs the same; a rewritten checkpoint, another quantization, a damaged or changed entry is
prepared again, and an index runs no code; only the entries used last are kept."""

import json
import logging
import os
import pickle
import shutil
from pathlib import Path

import jax
import numpy as np
import pytest

from jaxllama import LLM
from jaxllama.engine import prepared, runtime
from tests.helpers.fifo import fifo_instead_of

ONE_DEVICE = "data=1,model=1"  # the CPU kernels, whose packed weights are host arrays
TOKENS = [[5, 9, 200, 17, 3, 77]]


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    root = tmp_path / "prepared"
    monkeypatch.setattr(runtime, "_prepared", root)
    return root


@pytest.fixture
def checkpoint(tiny_chat_checkpoint, tmp_path) -> Path:
    return Path(shutil.copytree(tiny_chat_checkpoint, tmp_path / "ckpt"))


def entries(root: Path) -> list[Path]:
    return sorted(p.parent for p in root.glob(f"*/{prepared.INDEX}"))


def mapped_ranges(path: Path) -> list[tuple[int, int]]:
    """The address ranges this process maps `path` at (from /proc/self/maps)."""
    ranges = []
    for line in Path("/proc/self/maps").read_text().splitlines():
        if line.endswith(str(path)):
            start, end = line.split()[0].split("-")
            ranges.append((int(start, 16), int(end, 16)))
    return ranges


@pytest.mark.slow
def test_a_second_load_maps_the_prepared_weights(cache, checkpoint):
    first = LLM.load(checkpoint, mesh=ONE_DEVICE)
    want = first.logits(TOKENS)
    (entry,) = entries(cache)
    again = LLM.load(checkpoint, mesh=ONE_DEVICE)
    np.testing.assert_array_equal(again.logits(TOKENS), want)
    assert jax.tree.structure(again.params) == jax.tree.structure(first.params)
    # With the shardings they were restored with: the programs compiled for those are the ones found again.
    assert [x.sharding for x in jax.tree.leaves(again.params)] == [x.sharding for x in jax.tree.leaves(first.params)]
    # Every array of the second load lies in the entry's file, mapped: nothing was restored or copied.
    ranges = mapped_ranges((entry / prepared.WEIGHTS).resolve())
    for leaf in jax.tree.leaves(again.params):
        pointer = leaf.unsafe_buffer_pointer()
        assert any(start <= pointer < end for start, end in ranges), leaf.shape
    a, b = (llm.generate("the", max_tokens=8, temperature=0).token_ids for llm in (first, again))
    assert a == b


def test_bfloat16_weights_are_kept_and_mapped(cache, checkpoint):
    """bfloat16 arrays (ml_dtypes: no buffer format of their own) are written as their bytes."""
    want = LLM.load(checkpoint, mesh=ONE_DEVICE, dtype="bfloat16", keep_prepared=False).logits(TOKENS)
    for _ in range(2):  # prepared and kept, then mapped
        np.testing.assert_array_equal(LLM.load(checkpoint, mesh=ONE_DEVICE, dtype="bfloat16").logits(TOKENS), want)
    assert len(entries(cache)) == 1


@pytest.mark.slow
def test_each_quantization_is_its_own_entry_and_the_last_used_are_kept(cache, checkpoint, monkeypatch):
    monkeypatch.setattr(prepared, "KEEP", 2)
    for quantize in (None, "q8_0", "q4_0"):
        LLM.load(checkpoint, mesh=ONE_DEVICE, quantize=quantize)
    assert len(entries(cache)) == 2
    LLM.load(checkpoint, mesh=ONE_DEVICE, quantize="q8_0")  # kept: mapped, nothing written
    LLM.load(checkpoint, mesh=ONE_DEVICE)  # the oldest was removed: prepared and kept again
    kept = entries(cache)
    assert len(kept) == 2
    q4 = LLM.load(checkpoint, mesh=ONE_DEVICE, quantize="q4_0")  # removed, as the least recently used
    assert len(entries(cache)) == 2 and set(entries(cache)) != set(kept)
    assert np.isfinite(q4.logits(TOKENS)).all()


def test_a_rewritten_checkpoint_is_prepared_again(cache, checkpoint):
    want = LLM.load(checkpoint, mesh=ONE_DEVICE).logits(TOKENS)
    config = checkpoint / "config.json"
    config.write_text(json.dumps(json.loads(config.read_text()) | {"norm_eps": 0.5}))  # another model, same arrays
    got = LLM.load(checkpoint, mesh=ONE_DEVICE).logits(TOKENS)
    assert len(entries(cache)) == 2 and not np.allclose(got, want, atol=1e-3)
    data = next(p for p in (checkpoint / "params").rglob("*") if p.is_file())
    os.utime(data, ns=(0, 0))  # the arrays rewritten, as far as their files tell
    LLM.load(checkpoint, mesh=ONE_DEVICE)
    assert len(entries(cache)) == 3


def test_a_damaged_entry_is_prepared_again(cache, checkpoint, caplog):
    want = LLM.load(checkpoint, mesh=ONE_DEVICE).logits(TOKENS)
    (entry,) = entries(cache)
    weights = entry / prepared.WEIGHTS
    os.truncate(weights, weights.stat().st_size // 2)
    with caplog.at_level(logging.WARNING, logger="jaxllama.engine.prepared"):
        got = LLM.load(checkpoint, mesh=ONE_DEVICE).logits(TOKENS)
    assert "unusable" in caplog.text
    np.testing.assert_array_equal(got, want)
    assert entries(cache) == [entry] and weights.stat().st_size > 0  # written again, whole


@pytest.mark.parametrize("name", [prepared.WEIGHTS, prepared.INDEX])
def test_an_entry_file_that_is_a_fifo_is_never_read_and_prepared_again(cache, checkpoint, caplog, name):
    """A FIFO in place of an entry's file, whose read would wait for a writer forever (the load hung): the entry is
    unusable, and the weights are restored and kept again."""
    want = LLM.load(checkpoint, mesh=ONE_DEVICE).logits(TOKENS)
    (entry,) = entries(cache)
    with fifo_instead_of(entry / name) as blocked, caplog.at_level(logging.WARNING, logger="jaxllama.engine.prepared"):
        got = LLM.load(checkpoint, mesh=ONE_DEVICE).logits(TOKENS)
    assert not blocked, "the load waited on the FIFO"
    assert "unusable" in caplog.text and "not a regular file (a FIFO)" in caplog.text
    np.testing.assert_array_equal(got, want)
    assert entries(cache) == [entry] and (entry / name).is_file()  # written again, whole


def test_nothing_is_kept_on_a_mesh_or_when_asked_not_to(cache, checkpoint):
    LLM.load(checkpoint, mesh="data=2,model=1")  # XLA's operations read the restored arrays: nothing to keep
    LLM.load(checkpoint, mesh=ONE_DEVICE, keep_prepared=False)
    assert entries(cache) == []


@pytest.mark.parametrize("change", ["zeroed", "randomized"])
def test_weights_changed_in_place_are_not_used(cache, checkpoint, caplog, change):
    """The file's size and times as they were: only its status-change time tells, and the digests then."""
    want = LLM.load(checkpoint, mesh=ONE_DEVICE, keep_prepared=False).logits(TOKENS)
    LLM.load(checkpoint, mesh=ONE_DEVICE)
    (entry,) = entries(cache)
    weights = entry / prepared.WEIGHTS
    before = weights.stat()
    with open(weights, "r+b") as f:
        if change == "zeroed":  # 4 MB, or half a small file, from the first array on
            f.write(bytes(min(4 << 20, before.st_size // 2)))
        else:  # the second half
            f.seek(before.st_size // 2)
            f.write(np.random.default_rng(0).bytes(before.st_size - before.st_size // 2))
    os.utime(weights, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert weights.stat().st_size == before.st_size and weights.stat().st_mtime_ns == before.st_mtime_ns
    with caplog.at_level(logging.WARNING, logger="jaxllama.engine.prepared"):
        got = LLM.load(checkpoint, mesh=ONE_DEVICE).logits(TOKENS)
    np.testing.assert_array_equal(got, want)
    assert "changed since it was written" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="jaxllama.engine.prepared"):  # written again, whole: used
        np.testing.assert_array_equal(LLM.load(checkpoint, mesh=ONE_DEVICE).logits(TOKENS), want)
    assert caplog.text == "" and entries(cache) == [entry]


def test_a_copied_entry_is_checked_once_and_used(cache, checkpoint, caplog):
    """A cache restored from a copy: other inodes and times, the same bytes. Its digests are checked, its new stamp
    recorded, and its file mapped, not written again."""
    want = LLM.load(checkpoint, mesh=ONE_DEVICE).logits(TOKENS)
    (entry,) = entries(cache)
    copy = shutil.copytree(entry, cache / "copy")
    shutil.rmtree(entry)
    os.rename(copy, entry)
    inode = (entry / prepared.WEIGHTS).stat().st_ino
    for _ in range(2):
        with caplog.at_level(logging.INFO, logger="jaxllama.engine.prepared"):
            np.testing.assert_array_equal(LLM.load(checkpoint, mesh=ONE_DEVICE).logits(TOKENS), want)
    assert caplog.text.count("checked in") == 1 and "unusable" not in caplog.text
    assert (entry / prepared.WEIGHTS).stat().st_ino == inode


class MakesDirectory:
    """A pickle that, loaded, creates a directory: what a crafted index or program could do."""

    def __init__(self, path: Path):
        self.path = path

    def __reduce__(self):
        return os.mkdir, (str(self.path),)


@pytest.mark.parametrize("index", ["index.pkl of an earlier version", "index", "an offset changed"])
def test_an_index_runs_no_code_and_a_changed_one_is_not_used(cache, checkpoint, tmp_path, caplog, index):
    want = LLM.load(checkpoint, mesh=ONE_DEVICE).logits(TOKENS)
    (entry,) = entries(cache)
    marker = tmp_path / "ran"
    payload = pickle.dumps(MakesDirectory(marker))
    if index == "index.pkl of an earlier version":  # its weights.bin beside it
        (entry / prepared.INDEX).unlink()
        (entry / "index.pkl").write_bytes(payload)
    elif index == "index":
        (entry / prepared.INDEX).write_bytes(payload)
    else:
        data = json.loads((entry / prepared.INDEX).read_text())
        data["arrays"][0]["offset"] += 4096  # the next page: another array's bytes, whose digests still match
        (entry / prepared.INDEX).write_text(json.dumps(data))
    with caplog.at_level(logging.WARNING, logger="jaxllama.engine.prepared"):
        got = LLM.load(checkpoint, mesh=ONE_DEVICE).logits(TOKENS)
    assert not marker.exists()
    assert "unusable" in caplog.text
    np.testing.assert_array_equal(got, want)
    assert entries(cache) == [entry] and not (entry / "index.pkl").exists()  # written again, in this format
    assert json.loads((entry / prepared.INDEX).read_text())["format"] == prepared.FORMAT
