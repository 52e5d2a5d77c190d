"""`kog convert`: GGUF -> HF folder that transformers loads into the same weights and tokens.

The SmolLM2 tests run the real 135M model (about 40 s on 2 cores); deselect with -m "not slow".
"""

from __future__ import annotations

import os

import pytest
import torch

from kog.cli import main
from kog.errors import ModelLoadError
from kog.loader import GGUFCheckpoint, load_model, resolve_model, tokenizer_from_gguf
from kog.loader.convert import convert_gguf
from kog.testing.tiny_models import TRICKY_STRINGS, random_weights, tiny_config, write_gguf_model

transformers = pytest.importorskip("transformers")

STRINGS = ["Hello world", "naïve café 東京 😀👍🏽", "def f(x):\n    return x**2  # 1234", "  spaces\t\ttabs\n\n",
           "<|im_start|>user\nhi<|im_end|>", '{"a": [1, 2.5, null]}']


def _hf_state_dict(folder) -> dict[str, torch.Tensor]:
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    return model, model.state_dict()


def _assert_same_weights(kog_weights, hf_sd, tied: bool) -> None:
    if tied:  # transformers exposes the tied head under its own name, sharing the embedding
        assert torch.equal(hf_sd.pop("lm_head.weight"), kog_weights["model.embed_tokens.weight"])
    assert hf_sd.keys() == kog_weights.keys()
    for name, w in kog_weights.items():
        assert torch.equal(hf_sd[name], w), name


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_tiny_convert_loads_in_transformers(tmp_path, family):
    config = tiny_config(family)
    gguf_path = write_gguf_model(tmp_path / "m.gguf", config, random_weights(config), qtype="Q8_0")
    out = convert_gguf(gguf_path, tmp_path / "hf", progress=False)
    kog = load_model(gguf_path, dtype="float32", progress=False)
    assert load_model(out).config == kog.config
    model, sd = _hf_state_dict(out)
    _assert_same_weights(kog.weights, sd, config.tie_word_embeddings)
    assert type(model).__name__ == config.hf_architecture
    logits = model(torch.tensor([[1, 5, 9, 2]])).logits
    assert logits.shape == (1, 4, config.vocab_size) and torch.isfinite(logits).all()
    tok = transformers.AutoTokenizer.from_pretrained(out)
    for text in STRINGS:
        assert tok(text)["input_ids"] == kog.tokenizer.encode(text), text


def test_cli_convert(tmp_path, capsys):
    gguf_path = write_gguf_model(tmp_path / "m.gguf", tiny_config("llama"), qtype="F16")
    assert main(["convert", str(gguf_path), str(tmp_path / "out"), "--dtype", "bfloat16", "--no-progress"]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "out")
    assert {p.name for p in (tmp_path / "out").iterdir()} == {
        "config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "generation_config.json"}
    model = load_model(tmp_path / "out")
    assert model.config.torch_dtype == "bfloat16" and model.dtype == torch.bfloat16
    assert model.chat_template is not None
    (tmp_path / "bad.gguf").write_bytes(b"not a gguf at all")
    assert main(["convert", str(tmp_path / "bad.gguf"), str(tmp_path / "out2")]) == 1
    assert "bad.gguf: " in capsys.readouterr().err
    assert main(["convert", str(tmp_path / "out"), str(tmp_path / "out3")]) == 1
    assert "it converts to a .gguf file" in capsys.readouterr().err


# ---------------------------------------------------------------------- the real SmolLM2-135M-Instruct


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
    try:
        path = resolve_model(None)
    except ModelLoadError as e:
        pytest.skip(f"SmolLM2 GGUF unavailable: {e}")
    out = convert_gguf(path, tmp_path_factory.mktemp("smollm2"), progress=False)
    return path, out


@pytest.mark.slow
def test_smollm2_state_dict_equals_transformers(smollm2):
    gguf_path, out = smollm2
    kog = load_model(gguf_path, dtype="float32", progress=False)
    assert kog.config.num_hidden_layers == 30 and kog.config.tie_word_embeddings
    model, sd = _hf_state_dict(out)
    _assert_same_weights(kog.weights, sd, tied=True)

    # The converted model works: greedy decoding answers a greeting in kind.
    tok = transformers.AutoTokenizer.from_pretrained(out)
    prompt = kog.chat_template.render([{"role": "user", "content": "Hi there"}], add_generation_prompt=True)
    assert prompt == tok.apply_chat_template([{"role": "user", "content": "Hi there"}], tokenize=False,
                                             add_generation_prompt=True)
    ids = kog.tokenizer.encode(prompt, add_special_tokens=False)
    with torch.no_grad():
        out_ids = model.generate(torch.tensor([ids]), max_new_tokens=4, do_sample=False)[0, len(ids):]
    assert kog.tokenizer.decode(out_ids.tolist()).startswith("Hello")


@pytest.mark.slow
def test_smollm2_tokenizer_equals_transformers(smollm2):
    gguf_path, out = smollm2
    ours = tokenizer_from_gguf(GGUFCheckpoint(gguf_path).metadata)
    theirs = transformers.AutoTokenizer.from_pretrained(out)
    for text in TRICKY_STRINGS:
        assert theirs(text)["input_ids"] == ours.encode(text), text


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("KOG_SLOW_TESTS"), reason="about 90 s; set KOG_SLOW_TESTS=1")
def test_smollm2_gguf_equals_transformers_gguf_loader():
    """transformers' own GGUF loader (its name map, q/k un-permutation, dequantization) agrees."""
    pytest.importorskip("accelerate")
    path = resolve_model(None)
    kog = load_model(path, dtype="float32", progress=False)
    model = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    _assert_same_weights(kog.weights, model.state_dict(), tied=True)


@pytest.mark.slow
def test_load_default_model_end_to_end(smollm2):
    """load_model() with no argument: SmolLM2 in bf16, tokens, template and stop ids ready to run."""
    model = load_model(dtype="bfloat16", progress=False)
    assert model.path == smollm2[0] and model.dtype == torch.bfloat16
    assert model.lm_head is model.weights["model.embed_tokens.weight"]
    assert model.lm_head.shape == (49152, 576) and model.lm_head.dtype == torch.bfloat16
    assert model.stop_token_ids == (2,) and model.tokenizer.decode([2]) == "<|im_end|>"
    prompt = model.chat_template.render([{"role": "user", "content": "Hi"}], add_generation_prompt=True)
    assert prompt.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3"])
def test_transformers_saved_folder_loads(tmp_path, family):
    """The other direction: a folder transformers writes (its config layout, sharding) loads in Kog."""
    config = tiny_config(family)
    hf_config = transformers.AutoConfig.for_model(**config.to_hf_dict())
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
    model.save_pretrained(tmp_path, max_shard_size="100KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    write_tokenizer = transformers.AutoTokenizer.from_pretrained(
        convert_gguf(write_gguf_model(tmp_path / "t.gguf", config), tmp_path / "tok", progress=False))
    write_tokenizer.save_pretrained(tmp_path)
    kog = load_model(tmp_path, progress=False)
    assert kog.config == config
    _assert_same_weights(kog.weights, model.state_dict(), config.tie_word_embeddings)
    assert kog.tokenizer.encode("héllo 123") == write_tokenizer("héllo 123")["input_ids"]
