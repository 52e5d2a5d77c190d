"""build_app(): the FastAPI application around an AsyncEngine.

    engine = AsyncEngine(llm.engine, max_waiting=256)
    app = build_app(engine, llm.tokenizer, llm.chat_template, ServerConfig(served_model_names=["smollm2"]))

Routers read everything through `request.app.state.kog` (a ServerState) and guard themselves
with `Depends(require_api_key)`, so more routers (sessions) plug in through `routers=`.
"""

from __future__ import annotations

from contextlib import asynccontextmanager
from typing import AsyncIterator, Sequence

from fastapi import APIRouter, FastAPI

import kog
from kog.engine.async_engine import AsyncEngine
from kog.loader.chat_template import ChatTemplate
from kog.loader.tokenizer import Tokenizer
from kog.server.errors import install_error_handlers
from kog.server.metrics import ServerMetrics
from kog.server.middleware import BodyLimitMiddleware
from kog.server.routes import ROUTERS
from kog.server.state import ServerConfig, ServerState
from kog.server.tool_parsers import PARSERS


def build_app(engine: AsyncEngine, tokenizer: Tokenizer, chat_template: ChatTemplate | None,
              config: ServerConfig | None = None, routers: Sequence[APIRouter] = (),
              drain_on_shutdown: bool = True) -> FastAPI:
    """The HTTP app.

    Args:
        engine: the running async engine (the app drains it on shutdown).
        tokenizer: for prompts, logprob tokens and echo.
        chat_template: None makes /v1/chat/completions answer 400.
        config: names, API key, limits (defaults: model "kog", no key).
        routers: extra routers (e.g. sessions), included after the OpenAI ones.
        drain_on_shutdown: the end of the app's lifespan drains and stops the engine (turn off when
            the lifespan runs more than once, as test clients that wrap each call in one do).
    Returns:
        The FastAPI app; its state.kog is the ServerState.
    """
    config = config or ServerConfig()
    if config.tool_call_parser not in PARSERS:
        raise kog.InvalidRequest(f"tool_call_parser must be one of {PARSERS}, got {config.tool_call_parser!r}")

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        if drain_on_shutdown:
            await engine.shutdown(drain=True, timeout=config.drain_timeout_s)

    app = FastAPI(title="Kog", version=kog.__version__, lifespan=lifespan,
                  description="OpenAI-compatible API of the Kog inference engine. Errors are OpenAI error objects.")
    app.state.kog = ServerState(engine, tokenizer, chat_template, config, ServerMetrics(engine))
    install_error_handlers(app, config.retry_after_s)
    for router in [*ROUTERS, *routers]:
        app.include_router(router)
    app.add_middleware(BodyLimitMiddleware, max_bytes=config.max_body_bytes)
    return app
