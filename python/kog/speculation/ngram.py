"""Prompt-lookup drafting: agents repeat what is already in their context (file contents, tool
results, earlier JSON), so the tokens that followed the last earlier occurrence of the current
n-gram are a cheap, often right, guess at what comes next."""

from __future__ import annotations

from typing import Sequence

import numpy as np

from kog.errors import InvalidRequest


class NgramDrafter:
    """Proposes draft tokens by n-gram lookup in the sequence itself (prompt + output).

    Args:
        ngram_max: the longest n-gram to match (tried first: a longer match predicts better).
        ngram_min: the shortest n-gram to fall back to.
    """

    def __init__(self, ngram_max: int = 3, ngram_min: int = 1):
        if not 1 <= ngram_min <= ngram_max:
            raise InvalidRequest(f"ngram sizes need 1 <= ngram_min <= ngram_max, got {ngram_min}, {ngram_max}")
        self.ngram_max, self.ngram_min = ngram_max, ngram_min

    def propose(self, ids: Sequence[int], k: int) -> list[int]:
        """Up to k tokens that followed the latest earlier occurrence of the last n-gram of ids.

        Args:
            ids: the whole sequence so far, prompt then output.
            k: most tokens to propose.

        Returns:
            The draft (possibly shorter than k, empty when no n-gram of any size recurs).
        """
        arr = np.asarray(ids, dtype=np.int64)  # [L]
        n_ids = arr.shape[0]
        for n in range(min(self.ngram_max, n_ids - 1), self.ngram_min - 1, -1):
            start = latest_match(arr, n)
            if start is not None:
                # NOTE: start + n < n_ids always (the match ends before the suffix's last token),
                # so the draft is never empty; it may run into the suffix itself.
                return arr[start + n:start + n + k].tolist()
        return []


def latest_match(arr: np.ndarray, n: int) -> int | None:
    """Start of the latest occurrence of arr's last n tokens that ends before arr's end, or None.

    Args:
        arr: int64 [L] token ids.
        n: n-gram size, 1 <= n < L.
    """
    windows = np.lib.stride_tricks.sliding_window_view(arr[:-1], n)  # [L - n, n]: all but the suffix
    hits = np.flatnonzero((windows == arr[-n:]).all(axis=1))
    return int(hits[-1]) if hits.size else None
