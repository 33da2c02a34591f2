"""Streaming conversion: peak resident memory while converting a synthetic Hugging Face checkpoint.

    python -m benchmarks.convert_memory [--size-gb 2.2] [--workdir /tmp/jaxllama-convert-bench]

Writes a random bfloat16 Llama of about --size-gb in safetensors shards, converts it with
`python -m converters.llama` in a child process, and reports the child's peak RSS against the checkpoint
size (the goal: under 40%).
"""

from __future__ import annotations

import json
import shutil
import sys
import time
from pathlib import Path

import fire
import ml_dtypes
import numpy as np
from safetensors.numpy import save_file

from benchmarks.measure import peak_rss


def write_checkpoint(out: Path, dim: int, layers: int, ffn: int, vocab: int, heads: int, kv_heads: int) -> int:
    out.mkdir(parents=True, exist_ok=True)
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": dim,
        "intermediate_size": ffn,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "vocab_size": vocab,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    }
    (out / "config.json").write_text(json.dumps(config))
    rng = np.random.default_rng(0)
    hd = dim // heads

    def rand(*shape):
        return (rng.standard_normal(shape, np.float32) * 0.02).astype(ml_dtypes.bfloat16)

    weight_map, total = {}, 0
    shards = [{"model.embed_tokens.weight": rand(vocab, dim)}]
    for i in range(layers):
        p = f"model.layers.{i}."
        shards.append(
            {
                p + "self_attn.q_proj.weight": rand(heads * hd, dim),
                p + "self_attn.k_proj.weight": rand(kv_heads * hd, dim),
                p + "self_attn.v_proj.weight": rand(kv_heads * hd, dim),
                p + "self_attn.o_proj.weight": rand(dim, heads * hd),
                p + "mlp.gate_proj.weight": rand(ffn, dim),
                p + "mlp.up_proj.weight": rand(ffn, dim),
                p + "mlp.down_proj.weight": rand(dim, ffn),
                p + "input_layernorm.weight": rand(dim),
                p + "post_attention_layernorm.weight": rand(dim),
            }
        )
    shards.append({"model.norm.weight": rand(dim), "lm_head.weight": rand(vocab, dim)})
    for n, tensors in enumerate(shards):
        name = f"model-{n:05d}-of-{len(shards):05d}.safetensors"
        save_file(tensors, str(out / name))
        total += sum(t.nbytes for t in tensors.values())
        weight_map.update({k: name for k in tensors})
    (out / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return total


def main(size_gb: float = 2.2, workdir: str = "/tmp/jaxllama-convert-bench", keep: bool = False):
    work = Path(workdir)
    shutil.rmtree(work, ignore_errors=True)
    dim, ffn, vocab, heads = 2048, 5632, 32000, 16
    per_layer = 2 * (4 * dim * dim + 3 * dim * ffn)
    layers = max(1, int((size_gb * 1e9 - 2 * 2 * vocab * dim) / per_layer))
    t = time.time()
    size = write_checkpoint(work / "hf", dim, layers, ffn, vocab, heads, heads)
    print(f"synthetic checkpoint: {layers} layers, {size / 1e9:.2f} GB bfloat16 ({time.time() - t:.0f} s to write)")
    root = Path(__file__).resolve().parents[1]
    baseline = peak_rss(
        [sys.executable, "-c", "import converters.llama, converters.hf, jaxllama.core.checkpoint"], root
    )
    t = time.time()
    peak = peak_rss([sys.executable, "-m", "converters.llama", str(work / "hf"), str(work / "out")], root)
    print(
        f"converted in {time.time() - t:.0f} s; peak RSS {peak / 1e9:.2f} GB = {100 * peak / size:.0f}% of the "
        f"checkpoint; {(peak - baseline) / 1e9:.2f} GB above the {baseline / 1e9:.2f} GB of a process that only "
        f"imports the converter ({100 * (peak - baseline) / size:.0f}%)"
    )
    if not keep:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    fire.Fire(main)
