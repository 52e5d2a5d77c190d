"""GPTQ / AWQ 4-bit HF checkpoints (kog.loader.int4_checkpoint): tiny Llama folders whose linears
are packed here as AutoGPTQ (v1 and v2 zeros) and AutoAWQ write them, from codes, zeros and
scales drawn by the test; Kog must load exactly those values (dequantized), keep them as GGUF
blocks by default, and decode as the float model does."""

import json

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

import kog
from kog.errors import ModelLoadError
from kog.loader import LoadedModel, load_model
from kog.models import ModelRunner
from kog.quantized import QuantizedWeight
from kog.testing.tiny_models import random_weights, tiny_config, write_hf_model

from test_quant_model import decode_logits

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]


def pack(values: np.ndarray, along: int, order=None) -> np.ndarray:
    """uint 4-bit values -> int32 words of 8, along axis 0 or 1, nibble i = value 8 j + order[i]."""
    order = list(range(8)) if order is None else order
    v = values.astype(np.uint32)
    if along == 0:
        v = v.reshape(v.shape[0] // 8, 8, v.shape[1])
        words = sum(v[:, order[i], :] << np.uint32(4 * i) for i in range(8))
    else:
        v = v.reshape(v.shape[0], v.shape[1] // 8, 8)
        words = sum(v[:, :, order[i]] << np.uint32(4 * i) for i in range(8))
    return words.astype(np.uint32).view(np.int32)


def quantized_folder(tmp_path, method: str, group: int, sym: bool = False, fmt: str = "gptq", desc_act=False):
    """An HF folder of a tiny Llama with every layer linear 4-bit; returns (folder, float weights
    holding exactly the values the packed codes stand for)."""
    config = tiny_config("llama", hidden_size=64, intermediate_size=128, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=16)
    floats = random_weights(config, seed=3)
    rng = np.random.default_rng(0)
    stored, want = {}, dict(floats)
    for name, w in floats.items():
        if not any(f".{lin}." in name for lin in LINEARS):
            stored[name] = w
            continue
        n, k = w.shape
        g = k if group == -1 else group
        groups = k // g
        q = rng.integers(0, 16, (n, k))
        # GPTQ v1 stores z - 1 in 4 bits: its zeros are 1..16 (a stored 15 reads as 16, as in
        # GPTQ's kernels); 0 cannot be stored, which v2 fixed.
        lowest = 1 if method == "gptq" and fmt == "gptq" else 0
        z = np.full((n, groups), 8) if sym else rng.integers(lowest, lowest + 16, (n, groups))
        s = rng.uniform(0.002, 0.02, (n, groups)).astype(np.float16)
        g_idx = np.arange(k) // g
        if desc_act:
            g_idx = rng.permutation(g_idx)
        want[name] = torch.from_numpy(s[:, g_idx].astype(np.float32) * (q - z[:, g_idx]).astype(np.float32))
        base = name[: -len(".weight")]
        if method == "gptq":
            stored[base + ".qweight"] = torch.from_numpy(pack(q.T, along=0))  # [k / 8, n]
            stored[base + ".qzeros"] = torch.from_numpy(pack((z - (fmt == "gptq")).T % 16, along=1))  # [G, n / 8]
            stored[base + ".g_idx"] = torch.from_numpy(g_idx.astype(np.int32))
        else:
            stored[base + ".qweight"] = torch.from_numpy(pack(q.T, along=1, order=AWQ_ORDER))  # [k, n / 8]
            stored[base + ".qzeros"] = torch.from_numpy(pack(z.T, along=1, order=AWQ_ORDER))
        stored[base + ".scales"] = torch.from_numpy(np.ascontiguousarray(s.T))  # [G, n]
    folder = write_hf_model(tmp_path / method, config, floats)
    save_file({n: t.contiguous() for n, t in stored.items()}, str(folder / "model.safetensors"))
    cfg = json.loads((folder / "config.json").read_text())
    qc = {"quant_method": method, "bits": 4, "group_size": group}
    qc |= {"sym": sym, "desc_act": desc_act, "checkpoint_format": fmt} if method == "gptq" else {"version": "gemm",
                                                                                                "zero_point": True}
    cfg["quantization_config"] = qc
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder, config, want


CASES = [("gptq", 32, False, "gptq"), ("gptq", 64, True, "gptq"), ("gptq", -1, False, "gptq_v2"),
         ("awq", 32, False, None), ("awq", 64, False, None)]


@pytest.mark.parametrize("method,group,sym,fmt", CASES)
def test_4_bit_linears_load_as_their_values_and_decode_like_the_float_model(tmp_path, method, group, sym, fmt):
    folder, config, want = quantized_folder(tmp_path, method, group, sym, fmt or "gptq")
    floats = load_model(folder, dtype="float32", progress=False)
    for name, w in want.items():  # dequantized: exactly s (q - z)
        assert torch.equal(floats.weights[name], w), name
    kept = load_model(folder, progress=False)
    assert kept.dtype == torch.float32
    lin = kept.weights["model.layers.0.self_attn.q_proj.weight"]
    assert isinstance(lin, QuantizedWeight) and lin.type_name == ("Q4_0" if sym else "Q4_1")
    for name, w in want.items():
        got = kept.weights[name]
        if isinstance(got, QuantizedWeight):  # Q4_1's m = -s z rounded to fp16: 2^-11 of |s z|
            assert bool(((got.dequantize() - w).abs() <= 2e-3 * w.abs().amax() + 1e-7).all()), name
    reference = LoadedModel(path=None, config=config, weights=want, dtype=torch.float32, tokenizer=kept.tokenizer,
                            chat_template=None, stop_token_ids=())
    prompts = [[3 + (7 * i + j) % 50 for j in range(5 + 3 * i)] for i in range(3)]
    got = decode_logits(ModelRunner(kept, num_kv_blocks=64, block_size=4), prompts)
    ref = decode_logits(ModelRunner(reference, num_kv_blocks=64, block_size=4), prompts)
    assert (got - ref).abs().max() <= 2e-2 * ref.abs().max()


def test_columns_grouped_out_of_order_run_as_q8_0(tmp_path, caplog):
    folder, _, want = quantized_folder(tmp_path, "gptq", 32, desc_act=True)
    kept = load_model(folder, progress=False)
    w = kept.weights["model.layers.1.mlp.down_proj.weight"]
    assert w.type_name in ("Q8_0", "Q8_0_R8") and "re-encoded as Q8_0" in caplog.text
    ref = want["model.layers.1.mlp.down_proj.weight"]
    amax = ref.abs().view(ref.shape[0], -1, 32).amax(-1).repeat_interleave(32, -1)
    assert bool(((w.dequantize() - ref).abs() <= amax * (1 / 254 + 1 / 2048) + 1e-7).all())


def test_generate_through_kog_llm(tmp_path):
    folder, _, _ = quantized_folder(tmp_path, "awq", 32)
    llm = kog.LLM(str(folder))
    out = llm.generate([{"prompt_token_ids": [3, 5, 7, 9]}], kog.SamplingParams(max_tokens=6, temperature=0))
    assert len(out[0].outputs[0].token_ids) == 6


@pytest.mark.parametrize("qc,match", [
    ({"quant_method": "gptq", "bits": 8, "group_size": 32}, "bits=8"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 0}, "group_size=0"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 32, "checkpoint_format": "marlin"}, "checkpoint_format"),
    ({"quant_method": "awq", "bits": 4, "group_size": 32, "version": "gemv"}, "version='gemv'"),
])
def test_configs_kog_cannot_load_name_the_field(tmp_path, qc, match):
    folder, _, _ = quantized_folder(tmp_path, qc["quant_method"], 32)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["quantization_config"] = qc
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match=match):
        load_model(folder, progress=False)


def test_a_missing_or_misshapen_part_names_the_tensor(tmp_path):
    from safetensors.torch import load_file

    folder, _, _ = quantized_folder(tmp_path, "gptq", 32)
    tensors = load_file(str(folder / "model.safetensors"))
    tensors["model.layers.0.mlp.up_proj.scales"] = tensors["model.layers.0.mlp.up_proj.scales"][:1].clone()
    save_file(tensors, str(folder / "model.safetensors"))
    with pytest.raises(ModelLoadError, match=r"up_proj\.scales.*expected \[2, 128\]"):
        load_model(folder, progress=False)
    del tensors["model.layers.0.mlp.up_proj.scales"]
    save_file(tensors, str(folder / "model.safetensors"))
    with pytest.raises(ModelLoadError, match=r"up_proj.*has no.*up_proj\.scales"):
        load_model(folder, progress=False)
