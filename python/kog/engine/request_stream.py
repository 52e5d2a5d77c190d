"""The two ends of a request in the AsyncEngine: what a step produced (RequestUpdate) and the
consumer's async iterator over those (RequestStream), filled from the engine's loop thread."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any, Callable

from kog.engine.outputs import RequestOutput, StreamDelta

END = object()  # pushed after a request's last update


@dataclass
class RequestUpdate:
    """What one engine step produced for one request."""

    deltas: list[StreamDelta]   # one per sequence (choice) that advanced in this step
    output: RequestOutput       # the request after the step: texts, token ids, logprobs so far

    @property
    def finished(self) -> bool:
        return self.output.finished


class RequestStream:
    """The consumer end of one request: an async iterator of RequestUpdate.

    Closing it before the request finishes (or cancelling the task reading it) aborts the
    request, which frees its KV before the engine's next step.

    Args:
        request_id: the engine request.
        loop: the event loop of the consumer (updates are queued onto it).
        abort: called with request_id when the consumer leaves before the end.
    """

    def __init__(self, request_id: str, loop: asyncio.AbstractEventLoop, abort: Callable[[str], None]) -> None:
        self.request_id = request_id
        self._abort = abort
        self._loop = loop
        self._queue: asyncio.Queue[Any] = asyncio.Queue()
        self.finished = False  # set on the consumer side once the last update was read

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestUpdate:
        if self.finished:
            raise StopAsyncIteration
        item = await self._queue.get()
        if item is END:
            self.finished = True
            raise StopAsyncIteration
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        return item

    def close(self) -> None:
        """Aborts the request unless it already finished (idempotent)."""
        if not self.finished:
            self.finished = True
            self._abort(self.request_id)

    # ---- the producer end: called from the engine's loop thread ----------------------------------
    def push(self, item: Any) -> None:
        """Queues an update, END, or an exception for the reader (thread-safe; dropped once the
        consumer's event loop is closed)."""
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, item)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            pass
