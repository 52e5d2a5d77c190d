"""In-process server fixtures (helpers live in server_helpers.py)."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from kog.engine import AsyncEngine, LLMEngine
from kog.server import ServerConfig, build_app

from server_helpers import TEMPLATE, TOK, make_engine


@pytest.fixture
def make_client():
    """make_client(engine=None, max_waiting=..., **ServerConfig fields) -> TestClient; all closed after the test."""
    made = []

    def make(engine: LLMEngine | None = None, max_waiting: int = 64, template=TEMPLATE, **config) -> TestClient:
        async_engine = AsyncEngine(engine or make_engine(), max_waiting=max_waiting)
        app = build_app(async_engine, TOK, template, ServerConfig(**config))
        client = TestClient(app)
        made.append((client, async_engine))
        return client

    yield make
    for client, engine in made:
        client.close()
        engine.close(drain=False, timeout=10)


@pytest.fixture
def client(make_client):
    return make_client()
