"""The engine requests behind one HTTP request: submission, metrics, the end of a client.

One HTTP request becomes one engine request per prompt (a chat has one; a text completion
may have several), each with its n choices. Whoever leaves first, the client (disconnect,
cancelled task) or the handler (exception), the engine requests are aborted and their KV freed.
"""

from __future__ import annotations

import asyncio
from typing import AsyncIterator

from fastapi import Request
from pydantic import BaseModel

from kog.engine.async_engine import RequestStream, RequestUpdate
from kog.engine.outputs import RequestOutput
from kog.server.errors import APIError, to_api_error
from kog.server.metrics import RequestTimer
from kog.server.responses import ErrorResponse, ErrorDetail
from kog.server.state import ServerState
from kog.sampling_params import SamplingParams

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
SSE_DONE = "data: [DONE]\n\n"

# Characters that str.splitlines() (and so httpx.iter_lines and many line readers) treats as
# line ends, which JSON allows raw inside a string; escaped so one event stays one line.
_LINE_BREAKING = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def sse_json(payload: str) -> str:
    """One server-sent event carrying a JSON document; the event is a single line for any line reader."""
    return f"data: {payload.translate(_LINE_BREAKING)}\n\n"


def sse(chunk: BaseModel) -> str:
    """One server-sent event carrying a JSON chunk."""
    return sse_json(chunk.model_dump_json())


def sse_error(exc: BaseException) -> str:
    """An error that happens after the stream started: sent as an event (the status is already 200)."""
    err = to_api_error(exc)
    detail = ErrorDetail(message=err.message, type="server_error" if err.status >= 500 else "invalid_request_error",
                         param=err.param, code=err.code)
    return sse_json(ErrorResponse(error=detail).model_dump_json())


class Generation:
    """Engine requests of one HTTP request.

    Args:
        state: the server.
    """

    def __init__(self, state: ServerState) -> None:
        self.state = state
        self.streams: list[RequestStream] = []
        self.timers: list[RequestTimer] = []
        self.last: dict[int, RequestOutput] = {}  # prompt index -> its latest output

    async def start(self, prompts: list[list[int]], params: SamplingParams, request_id: str, priority: int,
                    texts: list[str | None] | None = None) -> None:
        """Submits one engine request per prompt, all at once; on any refusal none stays queued.

        Raises:
            InvalidRequest, QueueFull, EngineDraining, EngineStepError: from AsyncEngine.add_request.
        """
        # NOTE: one batch: every prompt is in the engine before its next step (one per step
        # would take a step per prompt before the last one is even queued).
        rids = [request_id] if len(prompts) == 1 else [f"{request_id}-{i}" for i in range(len(prompts))]
        try:
            self.streams = await self.state.engine.add_requests(prompts, params, rids, priority, texts)
            self.timers = [self.state.metrics.timer(len(ids)) for ids in prompts]
        except BaseException:
            self.close()
            raise

    async def start_session(self, session_id: str, params: SamplingParams, request_id: str, priority: int,
                            num_context: int) -> None:
        """Submits a generation on a session (its context is the prompt, num_context tokens long).

        Raises:
            InvalidOperation: the session has a request in flight; else as start().
        """
        try:
            self.streams.append(await self.state.engine.add_session_request(session_id, params, request_id, priority))
            self.timers.append(self.state.metrics.timer(num_context))
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Aborts whatever has not finished (idempotent); counted as aborted in the metrics."""
        for s in self.streams:
            s.close()
        for t in self.timers:
            t.finish("abort")

    async def updates(self) -> AsyncIterator[tuple[int, RequestUpdate]]:
        """(prompt index, update) as the engine produces them, all prompts interleaved."""
        if len(self.streams) == 1:
            async for u in self.streams[0]:
                self._record(0, u)
                yield 0, u
            return
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(i: int, stream: RequestStream) -> None:
            try:
                async for u in stream:
                    await queue.put((i, u))
            except Exception as e:
                await queue.put((i, e))
            await queue.put((i, None))

        tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(self.streams)]
        try:
            remaining = len(tasks)
            while remaining:
                i, item = await queue.get()
                if item is None:
                    remaining -= 1
                elif isinstance(item, Exception):
                    raise item
                else:
                    self._record(i, item)
                    yield i, item
        finally:
            for t in tasks:
                t.cancel()

    async def run_to_end(self, request: Request) -> list[RequestOutput]:
        """Waits for every prompt's final output; aborts everything if the client goes away.

        Raises:
            APIError: 499 when the client disconnected first (nobody reads the answer).
        """

        async def consume() -> list[RequestOutput]:
            last: dict[int, RequestOutput] = {}
            async for i, u in self.updates():
                last[i] = u.output
            return [last[i] for i in range(len(self.streams))]

        work = asyncio.ensure_future(consume())
        watcher = asyncio.ensure_future(_wait_for_disconnect(request))
        try:
            done, _ = await asyncio.wait({work, watcher}, return_when=asyncio.FIRST_COMPLETED)
            if work in done:
                return work.result()
            raise APIError(499, "client closed the request")
        finally:
            watcher.cancel()
            work.cancel()
            self.close()

    def _record(self, i: int, u: RequestUpdate) -> None:
        self.last[i] = u.output
        timer = self.timers[i]
        timer.on_tokens(sum(len(d.token_ids) for d in u.deltas))
        if u.finished:
            timer.finish(u.output.outputs[0].finish_reason if u.output.outputs else None)


async def _wait_for_disconnect(request: Request) -> None:
    """Returns when the client disconnects (the body was read already: the next message is that)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return
