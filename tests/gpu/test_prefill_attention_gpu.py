"""The flash-style prefill attention kernel (csrc/gpu/ops/prefill_attention.cuh) against
kog.testing.reference on fresh random inputs, and the dispatch between it and the split kernel.

Grids: padded head dims 64/128 and the generic 256 path (80, 256), GQA ratios 1-8, block sizes
that are and are not multiples of the key tile, chunked prefill over a cached context, several
sequences of different lengths, chunks whose rows do not fill the last query tile.
"""

import pytest
import torch

from kog import _C, ops
from kog.testing import reference as ref
from kog.testing.gpu import gpu_test_marks
from kog.testing.paged import random_prefill_case
from kog.testing.tolerances import assert_close

pytestmark = gpu_test_marks()

# fp32: both sides fp32 but summed in other orders and through expf; 16-bit: one rounding of the
# output on each side, plus the fp32 differences.
TOL = {torch.float32: dict(rtol=1e-4, atol=1e-4), torch.bfloat16: dict(rtol=2e-2, atol=2e-2),
       torch.float16: dict(rtol=2e-3, atol=2e-3)}
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
CASES = [  # (q_lens, seq_lens)
    ([16], [16]),                  # one tile at the threshold
    ([100], [100]),                # whole prompt, ragged last tile
    ([37, 5, 64], [300, 5, 64]),   # chunk over 263 cached tokens, a short and an exact chunk
    ([17, 0, 1], [17, 9, 40]),     # an empty chunk and a decode-like one in a flash launch
]


def make_case(gen, q_lens, seq_lens, n_q, n_kv, hd, bs, dtype):
    """A launch whose table padding is block 0 (a valid block: a stray read stays in bounds)."""
    return random_prefill_case(gen, q_lens, seq_lens, n_q, n_kv, hd, bs, dtype, pad=0)


def run(device, q, cache, table, seq_lens, qsl, **kw):
    return ops.paged_attention_prefill(q.to(device), cache.to(device), table.to(device), seq_lens.to(device),
                                       qsl.to(device), **kw).cpu()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hd", [64, 128])
@pytest.mark.parametrize("n_q,n_kv", [(4, 4), (8, 2), (6, 2), (8, 1)])
@pytest.mark.parametrize("bs", [16, 32, 5])
@pytest.mark.parametrize("lens", CASES)
def test_flash_prefill_matches_reference(gen, device, dtype, hd, n_q, n_kv, bs, lens):
    case = make_case(gen, *lens, n_q, n_kv, hd, bs, dtype)
    got = run(device, *case, kernel="flash")
    assert_close(got, ref.paged_attention(*case), **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hd", [80, 256])  # the generic path: padded to 256 (80 -> 128)
def test_flash_prefill_other_head_dims(gen, device, dtype, hd):
    case = make_case(gen, [40, 23], [90, 23], 8, 2, hd, 16, dtype)
    assert_close(run(device, *case, kernel="flash"), ref.paged_attention(*case), **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_long_prompt(gen, device, dtype):
    """Many query tiles and key tiles; scores of scale 1 move the running max often."""
    case = make_case(gen, [1500, 700], [1500, 2000], 8, 2, 128, 16, dtype)
    got = run(device, *case, kernel="flash", scale=1.0)
    assert_close(got, ref.paged_attention(*case, scale=1.0), **TOL[dtype])


def test_auto_split_and_flash_agree_around_the_threshold(gen, device):
    """Which kernel auto takes is tested on the CPU (partials_floats is 0 for flash)."""
    t = _C.GPU_FLASH_PREFILL_MIN_QUERY_LEN
    for q_len in (t - 1, t):
        case = make_case(gen, [q_len, 3], [q_len + 50, 3], 8, 2, 64, 16, torch.float32)
        expected = ref.paged_attention(*case)
        for kernel in ("auto", "split", "flash"):
            assert_close(run(device, *case, kernel=kernel), expected, **TOL[torch.float32])


def test_out_aliases_q_and_strided_q(gen, device):
    """q as a view into a fused qkv buffer (token stride > heads * hd), out written over q."""
    q, cache, table, seq_lens, qsl = make_case(gen, [33, 20], [60, 20], 4, 2, 64, 16, torch.bfloat16)
    expected = ref.paged_attention(q, cache, table, seq_lens, qsl)
    qkv = torch.randn(q.shape[0], 8, 64, generator=gen).to(torch.bfloat16)
    qkv[:, :4] = q
    qkv = qkv.to(device)
    qd = qkv[:, :4]
    out = ops.paged_attention_prefill(qd, cache.to(device), table.to(device), seq_lens.to(device), qsl.to(device),
                                      out=qd, kernel="flash")
    assert out.data_ptr() == qd.data_ptr()
    assert_close(qkv[:, :4].cpu(), expected, **TOL[torch.bfloat16])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window", [1, 7, 16, 100, 600])
@pytest.mark.parametrize("kernel", ["split", "flash"])
def test_sliding_window_matches_reference(gen, device, dtype, window, kernel):
    # Windows shorter than a block, unaligned, across the split kernel's partitions and key tiles,
    # and longer than some sequences (plain causal there); decode rows through the split kernel.
    q, cache, table, seq_lens, qsl = make_case(gen, [37, 5, 64, 1], [300, 5, 700, 40], 8, 2, 64, 16, dtype)
    got = run(device, q, cache, table, seq_lens, qsl, kernel=kernel, window=window)
    assert_close(got, ref.paged_attention(q, cache, table, seq_lens, qsl, window=window), **TOL[dtype])
    if window < 100:  # the window really changes the result
        assert not torch.allclose(got.float(), ref.paged_attention(q, cache, table, seq_lens, qsl).float(),
                                  **TOL[dtype])
    dq = q[qsl[1:] - 1]  # each sequence's last row as a decode query
    got = ops.paged_attention_decode(dq.to(device), cache.to(device), table.to(device), seq_lens.to(device),
                                     window=window).cpu()
    assert_close(got, ref.paged_attention(dq, cache, table, seq_lens, window=window), **TOL[dtype])
