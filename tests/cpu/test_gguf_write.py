"""GGUF -> GGUF re-quantization (kog.loader.gguf_write, `kog convert x.gguf y.gguf --outtype`):
our Q4_K encoder against gguf-py's decoder, the written files against their sources (metadata,
tensor types, weights within each type's error), and Kog running them."""

from __future__ import annotations

import dataclasses

import gguf
import numpy as np
import pytest
import torch

import kog
from kog.cli import main
from kog.loader import GGUFCheckpoint, resolve_model
from kog.loader.gguf_write import quantize_q4_k, requantize_gguf
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
