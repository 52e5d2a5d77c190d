"""GPU kernels against kog.testing.reference on fresh random device tensors.

Shapes cover both code paths of each launcher: 16-byte vector accesses (aligned rows, width a
multiple of the vector) and the scalar fallback (odd widths, unaligned starts, odd strides).
"""

import pytest
import torch

from kog import _C, ops
from kog.testing import reference as ref
from kog.testing.gpu import gpu_test_marks
from kog.testing.tolerances import assert_close



pytestmark = gpu_test_marks()

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
LLAMA3_SCALING = dict(rope_type="llama3", factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                      original_max_position_embeddings=8192)


def randn(gen, *shape, device, dtype=torch.float32, scale=1.0):
    """Random normal values drawn on the CPU (reproducible), then moved to the device."""
    return (torch.randn(*shape, generator=gen) * scale).to(device=device, dtype=dtype)


def test_devices_are_reported():
    devices = _C.gpu_devices()
    assert len(devices) == torch.cuda.device_count()
    d = devices[torch.cuda.current_device()]
    assert d["warp_size"] in (32, 64)
    assert d["total_memory"] > 0 and d["multiprocessors"] > 0
    props = torch.cuda.get_device_properties(d["index"])
    if torch.version.hip is None:
        assert d["arch"] == f"sm_{props.major}{props.minor}"
    else:
        assert props.gcnArchName.startswith(d["arch"])
    assert _C.build_info()["gpu_runtime"].split()[0] in ("CUDA", "HIP")


# ---- RMSNorm -------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "shape", [(1, 1), (1, 576), (3, 7), (5, 129), (2, 3, 4096), (70, 1000), (4, 8192), (3, 5120 + 8)]
)
@pytest.mark.parametrize("fused", [False, True])
def test_rmsnorm_matches_reference(gen, device, dtype, shape, fused):
    x = randn(gen, *shape, device=device, dtype=dtype, scale=3.0)
    w = randn(gen, shape[-1], device=device, dtype=dtype)
    res = randn(gen, *shape, device=device, dtype=dtype) if fused else None
    expected, expected_res = ref.rmsnorm(x, w, 1e-5, res)
    res_in = res.clone() if fused else None
    out = ops.rmsnorm(x, w, 1e-5, residual=res_in)
    assert_close(out, expected)
    if fused:
        assert_close(res_in, expected_res, rtol=0, atol=0)  # the add rounds once on both sides


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("offset, row_len", [(0, 320), (1, 320), (0, 301)])  # vector, unaligned, odd stride
@pytest.mark.parametrize("fused", [False, True])
def test_rmsnorm_in_place_strided_rows(gen, device, dtype, offset, row_len, fused):
    base = randn(gen, 6, row_len, device=device, dtype=dtype)
    x = base[:, offset : offset + 256]
    w = randn(gen, 256, device=device, dtype=dtype)
    res_base = randn(gen, 6, row_len, device=device, dtype=dtype) if fused else None
    res = res_base[:, offset : offset + 256] if fused else None
    expected, expected_res = ref.rmsnorm(x.clone(), w, 1e-6, res.clone() if fused else None)
    around = base.clone()
    out = ops.rmsnorm(x, w, 1e-6, residual=res, out=x)
    assert out.data_ptr() == x.data_ptr()
    assert_close(x, expected)
    if fused:
        assert_close(res, expected_res, rtol=0, atol=0)
    keep = torch.ones(row_len, dtype=torch.bool, device=device)
    keep[offset : offset + 256] = False
    assert torch.equal(base[:, keep], around[:, keep])  # nothing written outside the rows


# ---- SiLU-and-mul --------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 2), (1, 3072), (4, 18), (3, 5, 1538), (33, 8192), (2, 2 * 14336)])
def test_silu_and_mul_matches_reference(gen, device, dtype, shape):
    x = randn(gen, *shape, device=device, dtype=dtype, scale=4.0)
    assert_close(ops.silu_and_mul(x), ref.silu_and_mul(x))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("offset, row_len", [(0, 96), (2, 96), (0, 99)])
def test_silu_and_mul_strided_rows(gen, device, dtype, offset, row_len):
    base = randn(gen, 7, row_len, device=device, dtype=dtype, scale=4.0)
    x = base[:, offset : offset + 64]  # [7, 2 * 32] at stride row_len
    out_base = torch.full((7, 40), 7.0, device=device, dtype=dtype)
    out = out_base[:, :32]
    ops.silu_and_mul(x, out=out)
    assert_close(out, ref.silu_and_mul(x))
    assert (out_base[:, 32:] == 7.0).all()


def test_silu_and_mul_extremes(device):
    x = torch.tensor([[-100.0, 0.0, 100.0, -20.0, 2.0, 2.0, 2.0, 2.0]], device=device)
    out = ops.silu_and_mul(x)
    assert torch.isfinite(out).all()
    assert_close(out, ref.silu_and_mul(x))


# ---- RoPE ----------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize(
    "n_tokens, hq, hk, head_dim, rotary_dim",
    [(1, 1, 1, 2, 2), (1, 9, 3, 64, 64), (7, 4, 2, 128, 128), (5, 3, 1, 80, 40), (40, 8, 8, 64, 64),
     (3, 64, 8, 128, 128), (2, 2, 1, 512, 512), (4, 3, 1, 33, 16)],
)
def test_rope_matches_reference(gen, device, dtype, is_neox, n_tokens, hq, hk, head_dim, rotary_dim):
    q = randn(gen, n_tokens, hq, head_dim, device=device, dtype=dtype)
    k = randn(gen, n_tokens, hk, head_dim, device=device, dtype=dtype)
    positions = torch.randint(0, 32768, (n_tokens,), generator=gen).to(device)
    inv_freq = ops.rope_inv_freq(rotary_dim, 500000.0, LLAMA3_SCALING).to(device)
    eq, ek = ref.rope(q, k, positions, inv_freq, is_neox)
    ops.rope(q, k, positions, inv_freq, is_neox)
    # |angle| reaches 3e4 rad: fp32 cos/sin of it may differ by ~1e-3 between implementations.
    tol = {"atol": 5e-3, "rtol": 1e-4} if dtype == torch.float32 else {}
    assert_close(q, eq, **tol)
    assert_close(k, ek, **tol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("pos_dtype", [torch.int32, torch.int64])
def test_rope_small_positions_q_only(gen, device, dtype, pos_dtype):
    q = randn(gen, 16, 4, 64, device=device, dtype=dtype)
    positions = torch.arange(16, dtype=pos_dtype, device=device)
    inv_freq = ops.rope_inv_freq(64).to(device)
    eq, _ = ref.rope(q, None, positions, inv_freq)
    ops.rope(q, None, positions, inv_freq)
    assert_close(q, eq)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("is_neox", [True, False])
def test_rope_strided_tokens_of_fused_qkv(gen, device, dtype, is_neox):
    qkv = randn(gen, 6, 3 * 4 * 32 + 3, device=device, dtype=dtype)  # odd token stride
    q = qkv[:, : 4 * 32].view(6, 4, 32)
    k = qkv[:, 4 * 32 : 8 * 32].view(6, 4, 32)
    v_before = qkv[:, 8 * 32 :].clone()
    pos = torch.arange(6, device=device) * 100
    inv = ops.rope_inv_freq(32, scaling=dict(type="linear", factor=2.0)).to(device)
    eq, ek = ref.rope(q.clone(), k.clone(), pos, inv, is_neox, attention_scaling=1.1)
    ops.rope(q, k, pos, inv, is_neox, attention_scaling=1.1)
    assert_close(q, eq)
    assert_close(k, ek)
    assert torch.equal(qkv[:, 8 * 32 :], v_before)


# ---- streams and CPU agreement --------------------------------------------------------------
def test_ops_run_on_the_current_stream(gen, device):
    x = randn(gen, 64, 4096, device=device, dtype=torch.bfloat16)
    w = randn(gen, 4096, device=device, dtype=torch.bfloat16)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        out = ops.rmsnorm(x, w)
        act = ops.silu_and_mul(x)
    side.synchronize()
    assert_close(out, ref.rmsnorm(x, w, 1e-6)[0])
    assert_close(act, ref.silu_and_mul(x))


@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_matches_cpu_kernels(gen, device, dtype):
    x = randn(gen, 9, 2 * 1000, dtype=dtype, device="cpu", scale=3.0)
    w = randn(gen, 2 * 1000, dtype=dtype, device="cpu")
    assert_close(ops.rmsnorm(x.to(device), w.to(device)).cpu(), ops.rmsnorm(x, w))
    assert_close(ops.silu_and_mul(x.to(device)).cpu(), ops.silu_and_mul(x))
