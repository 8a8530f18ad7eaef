"""``load_tests/loadgen.py`` against the in-process test gateway (``LocalBackend`` over a tiny model): the
metrics it reports are there and sane, and failures of every kind are counted as errors, not as tokens."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from load_tests.loadgen import PROMPTS, markdown_table, percentile, prompt_index, run_load, write_report
from tests.gateway_fixtures import Gateway, shared_gateway


@pytest.fixture(scope="module")
def gw() -> Gateway:
    return shared_gateway()


def _monotone(stats: dict) -> bool:
    return stats["p50_ms"] <= stats["p95_ms"] <= stats["p99_ms"]


def test_percentile_is_interpolated_and_monotone() -> None:
    assert percentile([], 50) is None
    assert percentile([3.0], 99) == 3.0
    values = [float(v) for v in range(1, 101)]
    assert percentile(values, 50) == pytest.approx(50.5)
    assert percentile(values, 0) == 1.0 and percentile(values, 100) == 100.0
    qs = [percentile(values, q) for q in (50, 95, 99)]
    assert qs == sorted(qs)


def test_prompts_rotate_over_the_run() -> None:
    # at concurrency 1 a stream walks the list in order: the single-stream reference of every prompt
    assert [prompt_index(0, i, 1, len(PROMPTS)) for i in range(len(PROMPTS))] == list(range(len(PROMPTS)))
    firsts = {prompt_index(s, 0, 4, len(PROMPTS)) for s in range(4)}
    assert len(firsts) == 4  # concurrent streams start on different prompts


def test_metrics_of_a_clean_run(gw: Gateway, tmp_path: Path) -> None:
    result = asyncio.run(
        run_load(gw.url, 2, requests_per_stream=2, max_tokens=8, deadline_s=60, request_timeout_s=30)
    )
    assert result["errors"] == 0, result["error_samples"]
    assert result["requests"] == result["ok"] == 4
    assert result["completion_tokens"] > 0 and result["tokens_per_s"] > 0
    assert result["settings"]["model"]  # detected from /v1/models
    for key in ("ttft", "itl"):
        assert result[key]["count"] > 0
        assert _monotone(result[key]), result[key]
    assert result["ttft"]["count"] == 4
    details = result["requests_detail"]
    assert {(d["stream"], d["index"]) for d in details} == {(0, 0), (0, 1), (1, 0), (1, 1)}
    for d in details:
        assert d["status"] == 200 and d["error"] is None
        assert 1 <= d["completion_tokens"] <= 8
        assert d["finish_reason"] in ("stop", "length")
        assert d["ttft_s"] > 0 and d["end_s"] >= d["start_s"]
    # greedy: the same prompt gives the same text, whichever stream sent it
    by_prompt: dict[int, set[str]] = {}
    for d in details:
        by_prompt.setdefault(d["prompt_index"], set()).add(d["text"])
    assert all(len(texts) == 1 for texts in by_prompt.values())

    out, md = write_report(result, tmp_path / "load.json")
    assert json.loads(out.read_text())["requests"] == 4
    assert "| 2 | 4 | 0 |" in md.read_text()
    assert markdown_table([result]).count("\n|") >= 2


def test_http_400_is_an_error(gw: Gateway) -> None:
    result = asyncio.run(
        run_load(gw.url, 2, max_tokens=4, deadline_s=30, extra_body={"logit_bias": {"not-a-token": 1.0}})
    )
    assert result["requests"] == result["errors"] == 2
    assert result["completion_tokens"] == 0
    assert all(d["status"] == 400 for d in result["requests_detail"])
    assert result["error_samples"][0]["error"].startswith("HTTP 400")
    assert "logit_bias" in result["error_samples"][0]["error"]


def test_error_event_after_200_is_an_error(gw: Gateway) -> None:
    # one stream, so the failing step is deterministic: prefill (1), a decode step (2), then it breaks
    with gw.backend.tweaked(fail_at_step=3):
        result = asyncio.run(run_load(gw.url, 1, max_tokens=16, deadline_s=30))
    assert result["requests"] == result["errors"] == 1
    (detail,) = result["requests_detail"]
    assert detail["status"] == 200
    assert detail["error"].startswith("error event: server_error"), detail["error"]
    assert result["completion_tokens"] == 0  # a failed request's tokens are not throughput
    assert gw.backend.wait_all_closed()


def test_unreachable_server_and_deadline_are_errors(gw: Gateway) -> None:
    # a port nothing listens on: connection refused, counted, no exception escapes
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead_port = s.getsockname()[1]
    result = asyncio.run(run_load(f"http://127.0.0.1:{dead_port}", 1, model="m", deadline_s=10))
    assert result["requests"] == result["errors"] == 1
    assert "Connect" in result["error_samples"][0]["error"]

    with gw.backend.tweaked(step_delay_s=0.2):
        result = asyncio.run(run_load(gw.url, 1, max_tokens=32, deadline_s=0.5))
    assert result["deadline_hit"]
    assert result["errors"] == 1 and "deadline" in result["error_samples"][0]["error"]
    assert gw.backend.wait_all_closed()
