"""ModelConfig from HF config.json dicts of every supported family, and back."""

from __future__ import annotations

import json

import pytest
import torch

from kog.config import ModelConfig
from kog.errors import ModelLoadError
from kog.loader.gguf import llama3_rope_factors

LLAMA31_8B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336,
    "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8, "rms_norm_eps": 1e-05,
    "rope_theta": 500000.0, "max_position_embeddings": 131072, "vocab_size": 128256, "tie_word_embeddings": False,
    "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009], "torch_dtype": "bfloat16",
}
MISTRAL_7B = {
    "architectures": ["MistralForCausalLM"], "model_type": "mistral", "hidden_size": 4096,
    "intermediate_size": 14336, "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8,
    "rms_norm_eps": 1e-05, "rope_theta": 1000000.0, "max_position_embeddings": 32768, "sliding_window": None,
    "vocab_size": 32768, "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "bfloat16",
}
QWEN25_05B = {
    "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 896, "intermediate_size": 4864,
    "num_attention_heads": 14, "num_hidden_layers": 24, "num_key_value_heads": 2, "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0, "max_position_embeddings": 32768, "sliding_window": 32768,
    "use_sliding_window": False, "vocab_size": 151936, "tie_word_embeddings": True, "bos_token_id": 151643,
    "eos_token_id": 151645, "torch_dtype": "bfloat16",
}
QWEN3_06B = {  # head_dim (128) is not hidden_size / heads (64): it must be read, not derived
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 1024, "head_dim": 128,
    "intermediate_size": 3072, "num_attention_heads": 16, "num_hidden_layers": 28, "num_key_value_heads": 8,
    "rms_norm_eps": 1e-06, "rope_theta": 1000000, "max_position_embeddings": 40960, "attention_bias": False,
    "vocab_size": 151936, "tie_word_embeddings": True, "eos_token_id": 151645, "torch_dtype": "bfloat16",
}
SMOLLM2_135M = {  # transformers 5 layout: `dtype` and `rope_parameters`
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 576, "intermediate_size": 1536,
    "num_attention_heads": 9, "num_hidden_layers": 30, "num_key_value_heads": 3, "rms_norm_eps": 1e-05,
    "rope_parameters": {"rope_theta": 100000.0, "rope_type": "default"}, "max_position_embeddings": 8192,
    "vocab_size": 49152, "tie_word_embeddings": True, "bos_token_id": 1, "eos_token_id": 2, "dtype": "bfloat16",
}


def test_llama31():
    c = ModelConfig.from_hf_dict(LLAMA31_8B)
    assert (c.architecture, c.head_dim, c.num_kv_groups, c.rope_theta) == ("llama", 128, 4, 500000.0)
    assert c.rope_scaling == LLAMA31_8B["rope_scaling"]
    assert c.eos_token_ids == (128001, 128008, 128009) and c.dtype == torch.bfloat16
    assert not c.tie_word_embeddings and not c.attention_bias and not c.qk_norm


def test_mistral_qwen2_qwen3_smollm2():
    m = ModelConfig.from_hf_dict(MISTRAL_7B)
    assert (m.architecture, m.sliding_window, m.eos_token_ids) == ("mistral", None, (2,))
    q2 = ModelConfig.from_hf_dict(QWEN25_05B)
    assert (q2.attention_bias, q2.qk_norm, q2.sliding_window, q2.num_kv_groups) == (True, False, None, 7)
    q3 = ModelConfig.from_hf_dict(QWEN3_06B)
    assert (q3.head_dim, q3.attention_bias, q3.qk_norm, q3.rope_theta) == (128, False, True, 1e6)
    s = ModelConfig.from_hf_dict(SMOLLM2_135M)
    assert (s.rope_theta, s.rope_scaling, s.torch_dtype, s.head_dim, s.tie_word_embeddings) == (
        100000.0, None, "bfloat16", 64, True)


@pytest.mark.parametrize("d", [LLAMA31_8B, MISTRAL_7B, QWEN25_05B, QWEN3_06B, SMOLLM2_135M])
def test_round_trip_through_transformers(d, tmp_path):
    """to_hf_dict() is read by transformers into the same hyper-parameters, and back by Kog."""
    transformers = pytest.importorskip("transformers")
    c = ModelConfig.from_hf_dict(d)
    assert ModelConfig.from_hf_dict(c.to_hf_dict()) == c
    (tmp_path / "config.json").write_text(json.dumps(c.to_hf_dict()))
    hf = transformers.AutoConfig.from_pretrained(tmp_path)
    assert type(hf).__name__.removesuffix("Config").lower() == c.architecture
    assert (hf.hidden_size, hf.num_hidden_layers, hf.num_key_value_heads, hf.head_dim) == (
        c.hidden_size, c.num_hidden_layers, c.num_key_value_heads, c.head_dim)
    assert ModelConfig.from_hf_dict(hf.to_dict()) == c  # transformers 5 writes rope_parameters


def test_llama3_rope_factors_match_transformers():
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf = transformers.LlamaConfig(**{k: v for k, v in LLAMA31_8B.items() if k not in ("architectures", "model_type")})
    inv_freq, _ = ROPE_INIT_FUNCTIONS["llama3"](hf, "cpu")
    plain = 1.0 / 500000.0 ** (torch.arange(0, 128, 2, dtype=torch.float64) / 128)
    factors = llama3_rope_factors(500000.0, 128, LLAMA31_8B["rope_scaling"])
    torch.testing.assert_close(factors.double(), plain / inv_freq.double(), rtol=1e-5, atol=0)


@pytest.mark.parametrize("d,name", [
    ({**LLAMA31_8B, "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}, "gpt2"),
    ({**LLAMA31_8B, "architectures": ["DeepseekV3ForCausalLM"], "model_type": None}, "DeepseekV3ForCausalLM"),
])
def test_unknown_architecture_is_named(d, name):
    with pytest.raises(ModelLoadError, match=f"unknown architecture '{name}'"):
        ModelConfig.from_hf_dict(d)


def test_missing_key_and_bad_file(tmp_path):
    d = dict(LLAMA31_8B)
    del d["intermediate_size"]
    with pytest.raises(ModelLoadError, match="config.json: missing key 'intermediate_size'"):
        ModelConfig.from_hf_dict(d)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="config.json: cannot read config"):
        ModelConfig.from_hf_file(tmp_path)
    with pytest.raises(ModelLoadError, match="not a multiple"):
        ModelConfig.from_hf_dict({**LLAMA31_8B, "num_key_value_heads": 5})
