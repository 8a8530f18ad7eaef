"""Load generator: N concurrent *streaming* chat completions against an OpenAI-compatible base URL.

    python load_tests/loadgen.py --url http://127.0.0.1:8000 --concurrency 8 --max-tokens 64 \
        --requests-per-stream 4 --out bench_results/load.json

Each of ``concurrency`` streams sends its requests one after another (``--requests-per-stream``, or as many
as fit in ``--duration`` seconds, never more than ``--max-requests-per-stream``); the whole run is cut off
at ``--deadline`` seconds. Every request is greedy (``temperature 0``) with ``stream_options.include_usage``
and picks its prompt from a small built-in list (request ``i`` of stream ``s`` uses prompt
``(s + i * concurrency) % len(PROMPTS)``), so at concurrency 1 the prompts come in order and a run over
``len(PROMPTS)`` requests is the single-stream reference for every prompt.

Per request it measures TTFT (send → first chunk with content), inter-token latency (the gap between
consecutive content chunks), completion tokens (from the usage chunk) and the text; errors are HTTP
statuses other than 200, ``data: {"error": ...}`` frames, streams that end without ``[DONE]`` and
exceptions (timeouts, refused connections). The summary has p50/p95/p99 of TTFT and ITL, total tokens/s
(all completion tokens over the run's wall time), request and error counts. ``run_load`` is the library
entry point; the CLI writes the result as JSON and a Markdown table next to it (``.md``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

__all__ = [
    "PROMPTS",
    "RequestResult",
    "markdown_table",
    "percentile",
    "prompt_index",
    "run_load",
    "summarize",
    "write_report",
]

#: short, different chat prompts: streams do not all decode the same sequence
PROMPTS: tuple[str, ...] = (
    "Tell me about the swarm.",
    "Write a haiku about a swarm of servers.",
    "Explain continuous batching in one paragraph.",
    "What is a key-value cache?",
    "List three uses of a distributed hash table.",
    "Summarize the plot of a story about a lighthouse keeper.",
    "Why do transformers need positional information?",
    "Give me a recipe for a quick breakfast.",
)

#: how many characters of an error body or message a report keeps
_ERROR_CHARS = 300


@dataclass
class RequestResult:
    """One streamed request: timings are seconds relative to the run's start (``start_s``) or durations."""

    stream: int
    index: int
    prompt_index: int
    start_s: float
    end_s: float = 0.0
    status: int | None = None
    ttft_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    chunks: int = 0
    completion_tokens: int | None = None
    prompt_tokens: int | None = None
    finish_reason: str | None = None
    text: str = ""
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def tokens(self) -> int:
        """Completion tokens per the usage chunk; the content chunk count when no usage came."""
        return self.completion_tokens if self.completion_tokens is not None else self.chunks


# ---------------------------------------------------------------------------------------------- statistics
def percentile(values: Sequence[float], q: float) -> float | None:
    """Linear-interpolated percentile (numpy's default), ``q`` in [0, 100]; None for no values.
    Monotone in ``q`` by construction, so p50 ≤ p95 ≤ p99 always holds."""
    if not values:
        return None
    ordered = sorted(values)
    pos = (len(ordered) - 1) * min(100.0, max(0.0, q)) / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def _ms_stats(values_s: Sequence[float]) -> dict[str, float | int | None]:
    def ms(v: float | None) -> float | None:
        return None if v is None else round(v * 1000.0, 3)

    return {
        "p50_ms": ms(percentile(values_s, 50)),
        "p95_ms": ms(percentile(values_s, 95)),
        "p99_ms": ms(percentile(values_s, 99)),
        "mean_ms": ms(sum(values_s) / len(values_s)) if values_s else None,
        "count": len(values_s),
    }


def summarize(results: Sequence[RequestResult], wall_s: float, concurrency: int) -> dict[str, Any]:
    """Aggregate metrics of a run. Token counts and latencies come from successful requests only; a failed
    request counts as an error (``errors``), with its message in ``error_samples``."""
    good = [r for r in results if r.ok]
    tokens = sum(r.tokens for r in good)
    ttfts = [r.ttft_s for r in good if r.ttft_s is not None]
    itls = [gap for r in good for gap in r.itl_s]
    errors = [r for r in results if not r.ok]
    samples: dict[str, int] = {}
    for r in errors:
        key = (r.error or "")[:_ERROR_CHARS]
        samples[key] = samples.get(key, 0) + 1
    return {
        "concurrency": concurrency,
        "requests": len(results),
        "ok": len(good),
        "errors": len(errors),
        "error_samples": [
            {"error": k, "count": v} for k, v in sorted(samples.items(), key=lambda kv: -kv[1])
        ][:10],
        "wall_s": round(wall_s, 3),
        "completion_tokens": tokens,
        "tokens_per_s": round(tokens / wall_s, 3) if wall_s > 0 else 0.0,
        "ttft": _ms_stats(ttfts),
        "itl": _ms_stats(itls),
    }


# ---------------------------------------------------------------------------------------------- one request
def prompt_index(stream: int, index: int, concurrency: int, num_prompts: int) -> int:
    """Which prompt request ``index`` of ``stream`` uses: consecutive requests of the run, in start order,
    walk the list, so each level covers as many different prompts as it sends requests (up to the list)."""
    return (stream + index * concurrency) % num_prompts


def _error_text(payload: Any) -> str:
    err = payload.get("error") if isinstance(payload, dict) else None
    if isinstance(err, dict):
        return f"{err.get('type') or 'error'}/{err.get('code')}: {err.get('message')}"
    return str(err if err is not None else payload)


async def _one_request(
    client: httpx.AsyncClient,
    body: dict[str, Any],
    result: RequestResult,
    t0: float,
) -> None:
    """Send one streaming chat request and fill ``result`` in; never raises except on cancellation."""
    sent = time.perf_counter()
    last_content: float | None = None
    done = False
    pieces: list[str] = []
    try:
        async with client.stream("POST", "/v1/chat/completions", json=body) as response:
            result.status = response.status_code
            if response.status_code != 200:
                raw = (await response.aread()).decode("utf-8", "replace")
                try:
                    detail = _error_text(json.loads(raw))
                except ValueError:
                    detail = raw[:_ERROR_CHARS]
                result.error = f"HTTP {response.status_code}: {detail}"
                return
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue  # blank separators, ": ping" comments, "event:" lines
                data = line[5:].strip()
                if data == "[DONE]":
                    done = True
                    break
                now = time.perf_counter()
                try:
                    chunk = json.loads(data)
                except ValueError:
                    result.error = f"bad SSE payload: {data[:_ERROR_CHARS]!r}"
                    return
                if "error" in chunk:
                    result.error = f"error event: {_error_text(chunk)}"
                    continue  # keep reading up to [DONE], as a client would
                usage = chunk.get("usage")
                if usage:
                    result.completion_tokens = usage.get("completion_tokens")
                    result.prompt_tokens = usage.get("prompt_tokens")
                for choice in chunk.get("choices") or []:
                    content = (choice.get("delta") or {}).get("content")
                    if content:
                        pieces.append(content)
                        result.chunks += 1
                        if last_content is None:
                            result.ttft_s = now - sent
                        else:
                            result.itl_s.append(now - last_content)
                        last_content = now
                    if choice.get("finish_reason") is not None:
                        result.finish_reason = choice["finish_reason"]
        if not done and result.error is None:
            result.error = "stream ended without [DONE]"
    except httpx.HTTPError as exc:
        result.error = f"{type(exc).__name__}: {exc}"[:_ERROR_CHARS]
    except (OSError, ValueError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"[:_ERROR_CHARS]
    except asyncio.CancelledError:
        result.error = result.error or "cancelled: the run's deadline passed mid-request"
        raise
    finally:
        result.text = "".join(pieces)
        result.end_s = time.perf_counter() - t0


# ---------------------------------------------------------------------------------------------- the run
async def _detect_model(client: httpx.AsyncClient) -> str:
    r = await client.get("/v1/models")
    r.raise_for_status()
    return str(r.json()["data"][0]["id"])


async def run_load(
    base_url: str,
    concurrency: int,
    *,
    requests_per_stream: int = 1,
    duration_s: float | None = None,
    max_requests_per_stream: int = 10_000,
    deadline_s: float = 600.0,
    max_tokens: int = 32,
    model: str | None = None,
    prompts: Sequence[str] = PROMPTS,
    request_timeout_s: float = 120.0,
    extra_body: Mapping[str, Any] | None = None,
    include_requests: bool = True,
) -> dict[str, Any]:
    """Drive ``base_url`` (with or without a trailing ``/v1``) with ``concurrency`` streams.

    Without ``duration_s`` each stream sends ``requests_per_stream`` requests; with it, each stream keeps
    sending until ``duration_s`` has passed (at most ``max_requests_per_stream``). ``deadline_s`` bounds the
    whole run: requests still in flight then are cancelled and counted as errors. ``extra_body`` is merged
    into every request body (``logit_bias``, ``top_p``…). Returns ``summarize(...)`` plus the settings and,
    with ``include_requests``, one record per request (``requests_detail``)."""
    if concurrency < 1:
        raise ValueError("concurrency must be at least 1")
    if not prompts:
        raise ValueError("need at least one prompt")
    base = base_url.rstrip("/")
    if base.endswith("/v1"):
        base = base[: -len("/v1")]
    per_stream = max_requests_per_stream if duration_s is not None else requests_per_stream
    per_stream = max(1, min(per_stream, max_requests_per_stream))
    limits = httpx.Limits(max_connections=concurrency + 2, max_keepalive_connections=concurrency + 2)
    timeout = httpx.Timeout(request_timeout_s, connect=min(10.0, request_timeout_s))
    results: list[RequestResult] = []
    async with httpx.AsyncClient(base_url=base, timeout=timeout, limits=limits) as client:
        model_name = model or await _detect_model(client)
        t0 = time.perf_counter()
        stop_at = t0 + duration_s if duration_s is not None else None

        async def stream(s: int) -> None:
            for i in range(per_stream):
                if stop_at is not None and time.perf_counter() >= stop_at:
                    return
                p = prompt_index(s, i, concurrency, len(prompts))
                body: dict[str, Any] = {
                    "model": model_name,
                    "messages": [{"role": "user", "content": prompts[p]}],
                    "max_tokens": max_tokens,
                    "temperature": 0,
                    "stream": True,
                    "stream_options": {"include_usage": True},
                    **(extra_body or {}),
                }
                result = RequestResult(stream=s, index=i, prompt_index=p, start_s=time.perf_counter() - t0)
                results.append(result)
                await _one_request(client, body, result, t0)

        tasks = [asyncio.create_task(stream(s)) for s in range(concurrency)]
        _, pending = await asyncio.wait(tasks, timeout=deadline_s)
        for task in pending:
            task.cancel()
        if pending:
            await asyncio.wait(pending, timeout=10.0)
        wall = max((r.end_s for r in results), default=time.perf_counter() - t0)
    summary = summarize(results, wall, concurrency)
    summary["settings"] = {
        "base_url": base,
        "model": model_name,
        "max_tokens": max_tokens,
        "requests_per_stream": None if duration_s is not None else requests_per_stream,
        "duration_s": duration_s,
        "deadline_s": deadline_s,
        "extra_body": dict(extra_body or {}),
    }
    summary["deadline_hit"] = bool(pending)
    if include_requests:
        summary["requests_detail"] = [
            {**asdict(r), "itl_s": [round(x, 6) for x in r.itl_s]}
            for r in sorted(results, key=lambda r: (r.stream, r.index))
        ]
    return summary


# ---------------------------------------------------------------------------------------------- reports
def _fmt(value: Any, digits: int = 1) -> str:
    if value is None:
        return "–"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def run_load_sync(base_url: str, concurrency: int, options: Mapping[str, Any]) -> dict[str, Any]:
    """``run_load`` in a fresh event loop: for a separate process (``ProcessPoolExecutor``), so the load
    generator does not share a GIL with the server it measures."""
    return asyncio.run(run_load(base_url, concurrency, **options))


def markdown_table(summaries: Sequence[Mapping[str, Any]]) -> str:
    """One row per run: concurrency, requests, errors, tok/s, TTFT and ITL percentiles (ms)."""
    head = (
        "| concurrency | requests | errors | total tok/s | TTFT p50 | TTFT p95 | TTFT p99 "
        "| ITL p50 | ITL p95 | ITL p99 |\n"
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n"
    )
    rows = []
    for s in summaries:
        t, i = s["ttft"], s["itl"]
        rows.append(
            f"| {s['concurrency']} | {s['requests']} | {s['errors']} | {_fmt(s['tokens_per_s'])} "
            f"| {_fmt(t['p50_ms'])} | {_fmt(t['p95_ms'])} | {_fmt(t['p99_ms'])} "
            f"| {_fmt(i['p50_ms'])} | {_fmt(i['p95_ms'])} | {_fmt(i['p99_ms'])} |"
        )
    return head + "\n".join(rows) + "\n\nLatencies in ms; ITL = gap between consecutive content chunks.\n"


def write_report(result: Mapping[str, Any], out: Path) -> tuple[Path, Path]:
    """``out`` (JSON) and the Markdown table next to it (same name, ``.md``)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    md = out.with_suffix(".md")
    md.write_text(f"# Load generator: {result['settings']['base_url']}\n\n" + markdown_table([result]))
    return out, md


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default="http://127.0.0.1:8000", help="gateway base URL (with or without /v1)")
    p.add_argument("--concurrency", type=int, default=8, help="parallel streams")
    p.add_argument("--requests-per-stream", type=int, default=1, help="requests each stream sends in turn")
    p.add_argument("--duration", type=float, default=None, help="keep sending for this many seconds instead")
    p.add_argument("--max-requests-per-stream", type=int, default=10_000, help="cap with --duration")
    p.add_argument("--deadline", type=float, default=600.0, help="hard limit of the whole run (seconds)")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--model", default=None, help="model name (default: the first of /v1/models)")
    p.add_argument("--timeout", type=float, default=120.0, help="per-request timeout (seconds)")
    p.add_argument("--out", type=Path, default=Path("bench_results/load.json"), help="JSON report (+ .md)")
    args = p.parse_args(argv)
    result = asyncio.run(
        run_load(
            args.url,
            args.concurrency,
            requests_per_stream=args.requests_per_stream,
            duration_s=args.duration,
            max_requests_per_stream=args.max_requests_per_stream,
            deadline_s=args.deadline,
            max_tokens=args.max_tokens,
            model=args.model,
            request_timeout_s=args.timeout,
        )
    )
    out, md = write_report(result, args.out)
    print(markdown_table([result]))
    for sample in result["error_samples"]:
        print(f"error x{sample['count']}: {sample['error']}", file=sys.stderr)
    print(f"wrote {out} and {md}")
    return 1 if result["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
