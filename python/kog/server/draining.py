"""A uvicorn server whose first SIGTERM drains the engine, then shuts down.

While draining, the socket still accepts: new requests get 503 and /health answers 503, so a
load balancer stops sending; requests in flight run to their end. Then uvicorn exits (status 0).
A second SIGTERM, or SIGINT, is uvicorn's usual prompt shutdown. A tensor-parallel rank that
died or hung (the engine failed with a TransportError: the ranks are out of step for good) makes
the server exit with an error (`failed`), as a supervisor expects of a broken replica.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from types import FrameType

import uvicorn

from kog.engine.async_engine import AsyncEngine

log = logging.getLogger("kog.server")


class DrainingServer(uvicorn.Server):
    """Args:
        config: uvicorn's config.
        engine: the AsyncEngine to drain.
        drain_timeout: seconds in-flight requests may take.
    """

    def __init__(self, config: uvicorn.Config, engine: AsyncEngine, drain_timeout: float) -> None:
        super().__init__(config)
        self.engine = engine
        self.drain_timeout = drain_timeout
        self.draining = False
        self.failed: str | None = None  # why the server gave up (a lost tensor-parallel rank)
        self.loop: asyncio.AbstractEventLoop | None = None

    async def serve(self, sockets=None) -> None:
        self.loop = asyncio.get_running_loop()
        watchdog = asyncio.ensure_future(self._watch_ranks())
        try:
            await super().serve(sockets)
        finally:
            watchdog.cancel()

    async def _watch_ranks(self, period_s: float = 0.5) -> None:
        from kog.errors import TransportError

        while not self.should_exit:
            dead = self.engine.dead_error
            if dead is not None and isinstance(dead.__cause__, TransportError):
                self.failed = str(dead.__cause__)
                log.error("a tensor-parallel rank failed, exiting: %s", self.failed)
                self.should_exit = True
                return
            await asyncio.sleep(period_s)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if sig == signal.SIGTERM and not self.draining and self.loop is not None:
            # NOTE: not recorded as a captured signal, so uvicorn does not re-raise it at exit.
            self.draining = True
            self.loop.call_soon_threadsafe(lambda: asyncio.ensure_future(self._drain()))
            return
        super().handle_exit(sig, frame)

    async def _drain(self) -> None:
        log.info("SIGTERM: refusing new requests, draining those in flight")
        if not await self.engine.shutdown(drain=True, timeout=self.drain_timeout):
            log.warning("drain timed out after %.0f s; exiting anyway", self.drain_timeout)
        self.should_exit = True
