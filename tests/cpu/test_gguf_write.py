"""Writing GGUF (kog.loader.gguf_write, `kog convert x.gguf|hf_folder y.gguf --outtype`): our
Q4_K encoder against gguf-py's decoder, the written files against their sources (metadata,
tensor types, weights within each type's error, tokenizer), and Kog running them."""

from __future__ import annotations

import dataclasses

import gguf
import numpy as np
import pytest
import torch

import kog
from kog.cli import main
from kog.loader import GGUFCheckpoint, resolve_model
from kog.loader.gguf_write import hf_to_gguf, quantize_q4_k, quantize_q5_k, quantize_q6_k, requantize_gguf
from kog.testing.tiny_models import random_weights, tiny_config, write_gguf_model

Q = gguf.GGMLQuantizationType


def rms(a, b) -> float:
    return float(np.sqrt(np.mean((np.asarray(a, np.float64) - np.asarray(b, np.float64)) ** 2)))


def test_q4_k_blocks_decode_to_the_values_within_a_4_bit_error():
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((8, 1024)) * rng.uniform(0.01, 3, (8, 1))).astype(np.float32)
    x[3, 256:512] += 5.0  # an all-positive sub-block range: its min is clamped to 0
    blocks = quantize_q4_k(x)
    assert blocks.shape == (8, 1024 // 256 * 144) and blocks.dtype == np.uint8
    y = gguf.quants.dequantize(blocks, Q.Q4_K)
    q4_1 = gguf.quants.dequantize(gguf.quants.quantize(x, Q.Q4_1), Q.Q4_1)
    for r in range(8):
        if r != 3:  # as close as Q4_1 (fp16 scales per 32) is, within 15%; row 3's all-positive
            # sub-blocks span [0, max] (Q4_K subtracts its mins: a sub-block's offset is <= 0)
            assert rms(y[r], x[r]) <= 1.15 * rms(q4_1[r], x[r]) + 1e-7, r
        step = (x[r].reshape(-1, 32).max(-1) - np.minimum(x[r].reshape(-1, 32).min(-1), 0)) / 15
        assert np.all(np.abs(y[r] - x[r]).reshape(-1, 32) <= step[:, None] * 1.6 + 1e-6), r
    zeros = gguf.quants.dequantize(quantize_q4_k(np.zeros((2, 256), np.float32)), Q.Q4_K)
    assert np.array_equal(zeros, np.zeros((2, 256), np.float32))
    with pytest.raises(ValueError, match="multiple of 256"):
        quantize_q4_k(np.zeros((2, 576), np.float32))


def test_q5_k_and_q6_k_blocks_decode_to_the_values():
    """quantize_q5_k / quantize_q6_k against gguf's decoder: within a step of the format (Q5_K:
    its affine 5-bit step per 32; Q6_K: d sc per 16 plus the fp16/int8 rounding of the scales),
    and closer than Q4_K / Q5_K respectively in RMS."""
    rng = np.random.default_rng(1)
    x = (rng.standard_normal((6, 512)) * rng.uniform(0.01, 3, (6, 1))).astype(np.float32)
    x[2, :256] += 4.0
    q5 = quantize_q5_k(x)
    q6 = quantize_q6_k(x)
    assert q5.shape == (6, 2 * 176) and q6.shape == (6, 2 * 210)
    y5, y6 = gguf.quants.dequantize(q5, Q.Q5_K), gguf.quants.dequantize(q6, Q.Q6_K)
    y4 = gguf.quants.dequantize(quantize_q4_k(x), Q.Q4_K)
    for r in range(6):
        step5 = (x[r].reshape(-1, 32).max(-1) - np.minimum(x[r].reshape(-1, 32).min(-1), 0)) / 31
        assert np.all(np.abs(y5[r] - x[r]).reshape(-1, 32) <= step5[:, None] * 1.6 + 1e-6), r
        step6 = np.abs(x[r]).reshape(-1, 16).max(-1) / 31  # half a step, plus the int8 scale's rounding
        assert np.all(np.abs(y6[r] - x[r]).reshape(-1, 16) <= step6[:, None] * 0.75 + 1e-6), r
        assert rms(y5[r], x[r]) < rms(y4[r], x[r]) and rms(y6[r], x[r]) < rms(y5[r], x[r]), r
    for enc, t in ((quantize_q5_k, Q.Q5_K), (quantize_q6_k, Q.Q6_K)):
        assert not gguf.quants.dequantize(enc(np.zeros((1, 256), np.float32)), t).any()
        with pytest.raises(ValueError, match="multiple of 256"):
            enc(np.zeros((1, 576), np.float32))


@pytest.mark.parametrize("outtype,matrix_type,tol", [("f16", "F16", 1e-3), ("bf16", "BF16", 1e-2),
                                                     ("q8_0", "Q8_0", 2e-2), ("q4_k", "Q4_K", 0.25)])
def test_requantized_tiny_gguf_keeps_metadata_and_weights(tmp_path, outtype, matrix_type, tol):
    c = tiny_config("llama", hidden_size=256, intermediate_size=512, head_dim=64)  # every row 256 or 512
    src = write_gguf_model(tmp_path / "src.gguf", c, random_weights(c, seed=3))
    dst = tmp_path / f"out.{outtype}.gguf"
    written = requantize_gguf(src, dst, outtype)
    a, b = gguf.GGUFReader(src), gguf.GGUFReader(dst)
    keys = {k for k in a.fields if not k.startswith("GGUF.")}
    assert keys == {k for k in b.fields if not k.startswith("GGUF.")}
    for k in keys - {"general.file_type"}:
        assert a.fields[k].contents() == b.fields[k].contents(), k
    assert {t.name: t.tensor_type.name for t in b.tensors} == written
    assert {written[t.name] for t in b.tensors if len(t.shape) == 2} == {matrix_type}
    assert {written[t.name] for t in b.tensors if len(t.shape) == 1} == {"F32"}
    ca, cb = GGUFCheckpoint(src), GGUFCheckpoint(dst)
    assert dataclasses.replace(cb.config, torch_dtype=ca.config.torch_dtype) == ca.config
    wa, wb = ca.load_weights(ca.config, torch.float32), cb.load_weights(ca.config, torch.float32)
    assert wa.keys() == wb.keys()
    for name in wa:
        scale = float(wa[name].abs().max())
        assert rms(wa[name], wb[name]) <= tol * scale, name


def test_q4_k_falls_back_where_rows_are_not_whole_super_blocks(tmp_path):
    c = tiny_config("llama")  # hidden 64: no matrix row is a multiple of 256
    src = write_gguf_model(tmp_path / "src.gguf", c)
    written = requantize_gguf(src, tmp_path / "out.gguf", "q4_k")
    assert set(written.values()) == {"Q8_0", "F32"}


def test_bad_input_is_a_model_load_error(tmp_path):
    c = tiny_config("llama")
    src = write_gguf_model(tmp_path / "src.gguf", c)
    with pytest.raises(kog.ModelLoadError, match="unknown GGUF output type"):
        requantize_gguf(src, tmp_path / "x.gguf", "q3_xs")
    (tmp_path / "bad.gguf").write_bytes(b"GGUF\x03\x00")
    with pytest.raises(kog.ModelLoadError, match="not a readable GGUF"):
        requantize_gguf(tmp_path / "bad.gguf", tmp_path / "y.gguf", "q8_0")


def test_cli_writes_a_gguf_and_refuses_outtype_for_a_folder(tmp_path, capsys):
    c = tiny_config("llama", hidden_size=256, intermediate_size=512)
    src = write_gguf_model(tmp_path / "src.gguf", c)
    assert main(["convert", str(src), str(tmp_path / "out.gguf"), "--outtype", "q4_k"]) == 0
    assert "Q4_K" in capsys.readouterr().out
    assert GGUFCheckpoint(tmp_path / "out.gguf").config.hidden_size == 256
    assert main(["convert", str(src), str(tmp_path / "folder"), "--outtype", "q8_0"]) == 1
    assert "--outtype is for a .gguf output" in capsys.readouterr().err


def test_smollm2_requantized_to_q8_0_generates_what_the_shipped_q4_1_does(tmp_path):
    """Q8_0 of the Q4_1 file's values is nearly lossless: the same greedy tokens."""
    src = resolve_model(None)
    dst = tmp_path / "smol.q8_0.gguf"
    written = requantize_gguf(src, dst, "q8_0")
    assert sum(t == "Q8_0" for t in written.values()) == 211
    params = kog.SamplingParams(max_tokens=24, temperature=0.0)
    prompts = ["The capital of France is", "def fibonacci(n):"]
    want = [o.outputs[0].token_ids for o in kog.LLM(str(src)).generate(prompts, params)]
    got = [o.outputs[0].token_ids for o in kog.LLM(str(dst)).generate(prompts, params)]
    assert got == want


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_hf_folder_to_gguf_loads_as_the_same_model(tmp_path, arch):
    """An HF folder written as an F32 GGUF: the same config, bit-identical weights (q/k rows
    permuted to llama.cpp's order and back for llama), the same tokens for tricky texts, the same
    chat template and stop ids."""
    from kog.loader import load_model
    from kog.testing.tiny_models import TRICKY_STRINGS, default_pre, tiny_tokenizer, write_hf_model

    c = tiny_config(arch)
    folder = write_hf_model(tmp_path / "hf", c, random_weights(c, seed=1), tokenizer=tiny_tokenizer(default_pre(c)))
    written = hf_to_gguf(folder, tmp_path / "m.gguf", "f32")
    assert set(written.values()) == {"F32"}
    a, b = load_model(folder), load_model(tmp_path / "m.gguf")
    assert dataclasses.replace(b.config, torch_dtype=a.config.torch_dtype) == a.config
    assert a.weights.keys() == b.weights.keys() and all(torch.equal(a.weights[k], b.weights[k]) for k in a.weights)
    assert all(a.tokenizer.encode(s) == b.tokenizer.encode(s) for s in TRICKY_STRINGS)
    assert b.chat_template is not None and a.stop_token_ids == b.stop_token_ids
    pre = gguf.GGUFReader(tmp_path / "m.gguf").fields["tokenizer.ggml.pre"].contents()
    assert pre == default_pre(c)


def test_a_tokenizer_no_gguf_pre_tokenizer_reproduces_is_refused(tmp_path):
    from tokenizers import pre_tokenizers

    from kog.testing.tiny_models import tiny_tokenizer, write_hf_model

    tok = tiny_tokenizer()
    tok.hf.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Punctuation(),
                                                    pre_tokenizers.ByteLevel(add_prefix_space=True)])
    c = tiny_config("llama")
    folder = write_hf_model(tmp_path / "hf", c, tokenizer=tok)
    with pytest.raises(kog.ModelLoadError, match="no llama.cpp pre-tokenizer"):
        hf_to_gguf(folder, tmp_path / "m.gguf")
    assert not (tmp_path / "m.gguf").exists() or (tmp_path / "m.gguf").stat().st_size == 0


def test_smollm2_gguf_to_hf_to_gguf_round_trip_generates_the_same_tokens(tmp_path):
    """kog convert both ways: the shipped Q4_1 GGUF -> HF folder (float32) -> Q8_0 GGUF, tokenizer
    pre-tokenizer found again ('smollm'), the same greedy tokens as the shipped file."""
    src = resolve_model(None)
    assert main(["convert", str(src), str(tmp_path / "hf"), "--no-progress"]) == 0
    assert main(["convert", str(tmp_path / "hf"), str(tmp_path / "smol.gguf"), "--outtype", "q8_0"]) == 0
    assert gguf.GGUFReader(tmp_path / "smol.gguf").fields["tokenizer.ggml.pre"].contents() == "smollm"
    params = kog.SamplingParams(max_tokens=24, temperature=0.0)
    prompts = ["The capital of France is", "def fibonacci(n):"]
    want = [o.outputs[0].token_ids for o in kog.LLM(str(src)).generate(prompts, params)]
    got = [o.outputs[0].token_ids for o in kog.LLM(str(tmp_path / "smol.gguf")).generate(prompts, params)]
    assert got == want
