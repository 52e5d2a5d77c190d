"""4-bit GPU weights (kog.int4, kog._C.WEIGHT_Q4_GROUPS / WEIGHT_Q4_K) on the CPU: the repacking
of GGUF Q4_0 / Q4_1 / Q4_K blocks holds the format's exact values (against gguf's own decoder, on
random blocks covering every bit of the headers), the GEMV reference, the weights GpuDecoder
takes, and the program's 4-bit ops (the GPU kernel runs them; expand_gpu_program keeps them, the
CPU executor refuses them)."""

import gguf
import numpy as np
import pytest
import torch

import kog
from kog import _C
from kog.int4 import Int4Weight, from_quantized, q4_k_scale_mins, to_gpu_weights
from kog.loader.gguf_write import quantize_q4_k
from kog.models.decode import lower_program, model_dims, schedule_for
from kog.models.weights import prepare_weights
from kog.program import Opcode
from kog.quantized import QuantizedWeight
from kog.testing import reference
from kog.testing.programs import with_op
from kog.testing.tiny_models import random_weights, tiny_config

Q = gguf.GGMLQuantizationType
BLOCK = {"Q4_0": (32, 18, Q.Q4_0), "Q4_1": (32, 20, Q.Q4_1), "Q4_K": (256, 144, Q.Q4_K)}


def random_blocks(name: str, rows: int, cols: int, seed: int) -> np.ndarray:
    """uint8 [rows, cols / elems * bytes] of random blocks: every code and scale bit random, the
    f16 fields finite (random magnitudes around 1e-2, both signs)."""
    elems, size, _ = BLOCK[name]
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (rows, cols // elems, size), dtype=np.uint8)
    halves = 2 if name in ("Q4_1", "Q4_K") else 1
    f16 = (rng.standard_normal((rows, cols // elems, halves)) * 1e-2).astype(np.float16)
    blocks[..., : 2 * halves] = f16.view(np.uint8)
    return blocks.reshape(rows, -1)


def qweight(name: str, rows: int, cols: int, seed: int = 0) -> QuantizedWeight:
    return QuantizedWeight(torch.from_numpy(random_blocks(name, rows, cols, seed)), int(BLOCK[name][2]), cols)


@pytest.mark.parametrize("name,rows,cols", [("Q4_0", 3, 32), ("Q4_0", 17, 96), ("Q4_1", 5, 64), ("Q4_1", 1, 576),
                                            ("Q4_K", 3, 256), ("Q4_K", 9, 768)])
def test_repacked_blocks_hold_the_formats_values_exactly(name, rows, cols):
    w = qweight(name, rows, cols, seed=rows * cols)
    w4 = from_quantized(w)
    assert w4.kind == (_C.WEIGHT_Q4_K if name == "Q4_K" else _C.WEIGHT_Q4_GROUPS)
    assert w4.shape == (rows, cols) and w4.codes.shape == (rows, cols // 2)
    want = gguf.quants.dequantize(w.data.numpy(), BLOCK[name][2])
    got = w4.dequantize().numpy()
    assert got.dtype == np.float32 and np.array_equal(got, want)
    assert torch.equal(w4.dequantize(), w.dequantize().float())  # Kog's own CPU decoder agrees
    # bytes: Q4_1 / Q4_K keep the file's; Q4_0 adds one f16 (its min) per block
    extra = rows * cols // 32 * 2 if name == "Q4_0" else 0
    assert w4.nbytes == w.nbytes + extra


def test_q4_k_codes_land_in_group_order():
    """A Q4_K super-block whose sub-block j holds only code j (scales 1, mins 0, d 1): group j of
    the repacked row decodes to j everywhere (the nibble halves and pair order of the file)."""
    x = np.repeat(np.arange(8, dtype=np.float32), 32)[None, :]  # sub-block j = j
    w = QuantizedWeight(torch.from_numpy(quantize_q4_k(x)), int(Q.Q4_K), 256)
    got = from_quantized(w).dequantize().numpy()
    np.testing.assert_allclose(got, x, atol=1e-2)
    codes = from_quantized(w).codes.numpy().reshape(8, 16)
    assert all(len(set(codes[j].tolist())) == 1 for j in range(8))  # one code per group, both nibbles


def test_q4_k_scale_mins_cover_the_high_bits():
    """get_scale_min_k4 on all-ones scale bytes: every 6-bit field is 63 (its two high bits of
    groups 4..7 come from the first eight bytes' top bits)."""
    sc, mn = q4_k_scale_mins(np.full((1, 12), 0xFF, np.uint8))
    assert (sc == 63).all() and (mn == 63).all()
    sc, mn = q4_k_scale_mins(np.array([[0xC0] * 4 + [0x00] * 4 + [0x0F] * 4], np.uint8))
    assert sc.tolist() == [[0, 0, 0, 0, 63, 63, 63, 63]] and mn.tolist() == [[0] * 8]


def test_q4_0_min_out_of_f16_range_is_refused():
    blocks = random_blocks("Q4_0", 1, 32, 0)
    blocks[0, :2] = np.array([60000.0], np.float16).view(np.uint8)
    with pytest.raises(kog.InvalidRequest, match="leaves float16's range"):
        from_quantized(QuantizedWeight(torch.from_numpy(blocks), int(Q.Q4_0), 32))


def test_other_types_and_bad_shapes_are_refused():
    with pytest.raises(kog.InvalidRequest, match="Q8_0 weight: the GPU 4-bit formats take"):
        from_quantized(QuantizedWeight(torch.zeros(2, 34, dtype=torch.uint8), int(Q.Q8_0), 32))
    with pytest.raises(kog.InvalidRequest, match="not a multiple of 256"):
        Int4Weight(torch.zeros(2, 64, dtype=torch.uint8), torch.zeros(2, 16, dtype=torch.uint8), _C.WEIGHT_Q4_K, 128)
    with pytest.raises(kog.InvalidRequest, match=r"groups must be contiguous uint8 \[rows, 8\]"):
        Int4Weight(torch.zeros(2, 32, dtype=torch.uint8), torch.zeros(2, 4, dtype=torch.uint8),
                   _C.WEIGHT_Q4_GROUPS, 64)
    with pytest.raises(kog.InvalidRequest, match="kind"):
        Int4Weight(torch.zeros(2, 32, dtype=torch.uint8), torch.zeros(2, 8, dtype=torch.uint8), _C.WEIGHT_FP8, 64)


@pytest.mark.parametrize("name", ["Q4_1", "Q4_K"])
def test_reference_gemv_is_the_dequantized_linear(name):
    w4 = from_quantized(qweight(name, 7, 512, seed=3))
    x = torch.randn(3, 512, dtype=torch.float64)
    bias = torch.randn(7, dtype=torch.float64)
    got = reference.linear_q4(x, w4, bias)
    torch.testing.assert_close(got, x @ w4.dequantize().double().T + bias)


def q4_model(arch="llama", embed_type="Q8_0"):
    """A tiny model's prepared bf16 weights with every LINEAR matrix Q4_1 / Q4_K blocks (Q4_K
    where the input width is whole super-blocks: the MLP's down, intermediate 256) and the
    embedding `embed_type` blocks."""
    c = tiny_config(arch, intermediate_size=256)
    w = prepare_weights(c, random_weights(c), torch.bfloat16)
    linear_names = {n for ins in schedule_for(c) if ins.opcode == Opcode.LINEAR for n in ins.weights}
    out = dict(w)
    for i, name in enumerate(sorted(linear_names)):
        rows, cols = w[name].shape
        kind = "Q4_K" if cols % 256 == 0 else "Q4_1"
        out[name] = qweight(kind, rows, cols, seed=i)
    embed = "model.embed_tokens.weight"
    rows, cols = w[embed].shape
    out[embed] = QuantizedWeight(torch.from_numpy(gguf.quants.quantize(w[embed].float().numpy(), Q[embed_type])),
                                 int(Q[embed_type]), cols)
    return c, out, linear_names


def test_to_gpu_weights_makes_linears_4_bit_and_dequantizes_the_rest():
    c, w, linear_names = q4_model()
    got = to_gpu_weights(schedule_for(c), w, torch.bfloat16)
    for name in linear_names:
        assert isinstance(got[name], Int4Weight) and got[name].shape == w[name].shape
        assert torch.equal(got[name].dequantize(), w[name].dequantize().float())
    embed = got["model.embed_tokens.weight"]  # read by EMBED (and the tied head): dequantized
    assert isinstance(embed, torch.Tensor) and embed.dtype == torch.bfloat16
    assert torch.equal(embed, w["model.embed_tokens.weight"].dequantize().to(torch.bfloat16))
    assert got["model.norm.weight"] is w["model.norm.weight"]


def test_lowered_4_bit_ops_pass_validation_and_the_gpu_expansion():
    c, w, linear_names = q4_model("qwen3")
    gpu = to_gpu_weights(schedule_for(c), w, torch.bfloat16)
    ops = lower_program(schedule_for(c), gpu)
    dims = model_dims(c, torch.bfloat16)
    _C.validate_program(ops, dims)
    kinds = {o.w_type for o in ops if o.opcode == Opcode.LINEAR}
    assert kinds <= {_C.WEIGHT_Q4_GROUPS, _C.WEIGHT_Q4_K, _C.WEIGHT_RUN_DTYPE} and _C.WEIGHT_Q4_K in kinds
    for o in ops:
        if o.w_type in (_C.WEIGHT_Q4_GROUPS, _C.WEIGHT_Q4_K):
            assert o.w_scale != 0
    out = _C.expand_gpu_program(ops, dims)
    q4_kinds = (_C.WEIGHT_Q4_GROUPS, _C.WEIGHT_Q4_K)
    four_bit = lambda prog: {(o.w0, o.w_type, o.w_scale) for o in prog if o.w_type in q4_kinds}  # noqa: E731
    assert four_bit(out) == four_bit(ops)  # every 4-bit matrix kept, with its scales, through the fusions


def test_4_bit_ops_are_checked_and_refused_by_the_cpu_executor():
    c, w, _ = q4_model()
    ops = lower_program(schedule_for(c), to_gpu_weights(schedule_for(c), w, torch.bfloat16))
    lin = next(i for i, o in enumerate(ops) if o.w_type == _C.WEIGHT_Q4_GROUPS)
    norm = next(i for i, o in enumerate(ops) if o.opcode == Opcode.RMS_NORM)
    dims = model_dims(c, torch.bfloat16)

    with pytest.raises(kog.InvalidRequest, match=f"op {lin} reads an FP8 or 4-bit weight without its scales"):
        _C.validate_program(with_op(ops, lin, w_scale=0), dims)
    with pytest.raises(kog.InvalidRequest, match=f"op {norm} .*cannot read an? 4-bit weight"):
        _C.validate_program(with_op(ops, norm, w_type=_C.WEIGHT_Q4_GROUPS, w_scale=ops[lin].w_scale), dims)
    with pytest.raises(kog.InvalidRequest, match=f"op {lin} has Q4_K rows of {c.hidden_size} elements, not a multiple"):
        _C.validate_program(with_op(ops, lin, w_type=_C.WEIGHT_Q4_K), dims)
    with pytest.raises(kog.InvalidRequest, match="4-bit GPU weights run with bfloat16 activations"):
        _C.validate_program(ops, model_dims(c, torch.float32))
    with pytest.raises(kog.InvalidRequest, match="4-bit GPU weights run with bfloat16 activations"):
        _C.validate_program(ops, model_dims(c, torch.float16))
    kv = torch.zeros(dims.n_layers, 4, 2, dims.n_kv_heads, 4, dims.head_dim, dtype=torch.bfloat16)
    with pytest.raises(kog.InvalidRequest, match="reads a weight in a GPU format .*which only the GPU kernel runs"):
        _C.DecodeExecutor(dims, kv.data_ptr(), 4, 4, [1.0] * (dims.rotary_dim // 2), ops)


def test_the_kernels_byte_decode_and_nibble_order():
    """gpu/decode/int4.cuh's decode, in numpy: a byte moved into the mantissa of 2^23 (the CUDA
    PRMT with 0x4B000000) minus 2^23 is the byte's value; element e of a group is nibble e % 16
    of byte e % 16, low for e < 16, high after (int4_decode's halves and words)."""
    b = np.arange(256, dtype=np.uint32)
    assert np.array_equal((0x4B000000 | b).view(np.float32) - np.float32(8388608.0), b.astype(np.float32))
    group = np.random.default_rng(0).integers(0, 256, 16, dtype=np.uint8)
    words = group.view(np.uint32)
    decoded = []
    for r in range(4):  # the four bf16 x vectors of a group (V = 8)
        e0 = r * 8
        for q in range(2):
            w = int(words[(e0 % 16) // 4 + q])
            codes = ((w >> 4) if e0 >= 16 else w) & 0x0F0F0F0F
            decoded += [(codes >> (8 * i)) & 0xFF for i in range(4)]
    want = np.concatenate([group & 0x0F, group >> 4]).tolist()
    assert decoded == want


def test_the_kernels_q4_k_header_decode_matches_get_scale_min_k4():
    """group_affine<Int4Q4K>'s bit moves (int4.cuh), in Python: scale bytes 0..7 as one 64-bit
    value and 8..11 as one word, shifted by the group's index, on random headers for all 8 groups."""
    rng = np.random.default_rng(1)
    heads = rng.integers(0, 256, (64, 12), dtype=np.uint8)
    want_sc, want_mn = q4_k_scale_mins(heads)
    for h, ws, wm in zip(heads, want_sc, want_mn):
        words = h.view(np.uint32).tolist()
        lo, hi = (words[1] << 32) | words[0], words[2]
        for j in range(8):
            if j < 4:
                sc, mn = (lo >> (8 * j)) & 63, (lo >> (8 * (j + 4))) & 63
            else:
                qj4 = (hi >> (8 * (j - 4))) & 0xFF
                sc = (qj4 & 0xF) | ((((lo >> (8 * (j - 4))) & 0xFF) >> 6) << 4)
                mn = (qj4 >> 4) | ((((lo >> (8 * j)) & 0xFF) >> 6) << 4)
            assert (sc, mn) == (ws[j], wm[j])


@pytest.mark.parametrize("method,group,sym,fmt", [("gptq", -1, False, "gptq"), ("gptq", 32, True, "gptq_v2"),
                                                  ("awq", 64, False, "gptq")])
def test_gptq_and_awq_checkpoints_reach_the_gpu_format_with_their_values(tmp_path, method, group, sym, fmt):
    """An HF GPTQ / AWQ folder loads into Q4_0 / Q4_1 blocks (kog.loader.int4_checkpoint), which
    to_gpu_weights makes WEIGHT_Q4_GROUPS matrices holding the loader's values exactly."""
    from kog.loader import load_model

    from test_int4_checkpoint import quantized_folder

    folder, config, want = quantized_folder(tmp_path, method, group, sym, fmt)
    kept = load_model(folder, progress=False)
    w = prepare_weights(config, kept.weights, torch.bfloat16)
    gpu = to_gpu_weights(schedule_for(config), w, torch.bfloat16)
    four_bit = [n for n, t in gpu.items() if isinstance(t, Int4Weight)]
    assert len(four_bit) == 4 * config.num_hidden_layers  # qkv, o, gate_up, down
    for name in four_bit:
        assert gpu[name].kind == _C.WEIGHT_Q4_GROUPS
        assert torch.equal(gpu[name].dequantize(), w[name].dequantize().float()), name
    q = gpu["model.layers.0.self_attn.qkv_proj.weight"].dequantize()
    n_q = config.num_attention_heads * config.head_dim
    assert (q[:n_q] - want["model.layers.0.self_attn.q_proj.weight"]).abs().max() <= 2e-3 * q.abs().max() + 1e-7
