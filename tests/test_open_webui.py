"""Open WebUI 0.12's default chat request, exactly as it sent it (36 built-in tools, no ``tool_choice``,
streaming, model ``HuggingFaceTB/SmolLM2-135M-Instruct``), against a gateway serving that model offline.

SmolLM2's chat template knows no tools, so the gateway teaches them in the system message (≈7k of its 8k
tokens). Only ``max_tokens`` is added, to bound the run time on a CPU.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from gateway.backends.local import LocalBackend
from swarm_client.model_source import SMOLLM2_ID
from tests.gateway_fixtures import Gateway, start_gateway
from tests.test_tool_calling import open_webui_request, stream_open_webui_style


@pytest.fixture(scope="module")
def smollm2_gateway(smollm2_path: str) -> Iterator[Gateway]:
    gw = start_gateway(LocalBackend(smollm2_path, model_id=SMOLLM2_ID))
    try:
        yield gw
    finally:
        gw.server.stop()


@pytest.mark.slow
def test_open_webui_default_request_streams_200_on_smollm2(smollm2_gateway: Gateway) -> None:
    body = open_webui_request()
    assert body["model"] == SMOLLM2_ID
    stream_open_webui_style(smollm2_gateway, {**body, "max_tokens": 24})
