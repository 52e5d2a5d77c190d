"""AsyncEngine: an LLMEngine stepping in its own thread, fed and read from asyncio.

    engine = AsyncEngine(llm.engine, max_waiting=64)
    async for update in engine.generate(prompt_ids, SamplingParams(max_tokens=32)):
        print(update.deltas[0].text, end="")
    await engine.shutdown(drain=True)

NOTE: only the loop thread touches the LLMEngine (scheduler, KV allocator, runner). Every other
thread talks to it through a command queue under one lock, and hears back through asyncio
queues filled with `loop.call_soon_threadsafe`. The native steps release the GIL, so the event
loop keeps serving while a step runs. Replies of an iteration are sent after its stats snapshot,
so a consumer that sees its request end also sees the KV it held released in stats().
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
from collections import deque
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable, Sequence as Seq

from kog.engine.engine import LLMEngine
from kog.engine.outputs import StreamDelta
from kog.engine.request_stream import END, RequestStream, RequestUpdate
from kog.errors import EngineDraining, EngineStepError, QueueFull, SessionClosed
from kog.parallel.transport import TransportError
from kog.sampling_params import SamplingParams

log = logging.getLogger("kog.engine")

@dataclass
class _Add:
    """Requests queued in the engine together, all or none (one loop iteration, before a step)."""

    request_ids: list[str]
    submits: list[Callable[[LLMEngine], Any]]  # each queues one request (add_request, sessions.generate, ...)
    streams: list[RequestStream]
    accepted: asyncio.Future = field(repr=False)
    silent: bool = False  # prefill-only: produces no stream delta


@dataclass
class _Call:
    fn: Callable[..., Any]
    args: tuple
    done: asyncio.Future = field(repr=False)


@dataclass
class _Value:
    value: Any  # a call's result, told apart from "no error" (None) and an exception


class AsyncEngine:
    """Runs `engine.step()` in a background thread while requests come and go from asyncio.

    Args:
        engine: the engine to drive; from now on only the loop thread may call it.
        max_waiting: most requests queued and not yet running; one more raises QueueFull. A
            batch (add_requests) is checked once: refused when the queue is full, else queued
            whole, even past the limit.
    """

    def __init__(self, engine: LLMEngine, max_waiting: int = 256) -> None:
        self.engine = engine
        self.max_waiting = max_waiting
        self._wake = threading.Condition(threading.Lock())
        self._commands: deque[_Add | _Call | tuple[str, str | None]] = deque()  # guarded by _wake
        self._pending_adds = 0        # guarded by _wake: submitted, not yet seen by the loop
        self._accepting = True
        self._closing = False         # the loop exits once no request is in flight
        self._dead: EngineStepError | None = None
        self._streams: dict[str, RequestStream] = {}  # loop thread only
        self._silent: set[str] = set()  # loop thread only: prefill-only requests in _streams
        self._outbox: list[tuple[RequestStream | asyncio.Future, Any]] = []  # loop thread only
        self._ids = itertools.count()
        self._stats = self._collect_stats()
        self._thread = threading.Thread(target=self._run, name="kog-engine-loop", daemon=True)
        self._thread.start()

    # ---- public API -----------------------------------------------------------------------------
    async def add_request(self, prompt_token_ids: Seq[int], params: SamplingParams, request_id: str | None = None,
                          priority: int = 0, prompt: str | None = None) -> RequestStream:
        """Queues a request once the loop thread accepted it.

        Returns:
            The request's stream of updates.
        Raises:
            InvalidRequest: the engine rejected the prompt or the parameters.
            QueueFull: max_waiting requests are already waiting.
            EngineDraining: shutdown() was called.
            EngineStepError: the engine failed earlier and cannot run anything.
        """
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        return (await self.add_requests([prompt_token_ids], params, [rid], priority, [prompt]))[0]

    async def add_requests(self, prompts: Seq[Seq[int]], params: SamplingParams, request_ids: Seq[str],
                           priority: int = 0, texts: Seq[str | None] | None = None) -> list[RequestStream]:
        """Queues one request per prompt, all in the same loop iteration: they are all in the
        engine before its next step, which admits as many as its budget allows. All or none:
        when one is refused, none stays queued.

        Returns:
            The requests' streams, in the order of prompts.
        Raises:
            As add_request (the first refusal).
        """
        items = []
        for rid, ids, text in zip(request_ids, [list(p) for p in prompts], texts or [None] * len(prompts), strict=True):
            items.append((rid, lambda e, rid=rid, ids=ids, text=text: e.add_request(rid, ids, params, text, priority)))
        return await self._submit(items)

    async def add_session_request(self, session_id: str, params: SamplingParams | None, request_id: str | None = None,
                                  priority: int = 0) -> RequestStream:
        """A generation on a session (params) or, with params None, a prefill-only request over
        its pending tokens. Closing the stream early aborts it: the session's context stays as
        it was before (docs/SESSIONS.md). Errors as add_request, plus InvalidOperation (the
        session has a request in flight)."""
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        if params is None:
            return (await self._submit([(rid, lambda e: e.sessions.prefill(session_id, rid, priority))], True))[0]
        return (await self._submit([(rid, lambda e: e.sessions.generate(session_id, rid, params, priority))]))[0]

    async def open_session(self, session_id: str, prompt_token_ids: Seq[int], pin: bool = True,
                           priority: int = 0) -> RequestStream:
        """engine.sessions.open; the stream ends when the prefix's KV is computed."""
        ids = list(prompt_token_ids)
        open_ = (f"session-open:{session_id}", lambda e: e.sessions.open(session_id, ids, pin, priority))
        return (await self._submit([open_], silent=True))[0]

    async def close_session(self, session_id: str) -> bool:
        """engine.sessions.close; the session's request in flight ends at once: its stream
        gets a last update (finish_reason "abort", its KV freed) then raises SessionClosed.

        Returns:
            False when no session has this id (closing is idempotent).
        Raises:
            EngineDraining, EngineStepError: as call().
        """
        return await self.call(self._close_session, session_id)

    async def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Runs fn(*args) on the loop thread between two steps (any LLMEngine method, or a
        closure making several calls atomically) and returns its result or raises its exception.

        Raises:
            EngineDraining, EngineStepError: the loop is stopping or stopped (fn never runs).
        """
        call = _Call(fn, args, asyncio.get_running_loop().create_future())
        with self._wake:
            self._check_accepting()
            self._commands.append(call)
            self._wake.notify()
        return await call.done

    async def _submit(self, items: list[tuple[str, Callable[[LLMEngine], Any]]],
                      silent: bool = False) -> list[RequestStream]:
        """Queues (request id, submit) pairs as one _Add command; returns their streams once accepted."""
        loop = asyncio.get_running_loop()
        rids = [rid for rid, _ in items]
        add = _Add(rids, [submit for _, submit in items], [RequestStream(rid, loop, self.abort) for rid in rids],
                   loop.create_future(), silent)
        with self._wake:
            self._check_accepting()
            if self._pending_adds + self._stats["waiting"] >= self.max_waiting:
                raise QueueFull(f"{self.max_waiting} requests are already waiting; retry later")
            self._pending_adds += len(rids)
            self._commands.append(add)
            self._wake.notify()
        try:
            await add.accepted
        except asyncio.CancelledError:
            for rid in rids:  # commands run in order: these aborts come after the add
                self.abort(rid)
            raise
        return add.streams

    async def generate(self, prompt_token_ids: Seq[int], params: SamplingParams, request_id: str | None = None,
                       priority: int = 0, prompt: str | None = None) -> AsyncIterator[RequestUpdate]:
        """Yields the request's updates until it finishes; see add_request for the errors.

        Leaving the iteration early (break, exception, cancellation) aborts the request.
        """
        stream = await self.add_request(prompt_token_ids, params, request_id, priority, prompt)
        try:
            async for update in stream:
                yield update
        finally:
            stream.close()

    def abort(self, request_id: str) -> None:
        """Stops a request and frees its KV before the next step (thread-safe; unknown ids are ignored)."""
        self._command(("abort", request_id))

    def stats(self) -> dict[str, Any]:
        """Requests running and waiting, the KV allocator's counters (blocks, prefix queries and
        hits, ...) and kv_usage in [0, 1]; as of the end of the loop's latest iteration."""
        with self._wake:
            return dict(self._stats, accepting=self._accepting, dead=self._dead is not None)

    @property
    def is_accepting(self) -> bool:
        """False once shutdown() began or the engine failed."""
        return self._accepting and self._dead is None

    @property
    def dead_error(self) -> EngineStepError | None:
        """The failure that stopped the engine, if one did."""
        return self._dead

    async def shutdown(self, drain: bool = True, timeout: float | None = None) -> bool:
        """Refuses new requests (EngineDraining), then waits for those in flight to finish (or
        aborts them when drain is False) and stops the loop thread.

        Returns:
            True when the loop thread ended within `timeout` seconds.
        """
        self._begin_shutdown(drain)
        await asyncio.to_thread(self._thread.join, timeout)
        return not self._thread.is_alive()

    def close(self, drain: bool = False, timeout: float | None = None) -> bool:
        """shutdown() for code without an event loop; aborts what runs unless drain."""
        self._begin_shutdown(drain)
        self._thread.join(timeout)
        return not self._thread.is_alive()

    # ---- internal helpers -----------------------------------------------------------------------
    def _check_accepting(self) -> None:
        if self._dead is not None:
            raise EngineStepError(f"the engine is stopped after an earlier failure: {self._dead}")
        if not self._accepting:
            raise EngineDraining("the server is shutting down and accepts no new request")

    def _command(self, cmd: tuple[str, str | None]) -> None:
        with self._wake:
            self._commands.append(cmd)
            self._wake.notify()

    def _begin_shutdown(self, drain: bool) -> None:
        with self._wake:
            self._accepting = False
            if not drain:
                self._commands.append(("abort_all", None))
            self._closing = True
            self._wake.notify()

    def _run(self) -> None:
        while True:
            with self._wake:
                while not self._commands and not self._streams and not self._closing:
                    self._wake.wait()
                commands = list(self._commands)
                self._commands.clear()
                closing = self._closing
            for cmd in commands:
                self._guarded(self._apply, cmd)
            if self._streams and self._dead is None:
                self._guarded(self._step)
            stats = self._guarded(self._collect_stats) or self._stats
            with self._wake:
                self._stats = stats
                exit_now = closing and not self._streams and not self._commands
            if exit_now:  # NOTE: sessions outlive their requests; nobody can use them after this
                self._guarded(self._close_sessions)
            self._send_replies()
            if exit_now:
                return

    def _guarded(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Runs fn; an exception outside step() is a bug in the loop itself: every request in
        flight fails and the engine refuses new ones (rather than leaving clients hanging)."""
        try:
            return fn(*args)
        except Exception as e:
            self._fail_all(e, fatal=True)
            return None

    def _apply(self, cmd: _Add | _Call | tuple[str, str | None]) -> None:
        if isinstance(cmd, _Call):
            try:
                self._outbox.append((cmd.done, _Value(cmd.fn(*cmd.args))))
            except Exception as e:
                self._outbox.append((cmd.done, e))
        elif isinstance(cmd, _Add):
            self._apply_add(cmd)
        elif cmd[0] == "abort" and cmd[1] in self._streams:
            self._finish(cmd[1], abort=True)
        elif cmd[0] == "abort_all":
            for rid in list(self._streams):
                self._finish(rid, abort=True)

    def _apply_add(self, cmd: _Add) -> None:
        with self._wake:
            self._pending_adds -= len(cmd.request_ids)
        queued: list[str] = []
        try:
            if self._dead is not None:
                raise self._dead
            for rid, submit in zip(cmd.request_ids, cmd.submits):
                submit(self.engine)
                queued.append(rid)
        except Exception as e:  # delivered to the submitter, who raises it
            for rid in queued:  # all or none
                self.engine.release(rid)
            self._outbox.append((cmd.accepted, e))
            return
        for rid, stream in zip(cmd.request_ids, cmd.streams):
            self._streams[rid] = stream
            if cmd.silent:
                self._silent.add(rid)
        self._outbox.append((cmd.accepted, None))

    def _close_session(self, session_id: str) -> bool:
        sessions = self.engine.sessions
        if session_id not in sessions:
            return False
        rid = sessions.request_in_flight(session_id)
        if rid in self._streams:
            self._finish(rid, abort=True,
                         error=SessionClosed(f"session {session_id!r} was closed while this request ran on it"))
        sessions.close(session_id)
        return True

    def _step(self) -> None:
        try:
            deltas = self.engine.step()
        except Exception as e:
            # A failed collective leaves the ranks out of step: nothing can run after it.
            self._fail_all(e, fatal=isinstance(e, TransportError))
            return
        by_request: dict[str, list[StreamDelta]] = {}
        for d in deltas:
            by_request.setdefault(d.request_id, []).append(d)
        # NOTE: prefill-only requests (session open/prefill) end without a delta: poll those.
        for rid in [r for r in self._silent if r in self._streams and r not in by_request]:
            if self.engine.get_output(rid).finished:
                by_request[rid] = []
        for rid, ds in by_request.items():
            stream = self._streams.get(rid)
            if stream is None:
                continue
            out = self.engine.get_output(rid)
            self._outbox.append((stream, RequestUpdate(ds, out)))
            if out.finished:
                self._finish(rid, abort=False)

    def _finish(self, rid: str, abort: bool, error: Exception | None = None) -> None:
        """Ends a request: aborts it when asked (KV freed now), forgets it, closes its stream
        (with `error` raised to its reader after the last update, when one is given)."""
        stream = self._streams.pop(rid)
        self._silent.discard(rid)
        if abort:
            self.engine.abort(rid)
            self._outbox.append((stream, RequestUpdate([], self.engine.get_output(rid))))
        self.engine.release(rid)
        self._outbox.append((stream, END if error is None else error))

    def _close_sessions(self) -> None:
        for sid in self.engine.sessions:  # a snapshot of the ids
            self.engine.sessions.close(sid)

    def _fail_all(self, cause: Exception, fatal: bool = False) -> None:
        log.exception("engine loop failed; failing %d request(s)", len(self._streams))
        err = EngineStepError(f"engine {'loop' if fatal else 'step'} failed: {type(cause).__name__}: {cause}")
        err.__cause__ = cause
        if fatal:
            self._dead = err
        for rid, stream in list(self._streams.items()):
            try:
                self.engine.abort(rid)
                self.engine.release(rid)
            except Exception:  # the engine's state is broken: refuse everything from now on
                self._dead = err
            self._outbox.append((stream, err))
        self._streams.clear()
        try:
            if self.engine.has_unfinished():
                self._dead = err
        except Exception:
            self._dead = err

    def _send_replies(self) -> None:
        for target, item in self._outbox:
            if isinstance(target, RequestStream):
                target.push(item)
            else:
                _resolve(target, item)
        self._outbox.clear()

    def _collect_stats(self) -> dict[str, Any]:
        sched = self.engine.scheduler
        kv = self.engine.kv.stats()
        return {
            "running": len({s.request_id for s in sched.running}),
            "waiting": len({s.request_id for s in sched.waiting}),
            "in_flight": len(self._streams),
            "kv": kv,
            "kv_usage": kv["blocks_used"] / max(1, kv["num_blocks"]),
            "prefill_tokens_computed": self.engine.num_prefill_tokens_computed,
        }


def _resolve(future: asyncio.Future, item: BaseException | _Value | None) -> None:
    """Completes an asyncio future from the loop thread: with an exception, a _Value's value, or None."""

    def set_it() -> None:
        if future.done():
            return
        if isinstance(item, BaseException):
            future.set_exception(item)
        else:
            future.set_result(item.value if isinstance(item, _Value) else None)

    try:
        future.get_loop().call_soon_threadsafe(set_it)
    except RuntimeError:
        pass
