"""A damaged converted checkpoint (missing or truncated files, an absurd config.json, a config.json that does not
match the arrays stored) is refused with one CheckpointError naming the file and the problem, before anything of
the config's size is built; `jaxllama run` prints it as one `error:` line. Temporary folders that killed
conversions left beside OUT are removed by the next writer, and a conversion killed at any step of replacing OUT
(--overwrite) leaves OUT whole, the old checkpoint or the new, or the next command makes it so."""

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

from jaxllama.core.checkpoint import (
    CONFIG_FILE,
    FORMAT,
    FORMAT_FILE,
    PARAMS_DIR,
    CheckpointWriter,
    load_checkpoint,
    load_config,
    remove_stale_tmp,
)
from jaxllama.core.config import ModelConfig
from jaxllama.errors import CheckpointError
from tests.helpers.fifo import fifo_instead_of

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


def unlisted(path: Path) -> Path:
    """`path` as written before format.json listed the checkpoint's files: checked by its arrays alone."""
    (path / FORMAT_FILE).write_text(json.dumps({"format": FORMAT}) + "\n")
    return path


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
    unlisted(copy)  # else the file's absence is found first (test_a_checkpoint_missing_a_file_is_refused_naming_it)
    next((copy / PARAMS_DIR).rglob("_METADATA")).unlink()
    with pytest.raises(CheckpointError, match=r"params: cannot read Orbax's metadata"):
        load_checkpoint(copy)


@pytest.mark.parametrize("damage", ["truncate", "delete"])
def test_a_damaged_data_file_is_refused_naming_it(copy, damage):
    """By Orbax's reads, in a checkpoint whose format.json lists no files (those that list them: next tests)."""
    unlisted(copy)
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
    unlisted(copy)
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


# A checkpoint missing a file its format.json lists: refused before anything is read, naming the file.


@pytest.mark.parametrize("victim", ["tokenizer.json", "converter.json", "config.json", "data file", "_METADATA"])
def test_a_checkpoint_missing_a_file_is_refused_naming_it(copy, victim):
    from jaxllama.default_model import resolve_model

    file = {"data file": data_files(copy)[0], "_METADATA": next((copy / PARAMS_DIR).rglob("_METADATA"))}.get(victim)
    file = file or copy / victim
    file.unlink()
    name = file.relative_to(copy).as_posix()
    message = rf"{re.escape(str(copy))}: an incomplete checkpoint: {re.escape(name)} missing .*converters.llama SRC"
    for load in [load_checkpoint, load_config, lambda path: load_config(path, check=False), resolve_model]:
        with pytest.raises(CheckpointError, match=message):
            load(copy)


@pytest.mark.parametrize("victim", ["tokenizer.json", "config.json", "data file"])
def test_a_checkpoint_holding_a_fifo_is_refused_naming_it(copy, victim):
    """A FIFO in place of a file format.json lists, whose read would wait for a writer forever: refused, unread."""
    from jaxllama.default_model import resolve_model

    file = data_files(copy)[0] if victim == "data file" else copy / victim
    name = file.relative_to(copy).as_posix()
    message = rf"incomplete checkpoint: {re.escape(name)} is a FIFO, not a regular file"
    with fifo_instead_of(file) as blocked:
        for load in [load_checkpoint, load_config, resolve_model]:
            with pytest.raises(CheckpointError, match=message):
                load(copy)
    assert not blocked, "a load waited on the FIFO"


def test_a_checkpoint_missing_files_names_them(copy):
    for f in data_files(copy)[:7]:
        f.unlink()
    (copy / "tokenizer.json").unlink()
    with pytest.raises(CheckpointError, match=r"params/state/d/\w+, .* and 3 more missing \(of the \d+ files format"):
        load_config(copy)


def test_an_array_file_of_another_size_is_refused_naming_it(copy):
    victim = data_files(copy)[0]
    victim.write_bytes(victim.read_bytes()[:10])
    name = re.escape(victim.relative_to(copy).as_posix())
    with pytest.raises(CheckpointError, match=rf"incomplete checkpoint: {name} is 10 bytes, format.json lists \d+"):
        load_checkpoint(copy)


def test_a_checkpoint_loads_whole_with_its_json_files_edited(copy):
    """format.json's sizes of the JSON and tokenizer files, which a user may edit, are not checked."""
    edit_config(copy, max_seq_len=128)
    (copy / "tokenizer.json").write_text((copy / "tokenizer.json").read_text() + "\n\n")
    assert load_config(copy).max_seq_len == 128


# Replacing OUT (--overwrite), killed at each step: OUT is the old checkpoint or the new, whole, at every instant,
# or (where the system cannot swap two folders in one step) the next command to read or write OUT makes it so.


class Killed(BaseException):
    """The writer's process dying here: nothing after it runs, not even its clean-up."""


@pytest.fixture(scope="module")
def old_and_new(tmp_path_factory) -> tuple[Path, Path, Path]:
    """A tiny GGUF, its conversion in float32 (the OUT to replace) and in bfloat16 (what replaces it)."""
    from converters.llama import convert
    from tests.factories import write_chat_gguf

    tmp = tmp_path_factory.mktemp("swap")
    gguf = write_chat_gguf(tmp / "m.gguf")
    old = convert(gguf, tmp / "old", dtype="float32", progress=False)
    new = convert(gguf, tmp / "new", dtype="bfloat16", progress=False)
    return gguf, old, new


def snapshot(path: Path) -> dict[str, bytes]:
    return {f.relative_to(path).as_posix(): f.read_bytes() for f in sorted(path.rglob("*")) if f.is_file()}


def holds(out: Path, old: Path, new: Path) -> str | None:
    """Which checkpoint `out` holds, each of its files as written: "old" or "new"; None if neither, whole."""
    if not out.is_dir():
        return None
    found = snapshot(out)
    if found == snapshot(old):
        return "old"
    listed = json.loads(found.get(FORMAT_FILE, b"{}")).get("files")
    sizes = {name: len(content) for name, content in found.items() if name != FORMAT_FILE}
    same = found.get(CONFIG_FILE) == (new / CONFIG_FILE).read_bytes()
    return "new" if same and listed == sizes else None


def as_dead(folder: Path) -> None:
    """Rename the folders the 'killed' writer (this process) left beside `folder` to carry the id of a process that is
    gone, as a killed writer's do."""
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    for left in folder.parent.glob(f".{folder.name}.*-{os.getpid()}-*"):
        left.rename(left.with_name(left.name.replace(f"-{os.getpid()}-", f"-{dead.pid}-")))


@pytest.mark.slow
@pytest.mark.parametrize("one_step", [True, False], ids=["swap", "two-renames"])
def test_overwrite_killed_at_each_step_leaves_out_whole(old_and_new, tmp_path, monkeypatch, one_step):
    """The steps of replacing OUT are the renames, swaps and removals of the folders beside it; the writer is killed
    at each in turn (within a removal: half-way through it), until one run finishes."""
    from converters.llama import convert
    from jaxllama.core import folders

    gguf, old, new = old_and_new
    out = tmp_path / "out"
    if one_step:
        probe = [tmp_path / "a", tmp_path / "b"]
        for folder in probe:
            folder.mkdir()
        if not folders._exchange(*probe):
            pytest.skip(f"{tmp_path}: its file system cannot swap two folders in one step")
        for folder in probe:
            folder.rmdir()
    rename, rmtree, exchange = os.rename, shutil.rmtree, folders._exchange
    if not one_step:
        exchange = lambda a, b: False  # as where the system has no renameat2
    state = {"steps": 0, "kill_at": 0, "dead": False, "armed": False}

    def step(path) -> bool:
        """Whether this step of the replacement is where the writer dies."""
        if state["dead"]:
            return True
        if not state["armed"] or Path(path).parent != tmp_path:  # not the writer's step (Orbax's, within its folder)
            return False
        state["steps"] += 1
        state["dead"] = state["steps"] == state["kill_at"]
        return state["dead"]

    def killed_rename(src, dst, *args, **kwargs):
        if step(src):
            raise Killed
        return rename(src, dst, *args, **kwargs)

    def killed_exchange(a, b):
        if one_step and step(a):  # else nothing is done: not a step
            raise Killed
        return exchange(a, b)

    def killed_rmtree(path, *args, **kwargs):
        if state["dead"]:
            raise Killed
        if step(path):
            files = sorted(p for p in Path(path).rglob("*") if p.is_file())
            for f in files[: len(files) // 2]:
                f.unlink()
            raise Killed
        return rmtree(path, *args, **kwargs)

    monkeypatch.setattr(os, "rename", killed_rename)
    monkeypatch.setattr(shutil, "rmtree", killed_rmtree)
    monkeypatch.setattr(folders, "_exchange", killed_exchange)
    finished = False
    while not finished:
        state.update(steps=0, kill_at=state["kill_at"] + 1)
        assert state["kill_at"] < 10
        shutil.copytree(old, out)
        state["armed"] = True
        try:
            convert(gguf, out, dtype="bfloat16", overwrite=True, progress=False)
            finished = True
        except Killed:
            pass
        state.update(armed=False, dead=False)
        at = f"killed at step {state['kill_at']}" if not finished else "finished"
        as_dead(out)
        now = holds(out, old, new)
        if now is None:  # only between two renames: no OUT, until the next command
            assert not one_step and not os.path.lexists(out), at
        load_config(out)  # the next command: it finds OUT whole (repaired first where it had to be)
        assert holds(out, old, new) == ("new" if finished else now or "old"), at
        leftovers = [p.name for p in tmp_path.iterdir() if p.name != "out" and ".out.tmp-" not in p.name]
        assert not leftovers, at  # the old OUT moved aside is removed or put back; stale .tmp: the next writer's
        remove_stale_tmp(out)
        shutil.rmtree(out)
    assert state["kill_at"] == (3 if one_step else 4)  # steps: swap, remove the old; or rename, rename, remove


def test_overwrite_killed_between_its_renames_is_repaired_by_the_next_command(old_and_new, tmp_path):
    """The converter's own process, killed (SIGKILL) where a system without a one-step swap has no OUT: the old OUT
    moved aside, the new one not yet renamed into place. The next command (here a conversion without --overwrite,
    refused) puts the old one back; a conversion with --overwrite then replaces it and leaves nothing beside it."""
    from converters.llama import convert

    gguf, old, new = old_and_new
    out = tmp_path / "out"
    shutil.copytree(old, out)
    prelude = (
        "import os, signal; from jaxllama.core import folders; folders._exchange = lambda a, b: False; "
        "rename = os.rename; "
        f"os.rename = lambda a, b: os.kill(os.getpid(), signal.SIGKILL) if str(b) == {str(out)!r} else rename(a, b); "
        "import runpy, sys; sys.argv = ['converters.llama'] + sys.argv[1:]; "
        "runpy.run_module('converters.llama', run_name='__main__')"
    )
    proc = subprocess.run(
        [sys.executable, "-c", prelude, str(gguf), str(out), "--dtype", "bfloat16", "--overwrite"],
        cwd=REPO,
        capture_output=True,
        timeout=300,
    )
    assert proc.returncode == -9, proc.stderr.decode()[-2000:]
    assert not out.exists() and [p for p in tmp_path.iterdir() if p.name.startswith(".out.old-")]
    with pytest.raises(FileExistsError, match="already exists"):  # the next command finds the old OUT back
        convert(gguf, out, dtype="bfloat16", progress=False)
    assert load_config(out).dtype == "float32" and holds(out, old, new) == "old"
    convert(gguf, out, dtype="bfloat16", overwrite=True, progress=False)
    assert holds(out, old, new) == "new" and [p.name for p in tmp_path.iterdir()] == ["out"]
