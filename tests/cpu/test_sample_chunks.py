"""The decode kernel's chunked sampler (csrc/ops/sample_chunks.h), run on the host: chunk
summaries with candidates, then the draw from them, against the full-row sampler
(csrc/cpu/ops/sample.cpp) whose semantics it must keep. The GPU kernel runs the same
sample_from_chunks (its workgroup as the team); tests/gpu/test_decode_loop_gpu.py checks it there."""

import numpy as np
import pytest
import torch

from kog import _C

FALLBACK = _C.SAMPLE_FALLBACK
C = _C.SAMPLE_CANDIDATES

# (temperature, top_k, top_p, min_p): the forms agents use, and filters wider than the candidates.
PARAMS = [(0.0, 0, 1.0, 0.0), (1.0, 0, 1.0, 0.0), (0.8, 40, 1.0, 0.0), (0.7, 20, 0.9, 0.0), (1.0, 0, 0.95, 0.0),
          (1.0, 0, 1.0, 0.05), (0.6, 0, 0.8, 0.02), (1.0, C, 1.0, 0.0), (1.0, C + 1, 1.0, 0.0),
          (1.0, 300, 1.0, 0.0), (1.5, 40, 0.8, 0.01)]


def rows(vocab: int, n: int, seed: int):
    """Logit rows: flat and peaked, f32 and bf16-rounded (ties), as a model's LM head gives."""
    rng = np.random.default_rng(seed)
    for i in range(n):
        x = (rng.standard_normal(vocab) * (1.0, 3.0, 6.0)[i % 3]).astype(np.float32)
        if i % 2:
            x = torch.from_numpy(x).bfloat16().float().numpy()
        yield i, x


@pytest.mark.parametrize("vocab", [7, 400, _C.SAMPLE_CHUNK, 3 * _C.SAMPLE_CHUNK + 1000, 49152])
@pytest.mark.parametrize("params", PARAMS)
def test_chunked_sampler_draws_the_full_rows_token_or_falls_back(vocab, params):
    decided = 0
    for i, x in rows(vocab, 24, seed=vocab):
        got = _C.sample_row_chunked(x, *params, 1000 + i, i)
        if got == FALLBACK:
            continue
        assert got == _C.sample_row(x, *params, 1000 + i, i), (i, params)
        decided += 1
    temperature, top_k, top_p, min_p = params
    if temperature <= 0 or (top_p >= 1 and min_p <= 0 and top_k <= C):
        assert decided == 24  # greedy, no filter, top-k within the candidates: always decided
    if top_k == C + 1 and vocab >= 2 * _C.SAMPLE_CHUNK:
        assert decided > 0  # other chunks' candidates also pass the largest cutoff


def test_peaked_rows_with_top_p_and_min_p_are_decided_by_the_summaries():
    """An LM head's distribution is peaked (here 12 tokens hold > 95% of the mass): there the
    candidates hold the top-p mass and the min-p set, so the kernel skips the full-row passes."""
    rng = np.random.default_rng(3)
    decided = 0
    for i in range(40):
        x = rng.standard_normal(49152).astype(np.float32) * 2
        x[rng.choice(49152, 12, replace=False)] += rng.uniform(14, 20, 12).astype(np.float32)
        for params in [(1.0, 0, 0.9, 0.0), (0.7, 0, 1.0, 0.1), (1.0, 0, 0.95, 0.05)]:
            got = _C.sample_row_chunked(x, *params, 7, i)
            want = _C.sample_row(x, *params, 7, i)
            assert got in (FALLBACK, want)
            decided += got == want
    assert decided == 120


def test_ties_past_a_chunks_slots_fall_back_and_greedy_takes_the_lowest_index():
    x = np.zeros(3 * _C.SAMPLE_CHUNK, np.float32)  # 4096 ties per chunk: far past the slots
    x[5000] = x[9000] = 2.0
    assert _C.sample_row_chunked(x, 0.0, 0, 1.0, 0.0, 1, 0) == 5000  # ties to the lowest index, as the full row
    assert _C.sample_row(x, 0.0, 0, 1.0, 0.0, 1, 0) == 5000
    assert _C.sample_row_chunked(x, 1.0, 0, 0.9, 0.0, 1, 0) == FALLBACK
    x[:] = np.arange(x.size) % 7  # a tie of hundreds at each cutoff
    assert _C.sample_row_chunked(x, 1.0, 10, 1.0, 0.0, 1, 0) == FALLBACK


def test_draws_follow_the_distribution():
    """Over many counters the no-filter draw (chunk masses, then a scan of one chunk) follows
    softmax(x / T): a chi-square-style check on a few heavy tokens."""
    vocab = 2 * _C.SAMPLE_CHUNK + 10
    x = np.full(vocab, -30.0, np.float32)
    heavy = [3, 4100, 8200, 8201]
    x[heavy] = np.log(np.array([0.1, 0.2, 0.3, 0.4], np.float32))
    counts = np.zeros(4)
    for c in range(3000):
        t = _C.sample_row_chunked(x, 1.0, 0, 1.0, 0.0, 11, c)
        assert t in heavy
        counts[heavy.index(t)] += 1
    assert np.allclose(counts / 3000, [0.1, 0.2, 0.3, 0.4], atol=0.03), counts
