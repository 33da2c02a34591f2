"""jaxllama against HF transformers on the same chat job, same model (the SmolLM2 GGUF), same machine, one run.

    python benchmarks/job_bench.py JOB.jsonl [--hf-batch 32] [--skip-hf]

jaxllama runs the job twice through `jaxllama run` (cold: compilation cache emptied; warm: cache filled);
HF transformers runs float32 batched `generate` with left padding (greedy, stopping at end of turn, as
users run it). Prints output tokens/s, wall time and the ratios.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import fire

REPO = Path(__file__).resolve().parents[1]


def run_jaxllama(job: Path, cache: Path, extra=()) -> dict:
    out, stats = cache / "out.jsonl", cache / "stats.json"
    env = {**os.environ, "JAXLLAMA_CACHE": str(cache)}
    start = time.time()
    subprocess.run(
        [
            sys.executable,
            "-m",
            "jaxllama.cli",
            "run",
            str(job),
            "--output",
            str(out),
            "--overwrite",
            "--quiet",
            "--stats-file",
            str(stats),
            *extra,
        ],
        cwd=REPO,
        env=env,
        check=True,
    )
    s = json.loads(stats.read_text())
    s["process_wall_s"] = time.time() - start
    return s


def run_hf(job: Path, batch: int) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from jaxllama.default_model import default_gguf

    gguf = default_gguf()
    torch.set_num_threads(os.cpu_count() or 1)
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    tok.padding_side = "left"
    tok.pad_token = tok.pad_token or tok.eos_token
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32).eval()
    rows = [json.loads(line) for line in job.read_text().splitlines() if line.strip()]
    texts = [tok.apply_chat_template(r["messages"], add_generation_prompt=True, tokenize=False) for r in rows]
    stops = {tok.eos_token_id, tok.convert_tokens_to_ids("<|im_end|>")}
    start, tokens = time.time(), 0
    with torch.no_grad():
        for i in range(0, len(rows), batch):
            chunk = rows[i : i + batch]
            enc = tok(texts[i : i + batch], return_tensors="pt", padding=True, add_special_tokens=False)
            out = model.generate(
                **enc,
                max_new_tokens=max(r.get("max_tokens", 64) for r in chunk),
                do_sample=False,
                eos_token_id=list(stops),
                pad_token_id=tok.pad_token_id,
            )
            for r, g in zip(chunk, out[:, enc["input_ids"].shape[1] :].tolist(), strict=True):
                g = g[: r.get("max_tokens", 64)]
                tokens += next((j + 1 for j, t in enumerate(g) if t in stops), len(g))
    wall = time.time() - start
    return {"completion_tokens": tokens, "wall_s": wall, "output_tokens_per_s": tokens / wall}


def main(job: str, hf_batch: int = 32, skip_hf: bool = False):
    job = Path(job).resolve()
    cache = Path(tempfile.mkdtemp(prefix="jaxllama-bench-"))
    try:
        # Convert the default model first, so that "cold" measures compilation, not conversion.
        subprocess.run(
            [sys.executable, "-c", "from jaxllama.default_model import default_checkpoint as d; d(False)"],
            env={**os.environ, "JAXLLAMA_CACHE": str(cache)},
            check=True,
            cwd=REPO,
        )
        cold = run_jaxllama(job, cache)
        warm = run_jaxllama(job, cache)
    finally:
        shutil.rmtree(cache, ignore_errors=True)
    rows = [
        ("jaxllama cold", cold["output_tokens_per_s"], cold["wall_s"], cold["compile_s"], cold["ttft_ms_p50"]),
        ("jaxllama warm", warm["output_tokens_per_s"], warm["wall_s"], warm["compile_s"], warm["ttft_ms_p50"]),
    ]
    hf = None if skip_hf else run_hf(job, hf_batch)
    if hf:
        rows.append((f"HF transformers batch {hf_batch}", hf["output_tokens_per_s"], hf["wall_s"], 0.0, float("nan")))
    print(f"job: {job.name}, {warm['ok']} requests, {warm['completion_tokens']} output tokens (jaxllama)")
    print(
        f"{'system':<28} {'out tok/s':>10} {'wall s':>8} {'compile s':>10} {'TTFT p50 ms':>12}"
        + ("  vs HF" if hf else "")
    )
    for name, tps, wall, comp, ttft in rows:
        ratio = f"  {tps / hf['output_tokens_per_s']:.2f}x" if hf else ""
        print(f"{name:<28} {tps:>10.1f} {wall:>8.1f} {comp:>10.1f} {ttft:>12.0f}{ratio}")
    print(
        f"jaxllama warm: prefill {warm['prefill_tokens_per_s']} tok/s, decode {warm['decode_tokens_per_s']} tok/s, "
        f"slot occupancy {100 * warm['slot_occupancy']:.0f}%"
    )


if __name__ == "__main__":
    fire.Fire(main)
