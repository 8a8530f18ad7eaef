"""The base classes of the gateway's OpenAI wire models and the strict request parser.

Request models accept unknown fields and log them (as vLLM does) so newer SDKs keep working; the request
handlers also list them in the ``x-swarmserve-ignored-fields`` response header. Response models forbid
extras. Requests are validated in strict mode: ``"5"`` is not an integer, ``2.0`` is not ``n``.
"""

from __future__ import annotations

import json
import logging
import re
from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError, model_validator

from gateway.errors import InvalidRequestError, validation_error

logger = logging.getLogger("gateway.schema.requests")

__all__ = ["OpenAIRequestModel", "OpenAIResponseModel", "RequestT", "drop_none", "load_json_body", "parse_request"]


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


#: a JSON ``\\uXXXX`` escape of a UTF-16 surrogate: only then can a decoded string hold a lone one
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")


def load_json_body(body: bytes) -> Any:
    """Body bytes → JSON value, or an ``InvalidRequestError`` for anything no request can be made of: bad
    JSON, nesting deeper than the parser's recursion limit, an integer of more than 4300 digits, and a lone
    surrogate escape (``"\\ud800"``: valid JSON, but no text, and the tokenizer cannot encode it)."""
    try:
        data = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InvalidRequestError(
            f"We could not parse the JSON body of your request ({exc}). The OpenAI API expects a JSON payload."
        ) from None
    except RecursionError:
        raise InvalidRequestError("The JSON body of your request is nested too deeply.") from None
    except ValueError as exc:  # int digits past sys.get_int_max_str_digits()
        raise InvalidRequestError(f"The JSON body of your request has a number we cannot read ({exc}).") from None
    if _SURROGATE_ESCAPE.search(body):
        path = _lone_surrogate_path(data)
        if path is not None:
            raise InvalidRequestError(
                "A string in your request holds a lone UTF-16 surrogate escape (\\ud800-\\udfff without its "
                "pair), which is not text; send the character itself or a valid surrogate pair.",
                param=path or None,
            )
    return data


def _lone_surrogate_path(data: Any) -> str | None:
    """The dotted path of the first string (value or key) holding a lone surrogate, or None."""
    stack: list[tuple[str, Any]] = [("", data)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                return path
        elif isinstance(value, dict):
            for key, item in value.items():
                child = f"{path}.{key}" if path else str(key)
                stack.append((child, key))
                stack.append((child, item))
        elif isinstance(value, list):
            stack.extend((f"{path}.{i}" if path else str(i), item) for i, item in enumerate(value))
    return None


def parse_request(model_cls: type[RequestT], body: bytes) -> RequestT:
    """Body bytes → request model; malformed JSON, a non-object or a bad field is a 400 naming the param."""
    data = load_json_body(body)
    if not isinstance(data, dict):
        raise InvalidRequestError("The request body must be a JSON object.")
    try:
        return model_cls.model_validate(data, strict=True)
    except ValidationError as exc:
        raise validation_error(exc.errors(include_url=False)) from None


def drop_none(fields: dict[str, Any]) -> dict[str, Any]:
    """A serialized model without its unset (None) fields, for stream deltas that name only what changed."""
    return {k: v for k, v in fields.items() if v is not None}
