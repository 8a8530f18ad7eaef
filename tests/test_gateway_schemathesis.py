"""Property-based fuzzing of the gateway's OpenAPI schema with schemathesis: whatever a client sends —
valid requests and schema-violating ones — the answer is never a 5xx.

Bounded: 20 examples per operation, and 20 schema-violating bodies per POST, against the live shared
gateway (uvicorn over ``LocalBackend`` on the tiny model). Completion budgets and ``n`` are clamped before
sending, so a fuzzed ``max_tokens: 10**9`` costs a 400 or a short generation, not minutes of decoding;
everything else goes out as generated.
"""

from __future__ import annotations

from typing import Any

import pytest

schemathesis = pytest.importorskip("schemathesis", reason="schemathesis is in the `test` extra")
from hypothesis import HealthCheck, given, settings  # noqa: E402  (after the importorskip above)
from schemathesis.checks import (  # noqa: E402
    content_type_conformance,
    not_a_server_error,
    response_schema_conformance,
    status_code_conformance,
)
from schemathesis.generation import GenerationMode  # noqa: E402

from tests.gateway_fixtures import REQUEST_TIMEOUT_S, shared_gateway  # noqa: E402

MAX_EXAMPLES = 20
#: the largest completion budget / choice count a fuzzed request keeps (tiny model, 2 shared cores)
MAX_TOKENS, MAX_N = 16, 2


#: every operation of the schema (checked below), so a new route cannot slip past the fuzzer
OPERATIONS = [
    ("POST", "/v1/chat/completions"),
    ("POST", "/v1/completions"),
    ("GET", "/v1/models"),
    ("GET", "/v1/models/{model_id}"),
    ("GET", "/health"),
    ("GET", "/v1/swarm"),
    ("POST", "/v1/responses"),
    ("GET", "/v1/responses/{response_id}"),
    ("DELETE", "/v1/responses/{response_id}"),
]


@pytest.fixture(scope="module")
def gateway_schema() -> Any:
    gw = shared_gateway()
    return schemathesis.openapi.from_url(f"{gw.url}/openapi.json")


def _clamp(body: Any) -> None:
    """Keep fuzzed generation requests cheap; values that are not plain ints stay as generated."""
    if not isinstance(body, dict):
        return
    caps = (("max_tokens", MAX_TOKENS), ("max_completion_tokens", MAX_TOKENS), ("max_output_tokens", MAX_TOKENS))
    for key, cap in (*caps, ("n", MAX_N)):
        value = body.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > cap:
            body[key] = cap


def test_schema_documents_errors_and_streams(gateway_schema: Any) -> None:
    for path in ("/v1/chat/completions", "/v1/completions", "/v1/responses"):
        responses = gateway_schema.raw_schema["paths"][path]["post"]["responses"]
        assert {"400", "401", "404", "413", "429", "503"} <= set(responses), path
        assert "text/event-stream" in responses["200"]["content"], path


def test_schema_declares_the_request_bodies(gateway_schema: Any) -> None:
    """The routes parse their bodies themselves; without ``openapi_extra`` the fuzzer would send none."""
    paths = gateway_schema.raw_schema["paths"]
    for path in ("/v1/chat/completions", "/v1/completions"):
        body = paths[path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        assert body["type"] == "object" and body["properties"], path
    chat = paths["/v1/chat/completions"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert "messages" in chat["required"]
    listed = {(op.method.upper(), op.path) for op in (r.ok() for r in gateway_schema.get_all_operations())}
    assert listed == set(OPERATIONS)


#: valid requests for every operation; schema-violating ones where there is a body to violate
RUNS = [(m, p, "positive") for m, p in OPERATIONS]
RUNS += [(m, p, "negative") for m, p in OPERATIONS if m == "POST"]


# schemathesis's own pytest plugin (``schema.parametrize``) does not run under pytest 9, so each operation
# is one parametrized test driving its hypothesis strategy directly
@pytest.mark.parametrize(("method", "path", "mode"), RUNS, ids=[f"{m} {p} {g}" for m, p, g in RUNS])
def test_no_server_errors(gateway_schema: Any, method: str, path: str, mode: str) -> None:
    operation = gateway_schema[path][method]

    @settings(
        max_examples=MAX_EXAMPLES,
        deadline=None,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much, HealthCheck.data_too_large],
    )
    @given(case=operation.as_strategy(generation_mode=GenerationMode(mode)))
    def run(case: Any) -> None:
        _clamp(case.body)
        case.call_and_validate(checks=checks, timeout=REQUEST_TIMEOUT_S)

    # generation routes document their errors and the SSE stream (gateway/api/openapi_responses.py): every answer
    # must be a documented status, with a documented content type and (errors) the envelope's schema
    checks = [not_a_server_error]
    if method == "POST":
        checks += [status_code_conformance, content_type_conformance, response_schema_conformance]

    run()
