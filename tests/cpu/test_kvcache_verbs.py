"""The allocator's query verbs (can_append / max_appendable / max_appendable_batch), its batched
append with token ids, natively filled block tables, and the enums that cross from C++."""

import numpy as np
import pytest

import kog
from kog import _C
from kog.engine.outputs import FinishReason
from kog.kvcache import KVCacheManager, KVState

BS = 4


def exact_max(m: KVCacheManager, sid: int) -> int:
    """max_appendable checked at its boundary: one more token raises, exactly it fits."""
    most = m.max_appendable(sid)
    assert m.can_append(sid, most) and not m.can_append(sid, most + 1)
    with pytest.raises(kog.KVCacheFull):
        m.append(sid, n_tokens=most + 1)
    return most


def test_max_appendable_counts_the_tail_and_free_blocks():
    m = KVCacheManager(6, BS)
    m.add_sequence(0, list(range(6)))  # 2 blocks, 2 free slots in the tail
    assert exact_max(m, 0) == 2 + 4 * BS
    m.append(0, n_tokens=2)  # a full tail: the next token opens a block
    assert exact_max(m, 0) == 4 * BS


def test_a_shared_partial_tail_costs_a_block_for_its_copy():
    m = KVCacheManager(3, BS)
    m.add_sequence(0, list(range(6)))  # 2 blocks; 1 free
    m.fork(0, 1)
    # the copy-on-write takes the free block; then its 2 free slots
    assert exact_max(m, 0) == 2 and exact_max(m, 1) == 2
    m.append(0, n_tokens=1)  # 0 copies the tail: the pool is full, 1 owns the old tail alone
    assert exact_max(m, 1) == 2 and exact_max(m, 0) == 1
    m2 = KVCacheManager(2, BS)
    m2.add_sequence(0, list(range(6)))
    m2.fork(0, 1)
    assert exact_max(m2, 0) == 0  # no block for the copy: not even the tail's free slots
    assert not m2.can_append(0, 1) and m2.can_append(0, 0)


def test_prefix_cache_sharing_and_cached_blocks_count():
    m = KVCacheManager(5, BS, namespace="t")
    prompt = list(range(8))
    m.add_sequence(0, prompt)
    m.free(0)  # its 2 full blocks stay cached (evictable)
    cached, _ = m.add_sequence(1, prompt + [9])  # shares both cached blocks + 1 new
    assert cached == 8
    assert exact_max(m, 1) == 3 + 2 * BS
    m.add_sequence(2, prompt)  # shares the same 2 full blocks: appending opens a block
    assert exact_max(m, 2) == 2 * BS
    m.free(1)  # its own tail block frees; the shared blocks stay with 2
    assert exact_max(m, 2) == 3 * BS


def test_swappable_suspended_sequences_count_like_append_reserves():
    m = KVCacheManager(4, BS, num_host_blocks=2)
    m.add_sequence(0, list(range(8)))  # 2 blocks
    m.add_sequence(1, list(range(100, 104)))  # 1 block, 1 free
    m.suspend(0)
    assert exact_max(m, 1) == 1 * BS + 2 * BS  # the free block + 0's two, swapped out on demand
    mv = m.append(1, n_tokens=exact_max(m, 1))
    assert len(mv.swap_out) == 2 and m.state(0) is KVState.SWAPPED


def test_max_appendable_batch_is_the_longest_prefix_that_fits():
    m = KVCacheManager(4, BS)
    for sid in range(3):
        m.add_sequence(sid, list(range(10 * sid, 10 * sid + 4)))  # one full block each, 1 free
    assert m.max_appendable_batch([0, 1, 2], [1, 1, 1]) == 1
    assert m.max_appendable_batch([0, 1, 2], [0, 0, 1]) == 3
    assert m.max_appendable_batch([], []) == 0
    with pytest.raises(kog.InvalidRequest):
        m.max_appendable_batch([0, 0], [1, 1])
    with pytest.raises(kog.KVCacheFull):
        m.append_batch([0, 1], [1, 1], [5, 6])
    m.suspend(2)
    with pytest.raises(kog.InvalidOperation):
        m.max_appendable_batch([0, 2], [1, 1])
    with pytest.raises(kog.InvalidOperation):
        m.max_appendable(2)
    with pytest.raises(kog.UnknownSequence):
        m.can_append(7, 1)


def test_append_batch_with_tokens_equals_appends_one_by_one():
    """Same slots, copies and prefix-cache entries as appending each sequence in turn."""
    def setup():
        m = KVCacheManager(16, BS, namespace="t")
        m.add_sequence(0, list(range(6)))
        m.fork(0, 1)  # shared partial tail: both copy on write
        m.add_sequence(2, list(range(50, 53)))
        return m

    tokens = {0: [7, 8, 9], 1: [], 2: [1, 2, 3, 4, 5]}
    one = setup()
    slots, cow = [], []
    for sid in (0, 1, 2):
        if tokens[sid]:
            mv = one.append(sid, tokens[sid])
            slots += list(mv.slots)
            cow += [tuple(p) for p in mv.cow]
    batch = setup()
    mv = batch.append_batch([0, 1, 2], [3, 0, 5], [7, 8, 9, 1, 2, 3, 4, 5])
    assert list(mv.slots) == slots and [tuple(p) for p in mv.cow] == cow
    assert batch.debug_state() == one.debug_state()
    assert batch.lookup(list(range(6)) + [7, 8]) == 8  # token ids fed the prefix cache
    with pytest.raises(kog.InvalidRequest):
        batch.append_batch([0], [2], [1])  # tokens must hold sum(counts) ids


def test_block_tables_are_filled_natively_and_padded():
    m = KVCacheManager(16, BS, num_host_blocks=4)
    m.add_sequence(0, list(range(9)))  # 3 blocks
    m.add_sequence(1, list(range(3)))  # 1 block
    m.fork(0, 2)
    tables = m.block_tables([1, 0, 2])
    assert tables.dtype == np.int32 and tables.shape == (3, 3)
    assert list(tables[0]) == [*m.block_table(1), 0, 0]
    assert list(tables[1]) == list(m.block_table(0)) == list(tables[2])
    out = np.full((2, 5), -1, dtype=np.int32)
    m.fill_block_tables([1, 0], out)
    assert list(out[0]) == [*m.block_table(1), 0, 0, 0, 0] and list(out[1]) == [*m.block_table(0), 0, 0]
    with pytest.raises(kog.InvalidRequest):
        m.fill_block_tables([1, 0], np.zeros((2, 2), dtype=np.int32))  # narrower than 0's 3 blocks
    with pytest.raises(kog.InvalidRequest):
        m.fill_block_tables([1, 0], np.zeros((3, 3), dtype=np.int32))  # one row per sequence
    m.suspend(1)
    m.swap_out(1)
    with pytest.raises(kog.InvalidOperation):
        m.block_tables([0, 1])


def test_kv_state_crosses_as_an_enum_mirrored_by_name():
    assert sorted(_C.KVSeqState.__members__) == sorted(KVState.__members__)
    m = KVCacheManager(4, BS)
    m.add_sequence(0, [1, 2])
    state = m.state(0)
    assert state is KVState.RUNNING and state == "running" and str(state) == "running"
    m.suspend(0)
    assert m.state(0) is KVState.SUSPENDED
    assert isinstance(m._a.info(0)["state"], _C.KVSeqState)  # no string on the boundary


def test_finish_reason_mirrors_the_native_enum():
    native = {n for n in _C.FinishReason.__members__ if n != "NONE"}
    assert native == set(FinishReason.__members__)
    for name, value in _C.FinishReason.__members__.items():
        expect = None if name == "NONE" else FinishReason[name]
        assert FinishReason.from_native(value) is expect and FinishReason.from_native(int(value)) is expect
    assert FinishReason.STOP == "stop" and str(FinishReason.LENGTH) == "length"


def test_name_tokens_feeds_the_prefix_cache_after_a_count_only_append():
    m = KVCacheManager(8, BS, namespace="t")
    m.add_sequence(0, [1, 2, 3])
    m.append(0, n_tokens=6)  # KV reserved before the ids are known (the decode loop)
    ids = [1, 2, 3, 7, 8, 9, 10, 11, 12]
    assert m.lookup(ids) == 0 and not m.info(0)["tokens_known"]
    m.name_tokens(0, 3, ids[3:])
    assert m.info(0)["named"] == 9 and m.info(0)["tokens_known"]
    assert m.lookup(ids) == 8  # both full blocks joined the cache
    m.append(0, [13, 14, 15])  # and later appends with ids feed it again
    assert m.lookup(ids + [13, 14, 15]) == 12
    m.free(0)
    cached, _ = m.add_sequence(1, ids + [13, 14, 15, 16])
    assert cached == 12


def test_name_tokens_refuses_a_gap_and_a_different_id_and_changes_nothing():
    m = KVCacheManager(8, BS, namespace="t")
    m.add_sequence(0, [1, 2, 3, 4, 5])
    m.append(0, n_tokens=6)
    before = m.debug_state()
    with pytest.raises(kog.InvalidRequest, match="gap"):
        m.name_tokens(0, 6, [9, 9])  # token 5 is not named yet
    with pytest.raises(kog.InvalidRequest, match="is 5, not 6"):
        m.name_tokens(0, 4, [6, 7])  # token 4 is named (5)
    with pytest.raises(kog.InvalidRequest, match="pass"):
        m.name_tokens(0, 5, [0] * 7)  # past the 11 tokens
    assert m.debug_state() == before
    m.name_tokens(0, 4, [5, 6, 7])  # overlapping a named token with its own id is fine
    assert m.info(0)["named"] == 7
    m.suspend(0)
    with pytest.raises(kog.InvalidOperation):
        m.name_tokens(0, 7, [1])


def test_truncate_back_to_named_tokens_feeds_the_cache_again():
    m = KVCacheManager(8, BS, namespace="t")
    m.add_sequence(0, [1, 2, 3, 4, 5, 6])
    m.append(0, n_tokens=5)  # count-only: the sequence stops feeding the cache
    m.truncate(0, 6)  # back to its named tokens (a rejected reservation)
    assert m.info(0)["tokens_known"]
    m.append(0, [7, 8])
    assert m.lookup([1, 2, 3, 4, 5, 6, 7, 8]) == 8
