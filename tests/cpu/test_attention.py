"""CPU paged attention and kv_append (every ISA this machine supports) against kog.testing.reference."""

import pytest
import torch

import kog
from kog import ops
from kog.testing import reference as ref
from kog.testing.paged import random_paged_cache
from kog.testing.tolerances import assert_close

# fp32: different summation orders and a polynomial exp, both ~1e-7 relative per term.
TOL = {
    torch.float32: dict(rtol=1e-5, atol=1e-4),
    torch.bfloat16: dict(rtol=1.6e-2, atol=1.6e-2),
    torch.float16: dict(rtol=2e-3, atol=2e-3),
}
# (n_q_heads, n_kv_heads, head_dim, block_size): GQA ratios 1, 2, 3, 4 and 8 (decode reads K/V
# straight from the cache for up to 4 query heads per KV head, in register blocks of 1-4 rows);
# block size 5 leaves odd key chunks, head_dim 80 a column tail.
CONFIGS = [(4, 4, 64, 16), (6, 2, 128, 16), (16, 2, 64, 32), (8, 1, 128, 32), (3, 1, 64, 16),
           (8, 4, 64, 16), (8, 2, 80, 5)]


def make_cache(gen, seq_lens, n_kv_heads, head_dim, block_size, dtype, spare_blocks=7):
    """Random cache with shuffled, non-contiguous block tables padded with -1 past each sequence."""
    return random_paged_cache(gen, seq_lens, n_kv_heads, head_dim, block_size, dtype, spare_blocks, spare_columns=2)


def randn(gen, *shape, dtype):
    return torch.randn(*shape, generator=gen).to(dtype)


# ---- decode --------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hq, hk, d, bs", CONFIGS)
def test_decode_matches_reference(cpu_isa, gen, dtype, hq, hk, d, bs):
    # 1 token, exactly one block, one past it, a partition boundary, and long (split, merged).
    seq_lens = [1, bs, bs + 1, 37, 1024, 2500]
    cache, table, lens = make_cache(gen, seq_lens, hk, d, bs, dtype)
    q = randn(gen, len(seq_lens), hq, d, dtype=dtype)
    out = ops.paged_attention_decode(q, cache, table, lens)
    torch.testing.assert_close(out, ref.paged_attention(q, cache, table, lens), **TOL[dtype])


def test_decode_batch_one_long_context_float16(cpu_isa, gen):
    cache, table, lens = make_cache(gen, [4100], 2, 128, 16, torch.float16)
    q = randn(gen, 1, 8, 128, dtype=torch.float16)
    out = ops.paged_attention_decode(q, cache, table, lens, scale=0.3)
    torch.testing.assert_close(out, ref.paged_attention(q, cache, table, lens, scale=0.3), **TOL[torch.float16])


@pytest.mark.parametrize("seq_len, bs", [(600, 16), (300, 16), (1000, 5), (512, 32)])
def test_decode_few_work_items_split_into_finer_partitions(cpu_isa, gen, seq_len, bs):
    # One sequence over one KV head with 8 x 128 query columns: enough work for every thread,
    # but fewer items than 2 per thread at 512-token partitions, so the kernel halves them
    # (whole blocks, also an odd block size); the merge must give the same result.
    cache, table, lens = make_cache(gen, [seq_len], 1, 128, bs, torch.float32)
    q = randn(gen, 1, 8, 128, dtype=torch.float32) * 2
    out = ops.paged_attention_decode(q, cache, table, lens)
    torch.testing.assert_close(out, ref.paged_attention(q, cache, table, lens), **TOL[torch.float32])


def test_decode_sharp_softmax_and_strided_q(cpu_isa, gen):
    # Large scores (a near one-hot softmax) stress the running max and the partition merge.
    cache, table, lens = make_cache(gen, [3000, 600], 2, 64, 16, torch.float32)
    qkv = randn(gen, 2, 3 * 4 * 64, dtype=torch.float32) * 4
    q = qkv[:, : 4 * 64].view(2, 4, 64)  # token stride 768
    out = torch.full((2, 4, 64), float("nan"))
    ops.paged_attention_decode(q, cache, table, lens, scale=1.0, out=out)
    torch.testing.assert_close(out, ref.paged_attention(q, cache, table, lens, scale=1.0), **TOL[torch.float32])


def test_reference_matches_sdpa(gen):
    # The reference itself, on a contiguous cache, against torch's own attention.
    cache, table, lens = make_cache(gen, [40], 2, 64, 16, torch.float32, spare_blocks=0)
    table[0, :3] = torch.arange(3, dtype=torch.int32)
    q = randn(gen, 40, 6, 64, dtype=torch.float32)
    k = cache[:3, 0].permute(1, 0, 2, 3).reshape(2, 48, 64)[:, :40]
    v = cache[:3, 1].permute(1, 0, 2, 3).reshape(2, 48, 64)[:, :40]
    want = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1), k.repeat_interleave(3, 0), v.repeat_interleave(3, 0), is_causal=True
    ).transpose(0, 1)
    got = ref.paged_attention(q, cache, table, lens, torch.tensor([0, 40], dtype=torch.int32))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


# ---- prefill -------------------------------------------------------------------------------
# (q_len, seq_len): single token, a whole first block, a chunk after a cached prefix, a prompt
# longer than a query tile, an empty chunk, and short verifications over long contexts (the
# split-context path; in the last one the first rows see nothing of the last partition).
def prefill_batch(bs):
    return [(1, 1), (bs, bs), (37, 100), (130, 130), (0, 20), (5, 2100), (8, 1030)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hq, hk, d, bs", CONFIGS)
def test_prefill_matches_reference(cpu_isa, gen, dtype, hq, hk, d, bs):
    batch = prefill_batch(bs)
    cache, table, lens = make_cache(gen, [n for _, n in batch], hk, d, bs, dtype)
    qsl = torch.tensor([0] + [q for q, _ in batch], dtype=torch.int32).cumsum(0, dtype=torch.int32)
    q = randn(gen, int(qsl[-1]), hq, d, dtype=dtype)
    out = ops.paged_attention_prefill(q, cache, table, lens, qsl)
    torch.testing.assert_close(out, ref.paged_attention(q, cache, table, lens, qsl), **TOL[dtype])


@pytest.mark.parametrize("window", [1, 7, 16, 100, 600])
@pytest.mark.parametrize("hq, hk, d, bs", [(8, 2, 64, 16), (3, 1, 64, 5)])
def test_sliding_window_decode_and_prefill_match_the_reference(cpu_isa, gen, window, hq, hk, d, bs):
    # Windows shorter than a block, unaligned, across partitions (600 > a 512-token partition)
    # and longer than some sequences (then: plain causal); decode and prefill (tiles and the
    # split path for short chunks over long contexts).
    dtype = torch.float32
    seq_lens = [1, bs + 1, 37, 1024, 2500]
    cache, table, lens = make_cache(gen, seq_lens, hk, d, bs, dtype)
    q = randn(gen, len(seq_lens), hq, d, dtype=dtype)
    out = ops.paged_attention_decode(q, cache, table, lens, window=window)
    torch.testing.assert_close(out, ref.paged_attention(q, cache, table, lens, window=window), **TOL[dtype])
    batch = prefill_batch(bs)
    cache, table, lens = make_cache(gen, [n for _, n in batch], hk, d, bs, dtype)
    qsl = torch.tensor([0] + [n for n, _ in batch], dtype=torch.int32).cumsum(0, dtype=torch.int32)
    q = randn(gen, int(qsl[-1]), hq, d, dtype=dtype)
    out = ops.paged_attention_prefill(q, cache, table, lens, qsl, window=window)
    torch.testing.assert_close(out, ref.paged_attention(q, cache, table, lens, qsl, window=window), **TOL[dtype])
    if window < 100:  # the window really changes the result
        assert not torch.allclose(out, ref.paged_attention(q, cache, table, lens, qsl), **TOL[dtype])


def test_sliding_window_must_be_a_non_negative_int(gen):
    cache, table, lens = make_cache(gen, [20], 2, 64, 16, torch.float32)
    q = randn(gen, 1, 4, 64, dtype=torch.float32)
    for bad in (-1, 2.5, True):
        with pytest.raises(kog.InvalidRequest, match="window"):
            ops.paged_attention_decode(q, cache, table, lens, window=bad)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_equals_prefill_with_one_query(cpu_isa, gen, dtype):
    cache, table, lens = make_cache(gen, [1, 16, 33, 700, 2049], 2, 64, 16, dtype)
    q = randn(gen, 5, 8, 64, dtype=dtype)
    dec = ops.paged_attention_decode(q, cache, table, lens)
    pre = ops.paged_attention_prefill(q, cache, table, lens, torch.arange(6, dtype=torch.int32))
    # Same math; decode merges context partitions, so fp32 rounding differs slightly.
    assert_close(dec.float(), pre.float(), rtol=1e-5, atol=1e-5 if dtype == torch.float32 else 8e-3)


def test_chunked_prefill_equals_full_prefill(cpu_isa, gen):
    L = 300
    cache, table, lens = make_cache(gen, [L], 4, 128, 16, torch.float32)
    q = randn(gen, L, 8, 128, dtype=torch.float32)
    full = ops.paged_attention_prefill(q, cache, table, lens, torch.tensor([0, L], dtype=torch.int32))
    for a, b in [(0, 100), (100, 117), (117, 300), (299, 300)]:
        chunk = ops.paged_attention_prefill(
            q[a:b], cache, table, torch.tensor([b], dtype=torch.int32), torch.tensor([0, b - a], dtype=torch.int32)
        )
        assert_close(chunk, full[a:b], rtol=1e-6, atol=1e-6)


def test_batched_chunks_equal_separate_calls(gen):
    # One call over several sequences gives each the rows it would get alone.
    cache, table, lens = make_cache(gen, [50, 90, 17], 2, 64, 16, torch.float32)
    q_lens = [10, 90, 3]
    qsl = torch.tensor([0, 10, 100, 103], dtype=torch.int32)
    q = randn(gen, 103, 4, 64, dtype=torch.float32)
    both = ops.paged_attention_prefill(q, cache, table, lens, qsl)
    for s in range(3):
        a, b = int(qsl[s]), int(qsl[s + 1])
        alone = ops.paged_attention_prefill(q[a:b], cache, table[s : s + 1], lens[s : s + 1],
                                            torch.tensor([0, q_lens[s]], dtype=torch.int32))
        assert_close(both[a:b], alone, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("d", [16, 80, 256])
def test_unusual_head_dims(cpu_isa, gen, d):
    # Row widths that leave a tail after the two-vector column blocks of the PV micro-kernel.
    cache, table, lens = make_cache(gen, [700, 45], 1, d, 16, torch.float32)
    q = randn(gen, 2, 2, d, dtype=torch.float32)
    out = ops.paged_attention_decode(q, cache, table, lens)
    torch.testing.assert_close(out, ref.paged_attention(q, cache, table, lens), **TOL[torch.float32])
    qsl = torch.tensor([0, 20, 65], dtype=torch.int32)
    q = randn(gen, 65, 2, d, dtype=torch.float32)
    out = ops.paged_attention_prefill(q, cache, table, lens, qsl)
    torch.testing.assert_close(out, ref.paged_attention(q, cache, table, lens, qsl), **TOL[torch.float32])


def test_out_may_alias_q(cpu_isa, gen):
    # Each work item reads its own q rows before writing them; split decode writes out only
    # when merging, after every partition has read q.
    cache, table, lens = make_cache(gen, [1500, 3], 2, 64, 16, torch.float32)
    q = randn(gen, 2, 8, 64, dtype=torch.float32)
    want = ref.paged_attention(q, cache, table, lens)
    assert ops.paged_attention_decode(q, cache, table, lens, out=q) is q
    torch.testing.assert_close(q, want, **TOL[torch.float32])
    qsl = torch.tensor([0, 100, 103], dtype=torch.int32)
    q = randn(gen, 103, 8, 64, dtype=torch.float32)
    want = ref.paged_attention(q, cache, table, lens, qsl)
    ops.paged_attention_prefill(q, cache, table, lens, qsl, out=q)
    torch.testing.assert_close(q, want, **TOL[torch.float32])


# ---- kv_append -----------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_kv_append_matches_reference(cpu_isa, gen, dtype):
    cache = randn(gen, 9, 2, 3, 16, 64, dtype=dtype)
    kv = randn(gen, 12, 2 * 3 * 64, dtype=dtype)  # fused projection output: k and v are strided views
    k, v = kv[:, : 3 * 64].view(12, 3, 64), kv[:, 3 * 64 :].view(12, 3, 64)
    slots = torch.randperm(9 * 16, generator=gen)[:12]
    slots[[2, 7]] = -1  # padding tokens
    want = ref.kv_append(k, v, cache, slots)
    ops.kv_append(k, v, cache, slots)
    assert torch.equal(cache, want)


def test_append_then_attend_matches_dense_attention(cpu_isa, gen):
    # End to end: prompt of 45 tokens appended in two chunks, then one decode step, against
    # plain attention over the dense k, v (no block-table reference involved).
    hk, hq, d, bs, L = 2, 6, 64, 16, 46
    cache = torch.zeros(8, 2, hk, bs, d)
    table = torch.tensor([[5, 0, 7, 2]], dtype=torch.int32)
    k, v, q = (randn(gen, L, h, d, dtype=torch.float32) for h in (hk, hk, hq))
    pos = torch.arange(L)
    slots = table[0, pos // bs].long() * bs + pos % bs
    for a, b in [(0, 30), (30, 45), (45, 46)]:
        ops.kv_append(k[a:b], v[a:b], cache, slots[a:b])
    out = ops.paged_attention_decode(q[45:], cache, table, torch.tensor([L], dtype=torch.int32))
    want = torch.softmax(torch.einsum("hd,khd->hk", q[45], k.repeat_interleave(3, 1)) / 8.0, -1)
    want = torch.einsum("hk,khd->hd", want, v.repeat_interleave(3, 1))
    torch.testing.assert_close(out[0], want, **TOL[torch.float32])


# ---- bad input -----------------------------------------------------------------------------
def _args(**over):
    cache = torch.randn(4, 2, 2, 16, 64)
    a = dict(q=torch.randn(2, 4, 64), kv_cache=cache,
             block_tables=torch.tensor([[0, 1], [2, -1]], dtype=torch.int32),
             seq_lens=torch.tensor([20, 5], dtype=torch.int32))
    a.update(over)
    return a


@pytest.mark.parametrize(
    "over, match",
    [
        (dict(q=torch.randn(2, 3, 64)), "not a multiple"),
        (dict(q=torch.randn(2, 4, 32)), "head_dim"),
        (dict(q=torch.randn(3, 4, 64)), "one query per sequence"),
        (dict(q=torch.randn(2, 4, 64, dtype=torch.bfloat16)), "dtype"),
        (dict(kv_cache=torch.randn(4, 3, 2, 16, 64)), "kv_cache must be one layer"),
        (dict(kv_cache=torch.randn(4, 2, 2, 64, 16).transpose(3, 4)), "contiguous"),
        (dict(kv_cache=torch.randn(4, 2, 2, 16, 24), q=torch.randn(2, 4, 24)), "multiple of 16"),
        (dict(block_tables=torch.tensor([[0, 1], [2, -1]])), "block_tables must be 2-D int32"),
        (dict(block_tables=torch.tensor([[0, 4], [2, -1]], dtype=torch.int32)), "block ids outside"),
        (dict(block_tables=torch.tensor([[0, 1], [-1, 2]], dtype=torch.int32)), "block ids outside"),
        (dict(seq_lens=torch.tensor([20, 5])), "seq_lens must be torch.int32"),
        (dict(seq_lens=torch.tensor([20], dtype=torch.int32)), "seq_lens must be"),
        (dict(seq_lens=torch.tensor([33, 5], dtype=torch.int32)), "exceeds block_tables capacity"),
        (dict(seq_lens=torch.tensor([20, 0], dtype=torch.int32)), "seq_lens must be >= 1"),
        (dict(scale=float("inf")), "scale"),
        (dict(out=torch.empty(2, 4, 32)), "out shape"),
    ],
)
def test_decode_bad_input(over, match):
    with pytest.raises(kog.InvalidRequest, match=match):
        ops.paged_attention_decode(**_args(**over))


@pytest.mark.parametrize(
    "qsl, match",
    [
        ([0, 3], "query_start_loc must be torch.int32 of shape"),
        ([1, 2, 3], "start at 0 and end at n_tokens"),
        ([0, 2, 2], "start at 0 and end at n_tokens"),
        ([0, 4, 3], "non-decreasing"),
        ([0, 0, 3], None),  # valid: an empty chunk for sequence 0
    ],
)
def test_prefill_bad_query_start_loc(qsl, match):
    a = _args(q=torch.randn(3, 4, 64), seq_lens=torch.tensor([20, 3], dtype=torch.int32))
    if match is None:
        qsl = torch.tensor(qsl, dtype=torch.int32)
        out = ops.paged_attention_prefill(**a, query_start_loc=qsl)
        want = ref.paged_attention(a["q"], a["kv_cache"], a["block_tables"], a["seq_lens"], qsl)
        torch.testing.assert_close(out, want, **TOL[torch.float32])
        return
    with pytest.raises(kog.InvalidRequest, match=match):
        ops.paged_attention_prefill(**a, query_start_loc=torch.tensor(qsl, dtype=torch.int32))


def test_prefill_more_queries_than_cached_tokens():
    a = _args(q=torch.randn(8, 4, 64), seq_lens=torch.tensor([20, 2], dtype=torch.int32))
    with pytest.raises(kog.InvalidRequest, match="more query tokens"):
        ops.paged_attention_prefill(**a, query_start_loc=torch.tensor([0, 5, 8], dtype=torch.int32))


def test_native_checks_guard_unvalidated_calls():
    # validate_indices=False skips the Python scan; the CPU binding still refuses bad indices.
    a = _args(block_tables=torch.tensor([[0, 9], [2, -1]], dtype=torch.int32))
    with pytest.raises(kog.InvalidRequest, match=r"block_tables\[0, 1\] = 9"):
        ops.paged_attention_decode(**a, validate_indices=False)
    with pytest.raises(kog.InvalidRequest, match="slot_mapping"):
        ops.kv_append(torch.randn(1, 2, 64), torch.randn(1, 2, 64), torch.randn(4, 2, 2, 16, 64),
                      torch.tensor([64]), validate_indices=False)


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(slot_mapping=torch.tensor([0, 64])), "past the cache"),
        (dict(slot_mapping=torch.tensor([3, 3])), "same slot"),
        (dict(slot_mapping=torch.tensor([0, 1], dtype=torch.int32)), "slot_mapping must be torch.int64"),
        (dict(k=torch.randn(2, 3, 64)), "k must be"),
        (dict(v=torch.randn(2, 2, 64, dtype=torch.float16)), "dtype"),
    ],
)
def test_kv_append_bad_input(kw, match):
    a = dict(k=torch.randn(2, 2, 64), v=torch.randn(2, 2, 64), kv_cache=torch.randn(4, 2, 2, 16, 64),
             slot_mapping=torch.tensor([0, 17]))
    a.update(kw)
    with pytest.raises(kog.InvalidRequest, match=match):
        ops.kv_append(**a)
