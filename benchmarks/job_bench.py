"""jaxllama against HF transformers and llama.cpp on the same chat job, same model (the SmolLM2 GGUF), same
machine, one run; prints one table with the ratio of jaxllama (warm) to each peer.

    python -m benchmarks.job_bench JOB.jsonl [--hf-batch 32] [--skip hf,llamacpp] [--max-batch 64]
                                   [--quantize q8_0|w8a8] [--kv-cache-dtype float16]
                                   [--llama-server BIN [--server-slots 32]]

jaxllama runs the job through `jaxllama run` twice: cold (compilation cache emptied) and warm (cache filled);
with --quantize and/or --kv-cache-dtype, twice more with those options (the programs that take the weights or
the cache compile anew; the kernels and the others are in the cache by then).
The peers run from `benchmarks/peers.py` (HF transformers float32 batched `generate`; llama.cpp one request
at a time, if `llama-cpp-python` is installed: `pip install -e '.[bench]'`; with `--llama-server`, llama.cpp's own
server with parallel slots and continuous batching, the job's requests sent at once). Each system runs in its own
process; its peak resident memory is sampled. The roofline line sets jaxllama's decode against this
machine's float32 matmul peak and memory bandwidth, both measured here.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import fire

from benchmarks.measure import matmul_flops, memory_bandwidth, peak_rss
from jaxllama.core.config import ModelConfig
from jaxllama.engine.buckets import DEFAULT_SLOTS

REPO = Path(__file__).resolve().parents[1]


def run_jaxllama(job: Path, cache: Path, max_batch: int, options: dict) -> dict:
    """`jaxllama run` with `options` ({flag name: value}, e.g. {"quantize": "w8a8"}) and the summary it wrote."""
    out, stats = cache / "out.jsonl", cache / "stats.json"
    cmd = [sys.executable, "-m", "jaxllama.cli", "run", str(job), "--output", str(out), "--overwrite", "--quiet"]
    cmd += ["--stats-file", str(stats), "--max-batch", str(max_batch)]
    for flag, value in options.items():
        cmd += [f"--{flag.replace('_', '-')}", value]
    peak = peak_rss(cmd, REPO, env={**os.environ, "JAXLLAMA_CACHE": str(cache)})
    return {**json.loads(stats.read_text()), "peak_rss": peak}


def run_peer(name: str, job: Path, *args: str) -> dict:
    with tempfile.TemporaryFile("w+") as out:
        peak = peak_rss([sys.executable, "-m", "benchmarks.peers", name, str(job), *args], REPO, stdout=out)
        out.seek(0)
        return {**json.loads(out.read().strip().splitlines()[-1]), "peak_rss": peak}


# Bytes per weight a decode step reads: float32, or int8 with a float32 scale per 32 (`--quantize`).
BYTES_PER_PARAM = {None: 4, "q8_0": 1.125, "w8a8": 1.125}


def roofline(warm: dict, config: ModelConfig, flops: float, bandwidth: float, name: str, quantize=None) -> str:
    """Decode: the model's matmul FLOPs per generated token; every decode step reads every weight once."""
    bytes_per_param = BYTES_PER_PARAM[quantize]
    steps_per_s = warm["decode_steps"] / max(1e-9, warm["hosts"][0]["decode_s"])
    achieved_flops = config.flops_per_token() * warm["decode_tokens_per_s"]
    achieved_bytes = config.n_params * bytes_per_param * steps_per_s
    return (
        f"roofline ({name} warm decode): {achieved_flops / 1e9:.1f} GFLOP/s of a measured {flops / 1e9:.0f} "
        f"GFLOP/s float32 matmul peak ({100 * achieved_flops / flops:.0f}%); weights read at "
        f"{achieved_bytes / 1e9:.1f} GB/s of a measured {bandwidth / 1e9:.1f} GB/s "
        f"({100 * achieved_bytes / bandwidth:.0f}%)"
    )


def main(
    job: str,
    hf_batch: int = 32,
    skip: str | tuple = (),
    max_batch: int = DEFAULT_SLOTS,
    quantize: str | None = None,
    kv_cache_dtype: str | None = None,
    llama_server: str | None = None,
    server_slots: int = 32,
):
    """`quantize`, `kv_cache_dtype`: also run jaxllama with those options (`jaxllama run --quantize ...`), cold
    and warm."""
    options = {k: v for k, v in {"quantize": quantize, "kv_cache_dtype": kv_cache_dtype}.items() if v}
    variant = " ".join(["jaxllama", *options.values()]) if options else None
    job = Path(job).resolve()
    skip = set(skip.split(",") if isinstance(skip, str) else skip)
    cache = Path(tempfile.mkdtemp(prefix="jaxllama-bench-"))
    try:
        # Convert the default model first, so that "cold" measures compilation, not conversion.
        convert = "from jaxllama.default_model import default_checkpoint as d; print(d(False))"
        env = {**os.environ, "JAXLLAMA_CACHE": str(cache)}
        checkpoint = subprocess.run(
            [sys.executable, "-c", convert], env=env, check=True, cwd=REPO, capture_output=True, text=True
        ).stdout.split()[-1]
        config = ModelConfig.load(checkpoint)
        results = {"jaxllama cold": run_jaxllama(job, cache, max_batch, {})}
        results["jaxllama warm"] = run_jaxllama(job, cache, max_batch, {})
        if variant:
            results[f"{variant} cold"] = run_jaxllama(job, cache, max_batch, options)
            results[f"{variant} warm"] = run_jaxllama(job, cache, max_batch, options)
    finally:
        shutil.rmtree(cache, ignore_errors=True)
    warm = results["jaxllama warm"]
    if "hf" not in skip:
        results[f"HF transformers batch {hf_batch}"] = run_peer("hf", job, "--batch", str(hf_batch))
    if "llamacpp" not in skip and importlib.util.find_spec("llama_cpp"):
        results["llama.cpp sequential"] = run_peer("llamacpp", job)
    if llama_server:
        args = ("--server", llama_server, "--slots", str(server_slots))
        results[f"llama-server -np {server_slots}"] = run_peer("llamaserver", job, *args)
    peers = [name for name in results if not name.startswith("jaxllama")]

    print(f"job: {job.name}, {warm['ok']} requests, {warm['completion_tokens']} output tokens (jaxllama)")
    header = f"{'system':<34} {'out tok/s':>9} {'req/s':>6} {'TTFT p50 s':>10} {'wall s':>7} {'peak MB':>8}"
    print(header + "".join(f"  {'vs ' + p.split()[0]:>9}" for p in peers))
    for name, r in results.items():
        ttft = r.get("ttft_ms_p50")
        line = f"{name:<34} {r['output_tokens_per_s']:>9.1f} {r['requests_per_s']:>6.2f} "
        ttft_s = ttft / 1e3 if ttft is not None else float("nan")
        line += f"{ttft_s:>10.1f} {r['wall_s']:>7.1f} {r['peak_rss'] / 2**20:>8.0f}"
        line += "".join(f"  {r['output_tokens_per_s'] / results[p]['output_tokens_per_s']:>8.2f}x" for p in peers)
        print(line)
    flops, bandwidth = matmul_flops(), memory_bandwidth()
    for name, weights in (("jaxllama", None), *([(variant, quantize)] if variant else [])):
        cold, warm = results[f"{name} cold"], results[f"{name} warm"]
        print(
            f"{name}: compile {cold['compile_s']:.1f} s cold, {warm['compile_s']:.1f} s warm; warm prefill "
            f"{warm['prefill_tokens_per_s']} tok/s, decode {warm['decode_tokens_per_s']} tok/s, slot occupancy "
            f"{100 * warm['slot_occupancy']:.0f}%"
        )
        print(roofline(warm, config, flops, bandwidth, name, weights))


if __name__ == "__main__":
    fire.Fire(main)
