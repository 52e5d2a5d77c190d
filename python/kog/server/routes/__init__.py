"""The server's routers, one file per endpoint group; app.py includes them in this order."""

from kog.server.routes import chat, completions, health, models, sessions

ROUTERS = [chat.router, completions.router, sessions.router, models.router, health.router]

__all__ = ["ROUTERS"]
