"""cpu::RowQueue, the work-stealing split of a matrix's rows in the decode executor: every chunk
goes to exactly one thread per epoch, each thread takes its own slice front to back, and an idle
thread steals from the back of a slow thread's slice."""

import pytest

from kog import _C


@pytest.mark.parametrize("n_threads", [1, 2, 3, 4])
@pytest.mark.parametrize("n_chunks", [0, 1, 2, 5, 37, 1000])
def test_every_chunk_is_taken_exactly_once(n_threads, n_chunks):
    owners, counts = _C._row_queue_claims(n_threads, n_chunks, 20)
    for owner, count in zip(owners, counts):
        assert count == [1] * n_chunks
        assert all(0 <= t < n_threads for t in owner)


@pytest.mark.parametrize("n_threads", [2, 3])
def test_an_idle_thread_steals_the_tail_of_a_slow_threads_slice(n_threads):
    # The hook holds thread 0 after its first chunk until the others have stolen from it.
    n_chunks = 60
    owners, counts = _C._row_queue_claims(n_threads, n_chunks, 3, slow=0)
    lo, hi = 0, n_chunks // n_threads  # thread 0's own slice
    for owner, count in zip(owners, counts):
        assert count == [1] * n_chunks
        mine = [c for c in range(lo, hi) if owner[c] == 0]
        # The slow thread took a prefix of its slice, the others its tail.
        assert mine == list(range(lo, lo + len(mine)))
        assert len(mine) < hi - lo

