"""What every route needs: the engine, tokenizer, template, config and metrics (app.state.kog),
and the dependencies that read it: the API key check and the model-name check.
"""

from __future__ import annotations

import hmac
import time
from dataclasses import dataclass, field

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from kog.engine.async_engine import AsyncEngine
from kog.loader.chat_template import ChatTemplate
from kog.loader.tokenizer import Tokenizer
from kog.server.errors import APIError
from kog.server.metrics import ServerMetrics
from kog.server.session_store import ServerSession
from kog.speculation.params import SpeculativeParams


@dataclass
class ServerConfig:
    """Args:
        served_model_names: names clients use for the model (the first one is reported back).
        api_key: when set, /v1/* needs `Authorization: Bearer <api_key>`.
        max_body_bytes: largest request body (413 above).
        retry_after_s: the Retry-After of a 429.
        tool_call_parser: "auto", "hermes" or "llama3_json" (see tool_parsers.py).
        drain_timeout_s: on SIGTERM, how long in-flight requests may take before the exit.
        speculative: the speculative decoding of requests that do not set `speculative`
            (`kog serve --speculative`); None: none.
    """

    served_model_names: list[str] = field(default_factory=lambda: ["kog"])
    api_key: str | None = None
    max_body_bytes: int = 8 * 2**20
    retry_after_s: int = 1
    tool_call_parser: str = "auto"
    drain_timeout_s: float = 60.0
    speculative: SpeculativeParams | None = None


@dataclass
class ServerState:
    engine: AsyncEngine
    tokenizer: Tokenizer
    chat_template: ChatTemplate | None
    config: ServerConfig
    metrics: ServerMetrics
    created: int = field(default_factory=lambda: int(time.time()))
    sessions: dict[str, ServerSession] = field(default_factory=dict)  # open /v1/sessions, by id

    @property
    def max_model_len(self) -> int:
        return self.engine.engine.max_model_len

    @property
    def has_draft_model(self) -> bool:
        """Whether requests may ask for speculative method "draft" (kog.LLM(speculative_model=...))."""
        return self.engine.engine.speculator.drafter is not None

    @property
    def model_name(self) -> str:
        return self.config.served_model_names[0]

    def check_model(self, name: str) -> None:
        """Raises a 404 unless `name` is one of the served names."""
        if name not in self.config.served_model_names:
            raise APIError(404, f"The model `{name}` does not exist.", param="model", code="model_not_found")


def get_state(request: Request) -> ServerState:
    """The ServerState of the app serving `request` (any router may use it)."""
    return request.app.state.kog


_bearer = HTTPBearer(auto_error=False, description="the server's --api-key, when it has one")


async def require_api_key(request: Request,
                          credentials: HTTPAuthorizationCredentials | None = Depends(_bearer)) -> None:
    """401 unless the bearer token equals the configured key (constant-time comparison)."""
    key = get_state(request).config.api_key
    if key is None:
        return
    given = credentials.credentials if credentials is not None else ""
    if not hmac.compare_digest(given.encode(), key.encode()):
        raise APIError(401, "Incorrect API key provided.", code="invalid_api_key")
