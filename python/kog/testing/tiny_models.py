"""Tiny random-weight models on disk, for fast tests anywhere in Kog.

    config = tiny_config("qwen2")                          # hidden 64, 2 layers, GQA 4:2
    folder = write_hf_model(tmp_path / "hf", config, shards=2)
    gguf = write_gguf_model(tmp_path / "m.gguf", config, qtype="Q8_0")
    kog.loader.load_model(folder)                           # both load like real checkpoints

The tokenizer is a byte-level BPE trained in a blink on a fixed text, with ChatML markers;
both layouts carry the same vocabulary, so ids agree between them.
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import save_file

from kog.config import ModelConfig
from kog.loader.gguf import hf_name as _gguf_to_hf
from kog.loader.gguf import llama3_rope_factors
from kog.loader.tokenizer import Tokenizer, tokenizer_from_gguf
from kog.loader.weights import Weights, expected_shapes

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
_CORPUS = """The quick brown fox jumps over the lazy dog. Kog serves agents: tool calls, JSON, code.
def add(a, b):\n    return a + b  # 1234567890\n{"name": "get_weather", "arguments": {"city": "Paris"}}
Héllo wörld! naïve café — 東京 北京 中文 日本語 😀 🚀 ✓ \t tabs\tand   spaces\n\n"""

# Strings that break careless tokenizers: unicode, emoji sequences, whitespace runs, code, markers.
TRICKY_STRINGS = [
    "Hello world",
    " leading space and trailing space ",
    "multiple   spaces\t\ttabs\n\n\nnewlines  \n ",
    "naïve café résumé über Straße",
    "東京は日本の首都です。中文测试",
    "emoji 😀👍🏽 family 👨‍👩‍👧‍👦 flags 🇫🇷🇯🇵",
    "numbers 1234567890 3.14159 -42 1e-5 ٣٤٥",
    "def f(x):\n    return {'a': [1, 2]}  # comment\n",
    '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}',
    "I'm you're they've we'll she'd it's DON'T",
    "<|im_start|>user\nhi there<|im_end|>\n<|im_start|>assistant\n",
    "mixing<|im_end|>special<|endoftext|>tokens",
    "zero\u200bwidth and \u00a0nbsp and \r\n crlf",
    "Привет мир! Γειά σου κόσμε! مرحبا بالعالم",
    "https://example.com/path?q=1&r=two#frag",
    "    indented code block\n\tif (a && b || !c) { x += 1; }",
    "",
    "a",
    "🙂",
]


def tiny_config(architecture: str = "llama", vocab_size: int | None = None, **overrides: Any) -> ModelConfig:
    """A Llama-family config with hidden 64, 2 layers, 4 query heads over 2 KV heads (head_dim 16).

    MoE families get 4 experts of width 32, 2 per token, renormalized; every layer is MoE but
    layer 1 of qwen3_moe / qwen2_moe, which stays dense (mlp_only_layers); qwen2_moe's shared
    expert is 48 wide. laneformer_tp gets 2 lanes with a broadcast delay of 1.
    """
    n_layers = overrides.get("num_hidden_layers", 2)
    moe: dict[str, Any] = {}
    if architecture in ("qwen3_moe", "mixtral", "qwen2_moe"):
        moe = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
                   moe_layers=tuple(i for i in range(n_layers) if architecture == "mixtral" or i != 1))
    if architecture == "mixtral":  # Mixtral's experts are intermediate_size wide
        moe["intermediate_size"] = 32
    if architecture == "qwen2_moe":  # a shared expert 1.5 experts wide: two slots, the second half padding
        moe["shared_expert_intermediate_size"] = 48
    if architecture == "laneformer_tp":  # 2 lanes, layer 1 reduced with layer 0's outputs (delay 1)
        from kog.lane_config import LaneConfig

        moe["lanes"] = LaneConfig(num_lanes=2, broadcast_delay=1)
    fields: dict[str, Any] = dict(
        architecture=architecture, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, intermediate_size=128,
        vocab_size=vocab_size or len(tiny_tokenizer_metadata()["tokenizer.ggml.tokens"]),
        rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=256,
        tie_word_embeddings=architecture in ("qwen2", "qwen3"), attention_bias=architecture in ("qwen2", "qwen2_moe"),
        qk_norm=architecture in ("qwen3", "qwen3_moe"), bos_token_id=1, eos_token_ids=(2,), torch_dtype="float32",
    )
    return ModelConfig(**(fields | moe | overrides))


def random_weights(config: ModelConfig, seed: int = 0) -> Weights:
    """f32 weights: N(0, 0.02) matrices and biases, norm scales near 1."""
    g = torch.Generator().manual_seed(seed)
    weights = {}
    for name, shape in expected_shapes(config).items():
        if "norm" in name:
            weights[name] = 1.0 + 0.1 * torch.randn(shape, generator=g)
        else:
            weights[name] = 0.02 * torch.randn(shape, generator=g)
    return weights


@lru_cache(maxsize=4)
def tiny_tokenizer_metadata(pre: str = "smollm") -> dict[str, Any]:
    """GGUF `tokenizer.ggml.*` metadata of a ~400-token byte-level BPE.

    The vocabulary is trained with SmolLM2's pre-tokenizer; `pre` names the one the tokenizer
    declares ("qwen2" for Qwen models: transformers imposes Qwen's own on them).
    """
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import models, pre_tokenizers, trainers

    hf = HFTokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)])
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    hf.train_from_iterator([_CORPUS] * 4, trainer=trainer)
    model = json.loads(hf.to_str())["model"]
    tokens = [t for t, _ in sorted(model["vocab"].items(), key=lambda kv: kv[1])]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    return {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": pre,
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [3 if t in SPECIAL_TOKENS else 1 for t in tokens],
        "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.padding_token_id": 2,
        "tokenizer.ggml.add_bos_token": False,
    }


@lru_cache(maxsize=1)
def tiny_spm_metadata() -> dict[str, Any]:
    """GGUF metadata of a ~300-piece SentencePiece vocabulary (Llama 2 / Mistral style): <unk>,
    <s>, </s>, [INST], [/INST], 256 byte tokens, then pieces scored by merge order."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import models, pre_tokenizers, trainers

    hf = HFTokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="always")
    hf.train_from_iterator([_CORPUS] * 4, trainer=trainers.BpeTrainer(vocab_size=300, show_progress=False))
    model = json.loads(hf.to_str())["model"]
    merged = ["".join(m) if isinstance(m, list) else m.replace(" ", "") for m in model["merges"]]
    chars = [t for t in sorted(model["vocab"], key=model["vocab"].get) if len(t) == 1]
    specials = ["<unk>", "<s>", "</s>", "[INST]", "[/INST]"]
    tokens = specials + [f"<0x{b:02X}>" for b in range(256)] + chars + list(dict.fromkeys(merged))
    n_fixed = len(specials) + 256 + len(chars)
    return {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.scores": [0.0] * (len(specials) + 256) + [-1e4 - i for i in range(len(chars))]
        + [-float(i) for i in range(len(tokens) - n_fixed)],
        "tokenizer.ggml.token_type": [2, 3, 3, 3, 3] + [6] * 256 + [1] * (len(tokens) - len(specials) - 256),
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.unknown_token_id": 0,
        "tokenizer.ggml.add_bos_token": True,
        "tokenizer.ggml.add_space_prefix": True,
    }


def tiny_tokenizer(pre: str = "smollm") -> Tokenizer:
    return tokenizer_from_gguf(tiny_tokenizer_metadata(pre), source="tiny tokenizer")


def default_pre(config: ModelConfig) -> str:
    """The pre-tokenizer a real model of this family uses."""
    return "qwen2" if config.architecture in ("qwen2", "qwen3", "qwen3_moe", "qwen2_moe") else "smollm"


def write_hf_model(folder: str | Path, config: ModelConfig, weights: Weights | None = None,
                   tokenizer: Tokenizer | None = None, chat_template: str | None = CHATML_TEMPLATE,
                   shards: int = 1) -> Path:
    """Writes an HF folder; with shards > 1, `model-0000i-of-0000n.safetensors` plus the index."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    weights = random_weights(config) if weights is None else weights
    (folder / "config.json").write_text(json.dumps(config.to_hf_dict(), indent=2))
    (tokenizer or tiny_tokenizer(default_pre(config))).save(folder, chat_template=chat_template)
    if shards == 1:
        save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
        return folder
    names = list(weights)
    weight_map = {}
    for i in range(shards):
        file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: weights[n] for n in names[i::shards]}
        save_file(part, str(folder / file), metadata={"format": "pt"})
        weight_map |= dict.fromkeys(part, file)
    index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in weights.values())},
             "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return folder


def write_gguf_model(path: str | Path, config: ModelConfig, weights: Weights | None = None,
                     qtype: str = "F32", chat_template: str | None = CHATML_TEMPLATE,
                     tokenizer_metadata: dict[str, Any] | None = None) -> Path:
    """Writes a GGUF file the way llama.cpp's converter does (names, q/k row order for llama).

    Args:
        qtype: "F32", "F16", "Q8_0", "Q4_0", "Q4_1", "Q5_0" or "Q5_1" for the matrices (1-D tensors
            stay F32, as in llama.cpp; the block types are gguf's own encoders).
    """
    import gguf

    from kog.loader.gguf_write import GGUF_ARCH_OF, add_value

    path = Path(path)
    weights = random_weights(config) if weights is None else weights
    arch = GGUF_ARCH_OF.get(config.architecture, config.architecture)
    writer = gguf.GGUFWriter(str(path), arch)
    metadata = _gguf_metadata(config, arch, tokenizer_metadata or tiny_tokenizer_metadata(default_pre(config)))
    metadata["general.file_type"] = {"F32": 0, "F16": 1, "Q8_0": 7, "Q4_0": 2, "Q4_1": 3, "Q5_0": 8, "Q5_1": 9}[qtype]
    for key, value in metadata.items():
        add_value(writer, key, value)
    if chat_template is not None:
        writer.add_string("tokenizer.chat_template", chat_template)
    to_gguf = {hf: g for g in _gguf_names(config) if (hf := _gguf_to_hf(g))}
    scaling = config.rope_scaling or {}
    if scaling.get("rope_type") == "llama3":  # llama.cpp stores the per-frequency factors instead
        factors = llama3_rope_factors(config.rope_theta, config.head_dim, scaling)
        writer.add_tensor("rope_freqs.weight", factors.numpy())
    for hf_name, w in _gguf_experts(weights, config):
        array = _permute_for_llama_cpp(hf_name, w.float(), config, arch).numpy()
        if array.ndim == 1 or qtype == "F32":
            writer.add_tensor(to_gguf.get(hf_name, hf_name), array)
        elif qtype == "F16":
            writer.add_tensor(to_gguf.get(hf_name, hf_name), array.astype(np.float16))
        else:
            q = gguf.GGMLQuantizationType[qtype]
            writer.add_tensor(to_gguf.get(hf_name, hf_name), gguf.quants.quantize(array, q), raw_dtype=q)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


# ---------------------------------------------------------------------- internal helpers


def _gguf_metadata(config: ModelConfig, arch: str, tok: dict[str, Any]) -> dict[str, Any]:
    from kog.loader.gguf_write import model_metadata, moe_metadata

    return {"general.name": f"kog-tiny-{config.architecture}"} | model_metadata(config, arch) | \
        moe_metadata(config, arch) | tok


def _gguf_experts(weights: Weights, config: ModelConfig):
    from kog.loader.gguf_write import split_experts

    return split_experts(weights)


def _gguf_names(config: ModelConfig) -> list[str]:
    names = ["token_embd.weight", "output_norm.weight", "output.weight"]
    parts = ["attn_norm", "ffn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "attn_q_norm", "attn_k_norm",
             "ffn_gate", "ffn_up", "ffn_down", "ffn_gate_inp"]
    for n in range(config.num_hidden_layers):
        names += [f"blk.{n}.{p}.{kind}" for p in parts for kind in ("weight", "bias")]
    return names


def _permute_for_llama_cpp(name: str, w: torch.Tensor, config: ModelConfig, arch: str) -> torch.Tensor:
    from kog.loader.gguf_write import permute_for_llama_cpp

    return permute_for_llama_cpp(name, w, config, arch)

