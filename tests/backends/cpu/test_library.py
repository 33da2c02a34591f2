"""The CPU kernels' library as the cache keeps it (`backends/cpu/library.py`): loaded only as its build left it (the
size and SHA-256 recorded beside it), built again otherwise."""

import hashlib
import json
import os
import shutil

import pytest

from jaxllama.backends.cpu import library
from tests.helpers.cli import jaxllama
from tests.helpers.fifo import fifo_instead_of

ONE_DEVICE = ("--mesh", "data=1,model=1")  # the CPU kernels run


def record_of(path):
    return {"size": path.stat().st_size, "sha256": hashlib.sha256(path.read_bytes()).hexdigest()}


def kept_copy(kernel_folder, tmp_path):
    """The session's build, whole, copied with its record into a cache of this test's: the library's path there."""
    built = library.build(kernel_folder)
    cache = tmp_path / "cache"
    (cache / "kernels").mkdir(parents=True)
    for file in (built, built.with_suffix(".json")):
        shutil.copy2(file, cache / "kernels" / file.name)
    target = cache / "kernels" / built.name
    assert json.loads(target.with_suffix(".json").read_text()) == record_of(target)
    return target


def test_a_library_in_a_fifos_place_is_not_opened(tmp_path, kernel_folder, cpu_kernels, caplog):
    """A FIFO in the library's place hung the run: it is found not as built without being opened (so built again)."""
    target = kept_copy(kernel_folder, tmp_path)
    assert library._verified(target)
    with fifo_instead_of(target) as blocked:
        assert not library._verified(target)
    assert not blocked, "the check waited on the FIFO"
    assert "not as built" in caplog.text and "FIFO" in caplog.text


@pytest.mark.slow
def test_a_truncated_library_is_built_again(tmp_path, kernel_folder, cpu_kernels, tiny_chat_checkpoint):
    """A truncated library, loaded, killed the run with SIGBUS (exit -7, no message) at every run until it was
    deleted: it is built again, and the run goes on with the kernels."""
    assert cpu_kernels
    target = kept_copy(kernel_folder, tmp_path)
    cache = target.parents[1]
    job = tmp_path / "job.jsonl"
    job.write_text(json.dumps({"id": "x", "prompt": "the cat", "max_tokens": 4, "temperature": 0}) + "\n")
    os.truncate(target, target.stat().st_size // 3)
    done = jaxllama("run", job, "--model", tiny_chat_checkpoint, *ONE_DEVICE, env={"JAXLLAMA_CACHE": str(cache)})
    assert done.returncode == 0, (done.returncode, done.stderr[-3000:])
    assert f"the CPU kernels in {target} are not as built" in done.stderr
    assert "building the CPU kernels" in done.stderr and "CPU kernels unavailable" not in done.stderr
    assert json.loads(target.with_suffix(".json").read_text()) == record_of(target)  # whole, as recorded
    assert json.loads((tmp_path / "job.out.jsonl").read_text())["id"] == "x"
