"""Tiny random checkpoints of each family (Llama, Qwen2, Qwen3) in each source format, written by the formats' own
libraries.

Hugging Face folders come from transformers' model classes (`LlamaForCausalLM`, `Qwen2ForCausalLM`,
`Qwen3ForCausalLM`) and `save_pretrained`; GGUF files from `gguf.GGUFWriter`, a Llama's q/k permuted the way
llama.cpp's converter does (a Qwen's kept in Hugging Face's order, as llama.cpp's converter keeps them); Meta folders
from a state dict in Meta's names, optionally split into model-parallel shards the way fairscale splits them.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np


@dataclasses.dataclass(frozen=True)
class Tiny:
    vocab: int = 131
    dim: int = 64
    layers: int = 2
    heads: int = 8
    kv_heads: int = 2
    ffn: int = 96
    tied: bool = False
    rope_theta: float = 10000.0
    rope_scaling: bool = False  # llama3 scaling: factor 8, low 1, high 4, original context 8192
    max_pos: int = 256
    family: str = "llama"  # or "qwen2" (q/k/v biases), "qwen3" (per-head q/k norms), "mixtral" (experts)
    head_dim: int | None = None  # Qwen3's own (default: dim / heads)
    experts: int = 4  # Mixtral's, of which each token takes experts_per_token
    experts_per_token: int = 2

    @property
    def hd(self) -> int:
        return self.head_dim or self.dim // self.heads

    def hf_config(self):
        import transformers

        rope = {"rope_type": "default", "rope_theta": self.rope_theta}
        if self.rope_scaling:
            rope = {
                "rope_type": "llama3",
                "rope_theta": self.rope_theta,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192,
            }
        kind = {"llama": "LlamaConfig", "qwen2": "Qwen2Config", "qwen3": "Qwen3Config", "mixtral": "MixtralConfig"}
        extra = {"head_dim": self.hd} if self.head_dim or self.family == "qwen3" else {}  # Qwen3's default: 128
        if self.family == "mixtral":
            extra |= {"num_local_experts": self.experts, "num_experts_per_tok": self.experts_per_token}
        return getattr(transformers, kind[self.family])(
            **extra,
            vocab_size=self.vocab,
            hidden_size=self.dim,
            intermediate_size=self.ffn,
            num_hidden_layers=self.layers,
            num_attention_heads=self.heads,
            num_key_value_heads=self.kv_heads,
            tie_word_embeddings=self.tied,
            max_position_embeddings=self.max_pos,
            rms_norm_eps=1e-5,
            rope_parameters=rope,
            initializer_range=0.1,
            bos_token_id=1,
            eos_token_id=2,
        )


def hf_model(tiny: Tiny, seed: int = 0):
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny.hf_config()).float().eval()
    with torch.no_grad():  # non-trivial norm weights and biases
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            elif name.endswith(".bias"):
                p.uniform_(-0.5, 0.5)
    return model


def write_hf(tiny: Tiny, out: Path, seed: int = 0, max_shard_size: str | None = None):
    model = hf_model(tiny, seed)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(out, **kwargs)
    return model


def hf_state(model) -> dict[str, np.ndarray]:
    return {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}


def llamacpp_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf `permute`: HF's q/k row order back to Meta's interleaved pairs."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def meta_state(tiny: Tiny, hf: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """HF state dict -> Meta's names and layout."""
    out = {"tok_embeddings.weight": hf["model.embed_tokens.weight"], "norm.weight": hf["model.norm.weight"]}
    if not tiny.tied:
        out["output.weight"] = hf["lm_head.weight"]
    names = {
        "self_attn.q_proj": "attention.wq",
        "self_attn.k_proj": "attention.wk",
        "self_attn.v_proj": "attention.wv",
        "self_attn.o_proj": "attention.wo",
        "mlp.gate_proj": "feed_forward.w1",
        "mlp.up_proj": "feed_forward.w3",
        "mlp.down_proj": "feed_forward.w2",
        "input_layernorm": "attention_norm",
        "post_attention_layernorm": "ffn_norm",
    }
    for i in range(tiny.layers):
        for hf_name, meta_name in names.items():
            w = hf[f"model.layers.{i}.{hf_name}.weight"]
            if hf_name == "self_attn.q_proj":
                w = llamacpp_permute(w, tiny.heads)
            elif hf_name == "self_attn.k_proj":
                w = llamacpp_permute(w, tiny.kv_heads)
            out[f"layers.{i}.{meta_name}.weight"] = w
    return out


_COLUMN = ("attention.wq", "attention.wk", "attention.wv", "feed_forward.w1", "feed_forward.w3", "output")
_ROW = ("attention.wo", "feed_forward.w2")


def split_meta(state: dict[str, np.ndarray], n: int, embedding_axis: int) -> list[dict[str, np.ndarray]]:
    """Split a Meta state dict into n model-parallel shards as fairscale's parallel layers hold them."""
    shards = [{} for _ in range(n)]
    for k, w in state.items():
        if any(k.startswith(c) or f".{c}." in k for c in _COLUMN):
            parts = np.split(w, n, axis=0)
        elif any(f".{r}." in k for r in _ROW):
            parts = np.split(w, n, axis=1)
        elif k.startswith("tok_embeddings"):
            parts = np.split(w, n, axis=embedding_axis)
        else:
            parts = [w] * n
        for s, p in zip(shards, parts, strict=True):
            s[k] = p
    return shards


def write_meta(
    tiny: Tiny, state: dict[str, np.ndarray], out: Path, shards: int = 1, embedding_axis: int = 0, dtype=None
):
    import torch

    out.mkdir(parents=True, exist_ok=True)
    params = {
        "dim": tiny.dim,
        "n_layers": tiny.layers,
        "n_heads": tiny.heads,
        "n_kv_heads": tiny.kv_heads,
        "vocab_size": tiny.vocab,
        "multiple_of": 16,
        "norm_eps": 1e-5,
        "rope_theta": tiny.rope_theta,
        "use_scaled_rope": tiny.rope_scaling,
    }
    (out / "params.json").write_text(json.dumps(params))
    for i, shard in enumerate(split_meta(state, shards, embedding_axis)):
        tensors = {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in shard.items()}
        if dtype is not None:
            tensors = {k: v.to(dtype) for k, v in tensors.items()}
        torch.save(tensors, out / f"consolidated.{i:02d}.pth")


# HF layer tensor names -> llama.cpp's (blk.N.<name>.weight).
GGUF_LAYER_NAMES = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}
# HF layer tensors of the families that have them -> llama.cpp's (blk.N.<name>), by their full names.
GGUF_FAMILY_NAMES = {
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
}

# A mixture of experts' tensors as transformers holds them (gate and up split) -> llama.cpp's.
GGUF_EXPERT_NAMES = {
    "mlp.gate.weight": "ffn_gate_inp.weight",
    "experts.gate": "ffn_gate_exps.weight",
    "experts.up": "ffn_up_exps.weight",
    "mlp.experts.down_proj": "ffn_down_exps.weight",
}

# A mix of GGML types for write_gguf's qtypes: block quantizations of each kind, F16 and BF16.
GGUF_TYPE_MIX = {
    "token_embd": "Q8_0",
    "attn_q": "Q4_0",
    "attn_k": "Q4_1",
    "attn_v": "F16",
    "attn_output": "Q5_0",
    "ffn_gate": "Q8_0",
    "ffn_up": "BF16",
    "ffn_down": "Q5_1",
    "output.": "Q8_0",
}


def write_gguf(tiny: Tiny, hf: dict[str, np.ndarray], path: Path, qtypes: dict[str, str] | None = None):
    """A GGUF of the HF weights, of the tiny's family. qtypes: {substring of GGUF tensor name: GGML type name}."""
    import gguf

    w = gguf.GGUFWriter(str(path), "llama" if tiny.family == "mixtral" else tiny.family)
    w.add_block_count(tiny.layers)
    w.add_context_length(tiny.max_pos)
    w.add_embedding_length(tiny.dim)
    w.add_feed_forward_length(tiny.ffn)
    w.add_head_count(tiny.heads)
    w.add_head_count_kv(tiny.kv_heads)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(tiny.rope_theta)
    w.add_rope_dimension_count(tiny.hd)
    if tiny.head_dim or tiny.family == "qwen3":
        w.add_key_length(tiny.hd)
        w.add_value_length(tiny.hd)
    if tiny.family == "mixtral":
        w.add_expert_count(tiny.experts)
        w.add_expert_used_count(tiny.experts_per_token)
    w.add_vocab_size(tiny.vocab)
    w.add_file_type(0)
    # A byte-level BPE vocabulary: 256 byte tokens, then merged pairs, then specials.
    tokens = [bytes([b]).decode("latin-1") for b in range(256)][: tiny.vocab]
    tokens += [f"<extra_{i}>" for i in range(tiny.vocab - len(tokens))]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([1] * len(tokens))
    w.add_token_merges([])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)

    mapping = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }
    for i in range(tiny.layers):
        for a, b in GGUF_LAYER_NAMES.items():
            mapping[f"model.layers.{i}.{a}.weight"] = f"blk.{i}.{b}.weight"
        for a, b in GGUF_FAMILY_NAMES.items():
            mapping[f"model.layers.{i}.{a}"] = f"blk.{i}.{b}"
    if tiny.family == "mixtral":  # transformers holds every expert's gate and up as one tensor: llama.cpp's are two
        hf = dict(hf)
        for i in range(tiny.layers):
            gate_up = hf.pop(f"model.layers.{i}.mlp.experts.gate_up_proj")
            hf[f"model.layers.{i}.experts.gate"], hf[f"model.layers.{i}.experts.up"] = np.split(gate_up, 2, axis=1)
            for a, b in GGUF_EXPERT_NAMES.items():
                mapping[f"model.layers.{i}.{a}"] = f"blk.{i}.{b}"
    for hf_name, gguf_name in mapping.items():
        if hf_name not in hf or (tiny.tied and hf_name == "lm_head.weight"):
            continue
        t = hf[hf_name].astype(np.float32)
        if tiny.family in ("llama", "mixtral") and ".attn_q." in gguf_name:  # llama.cpp's "llama" rows
            t = llamacpp_permute(t, tiny.heads)
        elif tiny.family in ("llama", "mixtral") and ".attn_k." in gguf_name:
            t = llamacpp_permute(t, tiny.kv_heads)
        qtype = next((q for key, q in (qtypes or {}).items() if key in gguf_name), "F32")
        if t.ndim == 1:
            qtype = "F32"
        kind = gguf.GGMLQuantizationType[qtype]
        if qtype == "F32":
            w.add_tensor(gguf_name, t)
        elif qtype == "F16":
            w.add_tensor(gguf_name, t.astype(np.float16))
        else:
            w.add_tensor(gguf_name, gguf.quants.quantize(t, kind), raw_dtype=kind)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def write_chat_gguf(path: Path, seed: int = 0, context: int = 256) -> Path:
    """A tiny random chat model as a GGUF: byte-level BPE vocabulary (256 byte tokens, a few merges) plus
    ChatML control tokens, with a ChatML template; eos is <|im_end|>."""
    import gguf

    from jaxllama.text.byte_level import spell

    byte_tokens = [spell(bytes([b])) for b in range(256)]
    merges = ["Ġ t", "Ġ a", "h e", "i n", "Ġt he"]
    merged = ["Ġt", "Ġa", "he", "in", "Ġthe"]
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tokens = byte_tokens + merged + specials
    types = [1] * (len(byte_tokens) + len(merged)) + [3] * len(specials)
    tiny = Tiny(vocab=len(tokens), max_pos=context)
    state = hf_state(hf_model(tiny, seed))
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(tiny.layers)
    w.add_context_length(context)
    w.add_embedding_length(tiny.dim)
    w.add_feed_forward_length(tiny.ffn)
    w.add_head_count(tiny.heads)
    w.add_head_count_kv(tiny.kv_heads)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(tiny.rope_theta)
    w.add_vocab_size(tiny.vocab)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(tokens.index("<|im_start|>"))
    w.add_eos_token_id(tokens.index("<|im_end|>"))
    w.add_add_bos_token(False)
    w.add_chat_template(CHATML)
    w.add_tensor("token_embd.weight", state["model.embed_tokens.weight"] * 10)
    w.add_tensor("output_norm.weight", state["model.norm.weight"])
    w.add_tensor("output.weight", state["lm_head.weight"] * 10)
    for i in range(tiny.layers):
        for a, b in GGUF_LAYER_NAMES.items():
            t = state[f"model.layers.{i}.{a}.weight"]
            if b == "attn_q":
                t = llamacpp_permute(t, tiny.heads)
            elif b == "attn_k":
                t = llamacpp_permute(t, tiny.kv_heads)
            w.add_tensor(f"blk.{i}.{b}.weight", t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def copy_gguf(src: Path, dst: Path, replace=None, extra: dict | None = None, architecture: str | None = None) -> Path:
    """Rewrite the GGUF file src as dst with the same metadata and tensors, except that `replace(tensor)` may
    return (array, raw_dtype) for a tensor to write instead (None: unchanged; raw_dtype None: from the array),
    `extra` {name: array} tensors are appended, and `architecture` replaces `general.architecture`."""
    import gguf

    reader = gguf.GGUFReader(src)
    architecture = architecture or reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(str(dst), architecture)
    for field in reader.fields.values():
        if not field.name.startswith("GGUF.") and field.name != "general.architecture":
            sub_type = field.types[-1] if len(field.types) > 1 else None
            writer.add_key_value(field.name, field.contents(), field.types[0], sub_type=sub_type)
    for t in reader.tensors:
        data, raw_dtype = (replace and replace(t)) or (np.asarray(t.data), t.tensor_type)
        writer.add_tensor(t.name, data, raw_dtype=raw_dtype)
    for name, data in (extra or {}).items():
        writer.add_tensor(name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst


def write_chatml_tokenizer(folder: Path) -> int:
    """A byte-level BPE tokenizer.json (as Qwen's, made by the `tokenizers` library) of printable ASCII, space and
    newline, plus ChatML's control tokens, with a ChatML template in tokenizer_config.json; returns its size. Every
    token decodes to ASCII, so a random model's completion reads the same from any decoder."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    symbols = [chr(b) for b in range(33, 127)] + ["Ġ", "Ċ"]  # byte-level's spellings of bytes 33-126, space, \n
    tokenizer = Tokenizer(models.BPE(vocab={s: i for i, s in enumerate(symbols)}, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tokenizer.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(folder / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "chat_template": CHATML,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "bos_token": None,
        "add_bos_token": False,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return tokenizer.get_vocab_size()
