"""OpenAPI declarations shared by the routes: the error bodies and the SSE alternative."""

from __future__ import annotations

from typing import Any

from kog.server.responses import ErrorResponse

ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    400: {"model": ErrorResponse, "description": "Invalid parameters, or the prompt exceeds the context"},
    401: {"model": ErrorResponse, "description": "Missing or wrong API key"},
    404: {"model": ErrorResponse, "description": "Unknown model"},
    413: {"model": ErrorResponse, "description": "Request body too large"},
    429: {"model": ErrorResponse, "description": "Waiting queue full; see Retry-After"},
    500: {"model": ErrorResponse, "description": "The engine failed"},
    503: {"model": ErrorResponse, "description": "Shutting down"},
}

# NOTE: an SSE schema describes one event (as OpenAPI 3.2's itemSchema does, and schemathesis
# checks each event against it): its `data` is a JSON chunk, or `[DONE]` to end the stream.
_SSE_EVENT = {"type": "object", "required": ["data"],
              "properties": {"data": {"type": "string", "description": "a JSON chunk, or [DONE]"},
                             "event": {"type": "string"}}}
STREAM_RESPONSE: dict[int | str, dict[str, Any]] = {
    200: {"content": {"text/event-stream": {"schema": _SSE_EVENT}},
          "description": "The response; with stream: true, `data: {chunk}` events then `data: [DONE]`"},
}
