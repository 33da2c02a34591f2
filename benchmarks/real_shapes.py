"""jaxllama beside llama.cpp's server on the same GGUF files of real model shapes, one run: peak memory, load time and
output tokens/s of a batch job and of one request at a time.

    python -m benchmarks.real_shapes JOB.jsonl MODEL.gguf [MODEL.gguf ...] --llama-server BIN
                                     [--one-at-a-time 4] [--run-args "--quantize w8a8"] [--convert-args ""]

For each GGUF (random-weight ones of the Llama 3.2 1B / 3B and 3.1 8B shapes will do: the speed and memory of a
shape do not depend on its weights' values):
- convert it (`python -m converters.llama GGUF CKPT CONVERT_ARGS`): seconds, peak RSS, checkpoint bytes;
- `jaxllama run JOB --model CKPT RUN_ARGS` twice (cold: compilation cache empty; warm), peak RSS and output tok/s;
- load: `jaxllama run` of the job's first line with max_tokens 1, its programs compiled by a first such run: the
  whole process, start to exit;
- one request at a time: the first N lines with `--max-batch 1`, its programs compiled by a short such run first;
- llama.cpp: `llama-server -np 32` on the whole job (its requests sent at once) and `-np 1` on the first N lines
  (`benchmarks.peers llamaserver`); load: start to health check passed.
Each system runs alone, in its own process. llama.cpp spin-waits: run this on an otherwise idle machine.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import fire

from benchmarks.measure import peak_rss

REPO = Path(__file__).resolve().parents[1]


def _timed(cmd: list[str], env: dict, stdout=None) -> tuple[float, int]:
    start = time.perf_counter()
    peak = peak_rss(cmd, REPO, env=env, stdout=stdout)
    return time.perf_counter() - start, peak


def _jaxllama(job: Path, checkpoint: Path, work: Path, env: dict, args: list[str]) -> dict:
    out, stats = work / "out.jsonl", work / "stats.json"
    cmd = [sys.executable, "-m", "jaxllama.cli", "run", str(job), "--model", str(checkpoint), "--output", str(out)]
    cmd += ["--overwrite", "--quiet", "--stats-file", str(stats), *args]
    seconds, peak = _timed(cmd, env)
    return {**json.loads(stats.read_text()), "peak_rss": peak, "process_s": seconds}


def _server(job: Path, gguf: Path, server: str, slots: int) -> dict:
    with tempfile.TemporaryFile("w+") as out:
        cmd = [sys.executable, "-m", "benchmarks.peers", "llamaserver", str(job), "--server", server]
        cmd += ["--gguf", str(gguf), "--slots", str(slots)]
        _, peak = _timed(cmd, dict(os.environ), stdout=out)
        out.seek(0)
        return {**json.loads(out.read().strip().splitlines()[-1]), "peak_rss": peak}


def _size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def _first_lines(job: Path, n: int, folder: Path, max_tokens: int | None = None) -> Path:
    rows = [json.loads(line) for line in job.read_text().splitlines() if line.strip()][:n]
    if max_tokens is not None:
        rows = [{**r, "max_tokens": max_tokens} for r in rows]
    path = folder / f"first{n}-{max_tokens}.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def shape(job: Path, gguf: Path, server: str, one_at_a_time: int, run_args: list[str], convert_args: list[str]):
    """One GGUF through both systems -> rows of the table."""
    work = Path(tempfile.mkdtemp(prefix="jaxllama-shapes-"))
    env = {**os.environ, "JAXLLAMA_CACHE": str(work / "cache")}
    try:
        checkpoint = work / "ckpt"
        cmd = [sys.executable, "-m", "converters.llama", str(gguf), str(checkpoint), *convert_args]
        convert_s, convert_peak = _timed(cmd, env, stdout=subprocess.DEVNULL)
        cold = _jaxllama(job, checkpoint, work, env, run_args)
        warm = _jaxllama(job, checkpoint, work, env, run_args)
        one_token = _first_lines(job, 1, work, max_tokens=1)
        _jaxllama(one_token, checkpoint, work, env, run_args)  # compiles its own shapes' programs
        load = _jaxllama(one_token, checkpoint, work, env, run_args)
        alone_job = _first_lines(job, one_at_a_time, work)
        alone_args = [*run_args, "--max-batch", "1"]
        _jaxllama(_first_lines(job, one_at_a_time, work, max_tokens=4), checkpoint, work, env, alone_args)  # compiles
        alone = _jaxllama(alone_job, checkpoint, work, env, alone_args)
        batch_peer = _server(job, gguf, server, 32)
        alone_peer = _server(alone_job, gguf, server, 1)
        return {
            "gguf": gguf.name,
            "gguf_bytes": gguf.stat().st_size,
            "checkpoint_bytes": _size(checkpoint),
            "convert_s": convert_s,
            "convert_peak": convert_peak,
            "jaxllama": {"cold": cold, "warm": warm, "load": load, "alone": alone},
            "llama-server": {"batch": batch_peer, "alone": alone_peer},
        }
    finally:
        shutil.rmtree(work, ignore_errors=True)


def main(job: str, *ggufs: str, llama_server: str, one_at_a_time: int = 4, run_args: str = "", convert_args: str = ""):
    job = Path(job).resolve()
    mb = 2**20
    print(
        f"{'model':<28} {'system':<22} {'peak MB':>8} {'load s':>7} {'job tok/s':>9} {'alone tok/s':>11} "
        f"{'vs llama.cpp job':>16} {'alone':>6}"
    )
    for gguf in ggufs:
        r = shape(
            job, Path(gguf).resolve(), llama_server, one_at_a_time, shlex.split(run_args), shlex.split(convert_args)
        )
        j, peer = r["jaxllama"], r["llama-server"]
        peer_job, peer_alone = peer["batch"]["output_tokens_per_s"], peer["alone"]["output_tokens_per_s"]
        peer_first = peer["batch"]["first_token_s"]
        name = f"{r['gguf']} ({r['gguf_bytes'] / mb:.0f} MB)"
        for system, batch, alone, peak, load in (
            ("jaxllama warm", j["warm"], j["alone"], j["warm"]["peak_rss"], j["load"]["process_s"]),
            ("jaxllama cold", j["cold"], None, j["cold"]["peak_rss"], None),
            ("llama-server", peer["batch"], peer["alone"], peer["batch"]["peak_rss"], peer_first),
        ):
            tok = batch["output_tokens_per_s"]
            alone_tok = alone["output_tokens_per_s"] if alone else float("nan")
            load_text = f"{load:>7.1f}" if load is not None else f"{'':>7}"
            print(
                f"{name:<28} {system:<22} {peak / mb:>8.0f} {load_text} {tok:>9.1f} {alone_tok:>11.1f} "
                f"{tok / peer_job:>15.2f}x {alone_tok / peer_alone:>5.2f}x"
            )
        print(
            f"{name:<28} conversion: {r['convert_s']:.0f} s, peak {r['convert_peak'] / mb:.0f} MB; checkpoint "
            f"{r['checkpoint_bytes'] / mb:.0f} MB; jaxllama warm peak = "
            f"{j['warm']['peak_rss'] / r['checkpoint_bytes']:.2f}x the checkpoint; "
            f"load: {j['load']['process_s']:.1f} s start to exit for one token "
            f"({j['load']['wall_s']:.1f} s of it the job), {j['load']['process_s'] / peer_first:.2f}x llama-server's "
            f"start to first token (its health check: {peer['batch']['load_s']:.1f} s)"
        )
        print(json.dumps(r), file=sys.stderr)


if __name__ == "__main__":
    fire.Fire(main)
