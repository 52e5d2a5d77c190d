"""The native sampler (csrc/cpu/ops/sample.cpp) against the numpy statement of its rules
(kog.testing.sampling_reference), under every CPU ISA built."""

import numpy as np
import pytest

from kog import _C
from kog.testing import sampling_reference as ref

U64 = (1 << 64) - 1


def test_uniform01_matches_splitmix_reference():
    rng = np.random.default_rng(0)
    seeds = [0, 1, U64, 0x9E3779B97F4A7C15] + [int(s) for s in rng.integers(0, 2**63, 20)]
    for seed in seeds:
        for counter in (0, 1, 2, 1000, U64):
            u = _C.uniform01(seed, counter)
            assert u == ref.uniform01(seed, counter)
            assert 0.0 <= u < 1.0
    draws = np.array([_C.uniform01(7, c) for c in range(20000)])
    assert abs(draws.mean() - 0.5) < 0.01 and draws.min() < 0.001 and draws.max() > 0.999


def test_greedy_takes_the_lowest_index_of_a_tie(cpu_isa):
    x = np.array([0.5, 2.0, -1.0, 2.0, 2.0], dtype=np.float32)
    assert _C.sample_row(x, 0.0, 0, 1.0, 0.0, 1, 0) == 1
    x[1] = -np.inf
    assert _C.sample_row(x, 0.0, 0, 1.0, 0.0, 1, 0) == 3


def _logits(rng, vocab: int, kind: str) -> np.ndarray:
    if kind == "normal":
        return (rng.standard_normal(vocab) * 3).astype(np.float32)
    if kind == "ties":  # few distinct values: thresholds land on ties
        return (rng.integers(-6, 6, vocab) * 0.5).astype(np.float32)
    x = np.full(vocab, -5.0, dtype=np.float32)  # peaked: a few likely tokens
    x[rng.choice(vocab, 4, replace=False)] = [8.0, 7.5, 7.0, 3.0]
    return x


FILTERS = [  # (temperature, top_k, top_p, min_p)
    (1.0, 0, 1.0, 0.0), (0.7, 0, 1.0, 0.0), (1.3, 5, 1.0, 0.0), (1.0, 1, 1.0, 0.0),
    (1.0, 0, 0.9, 0.0), (0.8, 0, 0.5, 0.0), (1.0, 0, 1.0, 0.1), (1.0, 40, 0.95, 0.05),
    (2.0, 3, 0.3, 0.0), (0.5, 0, 0.999, 0.01),
]


@pytest.mark.parametrize("vocab", [7, 300, 5000])
@pytest.mark.parametrize("kind", ["normal", "ties", "peaked"])
def test_sample_row_matches_reference(cpu_isa, vocab, kind):
    rng = np.random.default_rng(vocab + len(kind))
    for trial in range(4):
        x = _logits(rng, vocab, kind)
        for temp, k, p, m in FILTERS:
            for counter in range(6):
                seed = int(rng.integers(0, 2**63))
                got = _C.sample_row(x, temp, k, p, m, seed, counter)
                want = ref.sample_row(x, temp, k, p, m, seed, counter)
                assert got == want, (trial, temp, k, p, m, seed, counter)


def test_draws_follow_the_filtered_distribution():
    x = np.log(np.array([0.4, 0.3, 0.15, 0.1, 0.05], dtype=np.float32))
    n = 20000
    # top_k = 3 keeps the 3 most likely; renormalized: 0.4/0.85, 0.3/0.85, 0.15/0.85.
    counts = np.bincount([_C.sample_row(x, 1.0, 3, 1.0, 0.0, 11, c) for c in range(n)], minlength=5)
    np.testing.assert_allclose(counts / n, [0.4 / 0.85, 0.3 / 0.85, 0.15 / 0.85, 0, 0], atol=0.015)
    # top_p = 0.6: 0.4 alone is < 0.6, so {0.4, 0.3} are kept.
    counts = np.bincount([_C.sample_row(x, 1.0, 0, 0.6, 0.0, 12, c) for c in range(n)], minlength=5)
    np.testing.assert_allclose(counts / n, [0.4 / 0.7, 0.3 / 0.7, 0, 0, 0], atol=0.015)
    # min_p = 0.3: p >= 0.12 kept.
    counts = np.bincount([_C.sample_row(x, 1.0, 0, 1.0, 0.3, 13, c) for c in range(n)], minlength=5)
    np.testing.assert_allclose(counts / n, [0.4 / 0.85, 0.3 / 0.85, 0.15 / 0.85, 0, 0], atol=0.015)


def _sampling(vocab, prompt, temp=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=5, rep=1.0, pres=0.0, freq=0.0,
              min_tokens=0, max_output=1 << 40, stop=(), banned=()):
    return _C.SequenceSampling(vocab, np.asarray(prompt, np.int32), temp, top_k, top_p, min_p, seed, rep, pres,
                               freq, min_tokens, max_output, list(stop), list(banned))


@pytest.mark.parametrize("temp", [0.0, 0.9])
def test_penalties_bans_and_counter_match_reference(cpu_isa, temp):
    rng = np.random.default_rng(3)
    vocab, prompt = 200, [int(t) for t in rng.integers(0, 200, 30)]
    rep, pres, freq, banned = 1.3, 0.4, 0.25, [7, 9]
    s = _sampling(vocab, prompt, temp=temp, top_k=50, top_p=0.95, seed=99, rep=rep, pres=pres, freq=freq,
                  min_tokens=3, banned=banned)
    output: list[int] = []
    for i in range(12):
        x = (rng.standard_normal(vocab) * 2).astype(np.float32)
        x[banned] += 20.0  # banned ids would win while they are banned
        want_x = ref.penalize(x, prompt + output, output, banned if i < 3 else [], rep, pres, freq)
        want = ref.sample_row(want_x, temp, 50, 0.95, 0.0, 99, i)
        logits = x[None].copy()
        tokens = np.zeros(1, np.int32)
        _C.sample_sequences(logits.ctypes.data, 1, vocab, [s], tokens.ctypes.data)
        np.testing.assert_array_equal(logits[0], want_x)  # penalties were applied in place
        assert tokens[0] == want, i
        if i < 3:
            assert tokens[0] not in banned
        s.add_output(int(tokens[0]))
        output.append(int(tokens[0]))
    assert s.n_output == 12


def test_finish_rules():
    s = _sampling(10, [1], stop=[2, 3], min_tokens=2, max_output=4)
    s.add_output(2)
    assert s.finish_after(2) == 0  # below min_tokens a stop id does not stop
    s.add_output(5)
    assert s.finish_after(5) == 0
    s.add_output(3)
    assert s.finish_after(3) == 1  # stop
    s.add_output(5)
    assert s.finish_after(5) == 2  # length: 4 tokens out


def test_bad_input_is_invalid_request():
    with pytest.raises(ValueError):
        _sampling(10, [11])
    s = _sampling(10, [1])
    with pytest.raises(ValueError):
        s.add_output(10)
    with pytest.raises(ValueError):
        _sampling(10, [1], top_p=0.0)
