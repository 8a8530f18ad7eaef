"""No filesystem path in a public answer (issue 35): a gateway started with ``--model /some/dir`` shows the
model as ``dir`` in /health, /v1/models (the chat page's model picker), /v1/swarm, every completion's
``model`` and every 404 ``model_not_found``; the path itself still selects the model.

The shared gateway serves the tiny model from a temporary directory, by its path.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway.backends.adapters import public_model_id
from tests.gateway_fixtures import Gateway, shared_gateway, tiny_model_dir


@pytest.fixture(scope="module")
def gw() -> Gateway:
    gw = shared_gateway()
    assert Path(gw.backend.model_id).is_absolute()  # what this module is about
    return gw


def _no_path(text: str) -> None:
    directory = tiny_model_dir()
    assert str(directory) not in text and str(directory.parent) not in text


@pytest.mark.parametrize(
    ("given", "shown"),
    [
        ("HuggingFaceTB/SmolLM2-135M-Instruct", "HuggingFaceTB/SmolLM2-135M-Instruct"),
        ("my-served-name", "my-served-name"),
        ("/srv/models/tiny-llama/", "tiny-llama"),
        ("./models/tiny-llama", "tiny-llama"),
        ("~/models/tiny-llama", "tiny-llama"),
    ],
)
def test_public_model_id(given: str, shown: str) -> None:
    assert public_model_id(given) == shown


def test_health_and_swarm_show_the_name(gw: Gateway) -> None:
    with gw.http() as http:
        health, swarm = http.get("/health"), http.get("/v1/swarm")
    assert health.status_code == 200 and health.json()["model"] == "tiny-llama"
    assert swarm.json()["model"] == "tiny-llama"
    _no_path(health.text)
    _no_path(swarm.text)


def test_model_not_found_lists_names_not_paths(gw: Gateway) -> None:
    with gw.http() as http:
        chat = http.post(
            "/v1/chat/completions", json={"model": "nope", "messages": [{"role": "user", "content": "hi"}]}
        )
        retrieve = http.get("/v1/models/nope")
    for r in (chat, retrieve):
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
        assert "tiny-llama" in r.json()["error"]["message"]
        _no_path(r.text)


def test_models_and_completions_show_the_name_and_the_path_still_selects(gw: Gateway) -> None:
    with gw.http() as http:
        models = http.get("/v1/models")
        by_path = http.post(
            "/v1/chat/completions",
            json={"model": gw.backend.model_id, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
        )
    assert [m["id"] for m in models.json()["data"]] == ["tiny-llama"]  # the chat page's picker lists these
    _no_path(models.text)
    assert by_path.status_code == 200 and by_path.json()["model"] == "tiny-llama"
    _no_path(by_path.text)


def test_served_model_name_is_the_name_clients_use() -> None:
    """``--served-model-name`` (vLLM's flag; ``--model-id`` still works) on ``gateway`` and ``up``: the name
    /v1/models shows and requests select, whatever ``--model`` is."""
    from gateway import LocalBackend
    from swarmserve.cli import build_parser
    from tests.gateway_fixtures import start_gateway

    parser = build_parser()
    peers = ["--initial-peers", "/ip4/127.0.0.1/tcp/31337/p2p/QmPeer"]
    for flag in ("--served-model-name", "--model-id"):
        args = parser.parse_args(["gateway", "--model", "/srv/models/llama", *peers, flag, "team-llama"])
        assert args.model_id == "team-llama"
    assert parser.parse_args(["up", "--served-model-name", "team-llama"]).model_id == "team-llama"
    assert parser.parse_args(["up"]).model_id is None

    gw = start_gateway(LocalBackend(tiny_model_dir(), model_id="team-llama"))
    try:
        client = gw.client(max_retries=0)
        assert [m.id for m in client.models.list().data] == ["team-llama"]
        reply = client.chat.completions.create(
            model="team-llama", messages=[{"role": "user", "content": "hi"}], max_tokens=2
        )
        assert reply.model == "team-llama"
        _no_path(reply.model_dump_json())
    finally:
        gw.server.stop()
