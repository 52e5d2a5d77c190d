"""The decode-batch linear kernel (every supported ISA) against an fp64 reference."""

import pytest
import torch

import kog
from kog import ops
from kog.testing import reference as ref
from kog.testing.tolerances import assert_close


def randn(gen, *shape, dtype):
    return torch.randn(*shape, generator=gen).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m", [1, 2, 3, 8])
@pytest.mark.parametrize("n, k", [(1, 1), (3, 7), (4, 8), (7, 17), (64, 576), (257, 1000), (130, 64)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_linear_matches_reference(cpu_isa, gen, dtype, m, n, k, with_bias):
    x = randn(gen, m, k, dtype=dtype)
    w = randn(gen, n, k, dtype=dtype)
    b = randn(gen, n, dtype=dtype) if with_bias else None
    assert_close(ops.linear(x, w, b), ref.linear(x, w, b), atol=1e-4 if dtype == torch.float32 else None)


def test_linear_large_parallel_and_strided_rows(cpu_isa, gen):
    base = randn(gen, 5, 3000, dtype=torch.bfloat16)
    x = base[:, :2048]  # rows 3000 apart
    w = randn(gen, 1536, 2048, dtype=torch.bfloat16)
    out = torch.empty(5, 1536, dtype=torch.bfloat16)
    ops.linear(x, w, out=out)
    assert_close(out, ref.linear(x, w))


@pytest.mark.parametrize("policy", ["none", "t0", "nta"])
def test_bf16_linear_gives_the_same_bits_under_every_weight_prefetch(cpu_isa, gen, policy):
    # the prefetch policy (kog._C.set_cpu_prefetch, KOG_CPU_PREFETCH) only moves lines early:
    # the sums, and their order, are the same
    from kog import _C

    x = randn(gen, 3, 1000, dtype=torch.bfloat16)
    w = randn(gen, 300, 1000, dtype=torch.bfloat16)
    default = _C.cpu_prefetch()
    try:
        _C.set_cpu_prefetch("none")
        want = ops.linear(x, w)
        _C.set_cpu_prefetch(policy)
        assert _C.cpu_prefetch() == policy
        assert torch.equal(ops.linear(x, w), want)
        assert_close(want, ref.linear(x, w))
    finally:
        _C.set_cpu_prefetch(default)


def test_linear_batched_leading_dims(gen):
    x = randn(gen, 2, 3, 40, dtype=torch.float32)
    w = randn(gen, 24, 40, dtype=torch.float32)
    assert ops.linear(x, w).shape == (2, 3, 24)
    assert_close(ops.linear(x, w), ref.linear(x, w), atol=1e-4)


@pytest.mark.parametrize(
    "args, match",
    [
        ((torch.randn(2, 8), torch.randn(4, 7)), "last dimension 7"),
        ((torch.randn(2, 8), torch.randn(8, 4).t()), "contiguous"),
        ((torch.randn(2, 8), torch.randn(4, 8), torch.randn(3)), "bias"),
        ((torch.randn(2, 8), torch.randn(4, 8, dtype=torch.bfloat16)), "dtype"),
    ],
)
def test_linear_bad_input(args, match):
    with pytest.raises(kog.InvalidRequest, match=match):
        ops.linear(*args)
