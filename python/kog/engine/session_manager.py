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

Every method is a plain call on the engine's thread between steps: the engine exposes its
manager as `LLMEngine.sessions` and calls `on_done` when a session's request ends.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator, Sequence as Seq

from kog.engine.scheduler import Scheduler
from kog.engine.sequence import Sequence
from kog.errors import InvalidOperation, InvalidRequest, KVCacheFull
from kog.kvcache import KVCacheManager, KVMoves, Pin
from kog.sampling_params import SamplingParams


@dataclass(frozen=True)
class EngineRequests:
    """How sessions create, queue and end requests in the engine that owns them; the engine
    passes its own functions, so that session requests are exactly its other requests.

    Fields:
        validate_ids: token ids -> them as ints; InvalidRequest when one is outside the vocabulary.
        validate_prompt: as validate_ids, and InvalidRequest for an empty prompt or one that
            leaves no room for a generated token.
        check_params: params -> None; InvalidRequest for a request the engine cannot serve
            (speculation it has no drafter for).
        new_sequence: (request_id, index, ids, params, priority, seq_id) -> a Sequence; seq_id
            None draws a new allocator seq id.
        admit_grammar: seq -> None; attaches its params' output constraint.
        is_request: request_id -> whether the engine knows it (in flight or not yet released).
        register: (request_id, seq, prompt text) -> None; get_output(request_id) reports seq from now on.
        abort: request_id -> None; ends it at once (on_done then parks its session).
    """

    validate_ids: Callable[[Seq[int]], list[int]]
    validate_prompt: Callable[[Seq[int]], list[int]]
    check_params: Callable[[SamplingParams], None]
    new_sequence: Callable[[str, int, list[int], SamplingParams, int, int | None], Sequence]
    admit_grammar: Callable[[Sequence], None]
    is_request: Callable[[str], bool]
    register: Callable[[str, Sequence, str | None], None]
    abort: Callable[[str], None]


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
    """The sessions of one LLMEngine (see the module docstring for the invariants).

    Args:
        kv: the engine's block allocator (sessions fork, truncate, pin and park its sequences).
        apply_moves: performs an allocator call's copies (swap in / out) on the runner's KV.
        scheduler: queues the sessions' requests and parks their sequences between requests.
        requests: the engine's request functions (EngineRequests).
    """

    def __init__(self, kv: KVCacheManager, apply_moves: Callable[[KVMoves], None], scheduler: Scheduler,
                 requests: EngineRequests) -> None:
        self.kv = kv
        self.apply_moves = apply_moves
        self.scheduler = scheduler
        self.requests = requests
        self._sessions: dict[str, SessionState] = {}

    # ---- public API ---------------------------------------------------------------------------
    def open(self, session_id: str, prompt_token_ids: Seq[int], pin: bool = True, priority: int = 0) -> str:
        """Opens a session on a prefix (system prompt + tools) and queues its prefill.

        The prefix's KV is computed once (all tokens but the last, which stays pending) and its
        full blocks pinned in the prefix cache. The session is busy until then.

        Returns:
            the id of the prefill request, "session-open:<session_id>" (the engine's
            get_output(id).finished tells when it is done; it reports prefill_tokens_computed
            and num_cached_tokens, and no output tokens).
        """
        if session_id in self._sessions:
            raise InvalidRequest(f"session id {session_id!r} is already in use")
        ids = self.requests.validate_prompt(prompt_token_ids)
        rid = f"session-open:{session_id}"
        seq = self._sequence(rid, session_id, ids, SamplingParams(), priority)
        seq.prefill_only = True
        st = SessionState(session_id, list(ids), seq, list(ids), want_pin=pin, request_id=rid)
        self.requests.register(rid, seq, None)
        self._sessions[session_id] = st
        self.scheduler.add(seq)
        return rid

    def generate(self, session_id: str, request_id: str, params: SamplingParams, priority: int = 0) -> None:
        """The engine's add_request on a session: the prompt is the session's context, only its
        tokens without KV are prefilled, and when the request ends normally its output tokens
        join the context. params.n must be 1 (fork for branches); no prompt_logprobs (most of
        the context's KV is computed already)."""
        if params.n != 1:
            raise InvalidRequest("a session generates one completion; use fork for branches")
        if params.prompt_logprobs is not None:
            raise InvalidRequest("prompt_logprobs is not supported on a session's generations")
        params.validate()
        self._queue(session_id, request_id, params, priority, prefill_only=False)

    def prefill(self, session_id: str, request_id: str, priority: int = 0) -> None:
        """Queues a prefill-only request computing an idle session's pending tokens (all but
        the last). Run it before fork after an append: each branch would otherwise compute the
        appended tokens itself. Its output has no tokens."""
        self._queue(session_id, request_id, SamplingParams(), priority, prefill_only=True)

    def append(self, session_id: str, token_ids: Seq[int]) -> None:
        """Adds tokens (a tool result, the next user turn) to an idle session's context; its
        next generation prefills them."""
        st = self._idle(session_id)
        ids = self.requests.validate_ids(token_ids)
        self.requests.validate_prompt(st.token_ids + ids)
        st.token_ids.extend(ids)

    def fork(self, session_id: str, child_ids: Seq[str]) -> None:
        """Opens one idle session per child id with the parent's context, sharing its KV
        copy-on-write (O(1) per child, no copies) and pinning the same prefix."""
        st = self._idle(session_id)
        if len(set(child_ids)) != len(child_ids) or any(c in self._sessions for c in child_ids):
            raise InvalidRequest("fork: child session ids must be new and distinct")
        kv, parent = self.kv, st.seq
        if not self._resident(parent):
            self._release_kv(parent)  # could not swap it in: the children recompute
        for cid in child_ids:
            child = self._sequence(f"session:{cid}", cid, st.token_ids, SamplingParams(), parent.priority)
            if parent.seq_id in kv:
                kv.fork(parent.seq_id, child.seq_id)  # O(1): shares every block copy-on-write
                child.num_computed = parent.num_computed
            pin = kv.pin(st.prefix) if st.pin is not None else None
            self._sessions[cid] = SessionState(cid, list(st.token_ids), child, list(st.prefix), pin, st.want_pin)
            self.scheduler.park(child)
        if parent.seq_id in kv and kv.state(parent.seq_id) == "running":
            kv.suspend(parent.seq_id)

    def suspend(self, session_id: str, offload: bool = False) -> str:
        """Declares an idle session waiting (a tool runs). Its KV is already out of the batch
        and swappable under pressure; offload=True swaps it to the host pool now.

        Returns:
            where its KV is: "suspended" (device), "swapped" (host) or "dropped" (recomputed).
        Raises:
            InvalidOperation: offload without a host pool. KVCacheFull: the host pool is full.
        """
        st = self._idle(session_id)
        kv, sid = self.kv, st.seq.seq_id
        if offload:
            if kv.num_host_blocks == 0:
                raise InvalidOperation("suspend(offload=True) needs a host swap pool (num_host_blocks > 0)")
            if sid in kv and kv.state(sid) == "suspended":
                self.apply_moves(kv.swap_out(sid))
        return kv.state(sid) if sid in kv else "dropped"

    def rollback(self, session_id: str, n_tokens: int) -> None:
        """Keeps the first n_tokens of an idle session's context (backtracking); the KV past
        them is released (allocator truncate)."""
        st = self._idle(session_id)
        if not 1 <= n_tokens <= len(st.token_ids):
            raise InvalidRequest(f"rollback: n_tokens must be in [1, {len(st.token_ids)}], got {n_tokens}")
        seq, kv = st.seq, self.kv
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
        """Aborts the session's request in flight, frees its KV and unpins its prefix
        (unknown ids are ignored)."""
        st = self._sessions.get(session_id)
        if st is None:
            return
        if st.request_id is not None:
            self.requests.abort(st.request_id)
        self.scheduler.unpark(st.seq)
        self._release_kv(st.seq)
        if st.pin is not None:
            self.kv.unpin(st.pin)
        del self._sessions[session_id]

    def info(self, session_id: str) -> dict:
        """token_ids (a copy of the context), num_computed (tokens with KV), kv_state,
        pinned_tokens, request_id (the request in flight, or None)."""
        st = self._get(session_id)
        sid, kv = st.seq.seq_id, self.kv
        return {"token_ids": list(st.token_ids), "num_computed": st.seq.num_computed,
                "kv_state": kv.state(sid) if sid in kv else "dropped",
                "pinned_tokens": st.pin.num_tokens if st.pin else 0, "request_id": st.request_id}

    def request_in_flight(self, session_id: str) -> str | None:
        """The id of the request running on the session, or None when it is idle."""
        return self._get(session_id).request_id

    def __contains__(self, session_id: object) -> bool:
        """Whether a session with this id is open."""
        return session_id in self._sessions

    def __iter__(self) -> Iterator[str]:
        """The open sessions' ids (a snapshot: closing while iterating is fine)."""
        return iter(list(self._sessions))

    def __len__(self) -> int:
        return len(self._sessions)

    # ---- engine hook ---------------------------------------------------------------------------
    def on_done(self, seq: Sequence) -> None:
        """seq's request ended (prefix prefilled, stop, length or abort): park its KV."""
        st = self._sessions[seq.session_id]
        if seq.finish_reason == "abort":
            keep = min(seq.num_computed, len(st.token_ids) - 1)  # outputs are not kept
            if keep < seq.num_computed:
                if seq.seq_id in self.kv and self.kv.state(seq.seq_id) == "running":
                    self.kv.truncate(seq.seq_id, keep)
                    seq.num_computed = keep
                else:
                    self._release_kv(seq)
        else:
            st.token_ids = list(seq.token_ids)  # a copy: the sequence's list stays as its outputs saw it
        st.request_id = None
        self.scheduler.park(seq)
        if seq.prefill_only and seq.finish_reason != "abort" and st.want_pin and st.pin is None:
            st.pin = self.kv.pin(st.prefix)  # the prefix's full blocks, computed by now

    # ---- internal helpers ---------------------------------------------------------------------
    def _queue(self, session_id: str, request_id: str, params: SamplingParams, priority: int,
               prefill_only: bool) -> None:
        """Queues a request on the session's KV: a new Sequence under the same seq id."""
        st = self._idle(session_id)
        ids = self.requests.validate_prompt(st.token_ids)
        if self.requests.is_request(request_id):
            raise InvalidRequest(f"request id {request_id!r} is already in use")
        old = st.seq
        seq = self._sequence(request_id, session_id, ids, params, priority, old.seq_id)
        seq.num_computed = seq.num_cached_tokens = old.num_computed
        seq.prefill_only = prefill_only
        self.scheduler.unpark(old)
        st.seq, st.request_id = seq, request_id
        self.requests.register(request_id, seq, None)
        self.scheduler.add(seq)

    def _sequence(self, rid: str, session_id: str, ids: list[int], params: SamplingParams,
                  priority: int, seq_id: int | None = None) -> Sequence:
        self.requests.check_params(params)
        seq = self.requests.new_sequence(rid, 0, list(ids), params, priority, seq_id)
        seq.session_id = session_id
        # A grammar constrains this request's output only (the context is not re-parsed).
        self.requests.admit_grammar(seq)
        return seq

    def _get(self, session_id: str) -> SessionState:
        st = self._sessions.get(session_id)
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
        kv = self.kv
        if seq.seq_id not in kv:
            return False
        if kv.state(seq.seq_id) != "running":
            try:
                self.apply_moves(kv.resume(seq.seq_id))
            except KVCacheFull:
                return False
        return True

    def _release_kv(self, seq: Sequence) -> None:
        if seq.seq_id in self.kv:
            self.kv.free(seq.seq_id)
        seq.num_computed = 0
