"""Kog's OpenAI-compatible HTTP server (FastAPI): build_app() and the `kog serve` command."""

from kog.server.app import build_app
from kog.server.state import ServerConfig, ServerState

__all__ = ["ServerConfig", "ServerState", "build_app"]
