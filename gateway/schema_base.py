"""The base classes of the gateway's OpenAI wire models and the strict request parser.

Request models accept unknown fields and log them (as vLLM does) so newer SDKs keep working; the request
handlers also list them in the ``x-swarmserve-ignored-fields`` response header. Response models forbid
extras. Requests are validated in strict mode: ``"5"`` is not an integer, ``2.0`` is not ``n``.
"""

from __future__ import annotations

import json
import logging
from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError, model_validator

from gateway.errors import InvalidRequestError, validation_error

logger = logging.getLogger("gateway.openai_schema")

__all__ = ["OpenAIRequestModel", "OpenAIResponseModel", "RequestT", "drop_none", "parse_request"]


class OpenAIRequestModel(BaseModel):
    """Base of request models: unknown fields are kept and logged, not rejected."""

    model_config = ConfigDict(extra="allow")

    @model_validator(mode="wrap")
    @classmethod
    def _log_extra_fields(cls, data: Any, handler: Any) -> Any:
        result = handler(data)
        if isinstance(data, dict):
            known = set(cls.model_fields)
            known.update(f.alias for f in cls.model_fields.values() if f.alias)
            extra = sorted(set(data) - known)
            if extra:
                logger.warning("%s: ignoring unknown fields %s", cls.__name__, extra)
        return result


class OpenAIResponseModel(BaseModel):
    model_config = ConfigDict(extra="forbid")


RequestT = TypeVar("RequestT", bound=OpenAIRequestModel)


def parse_request(model_cls: type[RequestT], body: bytes) -> RequestT:
    """Body bytes → request model; malformed JSON, a non-object or a bad field is a 400 naming the param."""
    try:
        data = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InvalidRequestError(
            f"We could not parse the JSON body of your request ({exc}). The OpenAI API expects a JSON payload."
        ) from None
    if not isinstance(data, dict):
        raise InvalidRequestError("The request body must be a JSON object.")
    try:
        return model_cls.model_validate(data, strict=True)
    except ValidationError as exc:
        raise validation_error(exc.errors(include_url=False)) from None


def drop_none(fields: dict[str, Any]) -> dict[str, Any]:
    """A serialized model without its unset (None) fields, for stream deltas that name only what changed."""
    return {k: v for k, v in fields.items() if v is not None}
