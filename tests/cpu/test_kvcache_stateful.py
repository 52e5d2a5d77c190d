"""Stateful property test: the C++ allocator against a plain-Python model of the same rules.

The model knows each sequence's tokens and state (running / suspended; 'swapped' is the
allocator's choice under pressure, seen as suspended), the pins and the expected KV of every
token. After every step: each device block is exactly one of free / referenced / cached, each
host block free or held by one swapped sequence; ref == children + sequences + pins (recomputed
here from the raw state); used + free + cached == total; every resident sequence's KV, read
through its block table from real tensors, equals what was written for it (so CoW and swap are
checked on data). A call that raises must leave the allocator state unchanged.
"""

import numpy as np
import torch
from hypothesis import settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

import kog
from kog.kvcache import KVCacheManager, KVCacheStorage, KVLayout

BS, N_BLOCKS, N_HOST = 4, 12, 6
PREFIXES = [list(range(100, 108)), list(range(200, 206)), []]  # shared "system prompts"
LAYOUT = KVLayout(num_layers=1, num_kv_heads=1, head_dim=2, block_size=BS, dtype=torch.float32)


def kv_of(tokens, start):
    """Expected KV of tokens at positions start..: K = token id, V = position."""
    pos = torch.arange(start, start + len(tokens), dtype=torch.float32)
    k = torch.tensor(tokens, dtype=torch.float32)[:, None, None].expand(-1, 1, 2)
    return k, pos[:, None, None].expand(-1, 1, 2)


class KVCacheMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.m = KVCacheManager(N_BLOCKS, BS, N_HOST, namespace="test")
        self.store = KVCacheStorage(LAYOUT, N_BLOCKS, N_HOST)
        self.seqs = {}  # id -> {"tokens": [...], "running": bool}
        self.pins = {}  # pin id -> pinned tokens
        self.next_id = 0

    # ---- helpers ---------------------------------------------------------------------------
    def snapshot(self):
        return self.m.debug_state(), self.m.stats()

    def expect_error(self, exc, fn, *args, **kw):
        before = self.snapshot()
        try:
            fn(*args, **kw)
        except exc:
            assert self.snapshot() == before, "a failed call changed the allocator"
            return True
        return False

    def apply(self, mv, tokens, start):
        self.store.apply(mv)
        assert len(mv.slots) == len(tokens)
        if tokens:
            self.store.write(0, mv.slots, *kv_of(tokens, start))

    def seq(self, data, running=None):
        ids = [s for s, v in self.seqs.items() if running is None or v["running"] == running]
        return data.draw(st.sampled_from(sorted(ids)))

    def reclaimable(self):
        s = self.m.stats()
        return s["blocks_free"] + s["blocks_cached"]

    # ---- rules -----------------------------------------------------------------------------
    @rule(prefix=st.sampled_from(PREFIXES), tail=st.lists(st.integers(0, 3), max_size=7))
    def add(self, prefix, tail):
        tokens, sid = prefix + tail, self.next_id
        self.next_id += 1
        before = self.snapshot()
        try:
            cached, mv = self.m.add_sequence(sid, tokens)
        except kog.KVCacheFull:
            assert self.snapshot() == before
            assert self.reclaimable() < -(-len(tokens) // BS)
            return
        assert cached % BS == 0 and cached <= len(tokens)
        for pinned in self.pins.values():
            if tokens[: len(pinned)] == pinned:
                assert cached >= len(pinned), "a pinned prefix missed the cache"
        self.apply(mv, tokens[cached:], cached)
        self.seqs[sid] = {"tokens": tokens, "running": True}

    @precondition(lambda self: self.seqs)
    @rule(data=st.data(), n=st.integers(1, 6), known=st.booleans())
    def append(self, data, n, known):
        sid = self.seq(data)
        s = self.seqs[sid]
        new = data.draw(st.lists(st.integers(0, 3), min_size=n, max_size=n))
        call = (lambda: self.m.append(sid, new)) if known else (lambda: self.m.append(sid, n_tokens=n))
        if not s["running"]:
            assert self.expect_error(kog.InvalidOperation, call)
            return
        before = self.snapshot()
        fits, most = self.m.can_append(sid, n), self.m.max_appendable(sid)
        assert fits == (n <= most), "can_append and max_appendable disagree"
        assert self.snapshot() == before, "the can_append verbs changed the allocator"
        try:
            mv = call()
        except kog.KVCacheFull:
            assert self.snapshot() == before
            assert not fits, "can_append said yes but append raised KVCacheFull"
            assert self.reclaimable() < -(-(len(s["tokens"]) + n) // BS) - len(s["tokens"]) // BS + 1
            return
        assert fits, "can_append said no but append succeeded"
        self.apply(mv, new, len(s["tokens"]))
        s["tokens"] = s["tokens"] + new

    @precondition(lambda self: any(s["running"] for s in self.seqs.values()))
    @rule(data=st.data())
    def append_batch(self, data):
        running = sorted(sid for sid, s in self.seqs.items() if s["running"])
        sids = data.draw(st.lists(st.sampled_from(running), min_size=1, max_size=4, unique=True))
        counts = data.draw(st.lists(st.integers(0, 5), min_size=len(sids), max_size=len(sids)))
        new = [data.draw(st.lists(st.integers(0, 3), min_size=c, max_size=c)) for c in counts]
        fit = self.m.max_appendable_batch(sids, counts)
        assert 0 <= fit <= len(sids)
        assert all(self.m.max_appendable_batch(sids[:k], counts[:k]) == min(k, fit) for k in range(len(sids) + 1))
        before = self.snapshot()
        try:
            mv = self.m.append_batch(sids, counts, [t for ts in new for t in ts])
        except kog.KVCacheFull:
            assert self.snapshot() == before and fit < len(sids)
            return
        assert fit == len(sids), "max_appendable_batch said it would not fit"
        self.store.apply(mv)
        assert len(mv.slots) == sum(counts)
        at = 0
        for sid, ts in zip(sids, new):
            if ts:
                self.store.write(0, mv.slots[at:at + len(ts)], *kv_of(ts, len(self.seqs[sid]["tokens"])))
            at += len(ts)
            self.seqs[sid]["tokens"] = self.seqs[sid]["tokens"] + ts

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def fork(self, data):
        sid, child = self.seq(data), self.next_id
        if self.m.state(sid) == "swapped":
            assert self.expect_error(kog.InvalidOperation, self.m.fork, sid, child)
            return
        self.next_id += 1
        used = self.m.stats()["blocks_used"]
        self.m.fork(sid, child)
        assert self.m.stats()["blocks_used"] == used  # a fork allocates and copies nothing
        self.seqs[child] = {"tokens": list(self.seqs[sid]["tokens"]), "running": True}

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def truncate(self, data):
        sid = self.seq(data)
        s = self.seqs[sid]
        n = data.draw(st.integers(0, len(s["tokens"])))
        if not s["running"]:
            assert self.expect_error(kog.InvalidOperation, self.m.truncate, sid, n)
            return
        self.m.truncate(sid, n)
        s["tokens"] = s["tokens"][:n]

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def name_tokens(self, data):
        """Names a span of a sequence's tokens (the model's ids are the truth: KV was written
        for them even when they were appended count-only); a wrong id or a gap is refused."""
        sid = self.seq(data)
        s = self.seqs[sid]
        n = len(s["tokens"])
        if not s["running"]:
            assert self.expect_error(kog.InvalidOperation, self.m.name_tokens, sid, 0, [])
            return
        named = self.m.debug_state()["seqs"][sid]["named"]
        start = data.draw(st.integers(0, n))
        end = data.draw(st.integers(start, n))
        ids = s["tokens"][start:end]
        if start > named:
            assert self.expect_error(kog.InvalidRequest, self.m.name_tokens, sid, start, ids)
            return
        if start < min(named, end) and data.draw(st.booleans()):
            wrong = [ids[0] + 50] + ids[1:]  # the first id is named already: it must match
            assert self.expect_error(kog.InvalidRequest, self.m.name_tokens, sid, start, wrong)
            return
        d = self.m.debug_state()
        table = self.m.block_table(sid)
        intact = all(d["hashed"][b] for b in table[: start // BS])  # the chain up to the span
        self.m.name_tokens(sid, start, ids)
        d = self.m.debug_state()
        assert d["seqs"][sid]["named"] == max(named, end)
        if intact:  # every block now full and named joined the prefix cache
            assert all(d["hashed"][b] for b in table[: max(named, end) // BS])

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def free(self, data):
        sid = self.seq(data)
        self.m.free(sid)
        del self.seqs[sid]

    @precondition(lambda self: any(s["running"] for s in self.seqs.values()))
    @rule(data=st.data())
    def suspend(self, data):
        sid = self.seq(data, running=True)
        self.m.suspend(sid)
        self.seqs[sid]["running"] = False

    @precondition(lambda self: any(not s["running"] for s in self.seqs.values()))
    @rule(data=st.data())
    def resume(self, data):
        sid = self.seq(data, running=False)
        host = len(self.m.debug_state()["seqs"][sid]["host_blocks"])
        before = self.snapshot()
        try:
            mv = self.m.resume(sid)
        except kog.KVCacheFull:
            assert self.snapshot() == before and self.reclaimable() < host
            return
        self.apply(mv, [], 0)
        self.seqs[sid]["running"] = True

    @precondition(lambda self: any(not s["running"] for s in self.seqs.values()))
    @rule(data=st.data())
    def swap_out(self, data):
        sid = self.seq(data, running=False)
        if self.m.state(sid) == "swapped":
            assert self.expect_error(kog.InvalidOperation, self.m.swap_out, sid)
            return
        if not self.expect_error(kog.KVCacheFull, lambda: self.apply(self.m.swap_out(sid), [], 0)):
            assert self.m.state(sid) == "swapped"

    @rule(prefix=st.sampled_from(PREFIXES), tail=st.lists(st.integers(0, 3), max_size=6))
    def lookup(self, prefix, tail):
        tokens = prefix + tail
        hit = self.m.lookup(tokens)
        assert hit % BS == 0 and hit <= len(tokens)

    @rule(prefix=st.sampled_from(PREFIXES[:2]))
    def pin(self, prefix):
        pin = self.m.pin(prefix)
        self.pins[pin] = prefix[: pin.num_tokens]

    @precondition(lambda self: self.pins)
    @rule(data=st.data())
    def unpin(self, data):
        pin = data.draw(st.sampled_from(sorted(self.pins, key=lambda p: p.id)))
        self.m.unpin(pin)
        del self.pins[pin]

    @rule(n=st.integers(0, 4))
    def evict(self, n):
        cached = self.m.stats()["blocks_cached"]
        assert self.m.evict(n) == min(n, cached)

    @rule(sid=st.integers(1000, 1001))
    def unknown(self, sid):
        assert self.expect_error(kog.UnknownSequence, self.m.append, sid, n_tokens=1)
        assert self.expect_error(kog.UnknownSequence, self.m.free, sid)

    # ---- invariants ------------------------------------------------------------------------
    @invariant()
    def block_states_and_ref_counts(self):
        d, s = self.m.debug_state(), self.m.stats()
        ref, parent = d["ref"], d["parent"]
        free, lru = set(d["free"]), set(d["lru"])
        referenced = {b for b in range(N_BLOCKS) if ref[b] > 0}
        assert len(free) == len(d["free"]) and len(lru) == len(d["lru"])
        assert not (free & lru) and not (free & referenced) and not (lru & referenced)
        assert free | lru | referenced == set(range(N_BLOCKS))
        assert lru == {b for b in range(N_BLOCKS) if d["registered"][b] and ref[b] == 0}
        assert sorted(d["cache"].values()) == sorted(b for b in range(N_BLOCKS) if d["registered"][b])
        assert all(parent[b] == -1 for b in free | lru)
        referrers = [0] * N_BLOCKS
        for b in referenced:
            if parent[b] >= 0:
                assert parent[b] in referenced
                referrers[parent[b]] += 1
        for info in d["seqs"].values():
            if info["tail"] >= 0:
                referrers[info["tail"]] += 1
        pinned = set()
        for _, blocks in d["pins"]:
            for b in blocks:
                referrers[b] += 1
                pinned.add(b)
        assert referrers == ref, "ref count != children + sequences + pins"
        assert s["blocks_used"] + s["blocks_free"] + s["blocks_cached"] == N_BLOCKS
        assert s["blocks_used"] == len(referenced) and s["blocks_pinned"] == len(pinned)
        held = [h for info in d["seqs"].values() for h in info["host_blocks"]]
        assert sorted(held + d["host_free"]) == list(range(N_HOST))
        assert s["blocks_swapped"] == len(held)

    @invariant()
    def sequences_match_model(self):
        d = self.m.debug_state()
        assert sorted(d["seqs"]) == sorted(self.seqs)
        for sid, s in self.seqs.items():
            info, n = d["seqs"][sid], len(s["tokens"])
            assert info["num_tokens"] == n
            assert (info["state"] == "running") == s["running"]
            chain, b = 0, info["tail"]
            while b >= 0:
                chain, b = chain + 1, d["parent"][b]
            assert chain + len(info["host_blocks"]) == -(-n // BS)
            if info["state"] != "swapped":
                got = self.store.gather(0, self.m.block_table(sid), n)
                k, v = kv_of(s["tokens"], 0)
                assert torch.equal(got[0], k) and torch.equal(got[1], v), f"KV of seq {sid} corrupt"

    @invariant()
    def known_sequences_feed_the_cache(self):
        """tokens_known: every token named and every full block registered (hashed)."""
        d = self.m.debug_state()
        for sid, info in d["seqs"].items():
            assert 0 <= info["named"] <= info["num_tokens"]
            if info["state"] == "swapped":
                continue
            full = self.m.block_table(sid)[: info["num_tokens"] // BS]
            chain = info["named"] == info["num_tokens"] and all(d["hashed"][b] for b in full)
            assert info["tokens_known"] == chain, f"seq {sid}: tokens_known disagrees with its blocks"

    @invariant()
    def block_tables_are_the_padded_tables(self):
        resident = [sid for sid in sorted(self.seqs) if self.m.state(sid) != "swapped"]
        tables = self.m.block_tables(resident)
        assert tables.dtype == np.int32 and tables.shape[0] == len(resident)
        for row, sid in zip(tables, resident):
            t = self.m.block_table(sid)
            assert list(row[: len(t)]) == list(t) and not row[len(t):].any()


KVCacheMachine.TestCase.settings = settings(max_examples=200, stateful_step_count=50, deadline=None)
TestKVCacheStateful = KVCacheMachine.TestCase
