"""CPU kernels (every ISA this machine supports) against kog.testing.reference."""


import pytest
import torch

import kog
from kog import ops
from kog.testing import reference as ref
from kog.testing.tolerances import assert_close

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def randn(gen, *shape, dtype=torch.float32, scale=1.0):
    return (torch.randn(*shape, generator=gen) * scale).to(dtype)


# ---- RMSNorm -------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 1), (1, 576), (3, 7), (5, 129), (2, 3, 4096), (70, 1000)])
@pytest.mark.parametrize("fused", [False, True])
def test_rmsnorm_matches_reference(cpu_isa, gen, dtype, shape, fused):
    x = randn(gen, *shape, dtype=dtype, scale=3.0)
    w = randn(gen, shape[-1], dtype=dtype)
    res = randn(gen, *shape, dtype=dtype) if fused else None
    expected, expected_res = ref.rmsnorm(x, w, 1e-5, res)
    res_in = res.clone() if fused else None
    out = ops.rmsnorm(x, w, 1e-5, residual=res_in)
    assert_close(out, expected)
    if fused:
        assert_close(res_in, expected_res, rtol=0, atol=0)  # the add rounds once on both sides


def test_rmsnorm_in_place_and_strided_rows(cpu_isa, gen):
    base = randn(gen, 6, 300)
    x = base[:, :256]  # rows 300 apart
    w = randn(gen, 256)
    expected, _ = ref.rmsnorm(x.clone(), w, 1e-6)
    out = ops.rmsnorm(x, w, 1e-6, out=x)
    assert out.data_ptr() == x.data_ptr()
    assert_close(x, expected)
    assert_close(base[:, 256:], base[:, 256:].clone())  # untouched around the rows


def test_rmsnorm_empty_batch(gen):
    x = torch.empty(0, 16)
    assert ops.rmsnorm(x, torch.ones(16)).shape == (0, 16)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(x=torch.randn(2, 8), weight=torch.randn(7)), "weight must be contiguous with shape"),
        (dict(x=torch.randn(2, 8), weight=torch.randn(8, dtype=torch.bfloat16)), "dtype"),
        (dict(x=torch.randn(2, 8, dtype=torch.float64), weight=torch.randn(8)), "float32, float16 or bfloat16"),
        (dict(x=torch.randn(2, 8), weight=torch.randn(8), residual=torch.randn(3, 8)), "residual shape"),
        (dict(x=torch.randn(8, 2).t(), weight=torch.randn(8)), "contiguous in its last dimension"),
        (dict(x=torch.randn(2, 8), weight=torch.randn(8), eps=float("nan")), "eps"),
    ],
)
def test_rmsnorm_bad_input(kwargs, match):
    with pytest.raises(kog.InvalidRequest, match=match):
        ops.rmsnorm(**kwargs)


# ---- SiLU-and-mul --------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 2), (1, 3072), (4, 18), (3, 5, 1538), (33, 8192)])
def test_silu_and_mul_matches_reference(cpu_isa, gen, dtype, shape):
    x = randn(gen, *shape, dtype=dtype, scale=4.0)
    assert_close(ops.silu_and_mul(x), ref.silu_and_mul(x))


def test_silu_and_mul_extremes():
    x = torch.tensor([[-100.0, 0.0, 100.0, 2.0, 2.0, 2.0]])
    out = ops.silu_and_mul(x)
    assert torch.isfinite(out).all()
    assert_close(out, ref.silu_and_mul(x))


def test_silu_and_mul_bad_input():
    with pytest.raises(kog.InvalidRequest, match="even"):
        ops.silu_and_mul(torch.randn(2, 7))
    with pytest.raises(kog.InvalidRequest, match="out must have shape"):
        ops.silu_and_mul(torch.randn(2, 8), out=torch.empty(2, 8))


# ---- RoPE ----------------------------------------------------------------------------------
LLAMA3_SCALING = dict(rope_type="llama3", factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                      original_max_position_embeddings=8192)


@pytest.mark.parametrize("scaling", [None, dict(type="linear", factor=4.0), LLAMA3_SCALING])
@pytest.mark.parametrize("dim, base", [(64, 10000.0), (128, 500000.0), (32, 100000.0)])
def test_rope_inv_freq_matches_reference(scaling, dim, base):
    got = ops.rope_inv_freq(dim, base, scaling)
    torch.testing.assert_close(got, ref.rope_inv_freq(dim, base, scaling), rtol=1e-6, atol=0)


def test_rope_llama3_scaling_changes_only_low_frequencies():
    plain = ops.rope_inv_freq(128, 500000.0)
    scaled = ops.rope_inv_freq(128, 500000.0, LLAMA3_SCALING)
    assert torch.equal(plain[:10], scaled[:10])  # high frequencies kept
    torch.testing.assert_close(scaled[-5:], plain[-5:] / 32.0)  # low frequencies slowed by factor


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize(
    "n_tokens, hq, hk, head_dim, rotary_dim",
    [(1, 1, 1, 2, 2), (1, 9, 3, 64, 64), (7, 4, 2, 128, 128), (5, 3, 1, 80, 40), (40, 8, 8, 64, 64)],
)
def test_rope_matches_reference(cpu_isa, gen, dtype, is_neox, n_tokens, hq, hk, head_dim, rotary_dim):
    q = randn(gen, n_tokens, hq, head_dim, dtype=dtype)
    k = randn(gen, n_tokens, hk, head_dim, dtype=dtype)
    positions = torch.randint(0, 32768, (n_tokens,), generator=gen)
    inv_freq = ops.rope_inv_freq(rotary_dim, 500000.0, LLAMA3_SCALING)
    eq, ek = ref.rope(q, k, positions, inv_freq, is_neox)
    ops.rope(q, k, positions, inv_freq, is_neox)
    # |angle| reaches 3e4 rad: fp32 cos/sin of it differ by ~1e-3 between libm and torch.
    atol = 5e-3 if dtype == torch.float32 else None
    assert_close(q, eq, **({"atol": atol, "rtol": 1e-4} if atol else {}))
    assert_close(k, ek, **({"atol": atol, "rtol": 1e-4} if atol else {}))


def test_rope_small_positions_are_tight(gen):
    q = randn(gen, 16, 4, 64)
    positions = torch.arange(16, dtype=torch.int32)
    inv_freq = ops.rope_inv_freq(64)
    eq, _ = ref.rope(q, None, positions, inv_freq)
    ops.rope(q, None, positions, inv_freq)
    assert_close(q, eq)


def test_rope_preserves_norm_and_position_zero_is_identity(gen):
    q = randn(gen, 2, 2, 64)
    before = q.clone()
    ops.rope(q, None, torch.tensor([0, 1234]), ops.rope_inv_freq(64))
    torch.testing.assert_close(q[0], before[0])
    torch.testing.assert_close(q[1].norm(dim=-1), before[1].norm(dim=-1), rtol=1e-5, atol=1e-5)


def test_rope_strided_tokens(gen):
    qkv = randn(gen, 6, 3 * 4 * 32)  # fused qkv projection output: q and k are views
    q = qkv[:, : 4 * 32].view(6, 4, 32)
    k = qkv[:, 4 * 32 : 8 * 32].view(6, 4, 32)
    v_before = qkv[:, 8 * 32 :].clone()
    pos = torch.arange(6) * 100
    inv = ops.rope_inv_freq(32)
    eq, ek = ref.rope(q.clone(), k.clone(), pos, inv)
    ops.rope(q, k, pos, inv)
    assert_close(q, eq)
    assert_close(k, ek)
    assert torch.equal(qkv[:, 8 * 32 :], v_before)


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: ops.rope(torch.randn(2, 8), None, torch.arange(2), ops.rope_inv_freq(8)), r"\[n_tokens, n_heads, head_dim\]"),
        (lambda: ops.rope(torch.randn(2, 1, 8), None, torch.arange(3), ops.rope_inv_freq(8)), "positions"),
        (lambda: ops.rope(torch.randn(2, 1, 8), None, torch.arange(2.0), ops.rope_inv_freq(8)), "positions"),
        (lambda: ops.rope(torch.randn(2, 1, 8), None, torch.arange(2), ops.rope_inv_freq(16)), "rotary_dim"),
        (lambda: ops.rope(torch.randn(2, 1, 8), torch.randn(2, 1, 4), torch.arange(2), ops.rope_inv_freq(8)), "k must be"),
        (lambda: ops.rope_inv_freq(7), "even"),
        (lambda: ops.rope_inv_freq(8, scaling=dict(rope_type="yarn", factor=2.0)), "unsupported rope_scaling"),
        (lambda: ops.rope_inv_freq(8, scaling=dict(rope_type="llama3", factor=2.0)), "original_max_position_embeddings"),
    ],
)
def test_rope_bad_input(call, match):
    with pytest.raises(kog.InvalidRequest, match=match):
        call()


def test_gpu_tensor_on_cpu_build_is_a_clear_error():
    if kog._C.has_gpu_backend:
        pytest.skip("GPU build")
    # A meta tensor stands in for a device tensor this build cannot run.
    with pytest.raises(kog.InvalidRequest, match="unsupported device"):
        ops.silu_and_mul(torch.empty(2, 8, device="meta"))
