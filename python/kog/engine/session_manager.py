"""Agent sessions in the engine: a context whose KV outlives each request.

A session holds one KV sequence (one allocator seq id) for its whole life. Its opening prefix
(system prompt + tool schemas) is prefilled once and pinned in the prefix cache; every
generation continues from the session's tokens and its output tokens join the context; between
requests the sequence is parked (suspended in the allocator, out of the batch), where memory
pressure may swap it to the host pool or, last of all, drop it (then it is recomputed).

Invariant of an idle session: token_ids[:seq.num_computed] have KV in the allocator under
seq.seq_id (or seq.num_computed == 0 and the allocator does not know the id), and
seq.num_computed < len(token_ids): the last token is always pending, so the next generation
has a token to compute its first logits from. A generation's prefill computes exactly
token_ids[num_computed:] (appended tokens plus the pending one).

Every method is a plain call on the engine's thread between steps. SessionManager is the
engine's helper; the public entry points are LLMEngine's *_session methods.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence as Seq

from kog.engine import structured
from kog.engine.sequence import Sequence
from kog.errors import InvalidOperation, InvalidRequest, KVCacheFull
from kog.kvcache import Pin
from kog.sampling_params import SamplingParams

if TYPE_CHECKING:
    from kog.engine.engine import LLMEngine


@dataclass(eq=False)
class SessionState:
    session_id: str
    token_ids: list[int]         # the context; grows with outputs and appends
    seq: Sequence                # holds the KV: seq_id, and num_computed tokens with KV
    prefix: list[int]            # the opening tokens (pinned when pin is set)
    pin: Pin | None = None
    want_pin: bool = True
    request_id: str | None = None  # the request in flight (the prefix prefill or a generation)


class SessionManager:
    """Sessions of one LLMEngine (see the module docstring for the invariants)."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.sessions: dict[str, SessionState] = {}

    # ---- operations (called through LLMEngine) ------------------------------------------------
    def open(self, session_id: str, token_ids: Seq[int], pin: bool, priority: int) -> str:
        if session_id in self.sessions:
            raise InvalidRequest(f"session id {session_id!r} is already in use")
        ids = self.engine._validate_prompt(token_ids)
        rid = f"session-open:{session_id}"
        seq = self._sequence(rid, session_id, ids, SamplingParams(), priority)
        seq.prefill_only = True
        st = SessionState(session_id, list(ids), seq, list(ids), want_pin=pin, request_id=rid)
        self.engine._register(rid, seq, None)
        self.sessions[session_id] = st
        self.engine.scheduler.add(seq)
        return rid

    def generate(self, session_id: str, request_id: str, params: SamplingParams, priority: int) -> None:
        if params.n != 1:
            raise InvalidRequest("a session generates one completion; use fork_session for branches")
        params.validate()
        self._queue(session_id, request_id, params, priority, prefill_only=False)

    def prefill(self, session_id: str, request_id: str, priority: int) -> None:
        self._queue(session_id, request_id, SamplingParams(), priority, prefill_only=True)

    def append(self, session_id: str, token_ids: Seq[int]) -> None:
        st = self._idle(session_id)
        ids = self.engine._validate_ids(token_ids)
        self.engine._validate_prompt(st.token_ids + ids)
        st.token_ids.extend(ids)

    def fork(self, session_id: str, child_ids: Seq[str]) -> None:
        st = self._idle(session_id)
        if len(set(child_ids)) != len(child_ids) or any(c in self.sessions for c in child_ids):
            raise InvalidRequest("fork: child session ids must be new and distinct")
        kv, parent = self.engine.kv, st.seq
        if not self._resident(parent):
            self._release_kv(parent)  # could not swap it in: the children recompute
        for cid in child_ids:
            child = self._sequence(f"session:{cid}", cid, st.token_ids, SamplingParams(), parent.priority)
            if parent.seq_id in kv:
                kv.fork(parent.seq_id, child.seq_id)  # O(1): shares every block copy-on-write
                child.num_computed = parent.num_computed
            pin = kv.pin(st.prefix) if st.pin is not None else None
            self.sessions[cid] = SessionState(cid, list(st.token_ids), child, list(st.prefix), pin, st.want_pin)
            self.engine.scheduler.park(child)
        if parent.seq_id in kv and kv.state(parent.seq_id) == "running":
            kv.suspend(parent.seq_id)

    def suspend(self, session_id: str, offload: bool) -> str:
        st = self._idle(session_id)
        kv, sid = self.engine.kv, st.seq.seq_id
        if offload:
            if kv.num_host_blocks == 0:
                raise InvalidOperation("suspend(offload=True) needs a host swap pool (num_host_blocks > 0)")
            if sid in kv and kv.state(sid) == "suspended":
                self.engine.runner.kv.apply(kv.swap_out(sid))
        return kv.state(sid) if sid in kv else "dropped"

    def rollback(self, session_id: str, n_tokens: int) -> None:
        st = self._idle(session_id)
        if not 1 <= n_tokens <= len(st.token_ids):
            raise InvalidRequest(f"rollback: n_tokens must be in [1, {len(st.token_ids)}], got {n_tokens}")
        seq, kv = st.seq, self.engine.kv
        keep = min(seq.num_computed, n_tokens - 1)  # the last kept token stays pending
        if keep < seq.num_computed:
            if self._resident(seq):
                kv.truncate(seq.seq_id, keep)
                seq.num_computed = keep
                kv.suspend(seq.seq_id)
            else:
                self._release_kv(seq)
        del st.token_ids[n_tokens:]

    def close(self, session_id: str) -> None:
        st = self.sessions.get(session_id)
        if st is None:
            return
        if st.request_id is not None:
            self.engine.abort(st.request_id)
        self.engine.scheduler.unpark(st.seq)
        self._release_kv(st.seq)
        if st.pin is not None:
            self.engine.kv.unpin(st.pin)
        del self.sessions[session_id]

    def info(self, session_id: str) -> dict:
        st = self._get(session_id)
        sid, kv = st.seq.seq_id, self.engine.kv
        return {"token_ids": list(st.token_ids), "num_computed": st.seq.num_computed,
                "kv_state": kv.state(sid) if sid in kv else "dropped",
                "pinned_tokens": st.pin.num_tokens if st.pin else 0, "request_id": st.request_id}

    # ---- engine hooks --------------------------------------------------------------------------
    def on_done(self, seq: Sequence) -> None:
        """seq's request ended (prefix prefilled, stop, length or abort): park its KV."""
        st = self.sessions[seq.session_id]
        if seq.finish_reason == "abort":
            keep = min(seq.num_computed, len(st.token_ids) - 1)  # outputs are not kept
            if keep < seq.num_computed:
                if seq.seq_id in self.engine.kv and self.engine.kv.state(seq.seq_id) == "running":
                    self.engine.kv.truncate(seq.seq_id, keep)
                    seq.num_computed = keep
                else:
                    self._release_kv(seq)
        else:
            st.token_ids = list(seq.token_ids)  # a copy: the sequence's list stays as its outputs saw it
        st.request_id = None
        self.engine.scheduler.park(seq)
        if seq.prefill_only and seq.finish_reason != "abort" and st.want_pin and st.pin is None:
            st.pin = self.engine.kv.pin(st.prefix)  # the prefix's full blocks, computed by now

    # ---- internal helpers ---------------------------------------------------------------------
    def _queue(self, session_id: str, request_id: str, params: SamplingParams, priority: int,
               prefill_only: bool) -> None:
        """Queues a request on the session's KV: a new Sequence under the same seq id."""
        st = self._idle(session_id)
        ids = self.engine._validate_prompt(st.token_ids)
        if request_id in self.engine._requests:
            raise InvalidRequest(f"request id {request_id!r} is already in use")
        old = st.seq
        seq = self._sequence(request_id, session_id, ids, params, priority, old.seq_id)
        seq.num_computed = seq.num_cached_tokens = old.num_computed
        seq.prefill_only = prefill_only
        self.engine.scheduler.unpark(old)
        st.seq, st.request_id = seq, request_id
        self.engine._register(request_id, seq, None)
        self.engine.scheduler.add(seq)

    def _sequence(self, rid: str, session_id: str, ids: list[int], params: SamplingParams,
                  priority: int, seq_id: int | None = None) -> Sequence:
        self.engine.speculator.check(params)
        seq = self.engine._new_sequence(rid, 0, list(ids), params, priority, seq_id)
        seq.session_id = session_id
        # A grammar constrains this request's output only (the context is not re-parsed).
        structured.admit(seq, self.engine.tokenizer, self.engine.eos_token_ids, self.engine.runner.vocab_size)
        return seq

    def _get(self, session_id: str) -> SessionState:
        st = self.sessions.get(session_id)
        if st is None:
            raise InvalidRequest(f"unknown session {session_id!r}")
        return st

    def _idle(self, session_id: str) -> SessionState:
        st = self._get(session_id)
        if st.request_id is not None:
            raise InvalidOperation(f"session {session_id!r} has a request in flight ({st.request_id!r})")
        return st

    def _resident(self, seq: Sequence) -> bool:
        """Makes a parked sequence's KV running on the device (swapping it in if needed).
        False if it has no KV or cannot be swapped in now."""
        kv = self.engine.kv
        if seq.seq_id not in kv:
            return False
        if kv.state(seq.seq_id) != "running":
            try:
                self.engine.runner.kv.apply(kv.resume(seq.seq_id))
            except KVCacheFull:
                return False
        return True

    def _release_kv(self, seq: Sequence) -> None:
        if seq.seq_id in self.engine.kv:
            self.engine.kv.free(seq.seq_id)
        seq.num_computed = 0
