"""Paged KV allocator on tiny pools: exact block ids, exact eviction order, real KV data."""

import numpy as np
import pytest
import torch

import kog
from kog.kvcache import KVCacheManager, KVCacheStorage, KVLayout

BS = 4


def toks(n, start=0):
    return list(range(start, start + n))


def table(m, seq):
    return m.block_table(seq).tolist()


def pairs(a):
    return [tuple(p) for p in a.tolist()]


def test_fresh_pool_hands_out_blocks_in_order_with_slots():
    m = KVCacheManager(8, BS)
    cached, mv = m.add_sequence(1, toks(6))
    assert cached == 0
    assert table(m, 1) == [0, 1]
    assert mv.slots.tolist() == [0, 1, 2, 3, 4, 5]
    mv = m.append(1, n_tokens=3)
    assert table(m, 1) == [0, 1, 2]
    assert mv.slots.tolist() == [6, 7, 8]
    assert m.slot_mapping(1, 5, 9).tolist() == [5, 6, 7, 8]
    s = m.stats()
    assert (s["blocks_used"], s["blocks_free"], s["blocks_cached"]) == (3, 5, 0)


def test_fork_shares_blocks_and_cow_on_first_write_into_shared_partial_block():
    m = KVCacheManager(8, BS)
    m.add_sequence(1, toks(6))  # blocks 0, 1 (1 half full)
    used = m.stats()["blocks_used"]
    m.fork(1, 2)
    assert m.stats()["blocks_used"] == used  # nothing allocated, nothing copied
    assert table(m, 2) == [0, 1]
    mv = m.append(2, [100])
    assert pairs(mv.cow) == [(1, 2)]
    assert mv.slots.tolist() == [2 * BS + 2]
    assert table(m, 2) == [0, 2] and table(m, 1) == [0, 1]
    mv = m.append(1, [200])  # block 1 is exclusively the parent's now: no copy
    assert pairs(mv.cow) == [] and mv.slots.tolist() == [1 * BS + 2]
    assert m.stats()["cow_copies"] == 1


def test_fork_at_block_boundary_needs_no_copy():
    m = KVCacheManager(8, BS)
    m.add_sequence(1, toks(8))
    m.fork(1, 2)
    mv = m.append(2, n_tokens=1)
    assert pairs(mv.cow) == [] and table(m, 2) == [0, 1, 2]


def test_truncate_releases_blocks_in_exact_order():
    m = KVCacheManager(8, BS)
    m.add_sequence(1, np.arange(10))
    assert table(m, 1) == [0, 1, 2]
    m.truncate(1, 3)
    assert table(m, 1) == [0] and m.num_tokens(1) == 3
    # blocks 2 (partial) and 1 were released; 1 was full with known tokens, so it is cached
    st = m.debug_state()
    assert st["free"][-1] == 2 and st["lru"] == [1]
    with pytest.raises(kog.InvalidRequest):
        m.truncate(1, 4)


def test_prefix_cache_hit_and_exact_lru_eviction_order():
    m = KVCacheManager(4, BS)
    m.add_sequence(1, toks(8))  # blocks 0, 1, both full and registered
    m.free(1)
    # NOTE: a sequence releases its tail first, so deeper blocks are evicted before prefixes
    assert m.debug_state()["lru"] == [1, 0]
    assert m.lookup(toks(8)) == 8 and m.lookup(toks(7)) == 4 and m.lookup(toks(8, 1)) == 0
    m.add_sequence(2, toks(8, 50))  # takes the free blocks 2, 3
    assert table(m, 2) == [2, 3]
    m.append(2, n_tokens=1)  # evicts block 1 (LRU head)
    assert table(m, 2) == [2, 3, 1]
    assert m.lookup(toks(8)) == 4
    m.append(2, n_tokens=4)  # evicts block 0
    assert table(m, 2) == [2, 3, 1, 0]
    assert m.lookup(toks(8)) == 0
    s = m.stats()
    assert s["evictions"] == 2 and s["prefix_queries"] == 7 and s["prefix_hit_tokens"] == 8 + 4 + 4


def test_add_sequence_reuses_cached_prefix_blocks():
    m = KVCacheManager(8, BS)
    m.add_sequence(1, toks(9))
    m.free(1)
    cached, mv = m.add_sequence(2, toks(10))
    assert cached == 8 and table(m, 2) == [0, 1, 2]
    assert mv.slots.tolist() == [8, 9]
    m.fork(2, 3)
    cached, _ = m.add_sequence(4, toks(12))  # shares live blocks 0 and 1
    assert cached == 8 and table(m, 4)[:2] == [0, 1]


def test_namespace_separates_caches():
    a, b = KVCacheManager(4, BS, namespace="model-a"), KVCacheManager(4, BS, namespace="model-b")
    for m in (a, b):
        m.add_sequence(1, toks(8))
    assert a.lookup(toks(8)) == 8 and b.lookup(toks(8)) == 8
    # Same pool, different namespace seed: the chained hashes differ
    assert set(a.debug_state()["cache"]) != set(b.debug_state()["cache"])


def test_pin_keeps_prefix_resident_until_unpinned():
    m = KVCacheManager(3, BS)
    m.add_sequence(1, toks(8))
    pin = m.pin(toks(8))
    assert pin.num_tokens == 8 and m.stats()["blocks_pinned"] == 2
    m.free(1)
    assert m.debug_state()["lru"] == []  # pinned: referenced, not evictable
    m.add_sequence(2, toks(4, 90))
    with pytest.raises(kog.KVCacheFull):
        m.append(2, n_tokens=1)
    m.unpin(pin)
    assert m.debug_state()["lru"] == [1, 0]  # released from its tail: deeper blocks go first
    m.append(2, n_tokens=1)
    assert table(m, 2) == [2, 1]
    with pytest.raises(kog.InvalidOperation):
        m.unpin(pin)


def test_truncated_registered_block_leaves_cache_on_write():
    m = KVCacheManager(4, BS)
    m.add_sequence(1, toks(8))
    m.truncate(1, 6)
    assert m.lookup(toks(8)) == 8  # still intact until written
    mv = m.append(1, [77])
    assert pairs(mv.cow) == [] and table(m, 1) == [0, 1]
    assert m.lookup(toks(8)) == 4


def test_typed_errors_leave_state_unchanged():
    m = KVCacheManager(4, BS, num_host_blocks=1)
    m.add_sequence(1, toks(6))
    m.fork(1, 2)
    m.suspend(2)
    before = (m.debug_state(), m.stats())
    with pytest.raises(kog.UnknownSequence):
        m.append(9, n_tokens=1)
    with pytest.raises(kog.InvalidOperation):
        m.append(2, n_tokens=1)  # suspended
    with pytest.raises(kog.InvalidOperation):
        m.add_sequence(1, toks(2))
    with pytest.raises(kog.InvalidOperation):
        m.fork(1, 2)
    with pytest.raises(kog.KVCacheFull):
        m.append(1, n_tokens=20)  # CoW + 5 blocks > 2 free + 0 cached + 0 swappable
    with pytest.raises(kog.InvalidRequest):
        m.append_batch([1, 1], [1, 1])
    with pytest.raises(kog.InvalidOperation):
        m.resume(1)
    assert (m.debug_state(), m.stats()) == before


def test_swap_out_under_pressure_then_resume():
    m = KVCacheManager(4, BS, num_host_blocks=4, bytes_per_block=64)
    m.add_sequence(1, toks(6, 10))  # blocks 0, 1
    m.suspend(1)
    m.add_sequence(2, toks(8, 50))  # blocks 2, 3
    mv = m.append(2, n_tokens=5)  # needs 2: swaps out sequence 1 (blocks 0, 1 -> host 0, 1)
    assert pairs(mv.swap_out) == [(0, 0), (1, 1)]
    assert m.state(1) == "swapped"
    assert table(m, 2) == [2, 3, 1, 0]  # block 0 was registered: cached, evicted after 1
    s = m.stats()
    assert s["blocks_swapped"] == 2 and s["bytes_swapped_out"] == 128
    with pytest.raises(kog.KVCacheFull):
        m.resume(1)
    assert m.state(1) == "swapped"
    m.free(2)  # tail first: 0, 1 to the free stack (count-only, unhashed); 3, 2 to the LRU
    assert m.debug_state()["lru"] == [3, 2]
    mv = m.resume(1)
    assert pairs(mv.swap_in) == [(0, 1), (1, 0)]  # the free stack is LIFO: 1 first
    assert table(m, 1) == [1, 0] and m.state(1) == "running"
    assert m.stats()["blocks_swapped"] == 0


def layout():
    return KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, block_size=BS, dtype=torch.bfloat16)


def write_random(store, mv, n, gen):
    """Writes fresh random K/V for n new tokens at mv.slots in every layer; returns them."""
    data = []
    for layer in range(store.layout.num_layers):
        k, v = torch.randn(2, n, 2, 8, generator=gen)
        store.apply(mv) if layer == 0 else None
        store.write(layer, mv.slots, k, v)
        data.append(torch.stack([k, v]).to(store.kv.dtype))
    return data


def gather_all(m, store, seq):
    n = m.num_tokens(seq)
    return [store.gather(layer, m.block_table(seq), n) for layer in range(store.layout.num_layers)]


def test_cow_with_real_data_neither_side_sees_the_other(gen):
    m = KVCacheManager(16, BS)
    store = KVCacheStorage(layout(), 16)
    _, mv = m.add_sequence(1, toks(6))
    base = write_random(store, mv, 6, gen)
    m.fork(1, 2)
    child = write_random(store, m.append(2, n_tokens=3), 3, gen)
    parent = write_random(store, m.append(1, n_tokens=5), 5, gen)
    for layer in range(2):
        got1, got2 = gather_all(m, store, 1)[layer], gather_all(m, store, 2)[layer]
        assert torch.equal(got1, torch.cat([base[layer], parent[layer]], dim=1))
        assert torch.equal(got2, torch.cat([base[layer], child[layer]], dim=1))


def test_swap_round_trip_is_bit_exact(gen):
    m = KVCacheManager(4, BS, num_host_blocks=4)
    store = KVCacheStorage(layout(), 4, 4)
    _, mv = m.add_sequence(1, toks(7))
    write_random(store, mv, 7, gen)
    before = [t.clone() for t in gather_all(m, store, 1)]
    m.suspend(1)
    store.apply(m.swap_out(1))
    store.kv.normal_(generator=gen)  # the device pool is reused by others meanwhile
    mv = m.resume(1)
    store.apply(mv)
    for a, b in zip(before, gather_all(m, store, 1)):
        assert torch.equal(a.view(torch.int16), b.view(torch.int16))


def test_pressure_swap_stops_at_the_prefix_a_new_prompt_reuses(gen):
    # Sequence 1 is suspended; its first two blocks are the cached prefix the new prompt of
    # sequence 3 matches. The swap that makes room for sequence 3 must take only sequence 1's
    # own blocks: the prefix blocks are about to be referenced. It once swapped the whole chain,
    # one host block per prefix block too (with too few host blocks, the same one twice).
    m = KVCacheManager(6, BS, num_host_blocks=4)
    store = KVCacheStorage(layout(), 6, 4)
    _, mv = m.add_sequence(1, toks(8, 100) + toks(5))  # blocks 0, 1 (prefix), 2, 3
    seq1 = write_random(store, mv, 13, gen)
    m.suspend(1)
    _, mv = m.add_sequence(2, toks(8, 200))  # blocks 4, 5: the pool is full
    write_random(store, mv, 8, gen)
    cached, mv = m.add_sequence(3, toks(8, 100) + [7])
    assert cached == 8
    assert pairs(mv.swap_out) == [(2, 0), (3, 1)]  # (device, host), root first
    assert m.state(1) == "swapped" and m.debug_state()["seqs"][1]["host_blocks"] == [0, 1]
    assert table(m, 3)[:2] == [0, 1]
    new = write_random(store, mv, 1, gen)
    m.free(2)
    store.apply(m.resume(1))
    assert table(m, 1)[:2] == [0, 1]
    for layer in range(2):
        got1, got3 = gather_all(m, store, 1)[layer], gather_all(m, store, 3)[layer]
        assert torch.equal(got1, seq1[layer])
        assert torch.equal(got3, torch.cat([seq1[layer][:, :8], new[layer]], dim=1))


def test_copy_blocks_rejects_bad_ids():
    store = KVCacheStorage(layout(), 4, 2)
    bad = np.array([[0, 5]], dtype=np.int32)
    with pytest.raises(kog.InvalidRequest):
        store.copy_blocks(store.kv, store.kv, bad)
    with pytest.raises(kog.InvalidRequest):
        store.copy_blocks(store.kv, store.kv, np.array([[0, 1], [1, 2]], dtype=np.int32))
