"""Stateful property test: the engine with agent sessions under a tiny KV pool, against a plain
model of what every request must return.

Rules open / generate in / prefill / fork / suspend / append to / rollback / close sessions, add and abort
stateless requests, and step the engine. The model keeps each session's context; every finished
request's tokens must equal the fake model's oracle on the context it was given (so any KV
kept, forked, truncated, swapped, dropped or preempted wrongly shows up). Invariants: the
allocator's block accounting adds up, it holds no sequence the engine does not own, and at the
end every request finishes (none lost) and closing every session leaves no block used or
pinned.
"""

import pytest
from hypothesis import HealthCheck, settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

import kog
from kog.sampling_params import SamplingParams
from kog.testing.engine_oracle import fake_engine, oracle_tokens
from kog.testing.tiny_models import tiny_tokenizer

TOK = tiny_tokenizer()
PREFIXES = [list(range(100, 109)), list(range(200, 206))]
MAX_LEN = 40  # 10 blocks: one longest sequence plus every pin (3 blocks) fits the pool
TOKENS = st.lists(st.integers(3, 60), min_size=1, max_size=6)


def greedy(k):
    return SamplingParams(temperature=0, max_tokens=k, ignore_eos=True)


class EngineSessionsMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.host = 6
        self.engine, _ = fake_engine(TOK, num_blocks=14, block_size=4, budget=12, max_num_seqs=4,
                                     max_model_len=MAX_LEN, host_blocks=self.host)
        self.sessions = {}  # sid -> {"context": [...], "busy": rid | None}
        self.requests = {}  # rid -> {"session": sid | None, "context": [...], "k": max_tokens, "open": bool}
        self.n = 0

    # ---- helpers ---------------------------------------------------------------------------
    def new_id(self, kind):
        self.n += 1
        return f"{kind}{self.n}"

    def idle(self):
        return sorted(s for s, v in self.sessions.items() if v["busy"] is None)

    def in_flight(self):
        return sorted(r for r, v in self.requests.items() if not self.engine.get_output(r).finished)

    def collect(self):
        """Checks every request that finished and advances its session."""
        for rid in list(self.requests):
            out = self.engine.get_output(rid)
            if not out.finished:
                continue
            req = self.requests.pop(rid)
            got = out.outputs[0]
            if got.finish_reason != "abort" and not req["open"]:
                assert got.token_ids == oracle_tokens(req["context"], greedy(req["k"]), TOK.vocab_size,
                                                      TOK.eos_token_id), rid
            sid = req["session"]
            if sid is not None and sid in self.sessions:
                if got.finish_reason != "abort" and not req["open"]:
                    self.sessions[sid]["context"] = req["context"] + got.token_ids
                self.sessions[sid]["busy"] = None
            self.engine.release(rid)

    # ---- rules -----------------------------------------------------------------------------
    @precondition(lambda self: len(self.sessions) < 3)
    @rule(prefix=st.sampled_from(PREFIXES), tail=st.lists(st.integers(3, 60), max_size=3), pin=st.booleans())
    def open(self, prefix, tail, pin):
        sid = self.new_id("s")
        tail = [] if pin else tail  # pins stay within 3 distinct blocks: the pool never fills with them
        rid = self.engine.sessions.open(sid, prefix + tail, pin=pin)
        self.sessions[sid] = {"context": prefix + tail, "busy": rid}
        self.requests[rid] = {"session": sid, "context": prefix + tail, "k": 1, "open": True}

    @precondition(lambda self: self.idle())
    @rule(data=st.data(), k=st.integers(1, 5))
    def generate(self, data, k):
        sid = data.draw(st.sampled_from(self.idle()))
        context = self.sessions[sid]["context"]
        rid = self.new_id("g")
        if len(context) >= MAX_LEN:
            with pytest.raises(kog.InvalidRequest):
                self.engine.sessions.generate(sid, rid, greedy(k))
            return
        self.engine.sessions.generate(sid, rid, greedy(k))
        self.sessions[sid]["busy"] = rid
        self.requests[rid] = {"session": sid, "context": list(context), "k": k, "open": False}

    @precondition(lambda self: self.idle())
    @rule(data=st.data())
    def prefill(self, data):
        sid = data.draw(st.sampled_from(self.idle()))
        context = self.sessions[sid]["context"]
        rid = self.new_id("p")
        if len(context) >= MAX_LEN:
            with pytest.raises(kog.InvalidRequest):
                self.engine.sessions.prefill(sid, rid)
            return
        self.engine.sessions.prefill(sid, rid)
        self.sessions[sid]["busy"] = rid
        self.requests[rid] = {"session": sid, "context": list(context), "k": 1, "open": True}

    @rule(tokens=st.lists(st.integers(3, 60), min_size=1, max_size=24), k=st.integers(1, 8))
    def add_request(self, tokens, k):
        rid = self.new_id("r")
        self.engine.add_request(rid, tokens, greedy(k))
        self.requests[rid] = {"session": None, "context": tokens, "k": k, "open": False}

    @rule(seed=st.integers(0, 2**16), n=st.integers(2, 4))
    def burst(self, seed, n):
        """Several long requests at once: KV pressure (eviction, swap, preemption, drops)."""
        for i in range(n):
            tokens = [3 + (seed * 7 + i * 13 + j * 5) % 57 for j in range(12 + i)]
            self.add_request(tokens, 8)

    @precondition(lambda self: self.idle() and len(self.sessions) < 4)
    @rule(data=st.data(), n=st.integers(1, 2))
    def fork(self, data, n):
        sid = data.draw(st.sampled_from(self.idle()))
        children = [self.new_id("f") for _ in range(n)]
        self.engine.sessions.fork(sid, children)
        for c in children:
            self.sessions[c] = {"context": list(self.sessions[sid]["context"]), "busy": None}

    @precondition(lambda self: self.idle())
    @rule(data=st.data(), offload=st.booleans())
    def suspend(self, data, offload):
        sid = data.draw(st.sampled_from(self.idle()))
        try:
            state = self.engine.sessions.suspend(sid, offload)
        except kog.KVCacheFull:
            assert offload  # the host pool is full
            return
        assert state in ("suspended", "swapped", "dropped")

    @precondition(lambda self: self.idle())
    @rule(data=st.data(), tokens=TOKENS)
    def append(self, data, tokens):
        sid = data.draw(st.sampled_from(self.idle()))
        context = self.sessions[sid]["context"]
        if len(context) + len(tokens) >= MAX_LEN:
            with pytest.raises(kog.InvalidRequest):
                self.engine.sessions.append(sid, tokens)
            return
        self.engine.sessions.append(sid, tokens)
        self.sessions[sid]["context"] = context + tokens

    @precondition(lambda self: self.idle())
    @rule(data=st.data())
    def rollback(self, data):
        sid = data.draw(st.sampled_from(self.idle()))
        context = self.sessions[sid]["context"]
        n = data.draw(st.integers(1, len(context)))
        self.engine.sessions.rollback(sid, n)
        self.sessions[sid]["context"] = context[:n]

    @precondition(lambda self: self.sessions)
    @rule(data=st.data())
    def close(self, data):
        sid = data.draw(st.sampled_from(sorted(self.sessions)))
        self.engine.sessions.close(sid)
        del self.sessions[sid]
        self.collect()  # its request in flight, if any, finished as aborted

    @precondition(lambda self: self.in_flight())
    @rule(data=st.data())
    def abort(self, data):
        rid = data.draw(st.sampled_from(self.in_flight()))
        self.engine.abort(rid)
        self.collect()

    @rule(steps=st.integers(1, 8))
    def step(self, steps):
        for _ in range(steps):
            self.engine.step()
        self.collect()

    # ---- invariants ------------------------------------------------------------------------
    @invariant()
    def accounting_adds_up(self):
        s = self.engine.kv.stats()
        assert s["blocks_used"] + s["blocks_free"] + s["blocks_cached"] == s["num_blocks"]
        assert s["blocks_swapped"] + s["host_blocks_free"] == self.host
        # every allocator sequence is a session's or an unfinished stateless request's
        stateless = sum(1 for v in self.requests.values() if v["session"] is None)
        assert s["num_sequences"] <= len(self.sessions) + stateless

    @invariant()
    def session_contexts_agree(self):
        for sid, v in self.sessions.items():
            if v["busy"] is None:
                info = self.engine.sessions.info(sid)
                assert info["token_ids"] == v["context"]
                assert info["num_computed"] < len(v["context"])

    def teardown(self):
        for _ in range(3000):  # no request is ever lost: everything finishes
            if not self.in_flight():
                break
            self.engine.step()
            self.collect()
        assert not self.in_flight() and not self.engine.has_unfinished()
        self.collect()
        for sid in list(self.sessions):
            self.engine.sessions.close(sid)
        s = self.engine.kv.stats()
        assert s["blocks_used"] == 0 and s["blocks_pinned"] == 0 and s["num_sequences"] == 0
        assert s["blocks_swapped"] == 0


EngineSessionsMachine.TestCase.settings = settings(
    max_examples=60, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
TestEngineSessions = EngineSessionsMachine.TestCase
