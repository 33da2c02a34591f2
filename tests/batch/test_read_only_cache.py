"""A cache folder that cannot be written (a read-only file system, with the model converted into it before) is a
warning naming it and a run without its caches, not an error: the run reads the converted model from it, compiles
its programs, restores its weights and builds the CPU kernels in a temporary folder."""

import json
import shutil
import subprocess

import pytest

from jaxllama.backends.cpu import library
from tests.factories import write_chat_gguf
from tests.helpers.cli import jaxllama

# The cache made read-only as a user's is: a read-only bind mount of it, in a mount namespace of the run's own
# (`unshare -rm`: a user namespace, whose root may mount, without privilege outside it). Tests run as root, whom
# neither chmod nor a folder's owner stops; the mount is the one way short of patching the code under test.
READ_ONLY = ["unshare", "-rm", "sh", "-c", 'mount --bind "$0" "$0" && mount -o remount,bind,ro "$0" && exec "$@"']


def can_mount() -> bool:
    try:
        return subprocess.run([*READ_ONLY[:3], "-c", "mount -t tmpfs none /mnt"], timeout=30).returncode == 0
    except OSError:
        return False


@pytest.mark.slow
def test_a_read_only_cache_is_a_warning_and_a_run_without_it(tmp_path, kernel_folder, cpu_kernels):
    if not can_mount():
        pytest.skip("no user and mount namespaces here (unshare -rm): a read-only mount cannot be made")
    assert cpu_kernels
    gguf = write_chat_gguf(tmp_path / "tiny.gguf")
    job = tmp_path / "job.jsonl"
    job.write_text(json.dumps({"id": "x", "prompt": "the cat", "max_tokens": 8, "temperature": 0}) + "\n")
    cache = tmp_path / "cache"
    built = library.build(kernel_folder)  # the session's kernels: the first run need not build them
    (cache / "kernels").mkdir(parents=True)
    for file in (built, built.with_suffix(".json")):
        shutil.copy2(file, cache / "kernels" / file.name)
    run = ("run", job, "--model", gguf, "--mesh", "data=1,model=1", "--overwrite")  # on one device: kernels, prepared
    first = jaxllama(*run, env={"JAXLLAMA_CACHE": str(cache)})
    assert first.returncode == 0, first.stderr[-3000:]
    want = json.loads((tmp_path / "job.out.jsonl").read_text())
    assert {p.name for p in cache.iterdir()} >= {"models", "xla", "programs", "prepared", "kernels"}
    for kernels in (cache / "kernels").iterdir():  # to be built again, where the cache cannot keep them
        kernels.unlink()

    second = jaxllama(*run, env={"JAXLLAMA_CACHE": str(cache)}, wrapper=[*READ_ONLY, cache], timeout=300)
    assert second.returncode == 0, second.stderr[-3000:]
    warning = f"cannot write in the cache folder {cache} (Read-only file system): running without its compiled "
    assert second.stderr.count(warning) == 1, second.stderr[-3000:]
    assert f"cannot write the CPU kernels' folder {cache / 'kernels'}" in second.stderr
    assert "converting" not in second.stderr and "CPU kernels unavailable" not in second.stderr
    assert json.loads((tmp_path / "job.out.jsonl").read_text())["text"] == want["text"]
    assert list((cache / "kernels").iterdir()) == []  # nothing was written there
