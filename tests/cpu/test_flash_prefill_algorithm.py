"""A numpy model of the flash-style GPU prefill kernel (csrc/gpu/ops/prefill_attention.cuh),
step for step, against kog.testing.reference on fresh random inputs.

The kernel cannot run on the machines that wrote it (no GPU), so its algorithm is checked here:
the same workgroups (query tile of flattened (token, GQA head) rows, sequence, KV head), the same
key-tile loop over the block table, the same masking and online-softmax rescaling, in float32.
The tile sizes mirror gpu/decode/tuning.cuh (a test below reads them from the header).
"""

import re
from pathlib import Path

import numpy as np
import pytest
import torch

from kog import _C, ops
from kog.errors import InvalidRequest
from kog.testing import reference as ref
from kog.testing.paged import random_prefill_case
from kog.testing.tolerances import assert_close

TUNING = Path(__file__).resolve().parents[2] / "csrc" / "gpu" / "decode" / "tuning.cuh"
# (padded head dim kD, kRows, kKeys): CUDA's and HIP's Tile<kD> (HIP takes 32 rows at kD 256).
TILES_CUDA = {64: (64, 32), 128: (32, 32), 256: (16, 16)}
TILES_HIP = {64: (64, 32), 128: (32, 32), 256: (32, 16)}
ROW_LANES = 16


def padded_head_dim(head_dim: int) -> int:
    """The kernel instantiation the launcher picks (prefill_attention.cu)."""
    return 64 if head_dim <= 64 else 128 if head_dim <= 128 else 256


def flash_prefill_model(q, kv_cache, block_tables, seq_lens, query_start_loc, scale, tiles, window=0):
    """The kernel's algorithm in float32 numpy.

    Args:
        q: [n_tokens, n_q_heads, head_dim]; kv_cache: [num_blocks, 2, n_kv_heads, block_size, head_dim];
        block_tables: [n_seqs, max_blocks]; seq_lens: [n_seqs]; query_start_loc: [n_seqs + 1].
        tiles: {kD: (kRows, kKeys)}.
        window: 0, or a sliding window (a row at position t sees keys (t - window, t]).

    Returns:
        out: [n_tokens, n_q_heads, head_dim] float32.
    """
    q = q.float().numpy()
    cache = kv_cache.float().numpy()
    tables, lens, qsl = block_tables.numpy(), seq_lens.numpy(), query_start_loc.numpy()
    n_q, hd = q.shape[1], q.shape[2]
    n_kv, bs = cache.shape[2], cache.shape[3]
    group = n_q // n_kv
    k_rows, k_keys = tiles[padded_head_dim(hd)]
    max_q_len = int(np.diff(qsl).max())
    out = np.full(q.shape, np.nan, dtype=np.float32)
    n_tiles = -(-max_q_len * group // k_rows)
    pairs = len(lens) * n_kv
    for block in range(n_tiles * pairs):  # one-dimensional grid, (sequence, KV head) fastest
        tile = n_tiles - 1 - block // pairs
        seq, kvh = divmod(block % pairs, n_kv)
        workgroup(q, cache, tables[seq], int(lens[seq]), int(qsl[seq]), int(qsl[seq + 1]), kvh, group, bs,
                  np.float32(scale), tile, k_rows, k_keys, out, window)
    return torch.from_numpy(out)


def workgroup(q, cache, table, seq_len, q0, q1, kvh, group, bs, scale, tile, k_rows, k_keys, out, window=0):
    """One workgroup: rows r = i * group + j of the chunk, [tile * k_rows, + k_rows)."""
    q_len, hd = q1 - q0, q.shape[2]
    n_rows, r0 = q_len * group, tile * k_rows
    if r0 >= n_rows:
        return
    ctx = seq_len - q_len
    r_end = min(n_rows, r0 + k_rows)
    kv_end = ctx + (r_end - 1) // group + 1
    rows = r0 + np.arange(k_rows)
    valid = rows < n_rows
    tok, head = rows // group, kvh * group + rows % group
    q_tile = np.zeros((k_rows, hd), np.float32)
    q_tile[valid] = q[q0 + tok[valid], head[valid]] * scale  # scaled once, at load
    pos = np.where(valid, ctx + tok, -1)  # -1: every key masked
    m = np.full(k_rows, np.finfo(np.float32).min, np.float32)  # -FLT_MAX
    l = np.zeros(k_rows, np.float32)
    o = np.zeros((k_rows, hd), np.float32)
    # the window's first visible key of the tile's first row, down to a whole key tile
    n_begin = max(0, ctx + r0 // group - window + 1) // k_keys * k_keys if window > 0 else 0
    for n0 in range(n_begin, kv_end, k_keys):
        keys = n0 + np.arange(k_keys)
        k_tile, v_tile = load_kv_tile(cache, table, kvh, keys, kv_end, bs)
        s = q_tile @ k_tile.T  # [k_rows, k_keys] fp32
        s[keys[None, :] > pos[:, None]] = -np.inf  # causal; covers keys >= kv_end
        if window > 0:
            s[keys[None, :] <= pos[:, None] - window] = -np.inf
        m_new = np.maximum(m, s.max(axis=1))
        corr = np.exp(m - m_new)
        p = np.exp(s - m_new[:, None])
        l = l * corr + p.sum(axis=1)
        m = m_new
        o = o * corr[:, None] + p @ v_tile
    out[q0 + tok[valid], head[valid]] = o[valid] / l[valid, None]


def load_kv_tile(cache, table, kvh, keys, kv_end, bs):
    """K and V rows of `keys` through the block table; zeros past kv_end."""
    inside = keys < kv_end
    k_tile = np.zeros((len(keys), cache.shape[4]), np.float32)
    v_tile = np.zeros_like(k_tile)
    blocks, offs = table[keys[inside] // bs], keys[inside] % bs
    k_tile[inside] = cache[blocks, 0, kvh, offs]
    v_tile[inside] = cache[blocks, 1, kvh, offs]
    return k_tile, v_tile


@pytest.fixture
def gen() -> torch.Generator:
    return torch.Generator().manual_seed(1234)


CASES = [  # (q_lens, seq_lens): whole prompts, chunked prefill over a context, ragged tiles, empty chunks
    ([16], [16]),
    ([37], [37]),
    ([5, 70, 16], [5, 100, 16]),
    ([33, 0, 1], [40, 7, 1]),
    ([19, 64], [83, 200]),
]


@pytest.mark.parametrize("tiles", [TILES_CUDA, TILES_HIP], ids=["cuda", "hip"])
@pytest.mark.parametrize("hd", [64, 128, 80, 256])
@pytest.mark.parametrize("n_q,n_kv", [(4, 4), (6, 2), (8, 1)])
@pytest.mark.parametrize("bs", [16, 5])
@pytest.mark.parametrize("lens", CASES)
def test_model_matches_reference_f32(gen, tiles, hd, n_q, n_kv, bs, lens):
    q, cache, table, seq_lens, qsl = random_prefill_case(gen, *lens, n_q, n_kv, hd, bs, torch.float32)
    got = flash_prefill_model(q, cache, table, seq_lens, qsl, hd ** -0.5, tiles)
    assert_close(got, ref.paged_attention(q, cache, table, seq_lens, qsl))  # fp32: 1e-5


@pytest.mark.parametrize("tiles", [TILES_CUDA, TILES_HIP], ids=["cuda", "hip"])
@pytest.mark.parametrize("hd", [64, 256])
@pytest.mark.parametrize("window", [1, 5, 16, 33, 150])
def test_sliding_window_model_matches_reference(gen, tiles, hd, window):
    # windows inside a key tile, across tiles, longer than some chunks; GQA groups span rows
    q, cache, table, seq_lens, qsl = random_prefill_case(gen, [70, 19, 64, 1], [100, 83, 200, 40], 6, 2, hd, 5,
                                                         torch.float32)
    got = flash_prefill_model(q, cache, table, seq_lens, qsl, hd ** -0.5, tiles, window=window)
    assert_close(got, ref.paged_attention(q, cache, table, seq_lens, qsl, window=window))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("hd", [64, 128])
def test_model_matches_reference_16bit(gen, dtype, hd):
    """16-bit I/O: fp32 math on the stored values, one rounding of the output (tolerances.py)."""
    q, cache, table, seq_lens, qsl = random_prefill_case(gen, [40, 17], [90, 17], 8, 2, hd, 16, dtype)
    got = flash_prefill_model(q, cache, table, seq_lens, qsl, hd ** -0.5, TILES_CUDA).to(dtype)
    assert_close(got, ref.paged_attention(q, cache, table, seq_lens, qsl))


def test_model_matches_the_cpu_kernel(gen):
    """Large scores (scale 1) exercise the rescaling: many running-max updates per row."""
    q, cache, table, seq_lens, qsl = random_prefill_case(gen, [50, 21], [130, 21], 4, 2, 64, 16, torch.float32)
    q = q * 3
    got = flash_prefill_model(q, cache, table, seq_lens, qsl, 1.0, TILES_CUDA)
    expected = ops.paged_attention_prefill(q, cache, table, seq_lens, qsl, scale=1.0)
    assert_close(got, expected, rtol=1e-4, atol=1e-4)


def test_tiles_mirror_the_tuning_header():
    text = TUNING.read_text()
    found = re.findall(r"struct Tile<(\d+)> \{\s*static constexpr int kRows = (\d+), kKeys = (\d+);", text)
    got = {(int(d), int(r), int(k)) for d, r, k in found}
    want = {(d, *rk) for tiles in (TILES_CUDA, TILES_HIP) for d, rk in tiles.items()}
    assert got == want
    assert re.search(rf"constexpr int kRowLanes = {ROW_LANES};", text)
    for tiles in (TILES_CUDA, TILES_HIP):
        for d, (rows, keys) in tiles.items():
            assert rows % (256 // ROW_LANES) == 0 and keys % ROW_LANES == 0 and d % ROW_LANES == 0


def test_dispatch_threshold_and_scratch():
    """Launches with a chunk of >= the threshold take the flash kernel, which needs no scratch."""
    t = _C.GPU_FLASH_PREFILL_MIN_QUERY_LEN
    assert t == 16
    split = _C.paged_attention_partials_floats(100, 8, 64, 1000, False, t - 1, 0)
    assert split == 100 * 8 * 4 * 66
    assert _C.paged_attention_partials_floats(100, 8, 64, 1000, False, t, 0) == 0
    assert _C.paged_attention_partials_floats(100, 8, 64, 1000, False, t, 1) == split  # forced split
    assert _C.paged_attention_partials_floats(100, 8, 64, 1000, False, 1, 2) == 0  # forced flash
    assert _C.paged_attention_partials_floats(100, 8, 64, 1000, True, 1, 2) > 0  # decode: never flash


def test_unknown_kernel_is_rejected(gen):
    q, cache, table, seq_lens, qsl = random_prefill_case(gen, [4], [4], 2, 2, 16, 16, torch.float32)
    with pytest.raises(InvalidRequest):
        ops.paged_attention_prefill(q, cache, table, seq_lens, qsl, kernel="fast")
