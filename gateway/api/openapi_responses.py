"""The OpenAPI description of what generation routes answer besides a 200 JSON body: an SSE stream when
``stream`` is true, and the error statuses, each in OpenAI's error envelope (``gateway.errors``)."""

from __future__ import annotations

from typing import Any

#: OpenAI's error envelope, as ``GatewayError.payload`` writes it
ERROR_ENVELOPE: dict[str, Any] = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type", "param", "code"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": ["string", "null"]},
                "code": {"type": ["string", "null"]},
            },
        }
    },
}

#: status → when a generation route answers it
ERROR_STATUSES: dict[int, str] = {
    400: "Invalid request: a bad field (named in `param`), malformed JSON, or a prompt past the context window",
    401: "Missing or unknown API key (when the gateway requires keys)",
    404: "Unknown model, or an unknown stored response",
    413: "The request body is larger than the gateway accepts",
    429: "Rate limited (requests or tokens per minute); see the Retry-After header",
    500: "An unexpected gateway error",
    503: "The swarm cannot serve now (blocks unserved, every server full, or the gateway queue full); see Retry-After",
    504: "The swarm did not answer in time",
}


def generation_responses(streams: bool = True) -> dict[str, Any]:
    """``responses`` of a generation operation: the 200 as JSON (and as ``text/event-stream`` when the route
    can stream) and each error status with the envelope."""
    ok: dict[str, Any] = {"application/json": {"schema": {"type": "object"}}}
    if streams:
        # OpenAPI before 3.2: the schema of a stream's media type describes each event (as schemathesis reads it)
        ok["text/event-stream"] = {
            "schema": {
                "type": "object",
                "description": "one server-sent event: its `data` is a JSON chunk; the last event's is `[DONE]`",
                "properties": {"data": {"type": "string"}, "event": {"type": "string"}, "id": {"type": "string"}},
                "required": ["data"],
            }
        }
    responses: dict[str, Any] = {
        "200": {"description": "The completion (a stream of chunks when `stream` is true)", "content": ok}
    }
    for status, description in ERROR_STATUSES.items():
        responses[str(status)] = {
            "description": description,
            "content": {"application/json": {"schema": ERROR_ENVELOPE}},
        }
    return responses
