"""Kog's exception hierarchy. Native errors (kog._C) are raised as these classes."""

from __future__ import annotations


class KogError(Exception):
    """Base class of every error Kog raises on purpose."""


class InvalidRequest(KogError, ValueError):
    """A request or argument is invalid (bad shape, dtype, sampling value, prompt too long)."""


class KVCacheFull(KogError):
    """No KV block can be freed even after evicting the prefix cache and swapping."""


class UnknownSequence(KogError, KeyError):
    """A sequence id that the KV allocator does not know."""

    def __str__(self) -> str:  # KeyError quotes its message; keep it readable
        return str(self.args[0]) if self.args else ""


class InvalidOperation(KogError):
    """An operation not allowed in the object's current state (e.g. appending to a suspended sequence)."""


class SessionClosed(InvalidOperation):
    """The session was closed while this request ran on it (HTTP 409 `session_closed`)."""


class ConversationDiverged(InvalidOperation):
    """A conversation sent to a session's append starts like the session's but differs from it
    (HTTP 409 `conversation_diverged`); docs/SESSIONS.md says what counts as the same."""


class ModelLoadError(KogError):
    """A checkpoint cannot be loaded: missing or misshapen tensor, corrupt file, unknown architecture."""


class BackendError(KogError, RuntimeError):
    """The native backend failed, or the requested backend is not in this build."""


class TransportError(BackendError):
    """A tensor-parallel collective failed: a rank died, hung past the timeout, or sent a
    mismatched shape (kog.parallel). The ranks are out of step: nothing more can run."""


class InternalError(KogError, RuntimeError):
    """A broken invariant inside Kog (a bug, not a bad request: HTTP 500). Native KOG_ASSERT
    failures are raised as this class; KOG_CHECK failures (bad arguments) as InvalidRequest."""


class QueueFull(KogError):
    """The async engine's waiting queue is at its limit; retry later (HTTP 429)."""


class EngineDraining(KogError):
    """The async engine is shutting down and accepts no new request (HTTP 503)."""


class EngineStepError(KogError, RuntimeError):
    """An engine step failed; every request in flight at that moment is failed with it."""


__all__ = [
    "BackendError",
    "ConversationDiverged",
    "EngineDraining",
    "EngineStepError",
    "InternalError",
    "InvalidOperation",
    "InvalidRequest",
    "KVCacheFull",
    "KogError",
    "ModelLoadError",
    "QueueFull",
    "SessionClosed",
    "UnknownSequence",
]
