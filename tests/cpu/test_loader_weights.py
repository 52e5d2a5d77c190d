"""Weights from HF folders (single and sharded) and GGUF files (F32/F16/Q8_0), and every way a
checkpoint can be broken."""

from __future__ import annotations

import json

import gguf
import numpy as np
import pytest
import torch

from kog.quantized import QuantizedWeight
from safetensors.torch import save_file

from kog.errors import ModelLoadError
from kog.loader import GGUFCheckpoint, load_model
from kog.loader.gguf_file import GGUFFile
from kog.testing.tiny_models import random_weights, tiny_config, write_gguf_model, write_hf_model

FAMILIES = ["llama", "mistral", "qwen2", "qwen3"]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("shards", [1, 3])
def test_hf_folder_round_trip(tmp_path, family, shards):
    config = tiny_config(family)
    weights = random_weights(config, seed=7)
    model = load_model(write_hf_model(tmp_path, config, weights, shards=shards), progress=False)
    assert model.config == config and model.dtype == torch.float32
    assert model.weights.keys() == weights.keys()
    for name, w in weights.items():
        assert torch.equal(model.weights[name], w), name
    assert ("lm_head.weight" in model.weights) == (not config.tie_word_embeddings)
    assert model.stop_token_ids == (2,)


def test_bf16_run_dtype(tmp_path):
    config = tiny_config("llama")
    weights = random_weights(config)
    model = load_model(write_hf_model(tmp_path, config, weights), dtype="bf16", progress=False)
    assert all(t.dtype == torch.bfloat16 for t in model.weights.values())
    assert torch.equal(model.weights["model.norm.weight"], weights["model.norm.weight"].bfloat16())


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("qtype,atol", [("F32", 0.0), ("F16", 1e-4), ("Q8_0", 1e-3)])
def test_gguf_round_trip(tmp_path, family, qtype, atol):
    """llama-arch q/k rows come back in HF order; quantization error stays within the format's step."""
    config = tiny_config(family)
    weights = random_weights(config, seed=3)
    model = load_model(write_gguf_model(tmp_path / "m.gguf", config, weights, qtype=qtype), progress=False)
    assert model.config.architecture == ("llama" if family == "mistral" else family)
    assert model.weights.keys() == weights.keys()
    for name, w in weights.items():
        got = model.weights[name]
        # A quantized file keeps its blocks (dtype None): dequantized here, rows in HF order.
        assert isinstance(got, QuantizedWeight) == (qtype == "Q8_0" and w.dim() == 2), name
        got = got.dequantize() if isinstance(got, QuantizedWeight) else got
        torch.testing.assert_close(got, w, rtol=0, atol=atol, msg=name)
    assert model.chat_template is not None and model.tokenizer.eos_token_id == 2


def test_gguf_file_agrees_with_gguf_reader(tmp_path):
    """Kog's header parser reads the same metadata and tensor bytes as the gguf package's reader."""
    path = write_gguf_model(tmp_path / "m.gguf", tiny_config("qwen2"), qtype="Q8_0")
    ours, theirs = GGUFFile(path), gguf.GGUFReader(path)
    fields = {k: f.contents() for k, f in theirs.fields.items() if not k.startswith("GGUF.")}
    assert ours.metadata.keys() == fields.keys()
    for key, value in fields.items():
        assert ours.metadata[key] == pytest.approx(value) if isinstance(value, float) else ours.metadata[key] == value
    assert list(ours.tensors) == [t.name for t in theirs.tensors]
    for t in theirs.tensors:
        info = ours.tensors[t.name]
        assert info.qtype == t.tensor_type and info.shape == tuple(int(s) for s in t.shape)
        assert np.array_equal(ours.data(info), np.asarray(t.data).reshape(-1).view(np.uint8))


# ---------------------------------------------------------------------- broken checkpoints


def test_missing_tensor_is_named(tmp_path):
    config = tiny_config("llama")
    weights = random_weights(config)
    del weights["model.layers.1.mlp.up_proj.weight"]
    folder = write_hf_model(tmp_path / "hf", config, weights)
    with pytest.raises(ModelLoadError, match=r"hf: missing tensor 'model\.layers\.1\.mlp\.up_proj\.weight'"):
        load_model(folder)
    path = write_gguf_model(tmp_path / "m.gguf", config, weights)
    with pytest.raises(ModelLoadError, match=r"m\.gguf: missing tensor 'model\.layers\.1\.mlp\.up_proj\.weight'"):
        load_model(path)


def test_wrong_shape_is_named(tmp_path):
    config = tiny_config("llama")
    weights = random_weights(config)
    weights["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(16, 64)
    folder = write_hf_model(tmp_path / "hf", config, weights, shards=2)
    with pytest.raises(ModelLoadError, match=r"model-0000\d-of-00002\.safetensors: tensor "
                                             r"'model\.layers\.0\.self_attn\.k_proj\.weight' has shape \[16, 64\], "
                                             r"expected \[32, 64\]"):
        load_model(folder)
    path = write_gguf_model(tmp_path / "m.gguf", config, weights)
    with pytest.raises(ModelLoadError, match=r"m\.gguf \(GGUF tensor blk\.0\.attn_k\.weight\): tensor "
                                             r"'model\.layers\.0\.self_attn\.k_proj\.weight' has shape"):
        load_model(path)


def test_unexpected_tensor(tmp_path):
    config = tiny_config("llama")
    weights = random_weights(config) | {"model.layers.0.self_attn.q_norm.weight": torch.ones(16)}
    with pytest.raises(ModelLoadError, match="unexpected tensor 'model.layers.0.self_attn.q_norm.weight'"):
        load_model(write_hf_model(tmp_path, config, weights))


def test_truncated_files(tmp_path):
    config = tiny_config("llama")
    folder = write_hf_model(tmp_path / "hf", config)
    st = folder / "model.safetensors"
    st.write_bytes(st.read_bytes()[:-1000])
    with pytest.raises(ModelLoadError, match=r"model\.safetensors: not a readable safetensors file "
                                             r"\(truncated: tensor '[\w.]+' ends at data byte \d+"):
        load_model(folder)
    path = write_gguf_model(tmp_path / "m.gguf", config)
    path.write_bytes(path.read_bytes()[:-1000])
    with pytest.raises(ModelLoadError, match=r"m\.gguf: truncated: tensor 'blk\.1\.\w+\.weight' ends at byte"):
        load_model(path)
    path.write_bytes(path.read_bytes()[:200])
    with pytest.raises(ModelLoadError, match=r"m\.gguf: corrupt GGUF header"):
        load_model(path)
    path.write_bytes(b"PK\x03\x04" + bytes(100))
    with pytest.raises(ModelLoadError, match="not a GGUF file"):
        load_model(path)


def test_missing_shard(tmp_path):
    folder = write_hf_model(tmp_path, tiny_config("llama"), shards=2)
    (folder / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(ModelLoadError, match=r"shard model-00002-of-00002\.safetensors \(holding tensor '.+'\) is missing"):
        load_model(folder)


def test_unknown_architecture(tmp_path):
    folder = write_hf_model(tmp_path / "hf", tiny_config("llama"))
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(cfg | {"model_type": "falcon", "architectures": ["FalconForCausalLM"]}))
    with pytest.raises(ModelLoadError, match=r"config\.json: unknown architecture 'falcon'"):
        load_model(folder)
    path = write_gguf_model(tmp_path / "m.gguf", tiny_config("llama"))
    data = path.read_bytes()
    key = b"general.architecture"
    at = data.index(key) + len(key) + 4 + 8  # value type (u32), string length (u64)
    path.write_bytes(data[:at] + b"gemma" + data[at + 5:])  # "llama" -> "gemma", same length
    with pytest.raises(ModelLoadError, match=r"m\.gguf: unknown architecture 'gemma'"):
        GGUFCheckpoint(path).config


def test_unsupported_gguf_quant_type_is_named(tmp_path):
    config = tiny_config("llama")
    path = write_gguf_model(tmp_path / "m.gguf", config)
    ckpt = GGUFCheckpoint(path)
    info = ckpt.tensors["blk.0.ffn_up.weight"]
    import dataclasses

    ckpt.tensors["blk.0.ffn_up.weight"] = dataclasses.replace(info, qtype=gguf.GGMLQuantizationType.IQ2_XXS)
    with pytest.raises(ModelLoadError, match=r"tensor 'blk\.0\.ffn_up\.weight' (uses unsupported type|is corrupt)"):
        ckpt.load_weights(config, torch.float32, progress=False)


def test_progress_bar_when_asked(tmp_path, capsys):
    folder = write_hf_model(tmp_path, tiny_config("llama"))
    load_model(folder, progress=True)
    assert "loading" in capsys.readouterr().err
    load_model(folder, progress=False)
    assert capsys.readouterr().err == ""


def test_ignores_rotary_inv_freq_and_tied_lm_head(tmp_path):
    config = tiny_config("qwen2")  # tied
    weights = random_weights(config)
    extra = {"model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(8),
             "lm_head.weight": weights["model.embed_tokens.weight"].clone()}
    folder = write_hf_model(tmp_path, config, weights)
    save_file(weights | extra, str(folder / "model.safetensors"), metadata={"format": "pt"})
    assert load_model(folder).weights.keys() == weights.keys()


@pytest.mark.parametrize("scaling", [
    {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 8192},
    {"rope_type": "linear", "factor": 4.0},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768},
], ids=lambda s: s["rope_type"])
def test_gguf_rope_scaling_round_trip(tmp_path, scaling):
    """Llama 3.x GGUFs keep only `rope_freqs`; the HF scaling parameters are recovered from them."""
    config = tiny_config("llama", head_dim=64, num_attention_heads=1, num_key_value_heads=1,
                         rope_theta=500000.0, rope_scaling=scaling)
    ckpt = GGUFCheckpoint(write_gguf_model(tmp_path / "m.gguf", config))
    assert ckpt.config.rope_scaling == scaling
    assert ckpt.load_weights(ckpt.config, torch.float32, progress=False).keys() == random_weights(config).keys()


def test_chat_template_jinja_file(tmp_path):
    """transformers >= 4.50 saves the template next to tokenizer_config.json."""
    folder = write_hf_model(tmp_path, tiny_config("llama"), chat_template=None)
    assert load_model(folder).chat_template is None
    (folder / "chat_template.jinja").write_text("{{ messages[0]['content'] | upper }}")
    assert load_model(folder).chat_template.render([{"role": "user", "content": "hi"}]) == "HI"
