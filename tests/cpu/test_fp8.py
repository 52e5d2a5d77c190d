"""FP8 e4m3 weights (kog.fp8, kog._C.WEIGHT_FP8) on the CPU: the two encodings on all 256 bit
patterns, per-channel quantization, the plain GEMV reference, and the program's FP8 ops (the GPU
kernel runs them; expand_gpu_program keeps them, the CPU executor refuses them)."""

import math

import pytest
import torch

import kog
from kog import _C
from kog.fp8 import FORMAT_MAX, Fp8Weight, decode, encode, quantize, to_format
from kog.models.decode import lower_program, model_dims, schedule_for
from kog.models.weights import prepare_weights
from kog.program import Opcode
from kog.testing import reference
from kog.testing.programs import with_op
from kog.testing.tiny_models import random_weights, tiny_config

ALL_BITS = torch.arange(256, dtype=torch.int32).to(torch.uint8)


def e4m3_value(b: int, bias: int) -> float:
    """The value of bits b in e4m3 with exponent bias `bias`, from the definition (NaN aside)."""
    s, e, m = b >> 7, (b >> 3) & 0xF, b & 7
    mag = (m / 8) * 2.0 ** (1 - bias) if e == 0 else (1 + m / 8) * 2.0 ** (e - bias)
    return -mag if s else mag


def test_decode_matches_the_definition_on_all_256_patterns():
    fn, fnuz = decode(ALL_BITS, "e4m3fn"), decode(ALL_BITS, "e4m3fnuz")
    for b in range(256):
        if b in (0x7F, 0xFF):  # fn's NaN codes
            assert math.isnan(fn[b])
        else:
            assert fn[b].item() == e4m3_value(b, 7), hex(b)
        if b == 0x80:  # fnuz's only NaN (no negative zero)
            assert math.isnan(fnuz[b])
        else:
            assert fnuz[b].item() == e4m3_value(b, 8), hex(b)


def test_the_same_bits_are_twice_the_value_in_fn():
    """The kernel's fold of 2^(15 - bias) into the row scale, and to_format, rest on this."""
    fn, fnuz = decode(ALL_BITS, "e4m3fn"), decode(ALL_BITS, "e4m3fnuz")
    finite = torch.isfinite(fn) & torch.isfinite(fnuz)
    assert int(finite.sum()) == 253  # all but 0x7f, 0xff (fn NaN) and 0x80 (fnuz NaN)
    assert torch.equal(fn[finite], 2 * fnuz[finite])
    assert fn.nan_to_num().abs().max() == FORMAT_MAX["e4m3fn"] and fnuz.nan_to_num().abs().max() == FORMAT_MAX["e4m3fnuz"]


@pytest.mark.parametrize("fmt", ["e4m3fn", "e4m3fnuz"])
def test_encode_round_trips_every_finite_code(fmt):
    v = decode(ALL_BITS, fmt)
    ok = torch.isfinite(v) & ~((ALL_BITS == 0x80) & (v == 0))  # -0 encodes as 0x80 in fn only
    assert torch.equal(encode(v[ok], fmt), ALL_BITS[ok])


@pytest.mark.parametrize("fmt", ["e4m3fn", "e4m3fnuz"])
def test_quantize_per_channel_scale_and_error(fmt):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(24, 64, generator=g) * torch.linspace(0.01, 3, 24)[:, None]
    w[5] = 0  # a zero row: scale 1, all codes zero
    q = quantize(w, fmt)
    assert q.data.shape == (24, 64) and q.scale.shape == (24,)
    absmax = w.abs().amax(dim=1)
    assert torch.allclose(q.scale[absmax > 0], absmax[absmax > 0] / FORMAT_MAX[fmt]) and q.scale[5] == 1
    deq = q.dequantize()
    assert torch.equal(deq.abs().amax(dim=1)[absmax > 0], absmax[absmax > 0])  # the row max is exact
    # e4m3 keeps 3 mantissa bits: relative error <= 2^-4 of each normal value (subnormals: half a step)
    step = torch.maximum(w.abs() * 2.0 ** -4, q.scale[:, None] * 2.0 ** (-9 if fmt == "e4m3fn" else -10))
    assert ((deq - w).abs() <= step + 1e-12).all()


def test_to_format_is_exact_both_ways():
    g = torch.Generator().manual_seed(1)
    w = quantize(torch.randn(16, 32, generator=g), "e4m3fn")
    nuz = to_format(w, "e4m3fnuz")
    assert torch.equal(nuz.dequantize(), w.dequantize())
    back = to_format(nuz, "e4m3fn")
    assert torch.equal(back.dequantize(), w.dequantize()) and torch.equal(back.data, w.data)
    native = quantize(torch.randn(16, 32, generator=g), "e4m3fnuz")  # holds 0x7f (240): no fn twin
    assert bool(((native.data & 0x7F) == 0x7F).any())
    assert torch.allclose(to_format(native, "e4m3fn").dequantize(), native.dequantize(), rtol=2 ** -4)
    bad = Fp8Weight(torch.full((2, 16), 0x7F, dtype=torch.uint8), torch.ones(2), "e4m3fn")
    with pytest.raises(kog.InvalidRequest, match="NaN"):
        to_format(bad, "e4m3fnuz")


def test_fp8_weight_checks_its_shapes():
    with pytest.raises(kog.InvalidRequest, match="uint8"):
        Fp8Weight(torch.zeros(2, 16), torch.ones(2), "e4m3fn")
    with pytest.raises(kog.InvalidRequest, match="scale must be f32 \\[2\\]"):
        Fp8Weight(torch.zeros(2, 16, dtype=torch.uint8), torch.ones(3), "e4m3fn")
    with pytest.raises(kog.InvalidRequest, match="unknown FP8 format"):
        quantize(torch.ones(2, 16), "e5m2")


@pytest.mark.parametrize("fmt", ["e4m3fn", "e4m3fnuz"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_gemv_is_the_dequantized_linear(fmt, dtype):
    g = torch.Generator().manual_seed(2)
    q = quantize(torch.randn(40, 48, generator=g), fmt)
    x, bias = torch.randn(3, 48, generator=g).to(dtype), torch.randn(40, generator=g).to(dtype)
    got = reference.linear_fp8(x, q.data, q.scale, fmt, bias)
    want = reference.linear(x, q.dequantize().double(), bias)  # the weights rounded to f32 first: 6e-8 apart
    assert got.dtype == dtype
    torch.testing.assert_close(got, want, rtol=1e-6 if dtype == torch.float32 else 1e-2, atol=1e-6)
    assert (got.float() - want.float()).abs().max() < 0.02 * want.float().abs().max()  # no scale forgotten


def fp8_program(arch="llama"):
    """The tiny model's lowered program with every LINEAR's weight FP8 (fake pointers to real
    tensors: the C++ checks read shapes and pointers, not data)."""
    c = tiny_config(arch)
    w = prepare_weights(c, random_weights(c), torch.bfloat16)
    ops = lower_program(schedule_for(c), w)
    scale = torch.ones(4096)
    out = []
    for o in ops:
        kw = dict(opcode=o.opcode, layer=o.layer, in_=o.in_, residual=o.residual, out=o.out, w0=o.w0, w1=o.w1,
                  deps=o.deps)
        if o.opcode == Opcode.LINEAR:
            kw |= dict(w_type=_C.WEIGHT_FP8, w_scale=scale.data_ptr())
        out.append(_C.Op(**kw))
    return out, model_dims(c, torch.bfloat16), scale


def test_gpu_program_keeps_fp8_weights_through_the_fusions():
    ops, dims, scale = fp8_program()
    _C.validate_program(ops, dims)
    plain = _C.expand_gpu_program(lower_program(schedule_for(tiny_config("llama")), prepare_weights(
        tiny_config("llama"), random_weights(tiny_config("llama")), torch.bfloat16)), dims)
    out = _C.expand_gpu_program(ops, dims)
    assert [o.opcode for o in out] == [o.opcode for o in plain]  # the same fusions as run-dtype weights
    gemvs = [o for o in out if o.opcode in (int(Opcode.LINEAR), _C.GPU_OP_LINEAR_SILU_MUL, _C.GPU_OP_LINEAR_ROPE_KV,
                                            _C.GPU_OP_LINEAR_SAMPLE_PARTIAL)]
    assert gemvs and all(o.w_type == _C.WEIGHT_FP8 and o.w_scale == scale.data_ptr() for o in gemvs)
    assert all(o.w_type == _C.WEIGHT_RUN_DTYPE and o.w_scale == 0 for o in out if o not in gemvs)


def test_fp8_ops_are_checked_and_refused_by_the_cpu_executor():
    ops, dims, scale = fp8_program()
    lin = next(i for i, o in enumerate(ops) if o.opcode == Opcode.LINEAR)
    norm = next(i for i, o in enumerate(ops) if o.opcode == Opcode.RMS_NORM)

    with pytest.raises(kog.InvalidRequest, match=f"op {lin} reads an FP8 or 4-bit weight without its scales"):
        _C.validate_program(with_op(ops, lin, w_scale=0), dims)
    with pytest.raises(kog.InvalidRequest, match=f"op {norm} has weight scales but its weight is not in a GPU format"):
        _C.validate_program(with_op(ops, norm, w_scale=scale.data_ptr()), dims)
    with pytest.raises(kog.InvalidRequest, match=f"op {norm} .*cannot read an FP8 weight"):
        _C.validate_program(with_op(ops, norm, w_type=_C.WEIGHT_FP8, w_scale=scale.data_ptr()), dims)
    kv = torch.zeros(dims.n_layers, 4, 2, dims.n_kv_heads, 4, dims.head_dim, dtype=torch.bfloat16)
    with pytest.raises(kog.InvalidRequest, match=r"reads a weight in a GPU format \(FP8 or 4-bit groups\), which only the GPU kernel runs"):
        _C.DecodeExecutor(dims, kv.data_ptr(), 4, 4, [1.0] * (dims.rotary_dim // 2), ops)


@pytest.mark.parametrize("fmt,bias", [("e4m3fn", 7), ("e4m3fnuz", 8)])
def test_the_kernels_f16_bit_decode_on_all_256_patterns(fmt, bias):
    """gpu/decode/fp8.cuh's decode, in torch: each byte's e/m bits moved into an f16 (s eeee mmm
    -> s 0eeee mmm0000000), converted, times fp8_row_scale's 2^(15 - bias), is the e4m3 value
    for every finite code (fp8x4_to_float does this for 4 bytes of a word at once)."""
    b = ALL_BITS.to(torch.int32)
    halves = (((b & 0x7F) << 7) | ((b & 0x80) << 8)).to(torch.int16).view(torch.float16)
    got = halves.float() * 2.0 ** (15 - bias)
    want = decode(ALL_BITS, fmt)
    finite = torch.isfinite(want)
    assert int(finite.sum()) == (254 if fmt == "e4m3fn" else 255)
    assert torch.equal(got[finite], want[finite])
    # and the word layout: bytes (0, 2) then (1, 3) of a little-endian word, as the kernel pairs them
    word = torch.tensor([0x01234567], dtype=torch.int64)
    even = ((word & 0x007F007F) << 7) | ((word & 0x00800080) << 8)
    assert int(even & 0xFFFF) >> 7 == 0x67 & 0x7F and int(even >> 16) >> 7 == 0x23 & 0x7F
