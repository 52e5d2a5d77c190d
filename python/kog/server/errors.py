"""Every failure leaves the server as an OpenAI error object with the right HTTP status:

    {"error": {"message": "...", "type": "invalid_request_error", "param": "top_p", "code": null}}

| cause                                          | status | type / code                               |
|------------------------------------------------|--------|-------------------------------------------|
| bad body (pydantic), kog.InvalidRequest        | 400    | invalid_request_error                     |
| prompt (+ max_tokens) over the context         | 400    | invalid_request_error / context_length_exceeded |
| missing or wrong API key                       | 401    | authentication_error / invalid_api_key    |
| unknown model, unknown path                    | 404    | not_found_error / model_not_found         |
| session busy (kog.InvalidOperation)            | 409    | conflict_error                            |
| session deleted under a request (SessionClosed)| 409    | conflict_error / session_closed           |
| append diverges (kog.ConversationDiverged)     | 409    | conflict_error / conversation_diverged    |
| body over the size limit                       | 413    | invalid_request_error / request_too_large |
| waiting queue full (kog.QueueFull)             | 429    | rate_limit_error, with Retry-After        |
| shutting down (kog.EngineDraining)             | 503    | service_unavailable, with Retry-After     |
| engine step failed (kog.EngineStepError)       | 500    | server_error                              |
| broken invariant (kog.errors.InternalError)    | 500    | server_error / internal_error             |
"""

from __future__ import annotations

import logging
import re

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from kog.errors import (ConversationDiverged, EngineDraining, EngineStepError, InternalError, InvalidOperation,
                        InvalidRequest, QueueFull, SessionClosed)
from kog.server.responses import ErrorDetail, ErrorResponse

log = logging.getLogger("kog.server")

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "not_found_error", 405: "invalid_request_error", 409: "conflict_error", 413: "invalid_request_error",
          429: "rate_limit_error", 500: "server_error", 503: "service_unavailable"}


class APIError(Exception):
    """An error to send as an OpenAI error object.

    Args:
        status: HTTP status.
        message: for the client.
        param: the request field at fault, if one is.
        code: a machine-readable code ("context_length_exceeded", "model_not_found", ...).
        headers: extra response headers (Retry-After).
    """

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers or {}


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    """The JSON body of an OpenAI error; `type` follows from the status."""
    detail = ErrorDetail(message=message, type=_TYPES.get(status, "server_error"), param=param, code=code)
    return ErrorResponse(error=detail).model_dump()


def error_response(err: APIError) -> JSONResponse:
    """The HTTP response for an APIError (status, body, headers)."""
    return JSONResponse(error_body(err.status, err.message, err.param, err.code), status_code=err.status,
                        headers=err.headers)


def to_api_error(exc: BaseException, retry_after_s: int = 1) -> APIError:
    """Maps Kog's exceptions (and anything else) to the APIError the client gets."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, InvalidRequest):
        return APIError(400, str(exc), param=_param_of(str(exc)))
    if isinstance(exc, SessionClosed):
        return APIError(409, str(exc), code="session_closed")
    if isinstance(exc, ConversationDiverged):
        return APIError(409, str(exc), param="messages", code="conversation_diverged")
    if isinstance(exc, InvalidOperation):  # e.g. a session that has a request in flight
        return APIError(409, str(exc))
    if isinstance(exc, QueueFull):
        return APIError(429, str(exc), headers={"Retry-After": str(retry_after_s)})
    if isinstance(exc, EngineDraining):  # another replica can take it; this one is going away
        return APIError(503, str(exc), headers={"Retry-After": str(retry_after_s)})
    if isinstance(exc, EngineStepError):
        return APIError(500, str(exc))
    if isinstance(exc, InternalError):  # a bug in Kog, not in the request: logged with its trace
        log.error("internal error", exc_info=exc)
        return APIError(500, str(exc), code="internal_error")
    log.exception("unexpected error", exc_info=exc)
    return APIError(500, f"internal error: {type(exc).__name__}")


def install_error_handlers(app: FastAPI, retry_after_s: int = 1) -> None:
    """Routes every exception through to_api_error; replaces FastAPI's 422 with a 400."""

    async def on_kog_error(request: Request, exc: Exception) -> JSONResponse:
        return error_response(to_api_error(exc, retry_after_s))

    async def on_validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        first = errors[0] if errors else {}
        param = _field_of(first) or None
        message = "; ".join(f"{_field_of(e) or 'body'}: {e.get('msg')}" for e in errors[:5])
        return error_response(APIError(400, message or "invalid request body", param=param))

    async def on_http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        err = APIError(exc.status_code, str(exc.detail), headers=dict(exc.headers or {}))
        return error_response(err)

    app.add_exception_handler(RequestValidationError, on_validation)
    app.add_exception_handler(StarletteHTTPException, on_http)
    for cls in (APIError, InvalidRequest, InvalidOperation, QueueFull, EngineDraining, EngineStepError, InternalError,
                Exception):
        app.add_exception_handler(cls, on_kog_error)


def _field_of(error: dict) -> str:
    """The dotted field of a pydantic error: its location in the body, or the ctx.param of a
    whole-body check (protocol.RequestBody)."""
    loc = ".".join(str(p) for p in error.get("loc", ()) if p != "body")
    return loc or str((error.get("ctx") or {}).get("param") or "")


def _param_of(message: str) -> str | None:
    """SamplingParams.validate() starts its messages with the field name ("top_p must be ...")."""
    m = re.match(r"([a-z_]+) (must|is|are) ", message)
    return m.group(1) if m else None
