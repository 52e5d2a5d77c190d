"""Prompt-lookup drafting: which occurrence is used, n-gram size order, k, edge cases."""

import pytest

import kog
from kog.speculation.ngram import NgramDrafter


def brute_force(ids, k, n_max, n_min):
    """The definition, written as plainly as possible."""
    for n in range(n_max, n_min - 1, -1):
        if len(ids) <= n:
            continue
        suffix = ids[-n:]
        for start in range(len(ids) - n - 1, -1, -1):
            if ids[start:start + n] == suffix:
                return ids[start + n:start + n + k]
    return []


def test_continues_the_latest_earlier_occurrence():
    #      0  1  2  3  4  5  6  7  8  9
    ids = [1, 2, 3, 9, 1, 2, 3, 7, 8, 1, 2, 3]
    # The last 3-gram (1, 2, 3) occurs at 0 and 4; the latest (4) is followed by 7, 8, 1.
    assert NgramDrafter(3, 1).propose(ids, 3) == [7, 8, 1]
    assert NgramDrafter(3, 1).propose(ids, 10) == [7, 8, 1, 2, 3]  # runs into the suffix itself


def test_longest_ngram_wins_and_falls_back_to_shorter():
    ids = [5, 6, 0, 6, 1, 5, 6]
    # 2-gram (5, 6) occurs at 0 -> 0, 6; the 1-gram (6) alone would match at 3 -> 1, 5.
    assert NgramDrafter(2, 1).propose(ids, 2) == [0, 6]
    assert NgramDrafter(1, 1).propose(ids, 2) == [1, 5]
    assert NgramDrafter(3, 3).propose(ids, 2) == []  # (1, 5, 6) never recurs


@pytest.mark.parametrize("ids", [[], [4], [4, 5], [4, 4], [1, 2, 3, 4]])
def test_short_or_novel_sequences(ids):
    assert NgramDrafter(3, 1).propose(ids, 4) == brute_force(ids, 4, 3, 1)


def test_matches_the_definition_on_random_sequences():
    import random

    rng = random.Random(0)
    for _ in range(300):
        ids = [rng.randrange(4) for _ in range(rng.randrange(1, 40))]
        n_min = rng.randrange(1, 4)
        n_max = rng.randrange(n_min, 5)
        k = rng.randrange(1, 6)
        assert NgramDrafter(n_max, n_min).propose(ids, k) == brute_force(ids, k, n_max, n_min), (ids, k, n_max, n_min)


def test_bad_sizes():
    with pytest.raises(kog.InvalidRequest):
        NgramDrafter(1, 2)
    with pytest.raises(kog.InvalidRequest):
        NgramDrafter(2, 0)
