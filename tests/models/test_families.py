"""Every registered family against HF transformers: tiny random checkpoints made with transformers' own config
classes, converted from their Hugging Face folders and from GGUF files written from them, give transformers' logits
in float32 (to 1e-5) and its greedy tokens, through the model's functions, `LLM` on either backend and `jaxllama
run`. What a family needs and jaxllama lacks is refused by name, never computed wrongly."""

from __future__ import annotations

import json
from pathlib import Path

import jax
import numpy as np
import pytest
import torch

from converters.layout import ConversionError
from converters.llama import convert
from jaxllama import models
from jaxllama.core.checkpoint import load_checkpoint
from jaxllama.core.config import ConfigError, ModelConfig
from jaxllama.core.model import sequence_logits
from tests.batch.test_invariance import TOLERANCE
from tests.factories import GGUF_TYPE_MIX, Tiny, hf_state, write_chatml_tokenizer, write_gguf, write_hf
from tests.helpers.cli import jaxllama

# One tiny of each family, and the feature each one exercises beyond Llama's.
TINIES = {
    "qwen2": Tiny(heads=8, kv_heads=2, tied=False, vocab=99, family="qwen2"),  # q/k/v biases
    "qwen3": Tiny(heads=8, kv_heads=2, tied=True, vocab=99, family="qwen3"),  # per-head q/k norms
    "qwen3-head-dim": Tiny(heads=8, kv_heads=2, tied=True, vocab=99, family="qwen3", head_dim=16),  # 16 != 64 / 8
    "mixtral": Tiny(heads=8, kv_heads=2, tied=False, vocab=99, family="mixtral", experts=4, experts_per_token=2),
}
TOKENS = np.array([[1, 5, 9, 90, 77, 3, 42, 8, 8, 98, 0, 64], [2, 30, 7, 7, 7, 1, 97, 15, 16, 17, 18, 19]])
EXACT = 1e-5  # float32 logits of a two-layer model: the bar
# The block types jaxllama keeps as they are (`converters/quantize.NATIVE`), on both rotary products.
NATIVE_MIX = {"token_embd": "Q8_0", "attn_q": "Q4_0", "attn_k": "Q8_0", "ffn_gate": "Q4_0", "ffn_down": "Q8_0"}


def hf_logits(model, tokens=TOKENS) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor(tokens)).logits.float().numpy()


def ours(ckpt: Path, tokens=TOKENS) -> np.ndarray:
    config, params = load_checkpoint(ckpt)
    return np.asarray(jax.jit(sequence_logits, static_argnums=1)(params, config, tokens))


@pytest.fixture(scope="module", params=list(TINIES))
def family(request, tmp_path_factory):
    """(name, tiny, the transformers model, its HF folder with a ChatML tokenizer, that folder converted)."""
    name, tiny = request.param, TINIES[request.param]
    folder = tmp_path_factory.mktemp(name)
    model = write_hf(tiny, folder / "hf")
    assert write_chatml_tokenizer(folder / "hf") == tiny.vocab
    return name, tiny, model, folder / "hf", convert(folder / "hf", folder / "ckpt", progress=False)


def test_hf_folder_gives_transformers_logits(family):
    name, tiny, model, _, ckpt = family
    config, _ = load_checkpoint(ckpt)
    assert config.family == tiny.family and config.head_dim == tiny.hd
    np.testing.assert_allclose(ours(ckpt), hf_logits(model), atol=EXACT, rtol=0)


def test_gguf_written_from_it_gives_the_same_logits(family, tmp_path):
    """A GGUF in llama.cpp's layout for the family (a Qwen's q/k rows kept in Hugging Face's order)."""
    name, tiny, model, _, _ = family
    write_gguf(tiny, hf_state(model), tmp_path / "m.gguf")
    ckpt = convert(tmp_path / "m.gguf", tmp_path / "ckpt", progress=False)
    config, _ = load_checkpoint(ckpt)
    assert config.family == tiny.family and config.head_dim == tiny.hd
    np.testing.assert_allclose(ours(ckpt), hf_logits(model), atol=EXACT, rtol=0)


# transformers reads a Qwen3 GGUF with its config's default head_dim (128), not the file's key_length: its tiny here
# has that head_dim.
GGUF_ORACLE_TINIES = {
    "qwen2": TINIES["qwen2"],
    "qwen3": Tiny(dim=256, heads=2, kv_heads=1, ffn=128, tied=True, vocab=99, family="qwen3"),
}


@pytest.mark.parametrize("name", GGUF_ORACLE_TINIES)
def test_gguf_blocks_read_as_transformers_reads_the_file(name, tmp_path):
    """Q8_0, Q4_0, Q4_1 and F16 tensors, q and k among them, as transformers' own GGUF loader (an implementation of
    llama.cpp's layout nobody here wrote) reads the same file: the rotary rows of blocks move with their scales."""
    from transformers import AutoModelForCausalLM

    tiny = GGUF_ORACLE_TINIES[name]
    state = hf_state(write_hf(tiny, tmp_path / "hf"))
    write_gguf(tiny, state, tmp_path / "mix.gguf", GGUF_TYPE_MIX)
    oracle = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="mix.gguf", dtype=torch.float32).eval()
    dense = convert(tmp_path / "mix.gguf", tmp_path / "dense", dtype="float32", progress=False)  # all dequantized
    np.testing.assert_allclose(ours(dense), hf_logits(oracle), atol=EXACT, rtol=0)

    write_gguf(tiny, state, tmp_path / "native.gguf", NATIVE_MIX)
    oracle = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="native.gguf", dtype=torch.float32).eval()
    kept = convert(tmp_path / "native.gguf", tmp_path / "blocks", progress=False)  # blocks kept as they are
    config, _ = load_checkpoint(kept)
    assert dict(config.stored_as)["layers_0/attention/wq"] == "q4_0"
    assert dict(config.stored_as)["layers_0/attention/wk"] == "q8_0"
    np.testing.assert_allclose(ours(kept), hf_logits(oracle), atol=EXACT, rtol=0)


# The CPU kernels on one device; XLA's operations on one; meshes splitting heads and hidden units (each expert's
# among them), and the batch or the cache in pages as on an accelerator.
BACKENDS = {
    "cpu-kernels": {"cpu_kernels": True},
    "xla": {"cpu_kernels": False},
    "xla-mesh": {"cpu_kernels": False, "mesh": "data=2,model=2"},
    "xla-paged": {"cpu_kernels": False, "mesh": "data=1,model=2", "page_size": 16},
}


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
def test_llm_gives_transformers_logits_and_greedy_tokens(family, backend, kernel_folder):
    from jaxllama import LLM

    name, tiny, model, _, ckpt = family
    llm = LLM.load(ckpt, max_slots=2, compilation_cache=False, **BACKENDS[backend])
    np.testing.assert_allclose(llm.logits(TOKENS.tolist()), hf_logits(model), atol=EXACT, rtol=0)
    prompts = [[5, 9, 40, 77], [30, 7, 7, 1, 60, 15, 16]]
    results = llm.generate(prompts, max_tokens=8, temperature=0, ignore_eos=True)
    for prompt, result in zip(prompts, results, strict=True):
        with torch.no_grad():
            expected = model.generate(
                torch.tensor([prompt]), max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0
            )[0, len(prompt) :].tolist()
        assert result.token_ids == expected


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["cpu-kernels", "xla-paged"])
def test_a_prompt_answers_the_same_alone_and_in_a_batch(family, backend, kernel_folder):
    """Batch invariance: each prompt's greedy tokens and their log-probabilities are the same whatever shares its
    steps (a mixture of experts' tokens grouped by expert with others' included): to the bit on the CPU kernels, to
    its rounding on XLA's path (`test_invariance.TOLERANCE`). Each engine is fresh,
    and the prompts share no prefix: what is compared is the batch, not a prefix kept from an earlier request."""
    from jaxllama import LLM

    name, tiny, model, _, ckpt = family
    load = lambda: LLM.load(ckpt, max_slots=8, compilation_cache=False, **BACKENDS[backend])
    rng = np.random.default_rng(1)
    prompts = [rng.integers(3, tiny.vocab, n).tolist() for n in (3, 17, 40, 9, 64, 1)]
    assert len({p[0] for p in prompts}) == len(prompts)
    sampling = dict(max_tokens=12, temperature=0, ignore_eos=True, logprobs=True)
    together, one_engine = load().generate(prompts, **sampling), load()
    for prompt, result in zip(prompts, together, strict=True):
        alone = one_engine.generate(prompt, **sampling)
        assert alone.usage["prompt_tokens_details"]["cached_tokens"] == 0
        assert result.token_ids == alone.token_ids
        np.testing.assert_allclose(result.logprobs, alone.logprobs, rtol=TOLERANCE[backend], atol=0)


@pytest.mark.slow
def test_jaxllama_run_on_the_hf_folder_answers_as_transformers(family, tmp_path):
    """`jaxllama run --model DIR` converts the folder, applies the checkpoint's chat template and answers greedily
    what transformers' `generate` answers for the same prompt."""
    from transformers import AutoTokenizer

    name, tiny, model, folder, _ = family
    messages = [{"role": "user", "content": "what is 2+2?"}]
    job = tmp_path / "job.jsonl"
    job.write_text(json.dumps({"id": "q", "messages": messages, "max_tokens": 8, "temperature": 0}) + "\n")
    run = jaxllama("run", job, "--model", folder, "--quiet")
    assert run.returncode == 0, run.stderr
    (record,) = [json.loads(line) for line in (tmp_path / "job.out.jsonl").read_text().splitlines()]

    tokenizer = AutoTokenizer.from_pretrained(folder)
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
    assert record["usage"]["prompt_tokens"] == len(prompt)
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]),
            max_new_tokens=8,
            do_sample=False,
            eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
            pad_token_id=0,
        )[0, len(prompt) :].tolist()
    assert record["message"]["content"] == tokenizer.decode(out, skip_special_tokens=True)


@pytest.mark.parametrize(
    "experts, mlp", [(None, "model"), ("model", None)], ids=["hidden-units-split", "experts-split"]
)
def test_a_familys_sharding_places_its_weights(experts, mlp, monkeypatch, tmp_path):
    """The mesh axes a family's parameters are split over are the family's (`Family.sharding`): a Mixtral's experts
    split by their hidden units (its own rules) or whole experts to a device (expert parallelism), restored onto a
    `model` axis of 2 as those rules say, give transformers' logits either way."""
    import dataclasses

    from jaxllama.core.sharding import make_mesh

    name = "mixtral"
    model = write_hf(TINIES[name], tmp_path / "hf")
    ckpt = convert(tmp_path / "hf", tmp_path / "ckpt", progress=False)
    rules = dict(models.FAMILIES[name].sharding) | {"experts": experts, "mlp": mlp}
    monkeypatch.setitem(models.FAMILIES, name, dataclasses.replace(models.FAMILIES[name], sharding=rules))
    config, _ = load_checkpoint(ckpt)
    mesh = make_mesh(config, "data=1,model=2", jax.devices()[:2])
    config, params = load_checkpoint(ckpt, mesh=mesh)
    gate = params["layers_0"]["mlp"]["gate_exps"]
    assert gate.sharding.spec[:2] == (experts, mlp)
    logits = jax.jit(sequence_logits, static_argnums=1)(params, config, TOKENS)
    np.testing.assert_allclose(np.asarray(logits), hf_logits(model), atol=EXACT, rtol=0)


# ---- refused by name ----------------------------------------------------------------------------------------


def test_sliding_window_in_use_is_refused(tmp_path):
    tiny = TINIES["qwen2"]
    write_hf(tiny, tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    config |= {"use_sliding_window": True, "sliding_window": 64, "max_window_layers": 0}
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConversionError, match="sliding-window attention is not supported"):
        convert(tmp_path / "hf", tmp_path / "ckpt", progress=False)


def test_a_window_named_but_not_used_is_full_attention(tmp_path):
    """Qwen's configs name a `sliding_window` with `use_sliding_window: false`: transformers attends over every
    position, and so does the converted model."""
    tiny = TINIES["qwen2"]
    model = write_hf(tiny, tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    config |= {"use_sliding_window": False, "sliding_window": 4}
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config))
    np.testing.assert_allclose(
        ours(convert(tmp_path / "hf", tmp_path / "ckpt", progress=False)), hf_logits(model), atol=EXACT, rtol=0
    )


def test_attention_biases_are_refused_where_the_family_declares_none(tmp_path):
    """`attention_bias: true` in a Llama config names q/k/v/o biases a Llama layer does not hold: refused, where a
    Qwen2 config saying so converts (its layers hold them)."""
    for name, tiny in (("llama", Tiny(vocab=99)), ("qwen2", TINIES["qwen2"])):
        write_hf(tiny, tmp_path / name)
        config = json.loads((tmp_path / name / "config.json").read_text()) | {"attention_bias": True}
        (tmp_path / name / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConversionError, match="attention_bias=true is not supported for llama"):
        convert(tmp_path / "llama", tmp_path / "llama-ckpt", progress=False)
    convert(tmp_path / "qwen2", tmp_path / "qwen2-ckpt", progress=False)


@pytest.mark.parametrize(
    "architecture, model_type",
    [("Qwen3MoeForCausalLM", "qwen3_moe"), ("Gemma2ForCausalLM", "gemma2"), (None, "phi3")],
)
def test_an_unregistered_architecture_is_refused_naming_the_supported_ones(architecture, model_type, tmp_path):
    write_hf(TINIES["qwen2"], tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    config |= {"architectures": [architecture] if architecture else None, "model_type": model_type}
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConversionError, match=f"unsupported architecture '{architecture or model_type}'") as e:
        convert(tmp_path / "hf", tmp_path / "ckpt", progress=False)
    assert all(a in str(e.value) for a in models.hf_architectures())


def test_an_unregistered_gguf_architecture_is_refused(tmp_path):
    from tests.factories import copy_gguf

    tiny = TINIES["qwen2"]
    write_gguf(tiny, hf_state(write_hf(tiny, tmp_path / "hf")), tmp_path / "m.gguf")
    copy_gguf(tmp_path / "m.gguf", tmp_path / "x.gguf", architecture="gemma2")
    with pytest.raises(ConversionError, match="x.gguf: unsupported architecture 'gemma2'"):
        convert(tmp_path / "x.gguf", tmp_path / "ckpt", progress=False)


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"family": "gemma"}, "family: 'gemma' is not one of llama, qwen2, qwen3, mixtral"),
        ({"family": "mixtral"}, "n_experts: 0: a mixtral model is a mixture of experts"),
        ({"n_experts": 8, "n_experts_per_token": 2}, "n_experts: 8: a llama model has no experts"),
        ({"family": "mixtral", "n_experts": 8, "n_experts_per_token": 9}, "n_experts_per_token: 9: expected 1 to"),
        ({"family": "mixtral", "n_experts": -1}, "n_experts: expected a whole number >= 0, got -1"),
    ],
)
def test_a_config_the_families_cannot_run_is_refused(fields, message):
    with pytest.raises(ConfigError, match=message):
        ModelConfig(vocab_size=8, dim=8, n_layers=1, n_heads=1, n_kv_heads=1, ffn_dim=8, **fields)


@pytest.mark.parametrize("name", list(models.FAMILIES))
def test_a_familys_checkpoint_names_are_one_to_one(name):
    """Every parameter has one name in each format that names it, and no two share one: a converter finds each
    tensor by its declaration alone."""
    experts = {"n_experts": 3, "n_experts_per_token": 2} if models.FAMILIES[name].experts else {}
    config = ModelConfig(vocab_size=8, dim=16, n_layers=2, n_heads=2, n_kv_heads=1, ffn_dim=8, family=name, **experts)
    declared = models.declarations(config)
    for fmt in ("hf", "gguf"):
        names = [getattr(d, fmt) for d in declared.values()]
        assert None not in names and len(set(names)) == len(names), fmt
    assert config.n_params == sum(int(np.prod(d.shape)) for d in declared.values())
